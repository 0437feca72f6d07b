"""One typed configuration: defaults < user config file < `--config FILE` < command-line flags.

Each key is declared once, as a field of `Config` whose metadata (see `_opt`) holds its help, allowed values,
range, flag and the commands that offer it. Everything else reads that declaration: validation and its
messages, the commands' options (`flags`, turned into Typer options by the CLI), the documented default file
that `fafo config show` prints and the reference page docs/configuration.md (`reference_markdown`).
"""

from __future__ import annotations

import contextlib
import datetime
import difflib
import json
import math
import os
import re
from collections.abc import Hashable
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Iterable

import yaml

from .errors import FafoError, first_line, shortened
from .files import user_path, xdg_dir

METHODS = ("vanilla", "fafo", "lookahead", "prompt-lookup", "cacheback", "suffix", "triforce", "quantspec")
COMPRESSORS = ("none", "stream", "quest", "snapkv", "h2o")
# `compressor: auto`: no compressor named, so no window asked for where it does not pay (see `streams`); where a
# window runs anyway, it sees this one
AUTO_COMPRESSOR = "stream"
AUTO_COUNTS = ("streams", "copies")  # keys that take an integer or `auto`
ATTENTION = ("auto", "split", "block")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda", "mps")
COMPILE = ("auto", "on", "off")
CUDA_GRAPHS = ("auto", "on", "off")


# The commands that generate text offer every key as a flag, and `compile`, whose builds follow the settings; a
# key's `also` names the other commands that offer it.
GENERATE = ("run", "chat", "serve", "compile")

# The option panel (and reference section) of a key whose help starts with a method's name ("fafo: ...").
SECTIONS = {"fafo": "FAFO", "lookahead": "Lookahead", "prompt-lookup": "Prompt lookup", "cacheback": "Cacheback",
            "suffix": "SuffixDecoding", "triforce": "TriForce", "quantspec": "QuantSpec"}


def _opt(default, help: str, *, choices=None, low=None, high=None, low_open=False, nullable=False, allowed=None,
         flag=None, short=None, switch=None, argument=False, also=()):
    """A key's declaration. Validation: `choices`, `low`/`high` (`low_open`: low itself excluded), `nullable`
    (may be empty); `allowed` describes the values of a key with a rule of its own (budget, AUTO_COUNTS).
    Command line: `flag` (default: --the-key-name, and --no-the-key-name for a bool), `short` alias (or a second
    long name other tools use), `switch`
    (a bool flag setting the key to switch[0] or switch[1]), `argument` (the commands' positional argument
    instead of a flag), `also` (commands besides GENERATE that offer it)."""
    return field(default=default, metadata=dict(help=help, choices=choices, low=low, high=high, low_open=low_open,
                                                nullable=nullable, allowed=allowed, flag=flag, short=short,
                                                switch=switch, argument=argument, also=also))


def _shown(value: Any) -> str:
    """A value for a one-line message: its repr, shortened (a number of thousands of digits too)."""
    try:
        return shortened(repr(value), 40)
    except ValueError:  # an integer past Python's limit of digits for text
        return "a number of thousands of digits"


def _finite_number(value: Any) -> bool:
    """An int or float (not a bool) within float's finite range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer of 309 digits or more
        return False


def _budget(value: Any) -> int | float:
    """Tokens (an integer >= 1) or a fraction of the prompt (a number in (0, 1))."""
    if not _finite_number(value):
        raise FafoError(f"config key 'budget' must be a number of tokens or a fraction (got {_shown(value)})")
    if value == 1.0 and isinstance(value, float):  # a fraction's end, not one token
        raise FafoError("config key 'budget' 1.0: a fraction of the prompt must be below 1 (all of it is compressor: "
                        "none); tokens are an integer >= 1")
    if isinstance(value, float) and value.is_integer() and value >= 1:
        value = int(value)
    if isinstance(value, int) and value >= 1 or isinstance(value, float) and 0 < value < 1:
        return value
    raise FafoError("config key 'budget' must be an integer >= 1 (tokens) or a fraction in (0, 1) "
                    f"(got {_shown(value)})")


# what the template is given by fafo itself, or transformers' apply_chat_template takes as its own parameters
TEMPLATE_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt", "conversation",
                               "chat_template", "continue_final_message", "tokenize", "sanitize_control_tokens",
                               "padding", "truncation", "max_length", "return_tensors", "return_dict",
                               "return_assistant_tokens_mask", "tokenizer_kwargs"})


def _template_variables(value: Any) -> str | None:
    """`chat_template_kwargs`: a mapping of variable names to JSON values (from YAML or a request), or its JSON
    text (from a flag), kept as compact JSON text (a Config stays hashable); an empty one is none (`build` merges
    what is given into what was there)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as e:
            raise FafoError(f"config key 'chat_template_kwargs' must be a JSON object ({first_line(e)})") from None
    if not isinstance(value, dict):
        raise FafoError(f"config key 'chat_template_kwargs' must be a mapping of names to values (got {_shown(value)})")
    for key in value:
        if not isinstance(key, str) or not key.isidentifier():
            raise FafoError(f"config key 'chat_template_kwargs': {_shown(key)} is not a name a template can read")
        if key in TEMPLATE_RESERVED:
            raise FafoError(f"config key 'chat_template_kwargs': {key!r} is fafo's to set, not a template variable")
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False) if value else None
    except (TypeError, ValueError, RecursionError) as e:  # a YAML date, NaN
        raise FafoError(f"config key 'chat_template_kwargs' must hold JSON values ({first_line(e)})") from None


