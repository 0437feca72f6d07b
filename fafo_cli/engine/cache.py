"""A preallocated KV cache: one key and one value tensor for all layers, filled in place.

Layout is [layer, slot, kv_head, head_dim] so the live prefix `[:length]` of a layer is one contiguous
block of memory (attention reads a view of it, never a copy). Rows of the step in flight are written after
`length`; `commit` makes them part of the cache, anything not committed is simply overwritten next step.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, *, max_slots: int,
                 dtype: torch.dtype, device: torch.device, initial_slots: int = 256):
        self.shape = (n_layers, n_kv_heads, head_dim)
        self.max_slots = max_slots
        self.dtype, self.device = dtype, device
        self.length = 0  # committed positions
        self.keys = self.values = torch.empty(0)
        self._allocate(min(max(initial_slots, 1), max_slots))

    def _allocate(self, slots: int) -> None:
        n_layers, n_kv, dim = self.shape
        keys = torch.empty(n_layers, slots, n_kv, dim, dtype=self.dtype, device=self.device)
        values = torch.empty_like(keys)
        if self.length:
            keys[:, : self.length] = self.keys[:, : self.length]
            values[:, : self.length] = self.values[:, : self.length]
        self.keys, self.values = keys, values

    @property
    def capacity(self) -> int:
        return self.keys.shape[1]

    def reserve(self, slots: int) -> None:
        """Make room for `slots` positions, growing geometrically so reallocation is rare."""
        if slots > self.max_slots:
            raise ValueError(f"{slots} positions exceed the cache limit of {self.max_slots}")
        if slots > self.capacity:
            self._allocate(min(self.max_slots, max(slots, 2 * self.capacity)))

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's rows ([rows, kv_head, dim]) after the committed prefix; return views over both."""
        end = self.length + keys.shape[0]
        self.keys[layer, self.length:end] = keys
        self.values[layer, self.length:end] = values
        return self.keys[layer, :end], self.values[layer, :end]

    def commit(self, rows: int) -> None:
        self.length += rows

    def commit_rows(self, rows: list[int]) -> None:
        """Commit some of this step's rows (indices after the prefix, increasing), in that order."""
        if rows != list(range(len(rows))):
            start = self.length
            source = torch.tensor(rows, device=self.device) + start
            self.keys[:, start:start + len(rows)] = self.keys[:, source]
            self.values[:, start:start + len(rows)] = self.values[:, source]
        self.length += len(rows)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() * 2
