"""Compressors choose C(kv), the cache positions the fumble rows may see. One module each, one protocol.

A compressor never changes the KV cache. It keeps, per layer, a contiguous copy of the B selected
positions (its "view", in any order: attention does not care) with room after them for the step's anchor
and window rows, and updates it incrementally as tokens are committed. `view(layer)` returning None means
"C(kv) is the whole cache" (compressor `none`, or a context still within the budget): then one attention
call over the cache serves every row.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..cache import KVCache
from .none import NoCompressor
from .stream import StreamCompressor


class Compressor(Protocol):
    name: str

    def rebuild(self, cache: KVCache) -> None:
        """Select from scratch (after a prefill, or after the cache was rolled back)."""

    def committed(self, cache: KVCache, start: int, count: int) -> None:
        """Positions start..start+count-1 were just committed to the cache."""

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(keys, values) [slots, kv_heads, dim] holding C(kv) in their first `visible` slots, or None."""

    def visible(self, cache: KVCache) -> int:
        """How many cache positions the fumble rows see."""


def make_compressor(name: str, *, budget: int, sink: int, tail_rows: int) -> Compressor:
    if name == "none":
        return NoCompressor()
    if name == "stream":
        return StreamCompressor(budget=budget, sink=sink, tail_rows=tail_rows)
    raise ValueError(f"unknown compressor {name!r}")


COMPRESSORS = ("none", "stream")