def _more_variables(base: Config, given: str | None, cleared: bool) -> str | None:
    """`chat_template_kwargs` given over `base`'s: variable by variable, as llama.cpp's server merges a request's
    into its command line's; an empty mapping adds none; `cleared` (a flag's empty text) leaves none."""
    if cleared or not base.chat_template_kwargs:
        return given
    return _template_variables({**template_variables(base), **json.loads(given or "{}")})


def variables_in(value: Any) -> frozenset[str]:
    """The names of the template variables a `chat_template_kwargs` value gives (a mapping, or its JSON text)."""
    return frozenset(json.loads(_template_variables(value) or "{}")) if value not in (None, "") else frozenset()


def template_variables(config: Config) -> dict:
    """The chat template's variables `config` gives."""
    return json.loads(config.chat_template_kwargs) if config.chat_template_kwargs else {}


def _auto_count(name: str, value: Any, low: int, high: int) -> int | str:
    """A count the decoder may choose (W, copies): an integer in low..high (from a flag, as text) or "auto"."""
    # ASCII digits only: str.isdigit() takes "²", which int() refuses
    if isinstance(value, str) and re.fullmatch(r"[0-9]+", value.strip()):
        value = _integer(name, value)
    if value == "auto" or not isinstance(value, bool) and isinstance(value, int) and low <= value <= high:
        return value
    raise FafoError(f"config key '{name}' must be auto or an integer from {low} to {high} (got {_shown(value)})")


