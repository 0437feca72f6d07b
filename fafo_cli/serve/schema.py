"""Request bodies of /v1/chat/completions and /v1/completions, checked into a Job.

OpenAI's fields are checked one by one; our own settings come as extra fields (`method`, `compressor`, `budget`,
...) and are checked exactly as the config file's keys are (Engine.request_config). Nothing that asks for an answer
of another kind is ignored: a field we do not support, or a value we cannot honour (n > 1, tools, logprobs), is a
400 that names it. The caller's ids (`user`, ...) are accepted and change nothing, as from OpenAI; a message's `name`
goes to the chat template, which may not show it. A field given as null is a field not given, as in OpenAI's API.
"""

from __future__ import annotations

import copy
import json
import re
import threading
from dataclasses import dataclass, fields, replace
from typing import Any

from .. import config as config_mod
from ..api import LOAD_KEYS, ROLES as API_ROLES, Engine
from ..errors import FafoError
from .errors import ApiError

MAX_STOPS = 16  # OpenAI takes 4; clients written for llama.cpp's or vLLM's servers send more (each costs little)
TEXT_MAX_TOKENS = 16  # OpenAI's limit of a completion that gives none (a chat's is the context left)
# (user, safety_identifier, prompt_cache_key: the caller's ids for its end user and its cache, no effect on the answer)
IDS = ("user", "safety_identifier", "prompt_cache_key")
# (metadata: the caller's tags for a stored completion, which this server neither stores nor reads)
COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "metadata", *IDS}
CHAT = COMMON | {"messages", "max_completion_tokens"}
TEXT = COMMON | {"prompt"}
# Fields accepted only at the value that asks for nothing (clients often send them explicitly)
COMMON_NEUTRAL = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "store": False,
                  "service_tier": "auto"}
NEUTRAL = {**COMMON_NEUTRAL, "logprobs": False, "top_logprobs": 0, "tools": [], "tool_choice": "none",
           "response_format": {"type": "text"}}
# (a completion's logprobs is a count: 0 asks for the chosen tokens' log probabilities, so only null is neutral)
TEXT_NEUTRAL = {**COMMON_NEUTRAL, "echo": False, "best_of": 1}
# Config keys a client may not set: a file on the server's disk; how many of every client's earlier answers
# SuffixDecoding drafts from (one client's request would drop the others')
SERVER_ONLY = {"cacheback_table", "suffix_outputs"}
PER_REQUEST = {spec.name for spec in fields(config_mod.Config)} - LOAD_KEYS - SERVER_ONLY
ROLES = {**{role: role for role in API_ROLES}, "developer": "system"}  # OpenAI: developer
# messages are what system messages were


@dataclass(frozen=True)
class Job:
    kind: str  # "chat" or "text"
    prompt: str | list[dict]  # chat messages (chat template applied) or text continued as is
    config: config_mod.Config  # the request's settings: validated, the model's sampling defaults and a seed filled
    tokens_field: str | None  # the field that gave max_tokens: beyond the context it is an error, not cut to fit
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    ids: tuple[int, ...] = ()  # the prompt's tokens (Prompts.encoded), with config.max_tokens fitted to the context

    @property
    def prompt_field(self) -> str:
        return "messages" if self.kind == "chat" else "prompt"

    def fitted(self, prompt_tokens: int, context: int) -> config_mod.Config:
        """The config with max_tokens bounded by the context left after the prompt (an error if asked beyond)."""
        room = context - prompt_tokens
        if room <= 0:
            raise ApiError(400, f"the prompt is {prompt_tokens} tokens; this model's context is {context} tokens, and "
                                "an answer needs at least one more",
                           param=self.prompt_field, code="context_length_exceeded")
        if self.config.max_tokens <= room:
            return self.config
        if self.tokens_field:
            raise ApiError(400, f"this model's context is {context} tokens: the prompt takes {prompt_tokens}, so "
                                f"{self.tokens_field} can be at most {room} (got {self.config.max_tokens})",
                           param=self.tokens_field, code="context_length_exceeded")
        return replace(self.config, max_tokens=room)


