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

from ....runtime.cache import KVCache
from .h2o import H2OCompressor
from .none import NoCompressor
from .quest import QuestCompressor
from .snapkv import SnapKVCompressor
from .stream import StreamCompressor


class Compressor(Protocol):
    name: str

    def rebuild(self, cache: KVCache) -> None:
        """Select from scratch, right after a prefill."""

    def prepare(self, cache: KVCache) -> None:
        """Before a step whose window rows run (only those read C(kv)): refresh the selection if it is due."""

    def committed(self, cache: KVCache, start: int, count: int) -> None:
        """Positions start..start+count-1 were just committed to the cache."""

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(keys, values) [slots, kv_heads, dim] holding C(kv) in their first `view_size()` slots, or None."""

    def view_size(self, cache: KVCache) -> int:
        """How many cache positions the fumble rows see (the same in every layer)."""

    def view_mask(self, cache: KVCache) -> torch.Tensor | None:
        """C(kv) as booleans [length, layers] (the compiled step's one masked attention call), or None."""

    def nbytes(self) -> int:
        """Memory held beside the cache: the copy of C(kv) and the selection's own state (draft_memory_mb)."""

    # Optional: `needs_query = True` and observe(layer, anchor_query [heads, dim], cached_keys) to learn from
    # the anchor row each step; observe_prefill(layer, q [heads, rows, dim], keys, first_position) to learn
    # from the prefill's queries.


_CLASSES = {c.name: c for c in (NoCompressor, StreamCompressor, QuestCompressor, SnapKVCompressor, H2OCompressor)}


def reads_queries(name: str) -> bool:
    """Whether the compressor `name` learns from each step's queries (so its steps cannot run compiled)."""
    return getattr(_CLASSES[name], "needs_query", False)


def make_compressor(settings, *, prompt_length: int, scale: float, tail_rows: int, max_commit: int) -> Compressor:
    """The compressor named in `settings` (FafoSettings), with its budget resolved in tokens."""
    name, budget = settings.compressor, settings.budget_tokens(prompt_length)
    if name == "none":
        return NoCompressor()
    if name == "stream":
        return StreamCompressor(budget=budget, sink=settings.sink, tail_rows=tail_rows)
    if name == "quest":
        return QuestCompressor(budget=budget, page_size=settings.page_size, refresh=settings.refresh,
                               tail_rows=tail_rows, max_commit=max_commit)
    if name == "snapkv":
        return SnapKVCompressor(budget=budget, window=settings.window, kernel=settings.kernel,
                                prompt_length=prompt_length, scale=scale, tail_rows=tail_rows)
    if name == "h2o":
        return H2OCompressor(budget=budget, recent=settings.recent, window=settings.window,
                             prompt_length=prompt_length, scale=scale, tail_rows=tail_rows)
    raise ValueError(f"unknown compressor {name!r}")
