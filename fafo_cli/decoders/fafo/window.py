"""The lookahead window: W streams × k levels of Jacobi guesses (the fumble rows).

Level 0 holds W−1 tokens (the anchor is its column 0); levels 1..k−1 hold W tokens. Token (level l,
column i) sits at position t+l+i and sees the anchor, the level-0 tokens of columns 1..i and the column-i
tokens of levels 1..l: its "staircase", positions t..t+l+i without gaps. Rows are flattened level by level,
so warm-up (after a prefill) just appends one level per step until there are k.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import torch

from ...runtime.rows import ViewRows
from .pool import NGram


@dataclass(frozen=True, eq=False)  # compared by identity: one per shape (window_layout's cache)
class WindowLayout:
    rows: ViewRows  # the window's rows as the step sees them; read: the predictor rows, in order
    predictors: tuple[int, ...]  # per column, the window row whose argmax is the next level's token; -1: anchor
    predictor_logits: tuple[int, ...]  # per column, where that row's logits are among the window's read rows; -1: anchor


@lru_cache(maxsize=None)
def window_layout(streams: int, levels: int) -> WindowLayout:
    """Offsets, staircase mask and prediction rows of a window with `levels` filled levels (1..k)."""
    cells = [(0, i) for i in range(1, streams)] + [(l, i) for l in range(1, levels) for i in range(streams)]
    row = {cell: r for r, cell in enumerate(cells)}
    mask = torch.zeros(len(cells), 1 + len(cells), dtype=torch.bool)
    mask[:, 0] = True  # everyone sees the anchor
    for r, (level, col) in enumerate(cells):
        for c in range(1, col + 1):
            mask[r, 1 + row[(0, c)]] = True
        for l in range(1, level + 1):
            mask[r, 1 + row[(l, col)]] = True
    last = levels - 1
    predictors = tuple(-1 if (last == 0 and i == 0) else row[(last, i)] for i in range(streams))
    read = tuple(sorted({p for p in predictors if p >= 0}))
    return WindowLayout(ViewRows(tuple(l + i for l, i in cells), mask, read), predictors,
                        tuple(-1 if p < 0 else read.index(p) for p in predictors))


class LookaheadWindow:
    def __init__(self, streams: int, ngram: int, prefix: int, seed_tokens: Sequence[int]):
        self.streams, self.ngram = streams, ngram
        rng = random.Random(0)  # deterministic: the same prompt fumbles the same way every run
        pool = list(seed_tokens) or [0]
        self.levels: list[list[int]] = [[rng.choice(pool) for _ in range(streams - 1)]]  # level 0 without anchor
        self.discarded = [deque(maxlen=prefix) for _ in range(streams)]  # per stream, tokens shifted out

    @property
    def layout(self) -> WindowLayout:
        return window_layout(self.streams, len(self.levels))

    def tokens(self) -> list[int]:
        return [t for level in self.levels for t in level]

    def advance(self, anchor: int, predicted: list[int]) -> list[tuple[list[int], NGram]]:
        """Take this step's new level (one token per stream; `anchor` was column 0 of level 0).

        While warming up the level is appended. Once all k levels exist, each stream yields a k-gram (its
        levels 1..k−1 and the new token) with the tokens before it, and the window shifts one level.
        """
        if len(self.levels) < self.ngram:
            self.levels.append(predicted)
            return []
        level0 = [anchor] + self.levels[0]
        found = []
        for i in range(self.streams):
            self.discarded[i].append(level0[i])
            ngram = tuple(self.levels[l][i] for l in range(1, self.ngram)) + (predicted[i],)
            found.append((list(self.discarded[i]), ngram))
        # Level 1 becomes level 0; its column 0 gives way to the next anchor.
        self.levels = [self.levels[1][1:]] + self.levels[2:] + [predicted]
        return found
