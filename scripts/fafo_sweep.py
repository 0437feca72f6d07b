"""Sweep decoding settings against vanilla on one model: tokens/s, τ and per-step cost, side by side.

Every repetition runs vanilla and each setting in turn on each prompt (interleaved, so machine drift hits all
equally); medians over repetitions. This is how the defaults in config.py were chosen; `fafo bench` will
supersede it for reporting.

    python scripts/fafo_sweep.py --tokens 256 --repeats 3 \
        --settings "W=2,k=4,G=2,P=2" "W=1,k=6,G=2,P=3" --prompts examples/rewrite.txt examples/prompt.txt

`--compile` runs everything on compiled steps (building the packages it needs first). `--suites chat,summarize`
takes the bench's prompts (`--samples` per suite) instead of files.

A setting is FAFO's short keys (W, k, G, P, B, C, S, N), `M=method` for another method, or any config key:
"M=cacheback,cacheback_budget=24". `--markdown` prints the results as a table for the README.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from fafo_cli import load
from fafo_cli.bench import suites

KEYS = {"W": "streams", "k": "ngram", "G": "guesses", "P": "prefix", "B": "budget", "C": "compressor",
        "S": "sink", "N": "pool_per_key", "M": "method"}


def parse(spec: str) -> dict:
    out = {"method": "fafo"}
    for part in spec.split(","):
        key, value = part.split("=")
        for kind in (int, float, str):
            try:
                out[KEYS.get(key, key)] = kind(value)
                break
            except ValueError:
                continue
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--settings", nargs="+", required=True)
    parser.add_argument("--prompts", nargs="+", default=["examples/rewrite.txt", "examples/prompt.txt"])
    parser.add_argument("--suites", default=None, help="the bench's prompts instead: e.g. chat,summarize")
    parser.add_argument("--samples", type=int, default=3, help="prompts per suite, with --suites")
    parser.add_argument("--markdown", action="store_true", help="also print a markdown table per prompt")
    parser.add_argument("--compile", action="store_true", help="every run (vanilla too) on compiled steps")
    args = parser.parse_args()

    engine = load(args.model, dtype=args.dtype, compile="on" if args.compile else "off")
    runs = [("vanilla", dict(method="vanilla"))] + [(s, parse(s)) for s in args.settings]
    if args.suites:
        prompts = [(f"{s.suite} · {s.id}", list(s.messages)) for s in suites.collect(args.suites.split(","),
                                                                                      args.samples, None)]
    else:
        prompts = [(path, Path(path).read_text()) for path in args.prompts]
    for path, prompt in prompts:
        results: dict[str, list] = {name: [] for name, _ in runs}
        reference = None
        for _ in range(args.repeats):
            for name, settings in runs:
                engine.reset()
                result = engine.complete(prompt, max_tokens=args.tokens, **settings)
                if name == "vanilla":
                    reference = result.token_ids
                same = _common_prefix(result.token_ids, reference)
                results[name].append((result.stats, same, len(result.token_ids)))
        base = statistics.median(s.tokens_per_s for s, _, _ in results["vanilla"])
        base_step = statistics.median(s.decode_s / max(1, s.steps - 1) for s, _, _ in results["vanilla"])
        print(f"\n{path} ({len(engine.encode(prompt))} prompt tokens, {args.tokens} new, {args.dtype}, "
              f"median of {args.repeats})")
        print(f"{'setting':28s} {'tok/s':>7s} {'speedup':>8s} {'tau':>5s} {'ms/step':>8s} {'step cost':>9s} "
              f"{'accept':>7s} {'extra MB':>8s} {'peak MB':>8s} {'same as vanilla':>16s}")
        rows = []
        for name, _ in runs:
            stats = [s for s, _, _ in results[name]]
            speed = statistics.median(s.tokens_per_s for s in stats)
            tau = statistics.median(s.tokens_per_step for s in stats)
            step = statistics.median(s.decode_s / max(1, s.steps - 1) for s in stats)
            rate = statistics.median(s.acceptance_rate or 0 for s in stats)
            extra = max(s.draft_memory_mb or 0 for s in stats)
            peak = max(s.peak_memory_mb for s in stats)
            same, total = results[name][-1][1], results[name][-1][2]
            rows.append((name, speed, speed / base, tau, rate, extra, peak))
            print(f"{name:28s} {speed:7.1f} {speed / base:7.2f}x {tau:5.2f} {step * 1e3:8.1f} "
                  f"{step / base_step:8.2f}x {rate:7.0%} {extra:8.1f} {peak:8.0f} {same:>7d}/{total} tok")
        if args.markdown:
            print("\n| method | tokens/s | speedup | τ | accepted/drafted | extra memory | peak RSS |")
            print("|---|---:|---:|---:|---:|---:|---:|")
            for name, speed, ratio, tau, rate, extra, peak in rows:
                print(f"| {name} | {speed:.1f} | {ratio:.2f}× | {tau:.2f} | {rate:.0%} | {extra:.1f} MB "
                      f"| {peak:.0f} MB |")


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


if __name__ == "__main__":
    main()
