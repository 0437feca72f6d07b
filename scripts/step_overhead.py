"""Where a compiled step's time goes: inside the compiled model call, and everything else the decoder does per
step (pool lookups, mask and position assembly, KV commit, acceptance, statistics, detokenization). Builds the
packages it needs that are missing (minutes each; `fafo run --compile` builds FAFO's).

    python scripts/step_overhead.py --tokens 256 --settings M=vanilla M=fafo M=prompt-lookup
"""

from __future__ import annotations

import statistics

import common


def main() -> None:
    parser = common.parser(__doc__, "model", "dtype", "tokens", "repeats", "suites", "samples", "prompts",
                           "settings", suites="chat,summarize", samples=1,
                           settings=["M=vanilla", "M=fafo", "M=prompt-lookup"])
    args = parser.parse_args()
    engine = common.load_engine(args, compile="on")
    samples = common.prompts(args, engine)
    for spec in args.settings:
        settings = common.parse_setting(spec)
        # untimed: loads the packages this setting runs in (building those missing), which its first step would do
        engine.complete(list(samples[0].messages), max_tokens=args.tokens, **{"temperature": 0.0, **settings})
        for sample in samples:
            totals, inside = [], []
            for _ in range(args.repeats):
                engine.reset()
                calls, seconds = engine.compiled.calls, engine.compiled.seconds
                stats = engine.complete(list(sample.messages), max_tokens=args.tokens,
                                        **{"temperature": 0.0, **settings}).stats  # greedy unless a setting says
                steps = engine.compiled.calls - calls
                totals.append(common.ms_per_step(stats))
                inside.append((engine.compiled.seconds - seconds) / max(steps, 1) * 1e3)
            total, model = statistics.median(totals), statistics.median(inside)
            print(f"{spec:16s} {sample.suite:10s} step {total:6.2f} ms = model {model:6.2f} ms + "
                  f"rest {total - model:5.2f} ms ({(total - model) / total:.0%})", flush=True)


if __name__ == "__main__":
    main()
