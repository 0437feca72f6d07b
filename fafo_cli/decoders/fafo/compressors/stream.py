"""`stream` (StreamingLLM / LM-Infinite): the first `sink` positions plus the most recent `budget − sink`.

Keys keep their original rotary positions (no re-rotation). The recent part is a ring: position p lives in
slot sink + (p − sink) mod (budget − sink), so each committed token costs one slot write per layer.
"""

from __future__ import annotations

import torch

from ....runtime.cache import KVCache
from .view import ViewCompressor


class StreamCompressor(ViewCompressor):
    name = "stream"

    def __init__(self, *, budget: int, sink: int, tail_rows: int):
        self.budget, self.sink, self.tail_rows = budget, min(sink, budget - 1), tail_rows

    def _ring(self, position: int) -> int:
        """The slot that holds `position`."""
        return position if position < self.sink else self.sink + (position - self.sink) % (self.budget - self.sink)

    def rebuild(self, cache: KVCache) -> None:
        self.active = cache.length > self.budget
        if not self.active:
            return
        slots = self._slots(cache, self.budget)
        positions = [*range(self.sink), *range(cache.length - (self.budget - self.sink), cache.length)]
        slots.fill(torch.tensor(sorted(positions, key=self._ring), device=cache.device))  # slot s: ring slot s

    def committed(self, cache: KVCache, start: int, count: int) -> None:
        if not self.active:
            if cache.length > self.budget:
                self.rebuild(cache)
            return
        positions = list(range(max(start, start + count - (self.budget - self.sink)), start + count))  # a ring's worth
        self.slots.put([self._ring(p) for p in positions], positions)
