"""Acceptance rules: which guessed tokens plain decoding would have produced itself."""

from __future__ import annotations

from typing import Sequence


def accept_greedy(first: int, candidates: Sequence[Sequence[int]], predictions: Sequence[int],
                  ngram: int) -> tuple[int, int]:
    """(best candidate, accepted length) under greedy decoding.

    `first` is the anchor's argmax; `predictions[c * ngram + j]` is the argmax after candidate c's token j.
    A candidate's token j is accepted when it equals the argmax of the position before it. The longest
    accepted prefix wins (the earliest candidate on ties: longer pool keys come first).
    """
    best, best_length = 0, 0
    for c, candidate in enumerate(candidates):
        expected, length = first, 0
        while length < len(candidate) and candidate[length] == expected:
            expected = predictions[c * ngram + length]
            length += 1
        if length > best_length:
            best, best_length = c, length
    return best, best_length
