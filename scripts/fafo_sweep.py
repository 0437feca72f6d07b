"""Sweep decoding settings against vanilla on one model: tokens/s, τ and per-step cost, side by side.

Every repetition runs vanilla and each setting in turn on each prompt (interleaved, so machine drift hits all
equally); medians over repetitions. This is how the defaults in config.py were chosen; `fafo bench` reports
the defaults, this script compares any settings (`fafo bench --tune` tries a fixed few).

    python scripts/fafo_sweep.py --tokens 256 --repeats 3 --settings "W=2,k=4,G=2,P=2" "W=1,k=6,G=2,P=3"

The prompts are examples/rewrite.txt and examples/prompt.txt unless `--prompts` names other files or `--suites
chat,summarize` takes the bench's (`--samples` per suite). `--compile` runs everything on compiled steps (building
the packages it needs first). `--markdown` prints the results as a table.
"""

from __future__ import annotations

import statistics

import common
from fafo_cli.runtime.conversations import shared_prefix


def main() -> None:
    parser = common.parser(__doc__, "model", "dtype", "tokens", "repeats", "suites", "samples", "prompts",
                           "compile", "settings", prompts=["examples/rewrite.txt", "examples/prompt.txt"])
    parser.add_argument("--markdown", action="store_true", help="also print a markdown table per prompt")
    args = parser.parse_args()
    engine = common.load_engine(args)
    runs = [("vanilla", dict(method="vanilla"))] + [(s, common.parse_setting(s)) for s in args.settings]
    for sample in common.prompts(args, engine):
        prompt = list(sample.messages)
        results: dict[str, list] = {name: [] for name, _ in runs}
        reference = None
        for _ in range(args.repeats):
            for name, settings in runs:
                engine.reset()
                result = engine.complete(prompt, max_tokens=args.tokens, **settings)
                if name == "vanilla":
                    reference = result.token_ids
                same = shared_prefix(result.token_ids, reference)
                results[name].append((result.stats, same, len(result.token_ids)))
        base = statistics.median(s.tokens_per_s for s, _, _ in results["vanilla"])
        base_step = statistics.median(common.ms_per_step(s) for s, _, _ in results["vanilla"])
        print(f"\n{sample.suite} · {sample.id} ({len(engine.encode(prompt))} prompt tokens, {args.tokens} new, "
              f"{args.dtype}, median of {args.repeats})")
        print(f"{'setting':28s} {'tok/s':>7s} {'speedup':>8s} {'tau':>5s} {'ms/step':>8s} {'step cost':>9s} "
              f"{'accept':>7s} {'extra MB':>8s} {'peak MB':>8s} {'same as vanilla':>16s}")
        rows = []
        for name, _ in runs:
            stats = [s for s, _, _ in results[name]]
            speed = statistics.median(s.tokens_per_s for s in stats)
            tau = statistics.median(s.tokens_per_step for s in stats)
            step = statistics.median(common.ms_per_step(s) for s in stats)
            rate = statistics.median(s.acceptance_rate or 0 for s in stats)
            extra = max(s.draft_memory_mb or 0 for s in stats)
            peak = max(s.peak_memory_mb for s in stats)
            same, total = results[name][-1][1], results[name][-1][2]
            rows.append((name, speed, speed / base, tau, rate, extra, peak))
            print(f"{name:28s} {speed:7.1f} {speed / base:7.2f}x {tau:5.2f} {step:8.1f} "
                  f"{step / base_step:8.2f}x {rate:7.0%} {extra:8.1f} {peak:8.0f} {same:>7d}/{total} tok")
        if args.markdown:
            print("\n| method | tokens/s | speedup | τ | accepted/drafted | extra memory | peak RSS |")
            print("|---|---:|---:|---:|---:|---:|---:|")
            for name, speed, ratio, tau, rate, extra, peak in rows:
                print(f"| {name} | {speed:.1f} | {ratio:.2f}× | {tau:.2f} | {rate:.0%} | {extra:.1f} MB "
                      f"| {peak:.0f} MB |")


if __name__ == "__main__":
    main()
