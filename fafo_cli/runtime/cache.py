"""A preallocated KV cache: one key and one value tensor for all layers, filled in place.

Layout is [layer, slot, kv_head, head_dim] so the live prefix `[:length]` of a layer is one contiguous
block of memory (attention reads a view of it, never a copy). Rows of the step in flight are written after
`length`; `commit` makes them part of the cache, anything not committed is simply overwritten next step.

For the block-sparse attention path the tensor can start with a leading region (`lead` slots per layer)
where a compressor keeps C(kv): then C(kv) and the positions are one physically contiguous tensor, and a
block mask lets the window rows read only the leading blocks. `keys`/`values` always address positions.

Storage and reading may differ in dtype: on a CPU, torch's attention computes in float32, and eager readers get
float32 views (`read_dtype`), while compiled steps, whose kernel reads bfloat16 itself, keep a bfloat16 model's
cache in bfloat16 (`store_as`): half the memory and half the bytes each step streams. Both hold the model's
bfloat16 keys and values exactly. Eager steps store and read the cache in `Model.attention_dtype` (`attend_in`).

A model spread over several GPUs (runtime/placement.py) keeps each layer's keys and values on its layer's device
(`layer_devices`): then `keys`/`values` are a `LayerStack`, one tensor per device indexed by layer like the single
tensor (`keys[layer, slots]`); the block-sparse layout's leading region is single-device only.
"""

from __future__ import annotations

import torch

from .syncs import upload

LEAD_ALIGN = 128  # the block-sparse attention's key block size


class LayerStack:
    """Per-layer tensors [slots, kv_heads, dim] held as one tensor per device (consecutive layers), indexed by layer
    first like one [layer, slot, kv_head, dim] tensor: `stack[layer]`, `stack[layer, slots]` (read and write)."""

    def __init__(self, groups: list[torch.Tensor]):
        self.groups = groups  # [layers on that device, slots, kv_heads, dim]
        self._where = [(g, i) for g, tensor in enumerate(groups) for i in range(tensor.shape[0])]
        self.shape = torch.Size((len(self._where), *groups[0].shape[1:]))

    def _locate(self, index):
        layer, rest = (index[0], index[1:]) if isinstance(index, tuple) else (index, ())
        if not isinstance(layer, int):
            raise TypeError("a layer stack is indexed by one layer first (each layer's device differs)")
        group, local = self._where[layer]
        return self.groups[group], (local, *rest)

    def __getitem__(self, index) -> torch.Tensor:
        tensor, index = self._locate(index)
        return tensor[index]

    def __setitem__(self, index, value) -> None:
        tensor, index = self._locate(index)
        tensor[index] = value.to(tensor.device) if isinstance(value, torch.Tensor) else value

    def columns(self, index) -> list[torch.Tensor]:
        """`[:, index]` of each device's tensor (slots of every layer), in layer order."""
        return [tensor[:, index] for tensor in self.groups]


