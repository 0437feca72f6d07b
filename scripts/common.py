"""What the measurement scripts share: their flags, the setting syntax, the model load, the prompts, a kernel's
source at a git revision, and a FAFO-shaped compiled step's inputs. Scripts import it as `common` (Python puts
the running script's folder first on the path)."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import torch

from fafo_cli import load
from fafo_cli.bench import suites
from fafo_cli.compiled import build as compiled

# FAFO's short keys in a setting ("W=2,k=4"); any other key is a config key as it is ("cacheback_budget=24")
SHORT_KEYS = {"W": "streams", "k": "ngram", "G": "guesses", "P": "prefix", "B": "budget", "C": "compressor",
              "S": "sink", "N": "pool_per_key", "M": "method"}


def parse_setting(spec: str) -> dict:
    """Config keywords for `engine.complete` from "W=2,k=4,M=cacheback,cacheback_budget=24" (method fafo unless
    M names another; values are read as true/false, else int, else float, else text)."""
    settings = {"method": "fafo"}
    for part in filter(None, spec.split(",")):
        key, value = part.split("=")
        if value in ("true", "false"):
            settings[SHORT_KEYS.get(key, key)] = value == "true"
            continue
        for kind in (int, float, str):
            try:
                settings[SHORT_KEYS.get(key, key)] = kind(value)
                break
            except ValueError:
                continue
    return settings


class _Replaces(argparse.Action):
    """--suites and --prompts name where the prompts come from: the one given replaces the script's default."""

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.suites = namespace.prompts = None
        setattr(namespace, self.dest, values)


FLAGS = {
    "model": dict(default=None, help="hub id, folder or .gguf (None: the embedded SmolLM2-135M-Instruct)"),
    "dtype": dict(default="auto", help="auto (as fafo run chooses for the device), float32, bfloat16 or float16"),
    "tokens": dict(type=int, default=256, help="new tokens per answer"),
    "repeats": dict(type=int, default=3, help="runs of every variant per prompt, alternated (medians reported)"),
    "suites": dict(default=None, action=_Replaces, help="the bench's suites to take prompts from, comma-separated"),
    "samples": dict(type=int, default=3, help="prompts per suite"),
    "prompts": dict(nargs="+", default=None, action=_Replaces, help="prompt files (one prompt each) instead"),
    "compile": dict(action="store_true", help="run on compiled steps (building missing packages first: minutes)"),
    "settings": dict(nargs="+", default=["M=fafo"], metavar="SETTING",
                     help="e.g. W=2,k=4,G=2 or M=cacheback,cacheback_budget=24: FAFO's short keys (W, k, G, P, B, "
                          "C, S, N), M for the method, or any config key"),
}


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help prints the script's docstring as written and each flag's default."""


def parser(doc: str, *flags: str, **defaults) -> argparse.ArgumentParser:
    """An argument parser for a script with docstring `doc`, with the shared `flags` (keys of FLAGS), each with the
    script's default where `defaults` gives one. The script adds its own flags to it."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=_Help)
    for flag in flags:
        options = dict(FLAGS[flag])
        if flag in defaults:
            options["default"] = defaults.pop(flag)
        parser.add_argument(f"--{flag}", **options)
    if defaults:
        raise TypeError(f"defaults for flags not asked for: {', '.join(defaults)}")
    return parser


def load_engine(args: argparse.Namespace, **settings):
    """The engine for --model and --dtype (where the script has them), compiled with --compile unless `settings`
    says how; without it, eager steps over the weights a default start reads (a .gguf model's packed blocks where
    our kernel serves the CPU), never a package."""
    settings.setdefault("compile", "on" if getattr(args, "compile", False) else "auto")
    settings.setdefault("dtype", getattr(args, "dtype", "auto"))
    engine = load(getattr(args, "model", None), **settings)
    if settings["compile"] == "auto":
        engine.session.compiled = None  # packages that exist stay unused: every step eager
    return engine


def prompts(args: argparse.Namespace, engine) -> list[suites.Sample]:
    """The prompts to run: each --prompts file whole (suite "file"), or the first --samples of each of --suites (the
    long suite's built with `engine`'s tokenizer, with room for --tokens)."""
    if getattr(args, "prompts", None):
        return [suites.Sample("file", path, ({"role": "user", "content": Path(path).read_text(encoding="utf-8")},))
                for path in args.prompts]
    long_settings = suites.LongSettings(engine.encode, engine.model.max_context, args.tokens)
    return suites.collect(suites.parse_suites(args.suites), args.samples, None, long_settings)


def ms_per_step(stats) -> float:
    """Milliseconds per decoding step: decode_s runs from the first step's token to the last's, steps - 1 steps."""
    return stats.decode_s / max(1, stats.steps - 1) * 1e3


KERNEL_FOLDERS = ("fafo_cli/compiled/kernels", "fafo_cli/engine")  # where the C++ sources lived, newest first


def kernel_source(revision: str, name: str) -> str:
    """The text of kernel source `name` (attention_op.cpp, packed_linear.cpp) at git `revision`."""
    for folder in KERNEL_FOLDERS:
        shown = subprocess.run(["git", "show", f"{revision}:{folder}/{name}"], capture_output=True, text=True)
        if shown.returncode == 0:
            return shown.stdout
    raise SystemExit(f"no {name} at {revision} (looked in {', '.join(KERNEL_FOLDERS)})")


# A FAFO-shaped compiled step: the first `see_all` rows (the anchor and the guesses to verify) see the whole cache,
# the next `see_part` (the window) a StreamingLLM view of it, any further rows nothing (padding).

def filled_cache(model, context: int, capacity: int):
    """A cache of `capacity` slots holding `context` random positions, stored as compiled steps store it."""
    cache = model.new_cache(capacity, capacity)
    cache.keys.normal_(generator=torch.Generator().manual_seed(0))
    cache.values.normal_(generator=torch.Generator().manual_seed(1))
    cache.commit(context)
    cache.store_as(compiled.stored_dtype(model))  # what the packages were traced with
    return cache


def step_inputs(model, cache, rows: int, context: int, see_all: int = 4, see_part: int = 5, sink: int = 4,
                recent: int = 252) -> tuple:
    """A package's inputs for a FAFO-shaped step of `rows` rows after `context` cached positions; the part-seeing
    rows see the first `sink` and the last `recent` of them."""
    sees_all = torch.arange(rows) < see_all
    sees_part = ~sees_all & (torch.arange(rows) < see_all + see_part)
    visible = torch.zeros(context, len(model.layers), dtype=torch.bool)
    visible[:sink] = visible[-recent:] = True
    return (torch.zeros(rows, dtype=torch.long), torch.arange(context, context + rows),
            torch.ones(rows, rows, dtype=torch.bool).tril(), sees_all, sees_part, visible,
            list(cache.keys.unbind(0)), list(cache.values.unbind(0)))
