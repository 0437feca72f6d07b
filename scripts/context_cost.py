"""Per-step cost against context length: plain decoding, and FAFO with `none` and with each compressor, on the long
suite's recall prompt cut to each length (1K, 2K, 4K, 8K tokens by default): ms per step, tokens/s, τ, the
positions the window rows see, draft memory, and the prefill's time (time to first token). FAFO's planner picks
each step's rows (`rows`: their mean), so ms/step compares whole steps as decoding runs them; `--settings
planner=false` holds every step to the same rows, for the cost of the attention alone (the check's profiled runs
use the same settings).

Eager runs also check, with torch's profiler, what the window rows' attention really reads on the split path: the
keys of every attention call of a few steps. Where a compressor is active, the window rows' call must read at most
B + the step's rows keys, however long the context, while the verify rows' call reads the whole cache. (Compiled
steps mask the cache inside one kernel call: the profiler cannot tell the rows apart there, so `--compile` runs
skip the check.)

Every run starts from an empty cache, so each prefills its whole prompt (minutes at 8K on a small CPU).

    python scripts/context_cost.py --contexts 1024 2048 4096 8192
"""

from __future__ import annotations

import statistics

import torch

import common
from fafo_cli.bench import long
from fafo_cli.config import COMPRESSORS, Config

# an attention call's (query rows, keys) from its input shapes: torch's [batch, heads, rows, dim], our kernel's
# (eager steps where our library is loaded) [rows, heads, dim]
ATTENTION_OPS = {"aten::scaled_dot_product_attention": 2, "fafo::attend": 0}
CHECKED_STEPS = 6  # tokens of the profiled run: a few steps are enough to see what each call reads


def prompt_at(engine, context: int, tokens: int) -> list[dict]:
    """The recall task's prompt of about `context` tokens (its answer's room beyond)."""
    return list(long.build(context + tokens, 0, tokens, engine.encode, tasks=("recall",))[0].messages)


def attention_reads(engine, messages: list[dict], settings: dict) -> list[tuple[int, int]]:
    """(query rows, keys) of every attention call in a few decoding steps (the prompt is prefilled first, outside
    the profile; the profiled request reuses it and recomputes its last token)."""
    engine.reset()
    engine.complete(messages, max_tokens=1, **settings)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profile:
        engine.complete(messages, max_tokens=CHECKED_STEPS, **settings)
    calls = []
    for event in profile.events():
        axis = ATTENTION_OPS.get(event.name)
        if axis is not None and len(event.input_shapes) >= 2 and len(event.input_shapes[1]) == 3 + (axis > 0):
            calls.append((event.input_shapes[0][axis], event.input_shapes[1][axis]))
    return calls


def check(calls: list[tuple[int, int]], context: int, budget: int, compressor: str) -> str:
    """What the window rows read, in words; raises if they read more than C(kv) and the step's rows."""
    small = [c for c in calls if c[1] < context]
    if compressor == "none":
        return f"one call per layer over {max(k for _, k in calls)} keys (no compressor: every row sees the cache)"
    if context <= budget:
        return "the context fits the budget: one call over the whole cache"
    if not small:
        raise SystemExit(f"{compressor} at {context}: no attention call read less than the whole cache: the window "
                         "rows did not run, or read everything")
    largest = max(k for _, k in small)
    rows = max(q for q, _ in small)
    if largest > budget + rows + 1:
        raise SystemExit(f"{compressor} at {context}: the window rows read {largest} keys, more than B = {budget} "
                         f"and their {rows} rows")
    return f"window calls read ≤ {largest} keys (B = {budget}), verify calls {max(k for _, k in calls)}"


def main() -> None:
    parser = common.parser(__doc__, "model", "dtype", "tokens", "repeats", "compile", tokens=64, repeats=1)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192],
                        help="prompt lengths in tokens")
    parser.add_argument("--compressors", nargs="+", default=list(COMPRESSORS), choices=COMPRESSORS)
    parser.add_argument("--budget", type=int, default=Config().budget, help="FAFO's budget B in tokens")
    parser.add_argument("--settings", default="", metavar="SETTING",
                        help="more settings for every FAFO row, e.g. planner=false,W=2 (scripts/README.md's syntax)")
    parser.add_argument("--no-check", dest="check", action="store_false",
                        help="skip the profiled check of what the window rows read")
    args = parser.parse_args()
    engine = common.load_engine(args)
    variants = {"vanilla": dict(method="vanilla")}
    extra = common.parse_setting(args.settings)
    variants.update({f"fafo-{c}": {**extra, "compressor": c, "budget": args.budget} for c in args.compressors})
    print(f"{'context':>7} {'row':12} {'ms/step':>8} {'rows':>5} {'tok/s':>7} {'τ':>5} {'window sees':>11} "
          f"{'draft MB':>8} {'prefill s':>9}", flush=True)
    for context in args.contexts:
        messages = prompt_at(engine, context, args.tokens)
        for name, settings in variants.items():
            measured = []
            for _ in range(args.repeats):
                engine.reset()  # every run prefills from scratch: the same selection and rounding for each
                measured.append(engine.complete(messages, max_tokens=args.tokens, **settings).stats)
            stats = measured[len(measured) // 2]
            ms = statistics.median(common.ms_per_step(s) for s in measured)
            speed = statistics.median(s.tokens_per_s for s in measured)
            print(f"{stats.prompt_tokens:7d} {name:12} {ms:8.1f} {stats.mean_rows or 1:5.1f} {speed:7.1f} "
                  f"{stats.tokens_per_step:5.2f} {stats.fumble_positions or '-':>11} "
                  f"{stats.draft_memory_mb or 0:8.2f} {statistics.median(s.prefill_s for s in measured):9.1f}",
                  flush=True)
            if args.check and not args.compile and settings.get("method", "fafo") == "fafo":
                calls = attention_reads(engine, messages, settings)
                print(f"{'':7} {'':12} {check(calls, stats.prompt_tokens, args.budget, settings['compressor'])}",
                      flush=True)


if __name__ == "__main__":
    main()