GROW_SLOTS = 1024  # the least a full cache grows by (see KVCache.reserve)


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, *, max_slots: int,
                 dtype: torch.dtype, device: torch.device, initial_slots: int = 256,
                 layer_devices: list[torch.device] | None = None):
        self.shape = (n_layers, n_kv_heads, head_dim)
        self.max_slots = max_slots
        # consecutive layers per device: (device, number of layers); one group unless the model is spread
        devices = layer_devices or [device] * n_layers
        # (every layer on one device other than the embedding's: the cache lives with the layers)
        self.dtype, self.device = dtype, devices[0] if len(set(devices)) == 1 else device
        self.groups = [(d, sum(1 for _ in run)) for d, run in _runs(devices)]
        self.read_dtype = dtype  # what eager readers get (see `store_as`)
        self.length = 0  # committed positions
        self.lead = 0  # leading slots per layer before position 0 (block-sparse layout)
        self.limit = max_slots  # the positions the current request can use (see `reserve`)
        self.keys = self.values = torch.empty(0)
        # spread over GPUs: the whole context at once, as runtime/placement.py budgets each layer's cache (growing
        # would hold the old and the new cache at once: up to twice that budget, out of memory mid-answer)
        self._allocate(max_slots if self.spread else min(max(initial_slots, 1), max_slots), 0)

    @property
    def spread(self) -> bool:
        """Whether the layers' keys and values live on several devices."""
        return len(self.groups) > 1

    def _allocate(self, slots: int, lead: int) -> None:
        if self.spread:
            return self._allocate_spread(slots, lead)
        n_layers, n_kv, dim = self.shape
        # zeros, not empty: the block-sparse path reads whole blocks, and a masked slot still adds 0 × value,
        # which is NaN if never-written memory happens to hold a NaN pattern
        storage_keys = torch.zeros(n_layers, lead + slots, n_kv, dim, dtype=self.dtype, device=self.device)
        storage_values = torch.zeros_like(storage_keys)
        if self.length:
            storage_keys[:, lead:lead + self.length] = self.keys[:, : self.length]
            storage_values[:, lead:lead + self.length] = self.values[:, : self.length]
        kept = min(lead, self.lead)  # a compressor's C(kv) copy survives growth
        if kept:
            storage_keys[:, :kept] = self.storage_keys[:, :kept]
            storage_values[:, :kept] = self.storage_values[:, :kept]
        self.storage_keys, self.storage_values, self.lead = storage_keys, storage_values, lead
        self.keys, self.values = storage_keys[:, lead:], storage_values[:, lead:]  # position-addressed views

    def _allocate_spread(self, slots: int, lead: int) -> None:
        if lead:
            raise ValueError("the block-sparse layout keeps one tensor for all layers: not on a model spread over "
                             "devices")
        _, n_kv, dim = self.shape
        keys = [torch.zeros(count, slots, n_kv, dim, dtype=self.dtype, device=device) for device, count in self.groups]
        values = [torch.zeros_like(part) for part in keys]
        if self.length:
            for new, old in zip(keys + values, self.keys.groups + self.values.groups):
                new[:, :self.length] = old[:, :self.length]
        self.keys, self.values, self.lead = LayerStack(keys), LayerStack(values), 0
        self.storage_keys, self.storage_values = self.keys, self.values

    @property
    def capacity(self) -> int:
        return self.keys.shape[1]

    def reserve(self, slots: int) -> None:
        """Make room for `slots` positions. A full cache grows by a quarter (at least GROW_SLOTS positions), never
        past `limit` (what the request can use: the prefill sets it) unless `slots` asks, and to the limit at once
        where less than a quarter more would be left: doubling held three times the cache while it copied, and left
        up to half of it unused at the answer's end (at a long context, the difference between fitting and running
        out of memory mid-answer)."""
        if slots > self.max_slots:
            raise ValueError(f"{slots} positions exceed the cache limit of {self.max_slots}")
        if slots > self.capacity:
            # (past the limit, a padded step's few slots: grown as usual, not reallocated step by step)
            limit = self.limit if slots <= self.limit else self.max_slots
            grown = max(slots, min(self.max_slots, limit, self.capacity + max(GROW_SLOTS, self.capacity // 4)))
            if slots <= self.limit and limit - grown < grown // 4:  # a last growth would copy all of it for less
                grown = limit  # than a quarter more (not past the limit: a padded step's slots grow as usual)
            self._allocate(grown, self.lead)

    def use_lead(self, slots: int) -> None:
        """Keep a leading region of at least `slots` per layer (the block-sparse layout); 0 removes it.
        Sizes are rounded to LEAD_ALIGN so the region ends on an attention block boundary."""
        slots = -(-slots // LEAD_ALIGN) * LEAD_ALIGN
        if slots > self.lead or (slots == 0 and self.lead):
            self._allocate(self.capacity, slots)

    def store_as(self, dtype: torch.dtype) -> None:
        """Hold keys and values in `dtype` from now on (one copy now); readers keep getting `read_dtype`."""
        if dtype != self.dtype:
            before, self.dtype = self.dtype, dtype  # (_allocate's: the new tensors')
            try:
                self._allocate(self.capacity, self.lead)
            except BaseException:  # (memory ran out: the tensors are still the old dtype's, and say so)
                self.dtype = before
                raise

    def attend_in(self, dtype: torch.dtype) -> None:
        """Hold keys and values in `dtype` and hand them out so (eager steps: undo a compiled step's compact storage
        once, not a conversion per layer per step)."""
        self.store_as(dtype)
        self.read_dtype = dtype

    def readable(self, tensor: torch.Tensor) -> torch.Tensor:
        """Cached keys or values in the dtype attention computes in (a copy only while stored compact)."""
        return tensor.to(self.read_dtype)

    def lead_buffers(self, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `slots` of the leading region (views: fetch them again after the cache grows)."""
        return self.storage_keys[:, :slots], self.storage_values[:, :slots]

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's rows ([rows, kv_head, dim]) after the committed prefix; return views over both."""
        end = self.length + keys.shape[0]
        self.keys[layer, self.length:end] = keys
        self.values[layer, self.length:end] = values
        return self.readable(self.keys[layer, :end]), self.readable(self.values[layer, :end])

    def commit(self, rows: int) -> None:
        self.length += rows

    def commit_rows(self, rows: list[int]) -> None:
        """Commit some of this step's rows (indices after the prefix, increasing), in that order."""
        if rows != list(range(len(rows))):
            start = self.length
            if self.spread:
                for keys, values in zip(self.keys.groups, self.values.groups):
                    source = upload(rows, keys.device) + start
                    keys[:, start:start + len(rows)] = keys[:, source]
                    values[:, start:start + len(rows)] = values[:, source]
            else:
                source = upload(rows, self.device) + start
                self.keys[:, start:start + len(rows)] = self.keys[:, source]
                self.values[:, start:start + len(rows)] = self.values[:, source]
        self.length += len(rows)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def forget(self, length: int) -> None:
        """`truncate`, the rows it drops zeroed: rows that hold no numbers (a prefill that overflowed float16) would
        reach later answers' steps that read whole blocks or the whole capacity under a mask (the block-sparse path,
        CUDA graphs), where a masked NaN is still NaN."""
        end, self.length = self.length, min(self.length, length)
        for stack in (self.keys, self.values):
            for part in stack.columns(slice(self.length, end)) if self.spread else [stack[:, self.length:end]]:
                part.zero_()

    def snapshot_bytes(self, dtype: torch.dtype) -> int:
        """What `snapshot` would take."""
        n_layers, n_kv, dim = self.shape
        return 2 * n_layers * self.length * n_kv * dim * torch.empty(0, dtype=dtype).element_size()

    def snapshot(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the committed keys and values ([layer, position, kv_head, dim]) in `dtype`: the model's dtype
        holds them exactly (see the module's note), in half the bytes of a float32 store."""
        if self.spread:  # gathered on the first device
            return tuple(torch.cat([part.to(self.device, dtype) for part in stack.columns(slice(0, self.length))])
                         for stack in (self.keys, self.values))
        return (self.keys[:, :self.length].to(dtype, copy=True),
                self.values[:, :self.length].to(dtype, copy=True))

    def load(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Make a snapshot's positions the committed cache (what was committed before is dropped)."""
        self.length = 0
        self.reserve(keys.shape[1])
        for layer in range(self.shape[0]) if self.spread else ():
            self.keys[layer, :keys.shape[1]] = keys[layer]
            self.values[layer, :values.shape[1]] = values[layer]
        if not self.spread:
            self.keys[:, :keys.shape[1]] = keys
            self.values[:, :values.shape[1]] = values
        self.length = keys.shape[1]

    def nbytes(self) -> int:
        if self.spread:
            return sum(t.numel() * t.element_size() for t in self.keys.groups) * 2
        return self.storage_keys.numel() * self.storage_keys.element_size() * 2


def _runs(devices: list[torch.device]):
    """Consecutive equal devices: (device, the run)."""
    from itertools import groupby

    return groupby(devices)
