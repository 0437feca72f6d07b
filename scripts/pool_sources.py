"""Where FAFO's accepted guesses come from: τ with the pool fed as usual (the window's n-grams and the text's) and
with the window's only (`seed_pool: false`), per suite and setting. τ does not depend on timing, so this runs
anywhere; `--compile` uses compiled steps (and `streams: auto`'s W for them). The text's n-grams alone (the
window running but its guesses withheld) would need a hook into the pool that no setting offers, so that variant
is not measured.

    python scripts/pool_sources.py --suites chat,summarize --compile
"""

from __future__ import annotations

import itertools
import statistics

import common

FEEDS = {"both": True, "window only": False}  # the pool's feed: seed_pool


def main() -> None:
    parser = common.parser(__doc__, "model", "dtype", "tokens", "suites", "samples", "prompts", "compile",
                           "settings", suites="chat,summarize")
    args = parser.parse_args()
    engine = common.load_engine(args)
    for spec in args.settings:
        settings = common.parse_setting(spec)
        for suite, samples in itertools.groupby(common.prompts(args), key=lambda sample: sample.suite):
            samples = list(samples)
            for feed, seed_pool in FEEDS.items():
                taus = []
                for sample in samples:
                    engine.reset()  # every request prefills from scratch: the same bf16 rounding for either feed
                    result = engine.complete(list(sample.messages), max_tokens=args.tokens, **settings,
                                             seed_pool=seed_pool)
                    taus.append(result.stats.tokens_per_step)
                print(f"{spec:12s} {suite:10s} {feed:12s} τ " + " ".join(f"{t:.2f}" for t in taus)
                      + f"  mean {statistics.mean(taus):.2f}", flush=True)


if __name__ == "__main__":
    main()