class Prompts:
    """Tokens of a job's prompt, found before the job queues, so that a request the model cannot take (a prompt
    beyond its context or refused by its chat template, a stop string that could never match) is a real status
    even for a stream that waits. Its own tokenizer: the engine's thread decodes with the engine's, and a fast
    tokenizer may not be used by two threads at once."""

    def __init__(self, engine: Engine):
        self._engine = engine
        self._tokenizer = copy.deepcopy(engine.tokenizer)
        self._lock = threading.Lock()

    def encoded(self, job: Job) -> Job:
        """The job with its prompt's ids and max_tokens fitted to the context left (an ApiError where it cannot)."""
        with self._lock:
            try:
                ids = self._engine.encode(job.prompt, job.config, self._tokenizer)
            except FafoError as e:  # the prompt itself: empty, not text, refused by the chat template
                raise ApiError(400, str(e), param=job.prompt_field, code="invalid_value") from None
            try:
                self._engine.token_stops(job.stop, self._tokenizer)
            except FafoError as e:  # a special token's text among other text
                raise ApiError(400, str(e), param="stop", code="invalid_value") from None
        return replace(job, ids=tuple(ids), config=job.fitted(len(ids), self._engine.model.max_context))


def read_json(raw: bytes) -> dict:
    try:
        # JSON on the wire is UTF-8 (RFC 8259), which lets a reader skip a byte order mark (a file saved on Windows)
        body = json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not UTF-8 text") from None
    except ValueError as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON here: nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:  # a lone "\\ud800" escape is valid JSON but no character: no field, key or echo of it may hold one
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, "the request body holds a lone UTF-16 surrogate escape (such as \\ud800): not text") \
            from None
    return body


def parse(body: dict, kind: str, engine: Engine, served: str, max_tokens: int | None = None) -> Job:
    """A Job for a chat (`kind` "chat") or completion ("text") request body, or ApiError 400/404. `max_tokens`: the
    limit of a request that gives none (`fafo serve --max-tokens`); None: OpenAI's (a chat's the context left after
    the prompt, a completion's 16 tokens)."""
    given = {key: value for key, value in body.items() if value is not None}
    openai, neutral = (CHAT, NEUTRAL) if kind == "chat" else (TEXT, TEXT_NEUTRAL)
    for key, value in given.items():
        if key in neutral:
            if value != neutral[key] or isinstance(value, bool) != isinstance(neutral[key], bool):
                raise ApiError(400, f"'{key}' must be {json.dumps(neutral[key])}: this server does not support "
                                    f"other values", param=key, code="unsupported_value")
        elif key == "logprobs":  # a completion's: a count, of which only null asks for nothing
            raise ApiError(400, "'logprobs' must be null: this server does not return log probabilities",
                           param=key, code="unsupported_value")
        elif key in LOAD_KEYS - {"model"}:
            raise ApiError(400, f"'{key}' is fixed when the server loads the model (a `fafo serve` option)",
                           param=key, code="unsupported_parameter")
        elif key in SERVER_ONLY:
            raise ApiError(400, f"'{key}' is the server's to set (a `fafo serve` option), not a request's",
                           param=key, code="unsupported_parameter")
        elif key not in openai and key not in PER_REQUEST:
            raise ApiError(400, f"unsupported field '{key}'", param=key, code="unsupported_parameter")
    for key in IDS:
        _typed(given, key, str, "a string")
    model = _typed(given, "model", str, "a string")
    if model is not None and model != served:
        raise ApiError(404, f"the model '{model}' does not exist: this server serves '{served}' (GET /v1/models)",
                       param="model", code="model_not_found")
    prompt = _messages(given) if kind == "chat" else _prompt(given)
    if kind == "chat" and "system" in given and any(message["role"] == "system" for message in prompt):
        raise ApiError(400, "'system' and a system message in 'messages' both give the system prompt: send one",
                       param="system", code="invalid_value")
    overrides = {key: given[key] for key in PER_REQUEST & given.keys() if key != "max_tokens"}
    seed = given.get("seed")
    if type(seed) is int and (seed < -2**63 or seed >= 2**64):
        raise ApiError(400, f"'seed' must be from -2**63 to 2**64 - 1 (got {seed})", param="seed", code="invalid_value")
    if type(seed) is int and seed < -1:  # OpenAI's seeds are signed 64-bit: the same bits, unsigned (-1: a fresh one)
        overrides["seed"] = seed + 2**64
    tokens, tokens_field = _max_tokens(given, kind)
    # no limit asked: the server's, else OpenAI's: a chat's the whole context (Job.fitted cuts it to what the prompt
    # leaves), a completion's 16
    overrides["max_tokens"] = tokens if tokens is not None else \
        max_tokens or (engine.model.max_context if kind == "chat" else TEXT_MAX_TOKENS)
    # nothing a request asks for may go unheeded, but a seed while greedy: clients send one with temperature 0
    # for repeatable answers, which greedy answers are; and top_p, top_k and min_p beside temperature 0, which
    # OpenAI (top_p) and vLLM accept and clients send from their presets (greedy decoding keeps to any of them: its
    # token is the likeliest)
    sampling_only = set(config_mod.SAMPLING_NEUTRAL) if given.get("temperature") == 0 else set()
    checked = PER_REQUEST & given.keys() - {"seed"} - sampling_only
    if _top_p_zero(given):  # OpenAI's top_p goes down to 0, which keeps only the likeliest token: greedy decoding
        try:  # a temperature sent beside it is checked all the same
            engine.request_config(temperature=overrides.get("temperature", 0.0))
        except FafoError as e:
            raise ApiError(400, str(e), param="temperature", code="invalid_value") from None
        del overrides["top_p"]
        overrides["temperature"] = 0.0
        checked -= {"top_p", "temperature"}
    if kind == "text":
        overrides.setdefault("chat_template", False)  # a completion continues the text as it is
        templated = next((key for key in config_mod.TEMPLATE_KEYS if overrides.get(key)), None)  # ("", {}: none)
        if templated and not overrides["chat_template"]:
            raise ApiError(400, f"'{templated}' needs the chat template: send \"chat_template\": true, or use "
                                "/v1/chat/completions" if engine.has_chat_template else
                                f"'{templated}' needs a chat template, and {engine.name} has none",
                           param=templated, code="unsupported_value")
    stream = _typed(given, "stream", bool, "true or false") or False
    include_usage = _stream_options(given, stream)
    stop = _stop(given)
    try:
        config = engine.request_config(**overrides)
        off = config_mod.SAMPLING_NEUTRAL
        sampling = [key for key in off if key in overrides and overrides[key] != off[key]]
        if sampling and "temperature" not in overrides and config.temperature == 0:
            config = engine.request_config(**overrides, temperature=1.0)  # OpenAI's temperature is 1 when not sent
        engine.check_given(config, checked, config_mod.variables_in(given.get("chat_template_kwargs")))
    except FafoError as e:
        key = re.search(r"'(\w+)'", str(e))
        raise ApiError(400, str(e), param=key.group(1) if key else None, code="invalid_value") from None
    return Job(kind, prompt, config, tokens_field, stop, stream, include_usage)


