"""`stream` (StreamingLLM / LM-Infinite): the first `sink` positions plus the most recent `budget − sink`.

Keys keep their original rotary positions (no re-rotation). The recent part is a ring: position p lives in
slot sink + (p − sink) mod (budget − sink), so each committed token costs one slot write per layer.
"""

from __future__ import annotations

import torch

from ..cache import KVCache
from .view import ViewCompressor


class StreamCompressor(ViewCompressor):
    name = "stream"

    def __init__(self, *, budget: int, sink: int, tail_rows: int):
        self.budget, self.sink, self.tail_rows = budget, min(sink, budget - 1), tail_rows

    def _ring(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.where(positions < self.sink, positions,
                           self.sink + (positions - self.sink) % (self.budget - self.sink))

    def rebuild(self, cache: KVCache) -> None:
        self.active = cache.length > self.budget
        if not self.active:
            return
        slots = self._slots(cache, self.budget)
        device = cache.device
        positions = torch.cat([torch.arange(self.sink, device=device),
                               torch.arange(cache.length - (self.budget - self.sink), cache.length, device=device)])
        slots.fill(cache, positions[torch.argsort(self._ring(positions))])  # slot s holds ring position s

    def committed(self, cache: KVCache, start: int, count: int) -> None:
        if not self.active:
            if cache.length > self.budget:
                self.rebuild(cache)
            return
        positions = torch.arange(start, start + count, device=cache.device)
        self.slots.put(cache, self._ring(positions), positions)
