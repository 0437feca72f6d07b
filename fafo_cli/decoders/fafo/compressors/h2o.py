"""`h2o` (Heavy-Hitter Oracle): keep the positions with the most accumulated attention plus a recent window.

Attention mass comes from the committed rows: at prefill from the last `window` prompt queries (the full
L×L weights would cost more than the prefill itself), then from each window step's anchor row over the positions
still kept. As in the paper, eviction is final: a position that leaves the view is never scored or selected again.
So a step's work is bounded by the budget, not the context: the anchor row is scored against the view's keys, and a
selection weighs only the kept heavy hitters against the positions that left the recent window since the last one
(the first selection, after the prefill, weighs every older position once).

The view's first `budget − recent` slots hold the heavy hitters, each staying in its slot while it is kept (a
promoted position takes an evicted one's slot, so a selection copies a few slots, not the view); the last `recent`
slots are a ring of the newest positions. The selection runs only on the steps whose window rows run (`prepare`):
positions committed in between are recent, or left the recent window unscored (no mass), which the next selection
weighs.
"""

from __future__ import annotations

import torch

from ....runtime.cache import KVCache
from .scores import attention_weights
from .snapkv import ObservationScores
from .view import ViewCompressor


class H2OCompressor(ViewCompressor):
    name = "h2o"
    needs_query = True

    def __init__(self, *, budget: int, recent: int, window: int, prompt_length: int, scale: float,
                 tail_rows: int):
        self.budget, self.recent, self.scale, self.tail_rows = budget, recent, scale, tail_rows
        self.heavy_slots = budget - recent
        self.mass = ObservationScores(window, prompt_length, scale)
        self.observed_rows = window  # the prompt's last rows its prefill must see (Session.prefill)
        self.observe_prefill = self.mass.observe_prefill
        # [layers, budget − recent]: each layer's heavy hitters, slot by slot (None before the first selection)
        self.heavy: torch.Tensor | None = None
        self.settled = 0  # positions below it were weighed by a selection: kept only if among `heavy`
        self.seen = 0  # the cache's length at the last selection
        self._queries: dict[int, torch.Tensor] = {}  # per layer, the last window step's anchor query
        self._observed = 0  # the cache's length when they were observed

    def state(self) -> list[torch.Tensor]:
        return self.mass.tensors() + ([] if self.heavy is None else [self.heavy])

    def observe(self, layer: int, q: torch.Tensor, keys: torch.Tensor) -> None:
        """Keep the anchor's query of `layer` ([heads, dim]) over `keys` (the cache so far): every layer's is scored
        at once when the step is committed (`learn`), not one layer at a time within the pass."""
        self._queries[layer] = q.detach().clone()  # (not the view of the layer's whole query tensor)
        self._observed = keys.shape[0]

    @torch.inference_mode()  # (the mass was made in the prefill's)
    def learn(self, cache: KVCache) -> None:
        """Add the observed queries' attention over the positions they kept to the mass (one call for all layers)."""
        if not self._queries:
            return
        layers, length = cache.keys.shape[0], self._observed
        q = torch.stack([self._queries[layer] for layer in range(layers)])[:, :, None]  # [layers, heads, 1, dim]
        self._queries.clear()
        if self.heavy is None:  # every position kept: the cache as it is
            kept, keys = torch.arange(length, device=cache.device).expand(layers, -1), cache.keys[:, :length]
        else:  # observed in a window step, after its selection: the kept positions are the view's
            self.slots.layer(0)  # (its keys copied, if no layer read them yet)
            kept, keys = self.slots.positions[:, :self.slots.size], self.slots.keys[:, :self.slots.size]
        self.mass.add_layers(kept, attention_weights(q, keys, self.scale), length)

    def rebuild(self, cache: KVCache) -> None:
        """The first selection: every position older than the recent window weighed at once."""
        self.learn(cache)
        self.heavy, self.settled, self.seen = None, 0, 0
        self.active = cache.length > self.budget
        if not self.active:
            return
        length, older, layers = cache.length, cache.length - self.recent, cache.keys.shape[0]
        candidates = torch.arange(older, device=cache.device).expand(layers, -1)
        top = torch.topk(self.mass.gather(candidates, length), self.heavy_slots, dim=1).indices
        self.heavy = candidates.gather(1, top)
        newest = torch.arange(older, length, device=cache.device)
        ring = newest[torch.argsort(newest % self.recent)]  # slot heavy_slots + i holds the position ≡ i mod recent
        self._slots(cache, self.budget).fill(torch.cat([self.heavy, ring.expand(layers, -1)], dim=1))
        self.settled, self.seen = older, length

    def prepare(self, cache: KVCache) -> None:
        self.learn(cache)
        if not self.active:
            if cache.length > self.budget:  # the answer outgrew the budget
                self.rebuild(cache)
            return
        length, older = cache.length, cache.length - self.recent
        if length == self.seen:
            return
        # the newest positions into the ring (the same slots in every layer)
        newest = list(range(max(self.seen, older), length))
        self.slots.put([self.heavy_slots + p % self.recent for p in newest], newest)
        if older > self.settled:  # positions that left the recent window compete with the heavy hitters
            self._promote(torch.arange(self.settled, older, device=cache.device), length)
        self.settled, self.seen = older, length

    def _promote(self, left: torch.Tensor, length: int) -> None:
        """Keep the heaviest `budget − recent` of the heavy hitters and the positions that `left` the recent window;
        a promoted one takes the slot of a heavy hitter it evicts (the same count in each layer)."""
        layers, n = self.heavy.shape[0], left.shape[0]
        left = left.expand(layers, -1)
        candidates = torch.cat([self.heavy, left], dim=1)
        top = torch.topk(self.mass.gather(candidates, length), self.heavy_slots, dim=1).indices
        keep = torch.zeros_like(candidates, dtype=torch.bool).scatter_(1, top, True)
        swaps = min(n, self.heavy_slots)
        # per layer: its evicted slots first, its promoted positions first (stable: the order does not matter)
        freed = torch.sort((~keep[:, :self.heavy_slots]).to(torch.int8), dim=1, descending=True, stable=True)
        promoted = torch.sort(keep[:, self.heavy_slots:].to(torch.int8), dim=1, descending=True, stable=True)
        slots = freed.indices[:, :swaps]
        real = freed.values[:, :swaps].bool()  # beyond a layer's count, a slot keeps its own position
        positions = torch.where(real, left.gather(1, promoted.indices[:, :swaps]), self.heavy.gather(1, slots))
        self.heavy.scatter_(1, slots, positions)
        self.slots.put_layers(slots, positions)

    def committed(self, cache: KVCache, start: int, count: int) -> None:
        self.learn(cache)  # (the next window step's prepare brings the view up to date)