def _typed(given: dict, key: str, kind: type, what: str) -> Any:
    value = given.get(key)
    if value is not None and (type(value) is not kind):
        raise ApiError(400, f"'{key}' must be {what} (got {json.dumps(value)})", param=key, code="invalid_type")
    return value


def _max_tokens(given: dict, kind: str) -> tuple[int | None, str | None]:
    """The limit asked for and the field that gave it (None, None: none)."""
    tokens, key = _typed(given, "max_tokens", int, "an integer"), "max_tokens"
    if kind == "chat":
        newer = _typed(given, "max_completion_tokens", int, "an integer")
        if tokens is not None and newer is not None and tokens != newer:
            raise ApiError(400, "'max_tokens' and 'max_completion_tokens' differ: give one", param="max_tokens",
                           code="invalid_value")
        if newer is not None:
            tokens, key = newer, "max_completion_tokens"
    if tokens is not None and tokens < 1:
        raise ApiError(400, f"'{key}' must be at least 1 (got {tokens})", param=key, code="invalid_value")
    return tokens, key if tokens is not None else None


def _top_p_zero(given: dict) -> bool:
    """Whether `top_p` is 0 (OpenAI's range is 0 to 1, ours above 0 to 1); other values are checked as the config's,
    but for the bound, which is stated here."""
    top_p = given.get("top_p")
    if type(top_p) not in (int, float):
        return False
    if not 0 <= top_p <= 1:  # (NaN too: Python's JSON reads it)
        raise ApiError(400, f"'top_p' must be between 0 and 1 (got {json.dumps(top_p)})", param="top_p",
                       code="invalid_value")
    if top_p != 0:
        return False
    neutral = config_mod.SAMPLING_NEUTRAL
    useless = [key for key in ("top_k", "min_p") if key in given and given[key] != neutral[key]]
    if useless:
        raise ApiError(400, f"'{useless[0]}' has no effect with top_p 0, which keeps only the likeliest token "
                            "(greedy decoding)", param=useless[0], code="invalid_value")
    return True


