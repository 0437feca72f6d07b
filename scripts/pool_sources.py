"""Where FAFO's accepted guesses come from: τ with the pool fed as usual (the window's n-grams and the text's),
with the text's n-grams only (the window runs but its guesses are withheld), and with the window's only.
τ does not depend on timing, so this runs anywhere; `--compile` uses compiled steps (and `streams: auto`'s W
for them).

    python scripts/pool_sources.py --suites chat,summarize --compile
"""

from __future__ import annotations

import argparse
import statistics

from fafo_cli import load
from fafo_cli.bench import suites
from fafo_cli.decoders.fafo import step as fafo
from fafo_cli.decoders.fafo.pool import NgramPool

from fafo_sweep import parse  # this folder: the same setting syntax


class TextOnly(NgramPool):
    """The window's n-grams never enter the pool; the prompt's and the generated text's do."""

    _reading_text = False

    def add_text(self, tokens, new=None):
        self._reading_text = True
        try:
            super().add_text(tokens, new)
        finally:
            self._reading_text = False

    def add(self, before, ngram):
        if self._reading_text:
            super().add(before, ngram)


class WindowOnly(NgramPool):
    """Only the window's n-grams enter the pool."""

    def add_text(self, tokens, new=None):
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--suites", default="chat,summarize")
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--settings", default="", help="FAFO config keys or fafo_sweep's short keys, e.g. W=2,C=none")
    args = parser.parse_args()
    settings = parse(args.settings) if args.settings else {"method": "fafo"}
    engine = load(args.model, dtype=args.dtype, compile="on" if args.compile else "off")
    for suite in args.suites.split(","):
        samples = suites.collect([suite], args.samples, None)
        for name, pool in (("both", NgramPool), ("text only", TextOnly), ("window only", WindowOnly)):
            fafo.NgramPool = pool
            taus = []
            for sample in samples:
                engine.reset()  # every request prefills from scratch: the same bf16 rounding for every pool
                result = engine.complete(list(sample.messages), max_tokens=args.tokens, **settings)
                taus.append(result.stats.tokens_per_step)
            print(f"{suite:10s} {name:12s} τ " + " ".join(f"{t:.2f}" for t in taus)
                  + f"  mean {statistics.mean(taus):.2f}", flush=True)
    fafo.NgramPool = NgramPool


if __name__ == "__main__":
    main()
