"""SlotView: the per-layer contiguous copy of C(kv) that every compressor maintains.

Slots hold cached positions in any order (attention does not care). A compressor replaces the whole
selection with one gather (`fill`), or updates single slots as tokens are committed (`put`). After the
`size` selected slots there is room for the step's anchor and window rows (the attention puts them there).
"""

from __future__ import annotations

import torch

from ..cache import KVCache


class SlotView:
    def __init__(self, cache: KVCache, slots: int, tail_rows: int):
        n_layers = cache.keys.shape[0]
        self.cache, self.total = cache, slots + tail_rows
        self._own: tuple[torch.Tensor, torch.Tensor] | None = None
        if cache.lead:  # block-sparse layout: C(kv) lives in the cache tensor's leading region
            cache.use_lead(self.total)
        else:
            keys = torch.empty((n_layers, self.total, *cache.keys.shape[2:]), dtype=cache.read_dtype,
                               device=cache.device)
            self._own = keys, torch.empty_like(keys)
        self.positions = torch.full((n_layers, slots), -1, dtype=torch.long, device=cache.device)
        self.slots = slots
        self.size = 0
        self._layers = torch.arange(n_layers, device=cache.device)[:, None]

    @property
    def keys(self) -> torch.Tensor:
        return self._own[0] if self._own else self.cache.lead_buffers(self.total)[0]

    @property
    def values(self) -> torch.Tensor:
        return self._own[1] if self._own else self.cache.lead_buffers(self.total)[1]

    def fill(self, cache: KVCache, positions: torch.Tensor) -> None:
        """Select `positions` ([layers, n] or [n] for every layer), replacing the whole view."""
        if positions.dim() == 1:
            positions = positions.expand(self._layers.shape[0], -1)
        n = positions.shape[1]
        self.keys[:, :n] = cache.keys[self._layers, positions]
        self.values[:, :n] = cache.values[self._layers, positions]
        self.positions[:, :n] = positions
        self.size = n

    def put(self, cache: KVCache, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Store `positions` ([m], the same in every layer) in `slots` ([m])."""
        self.keys[:, slots] = cache.readable(cache.keys[:, positions])
        self.values[:, slots] = cache.readable(cache.values[:, positions])
        self.positions[:, slots] = positions

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer], self.values[layer]

    def selected(self, layer: int) -> list[int]:
        return sorted(self.positions[layer, :self.size].tolist())


class ViewCompressor:
    """What compressors keeping a SlotView share: while the whole cache fits in the budget they are inactive
    (`view` is None: the fumble rows see everything); once active, the slots are C(kv)."""

    slots: SlotView | None = None
    active = False
    tail_rows = 0  # room after C(kv) for the step's anchor and window rows

    def _slots(self, cache: KVCache, size: int) -> SlotView:
        """The slot view, created on first use (a request whose context stays within the budget needs none)."""
        if self.slots is None:
            self.slots = SlotView(cache, size, self.tail_rows)
        return self.slots

    def prepare(self, cache: KVCache) -> None:
        pass

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.slots.layer(layer) if self.active else None

    def visible(self, cache: KVCache) -> int:
        return self.slots.size if self.active else cache.length

    def visible_mask(self, cache: KVCache) -> torch.Tensor | None:
        if not self.active:
            return None
        slots = self.slots
        mask = torch.zeros(slots.positions.shape[0], cache.length, dtype=torch.bool, device=cache.device)
        mask.scatter_(1, slots.positions[:, :slots.size], True)
        return mask.T.contiguous()

    def selected_positions(self, cache: KVCache, layer: int = 0) -> list[int]:
        """C(kv) as sorted positions (for tests and inspection)."""
        return self.slots.selected(layer) if self.active else list(range(cache.length))