def _stream_options(given: dict, stream: bool) -> bool:
    options = _typed(given, "stream_options", dict, "an object")
    if options is None:
        return False
    if not stream:
        raise ApiError(400, "'stream_options' is only allowed with \"stream\": true", param="stream_options",
                       code="invalid_value")
    unknown = sorted(set(options) - {"include_usage", "include_obfuscation"})
    if unknown:
        raise ApiError(400, f"unsupported field 'stream_options.{unknown[0]}'", param=f"stream_options.{unknown[0]}",
                       code="unsupported_parameter")
    if options.get("include_obfuscation") is not None and options["include_obfuscation"] is not False:
        raise ApiError(400, "'stream_options.include_obfuscation' must be false: this server does not pad its chunks",
                       param="stream_options.include_obfuscation", code="unsupported_value")
    usage = options.get("include_usage")
    if usage is not None and type(usage) is not bool:
        raise ApiError(400, "'stream_options.include_usage' must be true or false",
                       param="stream_options.include_usage", code="invalid_type")
    return bool(usage)


def _stop(given: dict) -> tuple[str, ...]:
    stop = given.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stop is None:
        return ()
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "'stop' must be a string or a list of strings", param="stop", code="invalid_type")
    if len(stops) > MAX_STOPS or not all(stops):
        raise ApiError(400, f"'stop' takes at most {MAX_STOPS} non-empty strings", param="stop", code="invalid_value")
    return tuple(stops)


def _messages(given: dict) -> list[dict]:
    messages = given.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of messages", param="messages",
                       code="invalid_type" if messages is not None else "missing_required_parameter")
    return [_message(message, f"messages[{i}]") for i, message in enumerate(messages)]


def _message(message: Any, where: str) -> dict:
    if not isinstance(message, dict):
        raise ApiError(400, f"'{where}' must be an object with 'role' and 'content'", param=where, code="invalid_type")
    given = {key: value for key, value in message.items() if value is not None}
    unknown = sorted(set(given) - {"role", "content", "name"})
    if unknown:
        raise ApiError(400, f"unsupported field '{where}.{unknown[0]}'", param=f"{where}.{unknown[0]}",
                       code="unsupported_parameter")
    role = given.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise ApiError(400, f"'{where}.role' must be one of {', '.join(ROLES)} (got {json.dumps(role)})",
                       param=f"{where}.role", code="invalid_value")
    name = given.get("name")  # the speaker's: the chat template may show it (api._messages)
    if name is not None and type(name) is not str:
        raise ApiError(400, f"'{where}.name' must be a string (got {json.dumps(name)})", param=f"{where}.name",
                       code="invalid_type")
    return {"role": ROLES[role], "content": _content(given.get("content"), f"{where}.content"),
            **({"name": name} if name is not None else {})}


def _content(content: Any, where: str) -> str:
    """A message's text: a string, or a list of text parts (joined); other parts (images, audio) are refused."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"'{where}[{i}]' must be a text part {{\"type\": \"text\", \"text\": ...}}: "
                                    "this server takes text only", param=f"{where}[{i}]", code="unsupported_value")
            unknown = sorted(key for key, value in part.items() if key not in ("type", "text") and value is not None)
            if unknown:
                raise ApiError(400, f"unsupported field '{where}[{i}].{unknown[0]}'", param=f"{where}[{i}].{unknown[0]}",
                               code="unsupported_parameter")
            texts.append(part["text"])
        return "\n".join(texts)  # (as vLLM and llama.cpp's server join them: each part its own line)
    raise ApiError(400, f"'{where}' must be a string or a list of text parts", param=where,
                   code="invalid_type" if content is not None else "missing_required_parameter")


def _prompt(given: dict) -> str:
    prompt = given.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # one prompt in a list: one completion
    if isinstance(prompt, str):
        return prompt
    if prompt is None:
        raise ApiError(400, "'prompt' is required", param="prompt", code="missing_required_parameter")
    raise ApiError(400, "'prompt' must be a string (one prompt per request; token ids are not supported)",
                   param="prompt", code="invalid_type")