@dataclass(frozen=True)
class Config:
    model: str | None = _opt(None, "hub id (org/name), local folder or .gguf file; empty: the embedded "
                                   "SmolLM2-135M-Instruct", nullable=True, argument=True, also=("bench", "doctor"))
    method: str = _opt("fafo", "decoding method: fafo, vanilla (plain decoding, one token per step) or a peer "
                               "method", choices=METHODS)
    dtype: str = _opt("auto", "weights and KV cache precision (auto: bfloat16 where the device computes it natively, "
                               "else float16 on a GPU (always on Apple's MPS), float32 on a CPU)",
                      choices=DTYPES, also=("bench", "doctor"))
    device: str = _opt("auto", "where the model runs (auto: cuda, then mps, then cpu)", choices=DEVICES,
                       also=("bench", "doctor"))
    gpus: int = _opt(1, "at most this many GPUs the model's layers are spread over, filled in order (accelerate's "
                        "device_map; each layer's KV cache on its layer's GPU), for models larger than one GPU; a "
                        "spread model runs FAFO with compressor none; 1: the whole model on `device`", low=1,
                     high=64, also=("bench", "doctor"))
    cuda_graphs: str = _opt("auto", "decoding steps as CUDA graphs, one captured per step size: auto uses them on a "
                                    "CUDA GPU (not on a model spread over GPUs), on requires "
                                    "them, off runs eager steps", choices=CUDA_GRAPHS,
                            flag="--cuda-graphs/--no-cuda-graphs", switch=("on", "off"), also=("bench", "doctor"))
    compile: str = _opt("auto", "compiled decoding steps, built once per model (minutes on a CPU), then loaded from "
                                "disk: on builds them when missing, auto uses those already built that measured "
                                "faster than eager, off uses none; on a CPU, auto and on also read a .gguf model's "
                                "quantized blocks in every step where our kernel serves its dtype, off keeps dense "
                                "weights", choices=COMPILE,
                        flag="--compile/--no-compile", switch=("on", "off"), also=("bench", "doctor"))
    max_tokens: int = _opt(512, "most tokens generated per answer", low=1, short="-n")
    # Sampling: empty = the model's generation_config.json when it asks to sample, else greedy / off.
    temperature: float | None = _opt(None, "0 = greedy; above 0 samples (empty: the model's default)", low=0.0,
                                     high=100.0, nullable=True, short="--temp")  # (llama.cpp's and mlx-lm's name)
    top_p: float | None = _opt(None, "nucleus sampling: keep the smallest set of tokens with this much mass "
                                     "(empty: the model's default, else 1)", low=0.0, high=1.0, low_open=True,
                               nullable=True)
    top_k: int | None = _opt(None, "sample among the k most likely tokens (0 = off; empty: the model's default)",
                             low=0, nullable=True)
    min_p: float | None = _opt(None, "drop tokens less likely than min_p times the likeliest (0 = off; empty: "
                                     "the model's default)", low=0.0, high=1.0, nullable=True)
    seed: int | None = _opt(None, "random seed for sampling (empty, or -1 as in llama.cpp and ollama: a fresh one per "
                                 "answer, which `fafo run --json` and the server's answers report)",
                            nullable=True, low=0, high=2**64 - 1)  # (runtime/sampling.Draws keys on 64 bits)
    system: str | None = _opt(None, "system prompt (chat-templated models only)", nullable=True)
    chat_template: bool = _opt(True, "wrap the prompt in the model's chat template")
    chat_template_kwargs: str | None = _opt(None, "variables for the chat template, a JSON object (a mapping in the "
                                                  "YAML file; a flag's or a request's are added to it one by one), "
                                                  "e.g. {\"enable_thinking\": false} for Qwen3's answers without a "
                                                  "thinking part", nullable=True,  # (llama.cpp's flag; mlx-lm's:)
                                            allowed="a JSON object, or empty", short="--chat-template-config")
    # The two opt-ins are off unless asked for; their --no- form turns a config file's off for one command
    trust_remote_code: bool = _opt(False, "allow a model repo's own Python code to run",
                                   also=("bench", "cacheback build-table", "doctor"))
    allow_pickle: bool = _opt(False, "allow loading pickle (.bin/.pt) weights, which can run code",
                              also=("bench", "pull", "doctor"))
    # FAFO (method fafo). Defaults measured on a 2-core CPU with SmolLM2-135M: see docs/benchmarks.md, "Choosing the defaults".
    streams: int | str = _opt("auto", "fafo: lookahead window streams W (fumble rows per level), 0-64; 0: no window "
                                      "(guesses from the text only); auto: on a CPU none, unless a compressor is "
                                      "named (its rows cost more than its guesses earned in every measurement on a "
                                      "CPU), then 1 where the step's rows cost arithmetic (compiled, or over a .gguf "
                                      "model's packed blocks); else the widest window (at least 2) whose step costs "
                                      "at most 25% more than a plain step, by the measured cost (wide on a GPU)",
                              low=0, high=64, allowed="auto or 0-64", short="-W")
    ngram: int = _opt(3, "fafo: guess length k (window levels, n-gram length)", low=2, high=16, short="-k")
    guesses: int = _opt(1, "fafo: candidate n-grams G verified per step (0 = window only feeds the pool)",
                        low=0, high=64, short="-G")
    prefix: int = _opt(2, "fafo: longest pool key P, in tokens", low=1, high=8, short="-P")
    pool_per_key: int = _opt(8, "fafo: n-grams kept per pool key (least recently used dropped)", low=1,
                             high=1024)
    copies: int | str = _opt("auto", "fafo: continuations of earlier occurrences of the text's ending offered per "
                                     "step, longest match first, besides what most often followed it (ours, beyond the "
                                     "paper; 0: no guesses from the text); auto: 2, or 4 when "
                                     "sampling (each further first token is another chance for the sampling rule to "
                                     "accept one)", low=0, high=16, allowed="auto or 0-16")
    planner: bool = _opt(True, "fafo: choose each step's guesses, and whether the window runs, for the most expected "
                               "tokens per second; off: every step verifies every candidate and runs the window")
    draft_tokens: int = _opt(16, "fafo: most guessed tokens a step verifies (the draft tree's nodes; a copy from the "
                                 "text runs up to this long, and as long as its match)", low=1, high=128, short="-D")
    compressor: str = _opt("auto", "fafo: which cache positions the window's rows see: none (the whole cache), "
                                   "stream (sink + recent), quest (query-scored pages), snapkv (what the prompt's "
                                   "end attends to), h2o (heavy hitters + recent); naming one runs the window under "
                                   "streams: auto; auto: stream, where a window runs", choices=("auto",) + COMPRESSORS)
    budget: int | float = _opt(256, "fafo stream/quest/snapkv/h2o: compressed budget B: tokens (>= 1) or a "
                                    "fraction of the prompt (e.g. 0.1)",
                               allowed="an integer >= 1 (tokens) or a fraction in (0, 1)", short="-B")
    sink: int = _opt(4, "fafo stream: first positions always kept (< budget)", low=0)
    page_size: int = _opt(16, "fafo quest: tokens per page", low=1, high=4096)
    refresh: int = _opt(16, "fafo quest: re-select pages every this many new tokens", low=1)
    window: int = _opt(32, "fafo snapkv/h2o: prompt queries observed at prefill", low=1)
    kernel: int = _opt(7, "fafo snapkv: width of the score smoothing (max pooling; odd)", low=1, high=63)
    recent: int = _opt(64, "fafo h2o: most recent positions always kept (< budget)", low=1)
    attention: str = _opt("auto", "fafo stream/quest/snapkv/h2o: how window rows skip what the compressed view "
                                  "leaves out: split (two stock attention calls) or block (one FlexAttention call "
                                  "with a block mask; slower than split on an H200); auto: split", choices=ATTENTION)

    # Peer methods (see docs/peers.md); defaults measured like FAFO's (docs/benchmarks.md).
    lookahead_streams: int = _opt(2, "lookahead: window streams W", low=1, high=64)
    lookahead_ngram: int = _opt(3, "lookahead: guess length (N - 1)", low=2, high=16)
    lookahead_guesses: int = _opt(1, "lookahead: candidates verified per step G", low=0, high=64)
    lookup_ngram: int = _opt(3, "prompt-lookup: longest ending of the text looked up in the context", low=1,
                             high=16)
    lookup_tokens: int = _opt(8, "prompt-lookup: tokens drafted after a match", low=1, high=256)
    cacheback_leader: int = _opt(1, "cacheback: leader length LL (tokens a lookup is keyed by)", low=1, high=8,
                                 also=("cacheback build-table",))
    cacheback_follower: int = _opt(3, "cacheback: follower length FL (tokens per table entry)", low=1, high=16,
                                   also=("cacheback build-table",))
    cacheback_followers: int = _opt(4, "cacheback: followers kept per leader FC (least recently used dropped)",
                                     low=1, high=256, also=("cacheback build-table",))
    cacheback_leaders: int = _opt(100_000, "cacheback: leaders kept in the dynamic table, and in a table "
                                           "`build-table` writes (least recently seen dropped)", low=1,
                                  also=("cacheback build-table",))
    cacheback_budget: int = _opt(8, "cacheback: draft tokens per step (tree nodes)", low=1, high=1024)
    cacheback_table: str | None = _opt(None, "cacheback: frozen table file (`fafo cacheback build-table`), "
                                             "looked up after the dynamic one", nullable=True)
    # SuffixDecoding: depth and min_prob are Arctic Inference's defaults (as in vLLM); factor, tokens and outputs are
    # ours, for a CPU and one user's session (docs/peers.md says why)
    suffix_depth: int = _opt(24, "suffix: longest ending of the text matched, in tokens (Arctic's max_tree_depth)",
                             low=1, high=256)
    suffix_factor: float = _opt(2.0, "suffix: α: a match of p tokens drafts at most α·p tokens (Arctic's "
                                     "max_spec_factor)", low=0.0, high=64.0, low_open=True)
    suffix_min_prob: float = _opt(0.1, "suffix: draft a token only while its estimated probability (how often it "
                                       "followed, multiplied along the path) is at least this", low=0.0, high=1.0)
    suffix_tokens: int = _opt(8, "suffix: most draft tokens per step (tree nodes)", low=1, high=256)
    suffix_outputs: int = _opt(256, "suffix: earlier answers of this session drafted from too, their newest 32K-64K "
                                    "tokens at most (0 = only the request's own text)", low=0, high=100_000)
    triforce_chunk: int = _opt(8, "triforce: tokens per retrieval chunk", low=1, high=1024)
    triforce_budget: int = _opt(256, "triforce: retrieval cache size in tokens, fixed: chunks of the context chosen "
                                     "by the latest query, then the recent positions (at least two chunks and "
                                     "triforce_recent)", low=2)
    triforce_recent: int = _opt(32, "triforce: retrieval-cache slots for recent tokens: each rebuild keeps the last "
                                    "half of them, and the cache is rebuilt from the whole context when new tokens "
                                    "fill the other half, or sooner when acceptance halves", low=2)
    triforce_gamma1: int = _opt(2, "triforce: tokens the draft model proposes per middle-level check", low=1,
                                high=32)
    triforce_gamma2: int = _opt(2, "triforce: tokens the middle level drafts per full-model check", low=1, high=32)
    triforce_draft_cache: int = _opt(256, "triforce: the draft model's StreamingLLM cache (4 sink + recent "
                                          "positions)", low=8)
    draft_model: str | None = _opt(None, "triforce: tiny draft model sharing the tokenizer (hub id, folder or "
                                         ".gguf); empty: the two upper levels only", nullable=True)
    quantspec_gamma: int = _opt(2, "quantspec: tokens drafted from the 4-bit cache per step", low=1, high=32)
    quantspec_group: int = _opt(64, "quantspec: quantisation group (key tokens per group; value channels per "
                                    "group: the smaller of it and the head dimension, which that must divide)",
                                low=2, high=4096)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


