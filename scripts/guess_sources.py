"""Where FAFO's accepted guesses come from: τ, the mean draft and the accepted tokens by source with both sources
(copies from the text and the window's k-grams), with copies only (`streams: 0`: no window) and with the window
only (`copies: 0`), per suite and setting. τ does not depend on timing, so this runs anywhere; `--compile` uses
compiled steps. The default setting names W=1: on a CPU, `streams: auto` runs no window unless a compressor is
named, and "window only" would be plain decoding.

    python scripts/guess_sources.py --suites chat,summarize,edit
"""

from __future__ import annotations

import itertools
import statistics

import common

SOURCES = {"both": {}, "text only": dict(streams=0), "window only": dict(copies=0)}


def main() -> None:
    parser = common.parser(__doc__, "model", "dtype", "tokens", "suites", "samples", "prompts", "compile",
                           "settings", suites="chat,summarize", settings=["W=1"])
    args = parser.parse_args()
    engine = common.load_engine(args)
    for spec in args.settings:
        settings = common.parse_setting(spec)
        for suite, samples in itertools.groupby(common.prompts(args, engine), key=lambda sample: sample.suite):
            samples = list(samples)
            for name, source in SOURCES.items():
                taus, drafts, accepted = [], [], {"text": 0, "window": 0}
                for sample in samples:
                    engine.reset()  # every request prefills from scratch: the same bf16 rounding for each variant
                    stats = engine.complete(list(sample.messages), max_tokens=args.tokens,
                                            **{**settings, **source}).stats
                    taus.append(stats.tokens_per_step)
                    drafts.append(stats.mean_draft)
                    for key, n in (stats.accepted_from or {}).items():
                        accepted[key] += n
                print(f"{spec:12s} {suite:10s} {name:12s} τ " + " ".join(f"{t:.2f}" for t in taus)
                      + f"  mean {statistics.mean(taus):.2f}  mean draft {statistics.mean(drafts):.1f}  accepted "
                      + " ".join(f"{key} {n}" for key, n in accepted.items()), flush=True)


if __name__ == "__main__":
    main()
