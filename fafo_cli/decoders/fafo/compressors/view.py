"""SlotView: the per-layer contiguous copy of C(kv) that every compressor maintains.

Slots hold cached positions in any order (attention does not care). A compressor replaces the whole
selection (`fill`), or updates single slots as tokens are committed (`put`). After the `size` selected slots
there is room for the step's anchor and window rows (the attention puts them there).

Both only record positions: keys and values are copied when a layer's view is next read (`layer`), and a
[positions, layers] mask of the selection is kept up to date. (`put_layers`, slots that differ by layer, copies at
once: h2o's, whose steps are never compiled.) A compiled step reads only that mask (its
kernel masks the cache itself), so it never pays for the copies nor for rebuilding the mask, both a visible
share of a small compiled step.
"""

from __future__ import annotations

import torch

from ....runtime.cache import KVCache
from ....runtime.syncs import upload


class SlotView:
    def __init__(self, cache: KVCache, slots: int, tail_rows: int):
        n_layers = cache.keys.shape[0]
        self.cache, self.total = cache, slots + tail_rows
        # the copy's own buffers, made when first read: compiled steps read the mask alone, and never need them
        self._own_buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self._owns = not cache.lead
        if cache.lead:  # block-sparse layout: C(kv) lives in the cache tensor's leading region
            cache.use_lead(self.total)
        self.positions = torch.full((n_layers, slots), -1, dtype=torch.long, device=cache.device)
        self.slots = slots
        self.size = 0
        self._layer_index = torch.arange(n_layers, device=cache.device)[:, None]
        self._uncopied: set[int] = set()  # slots whose keys and values are not copied yet
        # mask[p, layer]: position p is selected in that layer. One row more than positions: unused slots hold
        # position -1, whose updates land in that last row, which no reader sees.
        self._selected = torch.zeros(cache.capacity + 1, n_layers, dtype=torch.bool, device=cache.device)

    @property
    def keys(self) -> torch.Tensor:
        return self._buffers()[0]

    @property
    def values(self) -> torch.Tensor:
        return self._buffers()[1]

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._owns:
            return self.cache.lead_buffers(self.total)
        if self._own_buffers is None:
            cache = self.cache
            keys = torch.empty((cache.keys.shape[0], self.total, *cache.keys.shape[2:]), dtype=cache.read_dtype,
                               device=cache.device)
            self._own_buffers = keys, torch.empty_like(keys)
        return self._own_buffers

    def fill(self, positions: torch.Tensor) -> None:
        """Select `positions` ([layers, n] or [n] for every layer), replacing the whole view."""
        if positions.dim() == 1:
            positions = positions.expand(self._layer_index.shape[0], -1)
        n = positions.shape[1]
        self.positions[:, :n] = positions
        self.positions[:, n:] = -1
        self.size = n
        self._uncopied = set(range(n))
        self._grow_mask()
        self._selected.zero_()
        self._selected[positions, self._layer_index] = True

    def put(self, slots: list[int], positions: list[int]) -> None:
        """Store `positions` (the same in every layer) in `slots`."""
        both = upload([slots, positions], self.positions.device)
        self._grow_mask()
        self._selected[self.positions[:, both[0]], self._layer_index] = False
        self.positions[:, both[0]] = both[1]
        self._selected[both[1]] = True
        self._uncopied.update(slots)

    def put_layers(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Store `positions` [layers, n] in `slots` [layers, n], each layer its own (copied now: the slots differ by
        layer, which the lazy copy's slot set cannot say)."""
        self._grow_mask()
        self._selected[self.positions.gather(1, slots), self._layer_index] = False
        self.positions.scatter_(1, slots, positions)
        self._selected[positions, self._layer_index] = True
        cache = self.cache
        self.keys[self._layer_index, slots] = cache.readable(cache.keys[self._layer_index, positions])
        self.values[self._layer_index, slots] = cache.readable(cache.values[self._layer_index, positions])

    def _grow_mask(self) -> None:
        """Room for every position the cache can hold (its last row stays the spare one)."""
        rows = self.cache.capacity + 1
        if self._selected.shape[0] < rows:
            grown = torch.zeros(rows, self._selected.shape[1], dtype=torch.bool, device=self._selected.device)
            grown[:self._selected.shape[0] - 1] = self._selected[:-1]
            self._selected = grown

    def mask(self, length: int) -> torch.Tensor:
        """[length, layers]: which of the first `length` positions each layer selects (a view: read it now)."""
        return self._selected[:length]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._own_buffers and self._own_buffers[0].dtype != self.cache.read_dtype:  # eager attention's changed
            self._own_buffers = tuple(t.to(self.cache.read_dtype) for t in self._own_buffers)
        if self._uncopied:  # every layer's at once: one gather per step, not one per layer
            slots = upload(sorted(self._uncopied), self.positions.device)
            positions = self.positions[:, slots]
            self.keys[:, slots] = self.cache.readable(self.cache.keys[self._layer_index, positions])
            self.values[:, slots] = self.cache.readable(self.cache.values[self._layer_index, positions])
            self._uncopied.clear()
        return self.keys[layer], self.values[layer]

    def selected(self, layer: int) -> list[int]:
        return sorted(self.positions[layer, :self.size].tolist())

    def nbytes(self) -> int:
        """The copy of C(kv) (its own buffers once made, or the cache's leading region that holds it), positions and
        mask."""
        copy = 0 if self._owns and self._own_buffers is None else 2 * self.keys.nbytes
        return copy + self.positions.nbytes + self._selected.nbytes


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

    def view_size(self, cache: KVCache) -> int:
        return self.slots.size if self.active else cache.length

    def view_mask(self, cache: KVCache) -> torch.Tensor | None:
        return self.slots.mask(cache.length) if self.active else None

    def nbytes(self) -> int:
        """Memory the compressor holds beside the cache: the slot view and what `state` names."""
        return (self.slots.nbytes() if self.slots is not None else 0) + sum(t.nbytes for t in self.state())

    def state(self) -> list[torch.Tensor]:
        """The tensors a compressor keeps beside its view (page bounds, attention scores)."""
        return []

    def selected_positions(self, cache: KVCache, layer: int = 0) -> list[int]:
        """C(kv) as sorted positions (for tests and inspection)."""
        return self.slots.selected(layer) if self.active else list(range(cache.length))