SPECS = {spec.name: spec for spec in fields(Config)}  # each config key's declaration


_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")  # 1e-3, 2.5E4: numbers YAML 1.1 leaves as text


def _integer(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:  # past Python's limit of digits for text
        raise FafoError(f"config key '{name}' holds a number of thousands of digits") from None


def _number(name: str, text: str, kind: type) -> int | float:
    """The number a command line gave as text, for a key that may also be emptied."""
    text = text.strip()
    if kind is int and re.fullmatch(r"[+-]?[0-9]+", text):
        return _integer(name, text)
    if kind is float and re.fullmatch(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?", text):
        return float(text)
    raise FafoError(f"config key '{name}' must be {'an integer' if kind is int else 'a number'}, or empty for the "
                    f"default (got {text!r})")


def _check(name: str, value: Any, spec) -> Any:
    meta = spec.metadata
    if value is None or (value == "" and meta["nullable"]):  # "" is empty too (a command line has no null)
        if meta["nullable"]:
            return None
        raise FafoError(f"config key '{name}' must not be empty")
    if name == "seed" and type(value) is int and value == -1:  # llama.cpp's and ollama's "random": as empty
        return None
    kind = {"bool": bool, "int": int, "float": float}.get(spec.type.split(" ")[0], str)  # "float | None" -> float
    if isinstance(value, str) and _EXPONENT.fullmatch(value.strip()) and (kind is float or name == "budget"):
        value = float(value)  # YAML 1.1 reads 1e-3 as text
    if name == "chat_template_kwargs":
        return _template_variables(value)
    if name == "budget":
        if isinstance(value, str) and re.fullmatch(r"[0-9]+", value.strip()):  # from a flag
            value = _integer(name, value)
        elif isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = float(value)
        return _budget(value)
    if name in AUTO_COUNTS:
        return _auto_count(name, value, meta["low"], meta["high"])
    if kind is bool:
        if not isinstance(value, bool):
            raise FafoError(f"config key '{name}' must be true or false (got {_shown(value)})")
    elif kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise FafoError(f"config key '{name}' must be an integer (got {_shown(value)})")
    elif kind is float:
        if not _finite_number(value):
            raise FafoError(f"config key '{name}' must be a number (got {_shown(value)})")
        value = float(value)
    elif isinstance(value, bool) and meta["switch"]:  # YAML reads `on`, `off`, `true` as booleans
        value = meta["switch"][0] if value else meta["switch"][1]
    elif not isinstance(value, str):
        read_as = {bool: "true or false", datetime.date: "a date", datetime.datetime: "a date"}.get(type(value))
        hint = f", which YAML reads as {read_as}: put it in quotes" if read_as else ""
        raise FafoError(f"config key '{name}' must be text (got {_shown(value) if read_as is None else value}{hint})")
    if meta["choices"] and value not in meta["choices"]:
        raise FafoError(f"config key '{name}' must be one of {', '.join(meta['choices'])} (got {_shown(value)})")
    low, high = meta["low"], meta["high"]
    if low is not None and (value < low or (meta["low_open"] and value == low)):
        bound = f"> {low}" if meta["low_open"] else f">= {low}"
        raise FafoError(f"config key '{name}' must be {bound}" + (f" and <= {high}" if high is not None else "")
                        + f" (got {_shown(value)})")
    if high is not None and value > high:
        raise FafoError(f"config key '{name}' must be <= {high} (got {_shown(value)})")
    return value


def build(base: Config | None = None, together: bool = True, /, **changes: Any) -> Config:
    """A validated Config; keys with value None in `changes` are left as they are (flag not given). `together`:
    the keys that must fit one another checked too (not for a file whose flags are still to come)."""
    unknown = sorted(set(changes) - set(SPECS))
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), SPECS, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise FafoError(f"unknown config key '{unknown[0]}' ({hint}`fafo config show --markdown` lists every key)")
    given = {k: _check(k, v, SPECS[k]) for k, v in changes.items() if v is not None}
    base = base or Config()
    if "chat_template_kwargs" in given:
        given["chat_template_kwargs"] = _more_variables(base, given["chat_template_kwargs"],
                                                        cleared=changes["chat_template_kwargs"] == "")
    config = replace(base, **given)
    if together:
        _check_together(config)
    return config


def _check_together(config: Config) -> None:
    problem = _together_problem(config)
    if problem is not None:
        raise FafoError(problem)


def _together_problem(config: Config) -> str | None:
    """What keeps the keys from fitting one another, or None: the chosen compressor's parts must fit in its budget
    (checked here when the budget is in tokens), TriForce's chunks in its, SnapKV's kernel be odd."""
    if config.kernel % 2 == 0:
        return f"config key 'kernel' must be odd (got {config.kernel})"
    if config.triforce_budget < 2 * config.triforce_chunk + config.triforce_recent:
        return (f"config key 'triforce_budget' ({config.triforce_budget}) must hold two chunks and the recent tokens "
                f"(2 × triforce_chunk + triforce_recent = {2 * config.triforce_chunk + config.triforce_recent})")
    compressor = view_compressor(config.compressor)
    if not isinstance(config.budget, int) or compressor not in MIN_BUDGET:
        return None
    what, least = MIN_BUDGET[compressor](config)
    if config.budget < least:
        return (f"config key 'budget' ({config.budget}) is too small for the {compressor} compressor: it needs at "
                f"least {what} = {least}")
    return None


# Sampling settings at the values that change nothing
SAMPLING_NEUTRAL = {"top_p": 1.0, "top_k": 0, "min_p": 0.0}


# FAFO's keys that act only where its lookahead window runs (the pool it feeds, the view its rows read), besides
# each compressor's own (`compressors_of`)
WINDOW_KEYS = frozenset({"ngram", "guesses", "prefix", "pool_per_key", "compressor", "attention"})


DRAFT_MODEL_KEYS = frozenset({"triforce_gamma1", "triforce_draft_cache"})  # read by TriForce's bottom level only

# methods' settings of what their guesses are made from, not of the rows a step runs (the compiled packages' sizes:
# `fafo compile` refuses them)
GUESS_ONLY_KEYS = frozenset({"prefix", "pool_per_key", "copies", "lookup_ngram", "cacheback_leader",
                             "cacheback_follower", "cacheback_followers", "cacheback_leaders", "cacheback_table",
                             "suffix_depth", "suffix_factor", "suffix_min_prob", "suffix_outputs"})
TEMPLATE_KEYS = ("system", "chat_template_kwargs")  # what the chat template reads: nothing without one
SESSION_KEYS = frozenset({"suffix_outputs"})  # read by the answers after a session's first (chat, serve)


def runs_window(streams: int | str, compressor_named: bool, accelerator: bool) -> bool:
    """Whether FAFO's lookahead window runs under `streams`: not at 0, nor at `auto` on a CPU unless a compressor
    is named (see the key's help)."""
    return streams != 0 and (streams != "auto" or compressor_named or accelerator)


def check_given(config: Config, given: Iterable[str], accelerator: bool) -> None:
    """Settings given explicitly (a command's flags, a request's fields) must have an effect: a method's own
    settings only where that method runs (FAFO's window settings where its window runs, on `accelerator` or not, a
    compressor's where it is the one), TEMPLATE_KEYS only with the chat template, and a sampling setting other than its
    neutral value, or a seed, only where decoding samples (temperature above 0; None, the model's default, is not
    checked here)."""
    given = {key for key in given if key in SPECS and getattr(config, key) is not None}  # (None: emptied)
    for key in sorted(given):
        owner = method_of(SPECS[key])
        if owner is not None and owner != config.method:
            raise FafoError(f"'{key}' is a setting of method {owner}, which is not running here (method: "
                            f"{config.method})")
        compressors = compressors_of(SPECS[key])
        # (`compressor: auto` is never refused: naming no compressor is what turns a file's window off on a CPU)
        if owner == "fafo" and (key in WINDOW_KEYS or compressors) and not (key == "compressor" and
                                                                            config.compressor == "auto"):
            if not runs_window(config.streams, config.compressor != "auto", accelerator):
                why = ("streams: 0" if config.streams == 0 else
                       "on a CPU, streams: auto runs it only where a compressor is named")
                raise FafoError(f"'{key}' sets FAFO's lookahead window, which does not run here ({why})")
            compressor = view_compressor(config.compressor)
            if compressors and compressor not in compressors:
                raise FafoError(f"'{key}' is a setting of the {'/'.join(compressors)} compressor, which the window "
                                f"does not use here (compressor: {compressor})")
        if key in DRAFT_MODEL_KEYS and config.draft_model is None:
            raise FafoError(f"'{key}' sets TriForce's draft-model level, which runs only with a draft_model")
    for key in sorted(given & set(TEMPLATE_KEYS)):
        if getattr(config, key) and not config.chat_template:
            raise FafoError(f"'{key}' needs the chat template: the prompt is continued as plain text without it")
    if config.temperature == 0:
        for key in sorted(given & (SAMPLING_NEUTRAL.keys() | {"seed"})):
            if getattr(config, key) != SAMPLING_NEUTRAL.get(key):
                raise FafoError(f"'{key}' has no effect when decoding greedily (temperature 0): give a temperature "
                                "above 0 to sample")


def view_compressor(name: str) -> str:
    """The compressor a window runs with under config value `name` (`auto` names none)."""
    return AUTO_COMPRESSOR if name == "auto" else name


# compressor -> (what its budget must hold, the least budget in tokens)
MIN_BUDGET = {
    "stream": lambda c: ("sink + 1", c.sink + 1),
    "quest": lambda c: ("page_size + refresh", c.page_size + c.refresh),
    # (a quarter of snapkv's budget, at least 1, is kept for new tokens: below this least B, where B - max(1, B // 4)
    # first exceeds the window, no position would be chosen by its score)
    "snapkv": lambda c: ("window + 1 beside a quarter for new tokens", max(c.window + 2, 4 * c.window // 3 + 1)),
    "h2o": lambda c: ("recent + 1", c.recent + 1),
}


def user_config_path() -> Path:
    return xdg_dir("XDG_CONFIG_HOME", ".config") / "fafo" / "config.yaml"


class _StrictLoader(yaml.SafeLoader):
    """safe_load's loader, refusing a key given twice (YAML keeps the last without a word)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):  # a list or map as a key: SafeLoader's own error says so
                break
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"the key '{key}' is given twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def file_keys(path: Path) -> set[str]:
    """The keys a config file gives (one `load_file` has read)."""
    return set(yaml.load(path.read_text(encoding="utf-8"), Loader=_StrictLoader) or {})


def load_file(path: Path, base: Config | None = None, together: bool = True) -> Config:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if path.is_symlink():  # a link to nothing (a dotfiles link not yet set up) is not "no file"
            raise FafoError(f"cannot read config file {path}: it links to {os.readlink(path)}, which does not "
                            "exist") from None
        # (llama.cpp's -c is the context length)
        hint = " (-c is --config, a YAML file; the context is the model's own)" if path.name.isdigit() else ""
        raise FafoError(f"config file not found: {path}{hint}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise FafoError(f"cannot read config file {path}: {getattr(e, 'strerror', None) or e}") from None
    return load_text(text, path, base, together)


def _yaml_problem(error: yaml.YAMLError, text: str) -> str:
    """" (line N): what is wrong", as far as PyYAML tells it."""
    if isinstance(error, yaml.reader.ReaderError):  # a character YAML does not allow: it names no line of its own
        line = text.count("\n", 0, error.position) + 1
        return f" (line {line}): it holds the control character {chr(error.character)!r}"
    mark, problem = getattr(error, "problem_mark", None), getattr(error, "problem", None) or ""
    if "'\\t'" in problem:
        problem = "a tab where YAML wants spaces (YAML indents with spaces only)"
    return (f" (line {mark.line + 1})" if mark else "") + (f": {problem}" if problem else "")


def load_text(text: str, path: Path, base: Config | None = None, together: bool = True) -> Config:
    """`load_file` for the text of the file `path` (named in the errors); `together`: as `build`'s."""
    try:
        data = yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as e:
        raise FafoError(f"config file {path} is not valid YAML{_yaml_problem(e, text)}") from None
    except RecursionError:
        raise FafoError(f"config file {path} nests too deeply to be a config") from None
    except (ValueError, LookupError, AttributeError, TypeError) as e:
        if "integer string conversion" in str(e):  # an integer past Python's limit of digits for text
            raise FafoError(f"config file {path} holds a number of thousands of digits") from None
        # PyYAML's own readers of a tagged value they cannot read (`!!int abc`, `!!int ""`, `!!bool y`)
        raise FafoError(f"config file {path} holds a tagged value YAML cannot read ({type(e).__name__}: "
                        f"{str(e)[:80]})") from None
    if data is None:
        return base or Config()
    if not isinstance(data, dict):
        raise FafoError(f"config file {path} must be a mapping of keys to values")
    # In a file an explicit null is a value (e.g. `seed:` to clear it), not "not given".
    explicit_nulls = {k for k, v in data.items() if v is None}
    try:
        config = build(base, together, **{str(k): v for k, v in data.items()})
    except FafoError as e:
        raise FafoError(f"{path}: {e}") from None
    for key in explicit_nulls:
        if not SPECS[key].metadata["nullable"]:
            raise FafoError(f"{path}: config key '{key}' must not be empty")
        config = replace(config, **{key: None})
    return config


def resolve(config_file: str | None, *, written: bool = False, **flags: Any) -> Config:
    """The effective config: defaults, then the user's file (or `config_file`), then the flags. `written`: the
    command writes settings into `config_file`, which it creates where there is none yet."""
    config, source = Config(), config_source(config_file, written)
    if source is not None:  # (the keys that must fit one another are checked once the flags are in)
        config = load_file(source, config, together=False)
    resolved = build(config, False, **flags)
    problem = _together_problem(resolved)
    if problem is not None:  # (named by the file where its keys alone say the same)
        raise FafoError(f"{source}: {problem}" if source and _together_problem(config) == problem else problem)
    return resolved


def config_source(config_file: str | None, written: bool = False) -> Path | None:
    """The file `resolve` reads: `config_file`, else the user's, where there is one (`written`: as resolve's)."""
    if config_file is not None and not config_file.strip():
        raise FafoError("--config needs a file name")
    if config_file is not None:
        path = user_path(config_file)
        return None if written and not path.exists() and not path.is_symlink() else path  # (a link to nothing: its
    if user_config_path().exists() or user_config_path().is_symlink():  # error; a folder, a link to nothing: errors)
        return user_config_path()
    return None


def describe(spec) -> str:
    """A key's help with its choices, as `fafo config show` comments it."""
    meta = spec.metadata
    return meta["help"] + (f" [{' | '.join(meta['choices'])}]" if meta["choices"] else "")


def default_yaml(config: Config | None = None, source: Path | None = None) -> str:
    """The documented default config file, every key commented out at its default (what `fafo config init` writes):
    saved, it sets nothing until a key is uncommented (a key given in a file is an explicit setting: `fafo serve`
    takes its max_tokens as every request's limit). With `config` read from `source` (what `fafo config show`
    prints), the keys that file gives are uncommented at their values."""
    lines = ["# fafo-cli configuration. Command-line flags override these values.",
             "# Each key below is commented out at its default: uncomment a key to change it.",
             f"# Location read when --config is not given: {user_config_path()}", ""]
    given = file_keys(source) if source is not None else set()
    if source is not None:
        lines[1:2] = [f"# The settings read from {source}: the keys it gives, and every other key commented out at "
                      "its default."]
    for spec in fields(Config):
        lines.append(f"# {describe(spec)}")
        default = spec.default if spec.default is not MISSING else None
        value = default if config is None else getattr(config, spec.name)
        if spec.name == "chat_template_kwargs" and value is not None:
            value = template_variables(config)  # (a mapping, as a file gives it)
        text = yaml.safe_dump({spec.name: value}, default_flow_style=False, sort_keys=False).strip()
        lines.append(text if spec.name in given else "\n".join(f"# {line}" for line in text.splitlines()))
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Flag:
    """How one key appears on a command line, read from its declaration."""
    key: str
    declarations: tuple[str, ...]  # e.g. ("--max-tokens", "-n"); empty for the positional argument
    kind: type  # what the command line parses: str, int, float or bool
    help: str
    section: str | None  # the options panel; None: the general options
    switch: tuple[str, str] | None  # a bool flag that sets the key to switch[0] (given) or switch[1] (--no-)

    def value(self, parsed: Any) -> Any:
        """The key's value for what the command line parsed (None: not given, the files' value stands)."""
        if parsed is None:
            return None
        if self.switch is not None:
            return self.switch[0] if parsed else self.switch[1]
        kind = _text_number(SPECS[self.key])
        if kind is not None and parsed.strip():  # a number read as text
            return _number(self.key, parsed, kind)
        return parsed


def commands(spec) -> tuple[str, ...]:
    """The commands that offer a key on their command line."""
    return GENERATE + spec.metadata["also"]


def flags(command: str) -> list[Flag]:
    """The keys `command` offers on its command line, in declaration order."""
    return [_flag(spec) for spec in fields(Config) if command in commands(spec)]


def method_of(spec) -> str | None:
    """The method a key belongs to, by its help's first word ("fafo stream: ..."); None for the general keys."""
    first = spec.metadata["help"].split(":")[0].split()[0]
    return first if first in SECTIONS else None


def compressors_of(spec) -> tuple[str, ...]:
    """The compressors a FAFO key belongs to, by its help ("fafo snapkv/h2o: ..."); () for the others."""
    head = spec.metadata["help"].split(":")[0].split()
    return tuple(head[1].split("/")) if len(head) == 2 and head[0] == "fafo" else ()


def section(spec) -> str | None:
    """The option panel of a key: its method's (see `method_of`); None for the general keys."""
    method = method_of(spec)
    return SECTIONS[method] if method else None


def _command_line_type(spec) -> type:
    """The widest of the annotation's types: a flag's text must reach the checks ("int | str": "auto" or 3)."""
    if spec.metadata["switch"]:
        return bool
    if _text_number(spec):  # text: --seed "" empties a config file's value
        return str
    names = {name.strip() for name in spec.type.split("|")} - {"None"}
    if {"int", "float"} <= names:  # text: "1" is one token (an int), "0.5" a fraction (budget)
        return str
    return next(kind for kind in (str, float, int, bool) if kind.__name__ in names)


def _text_number(spec) -> type | None:
    """int or float for a number that may also be emptied: its flag reads text (Flag.value converts it)."""
    names = {name.strip() for name in spec.type.split("|")} - {"None"}
    return {"int": int, "float": float}.get(names.pop()) if spec.metadata["nullable"] and len(names) == 1 else None


def _flag(spec) -> Flag:
    meta = spec.metadata
    kind = _command_line_type(spec)
    declarations: tuple[str, ...] = ()
    if not meta["argument"]:
        name = spec.name.replace("_", "-")
        long = meta["flag"] or (f"--{name}/--no-{name}" if kind is bool else f"--{name}")
        declarations = (long, meta["short"]) if meta["short"] else (long,)
    if meta["switch"]:  # the flag's two sides stand for the key's choices (not giving it: the files' value)
        sides = zip(declarations[0].split("/"), meta["switch"])
        help = f"{meta['help']} ({', '.join(f'{side}: {value}' for side, value in sides)})"
    else:
        help = describe(spec)
    return Flag(spec.name, declarations, kind, help, section(spec), meta["switch"])


def _flag_text(flag: Flag) -> str:
    if not flag.declarations:
        return f"argument `{flag.key.upper()}`"
    return ", ".join(" / ".join(f"`{d}`" for d in declaration.split("/")) for declaration in flag.declarations)


def _type_text(spec) -> str:
    names = [name.strip() for name in spec.type.split("|") if name.strip() != "None"]
    return " or ".join(names) + (", or empty" if spec.metadata["nullable"] else "")


def _allowed_text(spec) -> str:
    meta = spec.metadata
    low, high = meta["low"], meta["high"]
    if meta["allowed"]:
        return meta["allowed"]
    if meta["choices"]:
        return ", ".join(f"`{choice}`" for choice in meta["choices"])
    if low is None:
        return ""
    if high is None:
        return f"> {low}" if meta["low_open"] else f">= {low}"
    return f"> {low} and <= {high}" if meta["low_open"] else f"{low}-{high}"


def _default_text(value: Any) -> str:
    if value is None:
        return "empty"
    return f"`{str(value).lower() if isinstance(value, bool) else value}`"


def reference_markdown() -> str:
    """docs/configuration.md: every key with its flag, type, default, allowed values and help."""
    everywhere = ", ".join(f"`fafo {command}`" for command in GENERATE[:-1]) + f" and `fafo {GENERATE[-1]}`"
    others = sorted({command for spec in fields(Config) for command in spec.metadata["also"]})
    lines = [
        "# Configuration", "",
        "<!-- Generated from fafo_cli/config.py by `fafo config show --markdown`: edit the declarations there. -->",
        "",
        "Every setting is a key of one typed configuration, `Config` in `fafo_cli/config.py`, which declares each "
        "key's help, type, default, allowed values and flag once; the commands' `--help`, the checks on files and "
        "flags, `fafo config show` and this page are all read from there.", "",
        "## Where values come from", "",
        "Later sources win: **defaults < the user config file, or `--config FILE` instead < flags**. The user config "
        "file is `~/.config/fafo/config.yaml` (`$XDG_CONFIG_HOME/fafo/config.yaml` where that is set; `fafo config "
        "path` prints it, `fafo config init` writes every key there commented out at its default, to uncomment what "
        "you change); `--config FILE` is read instead of it. In a "
        "file, a key left empty (`seed:`) clears a key that may be empty, and a path (`model`, `draft_model`, "
        "`cacheback_table`) is read as a flag's is: `~` is your home folder, a relative path starts at the folder "
        "the command runs in, not the file's (write an absolute one in the user file). An unknown key or a value "
        "outside what "
        "the key allows is an error that names the key. A file's keys are defaults; a flag of `fafo run` or `fafo "
        "chat` (or a field of a `fafo serve` request) that would change nothing is an error: another method's "
        "setting; a setting of FAFO's lookahead window where none runs (`streams: 0`, or `auto` on a CPU without a "
        "compressor named) or of a compressor the window does not use; `top_p`, `top_k` or `min_p` other than 1, "
        "0, 0, or a `seed`, while decoding greedily (a server request may send a seed, or `top_p`, `top_k` or "
        "`min_p` with temperature 0, as clients do for repeatable answers or from presets); `system` or "
        "`chat_template_kwargs` without a chat template, or a variable the template never reads. "
        "`fafo compile` refuses the answer's settings (sampling, `max_tokens`, `system`, `chat_template`, "
        "`chat_template_kwargs`), other methods' settings and those of where guesses come from (`prefix`, "
        "`pool_per_key`, `copies`, the lookup, Cacheback and SuffixDecoding keys), which do not shape the steps it "
        "builds, and a draft model, several GPUs, CUDA graphs or a device other than the CPU (it builds CPU steps); "
        "it checks the rest as `fafo run` does.", "",
        f"{everywhere} take every key on their command line; the other commands take these:", "",
    ]
    for command in others:
        offered = ", ".join(f"`{flag.key}`" for flag in flags(command))
        lines.append(f"- `fafo {command}`: {offered}")
    lines.append("")
    titles = [None, *SECTIONS.values()]
    methods = {title: method for method, title in SECTIONS.items()}
    for title in titles:
        heading = f"{title} (`--method {methods[title]}`)" if title else "General"
        lines += [f"## {heading}", "", "| key | flag | type | default | allowed | meaning |",
                  "|---|---|---|---|---|---|"]
        for spec in fields(Config):
            if section(spec) == title:
                flag = _flag(spec)
                lines.append(f"| `{spec.name}` | {_flag_text(flag)} | {_type_text(spec)} | "
                             f"{_default_text(spec.default)} | {_allowed_text(spec)} | {spec.metadata['help']} |")
        lines.append("")
    least = "; ".join(f"{name}: {rule(Config())[0]}" for name, rule in MIN_BUDGET.items())
    lines += [f"`budget`, when in tokens, must hold what the compressor always keeps, at least: {least}.", ""]
    return "\n".join(lines)
