"""`quest` (Quest, query-aware page selection).

The cache is split into pages of `page_size` positions; each page keeps the element-wise min and max of
its keys, updated as tokens are committed. Pages are scored with the latest anchor query by the upper bound
Σ_d max(q_d·min_d, q_d·max_d) (summed over the query heads of each kv group and over groups), and the top
pages (the newest page always among them) fill the budget, leaving room for the tokens committed until
the next refresh, every `refresh` new tokens.
"""

from __future__ import annotations

import math

import torch

from ....runtime.cache import KVCache
from .view import ViewCompressor


def page_bounds(q: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor) -> torch.Tensor:
    """Quest's upper bound per page. q: [heads, dim]; page_min/max: [pages, kv_heads, dim] -> [pages]."""
    kv_heads = page_min.shape[1]
    grouped = q.float().view(kv_heads, -1, q.shape[-1])  # [kv, group, dim]
    low = page_min.float()[:, :, None, :] * grouped[None]
    high = page_max.float()[:, :, None, :] * grouped[None]
    return torch.maximum(low, high).sum(-1).sum((1, 2))


class QuestCompressor(ViewCompressor):
    name = "quest"
    needs_query = True

    def __init__(self, *, budget: int, page_size: int, refresh: int, tail_rows: int, max_commit: int):
        self.budget, self.page_size, self.refresh = budget, page_size, refresh
        # room for `refresh` tokens beside the selection, else it would be due again every step (a step's commit
        # past the budget goes to the view's spare slots, and the next window step selects anew)
        self.pages_kept = max(1, (budget - refresh) // page_size)
        self.tail_rows, self.max_commit = tail_rows, max_commit
        self.page_min = self.page_max = None
        self.query: list[torch.Tensor | None] = []
        self.refreshed_at = 0

    def _update_pages(self, cache: KVCache, first_page: int, end: int) -> None:
        ps = self.page_size
        pages = math.ceil(end / ps)
        if self.page_min is None or self.page_min.shape[1] < pages:
            # the cache's pages (it grows by a quarter, the answer's room reserved): doubling the prompt's pages
            # held bounds for twice the context at a long prompt's first new page
            grow = max(pages, -(-cache.capacity // ps))
            shape = (cache.keys.shape[0], grow, *cache.keys.shape[2:])
            page_min = torch.empty(shape, dtype=cache.dtype, device=cache.device)
            page_max = torch.empty_like(page_min)
            if self.page_min is not None:
                page_min[:, :self.page_min.shape[1]] = self.page_min
                page_max[:, :self.page_max.shape[1]] = self.page_max
            self.page_min, self.page_max = page_min, page_max
        full = max(first_page, end // ps)  # the full pages at once (a long prompt's thousands), then the last one
        if full > first_page:
            blocks = cache.keys[:, first_page * ps:full * ps]
            blocks = blocks.reshape(blocks.shape[0], full - first_page, ps, *blocks.shape[2:])
            self.page_min[:, first_page:full] = blocks.amin(2)
            self.page_max[:, first_page:full] = blocks.amax(2)
        for page in range(full, pages):
            block = cache.keys[:, page * ps:min(end, (page + 1) * ps)]
            self.page_min[:, page] = block.amin(1)
            self.page_max[:, page] = block.amax(1)

    def state(self) -> list[torch.Tensor]:
        return [t for t in (self.page_min, self.page_max, *self.query) if t is not None]

    def observe_prefill(self, layer: int, q: torch.Tensor, keys: torch.Tensor, first: int) -> None:
        self.observe(layer, q[:, -1], keys)

    def observe(self, layer: int, q: torch.Tensor, keys: torch.Tensor) -> None:
        """Remember the newest query row ([heads, dim]) of each layer for the next selection."""
        while len(self.query) <= layer:
            self.query.append(None)
        self.query[layer] = q.detach().clone()

    def rebuild(self, cache: KVCache) -> None:
        self._update_pages(cache, 0, cache.length)
        self.active = cache.length > self.budget
        if self.active:
            self._select(cache)

    def _select(self, cache: KVCache) -> None:
        ps, length = self.page_size, cache.length
        pages = math.ceil(length / ps)
        keep = min(self.pages_kept, pages)
        chosen = []
        for layer in range(cache.keys.shape[0]):
            scores = page_bounds(self.query[layer], self.page_min[layer, :pages], self.page_max[layer, :pages])
            scores[pages - 1] = float("inf")  # the newest page is always in
            chosen.append(torch.topk(scores, keep).indices)
        chosen = torch.stack(chosen).sort(-1).values  # [layers, keep], the newest page last
        offsets = torch.arange(ps, device=cache.device)
        positions = (chosen[:, :-1, None] * ps + offsets).flatten(1)
        newest = torch.arange((pages - 1) * ps, length, device=cache.device).expand(len(chosen), -1)
        self._slots(cache, self.budget + self.max_commit).fill(torch.cat([positions, newest], dim=1))
        self.refreshed_at = length

    def prepare(self, cache: KVCache) -> None:
        if not self.active:  # (no selection yet: the whole cache fits in the budget)
            return
        if cache.length - self.refreshed_at >= self.refresh or self.slots.size > self.budget:
            self._select(cache)

    def committed(self, cache: KVCache, start: int, count: int) -> None:
        self._update_pages(cache, start // self.page_size, start + count)
        if not self.active:
            if cache.length > self.budget:
                self.active = True
                self._select(cache)
            return
        if self.slots.size + count > self.slots.slots:  # steps without the window since the last selection: the
            return  # next window step selects anew (its refresh is due: more than `refresh` tokens came since)
        self.slots.put(list(range(self.slots.size, self.slots.size + count)), list(range(start, start + count)))
        self.slots.size += count
