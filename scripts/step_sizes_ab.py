"""FAFO's compiled steps without candidates in their own smaller package against padded to the full step's, side by
side in one process (alternating, median of the repeats per prompt): tokens/s and ms per step. The same tokens
either way (checked). Uses the packages already built for the model (fafo run --compile, or fafo bench --compile);
where one is missing that step runs eager.

    python scripts/step_sizes_ab.py --suites chat,summarize --repeats 3
"""

from __future__ import annotations

import statistics

import common

VARIANTS = {"padded": "never", "own size": "always"}  # CompiledSteps' own_sizes, instead of its timed choice


def main() -> None:
    parser = common.parser(__doc__, "model", "dtype", "tokens", "repeats", "suites", "samples", "prompts",
                           "settings", suites="chat,summarize")
    args = parser.parse_args()
    engine = common.load_engine(args, compile="auto")
    for spec in args.settings:
        settings = common.parse_setting(spec)
        for sample in common.prompts(args):
            runs: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
            tokens = {}
            for _ in range(args.repeats):
                for name, own_sizes in VARIANTS.items():
                    engine.compiled.own_sizes = own_sizes
                    engine.reset()
                    result = engine.complete(list(sample.messages), max_tokens=args.tokens, temperature=0.0,
                                             **settings)
                    tokens.setdefault(name, result.token_ids)
                    runs[name].append((result.stats.tokens_per_s, common.ms_per_step(result.stats)))
            same = tokens["padded"] == tokens["own size"]
            print(f"{spec:12s} {sample.suite:10s} {sample.id:14s} " + "  ".join(
                f"{name}: {statistics.median(t for t, _ in r):6.1f} tok/s {statistics.median(m for _, m in r):5.2f} ms"
                for name, r in runs.items()) + f"  same tokens: {same}", flush=True)


if __name__ == "__main__":
    main()
