"""FAFO's compiled steps without candidates in their own smaller package against padded to the full step's, side by
side in one process (alternating, median of the repeats per prompt): tokens/s and ms per step. The same tokens
either way (checked). Needs the packages (fafo run --compile, or fafo bench --compile).

    python scripts/step_sizes_ab.py --suites chat,summarize --repeats 3
"""

from __future__ import annotations

import argparse
import statistics

from fafo_cli import load
from fafo_cli.bench import suites

SIZES = (3, 6)  # FAFO's default compiled steps (W=1, k=3, G=1): without candidates, and full


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--suites", default="chat,summarize")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    engine = load(args.model, dtype="bfloat16", compile="auto")
    steps = engine.compiled
    for sample in suites.collect(args.suites.split(","), 3, None):
        runs: dict[str, list[tuple[float, float]]] = {"padded": [], "own size": []}
        tokens = {}
        for _ in range(args.repeats):
            for name in runs:
                steps._cheaper[SIZES] = name == "own size"  # CompiledSteps.size_for's decision, set
                engine.reset()
                result = engine.complete(list(sample.messages), max_tokens=args.tokens, method="fafo", temperature=0.0)
                stats = result.stats
                tokens.setdefault(name, result.token_ids)
                runs[name].append((stats.tokens_per_s, stats.decode_s / (stats.steps - 1) * 1e3))
        same = tokens["padded"] == tokens["own size"]
        print(f"{sample.suite:10s} {sample.id:14s} " + "  ".join(
            f"{name}: {statistics.median(t for t, _ in r):6.1f} tok/s {statistics.median(m for _, m in r):5.2f} ms"
            for name, r in runs.items()) + f"  same tokens: {same}")


if __name__ == "__main__":
    main()
