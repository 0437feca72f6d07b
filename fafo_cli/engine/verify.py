"""Acceptance rules: which guessed tokens plain decoding would have produced itself."""

from __future__ import annotations

from typing import Callable, Sequence

import torch


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


def accept_sampling(target: Callable[[int, int], torch.Tensor], candidates: Sequence[Sequence[int]],
                    generator: torch.Generator | None) -> tuple[int, list[int]]:
    """(candidate whose rows to commit, emitted tokens) under sampling, exactly distributed as the target.

    `target(c, j)` is the target distribution for position j of candidate c (j = 0: after the anchor). Guesses
    are one-hot drafts; position by position, the distinct guessed tokens of the candidates still alive are
    tried in order: token x is accepted with probability p(x); on rejection p(x) = 0 and p is renormalised.
    An acceptance keeps the candidates that agree on it; if every guess is rejected, the token is sampled
    from what is left of p and the step ends. After a fully accepted candidate, one bonus token is sampled.
    """
    alive = list(range(len(candidates)))
    emitted: list[int] = []
    p = target(0, 0)
    for j in range(len(candidates[0]) if candidates else 0):
        p = p.clone()
        accepted = None
        for x in dict.fromkeys(candidates[c][j] for c in alive):
            if torch.rand((), generator=generator, device=p.device) < p[x]:
                accepted = x
                break
            p[x] = 0.0
            total = p.sum()
            if total <= 0:  # nothing left to sample from (x held all the mass, yet was rejected: rounding)
                break
            p /= total
        if accepted is None:
            break
        emitted.append(accepted)
        alive = [c for c in alive if candidates[c][j] == accepted]
        p = target(alive[0], j + 1)
    emitted.append(int(torch.multinomial(p, 1, generator=generator)))
    return (alive[0] if alive else 0), emitted
