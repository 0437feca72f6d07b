"""Where a compiled step's time goes: inside the compiled model call, and everything else the decoder does per
step (pool lookups, mask and position assembly, KV commit, acceptance, statistics, detokenization).

    python scripts/step_overhead.py --tokens 256            # needs the compiled packages (fafo run --compile)
"""

from __future__ import annotations

import argparse
import statistics

from fafo_cli import load
from fafo_cli.bench import suites


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default="vanilla,fafo,prompt-lookup")
    args = parser.parse_args()
    engine = load(args.model, dtype=args.dtype, compile="on")
    samples = [s for s in suites.collect(["chat", "summarize"], 1, None)]
    for method in args.methods.split(","):
        for sample in samples:
            totals, inside = [], []
            for _ in range(args.repeats):
                engine.reset()
                calls, seconds = engine.compiled.calls, engine.compiled.seconds
                stats = engine.complete(list(sample.messages), max_tokens=args.tokens, method=method,
                                        temperature=0.0).stats
                steps = engine.compiled.calls - calls
                totals.append(stats.decode_s / (stats.steps - 1) * 1e3)
                inside.append((engine.compiled.seconds - seconds) / max(steps, 1) * 1e3)
            total, model = statistics.median(totals), statistics.median(inside)
            print(f"{method:14s} {sample.suite:10s} step {total:6.2f} ms = model {model:6.2f} ms + "
                  f"rest {total - model:5.2f} ms ({(total - model) / total:.0%})")


if __name__ == "__main__":
    main()
