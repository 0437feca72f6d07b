"""`stream` (StreamingLLM / LM-Infinite): the first `sink` positions plus the most recent `budget − sink`.

Keys keep their original rotary positions (no re-rotation). The recent part is a ring: position p lives in
slot sink + (p − sink) mod (budget − sink), so each committed token costs one slot write per layer.
"""

from __future__ import annotations

import torch

from ..cache import KVCache


class StreamCompressor:
    name = "stream"

    def __init__(self, *, budget: int, sink: int, tail_rows: int):
        if not 0 <= sink < budget:
            raise ValueError("sink must be smaller than the budget")
        self.budget, self.sink, self.tail_rows = budget, sink, tail_rows
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.active = False  # False while the whole cache fits in the budget

    def _slots(self, positions: torch.Tensor) -> torch.Tensor:
        ring = self.budget - self.sink
        return torch.where(positions < self.sink, positions, self.sink + (positions - self.sink) % ring)

    def _copy(self, cache: KVCache, positions: torch.Tensor) -> None:
        slots = self._slots(positions)
        self.keys[:, slots] = cache.keys[:, positions]
        self.values[:, slots] = cache.values[:, positions]

    def rebuild(self, cache: KVCache) -> None:
        self.active = cache.length > self.budget
        if not self.active:
            return
        if self.keys is None:
            shape = (cache.keys.shape[0], self.budget + self.tail_rows, *cache.keys.shape[2:])
            self.keys = torch.empty(shape, dtype=cache.dtype, device=cache.device)
            self.values = torch.empty_like(self.keys)
        recent = torch.arange(cache.length - (self.budget - self.sink), cache.length, device=cache.device)
        self._copy(cache, torch.cat([torch.arange(self.sink, device=cache.device), recent]))

    def committed(self, cache: KVCache, start: int, count: int) -> None:
        if not self.active:
            if cache.length > self.budget:
                self.rebuild(cache)
            return
        self._copy(cache, torch.arange(start, start + count, device=cache.device))

    def view(self, layer: int):
        return (self.keys[layer], self.values[layer]) if self.active else None

    def visible(self, cache: KVCache) -> int:
        return min(cache.length, self.budget)

    def selected_positions(self, cache: KVCache) -> list[int]:
        """C(kv) as positions (for tests and inspection)."""
        if not self.active:
            return list(range(cache.length))
        return list(range(self.sink)) + list(range(cache.length - (self.budget - self.sink), cache.length))
