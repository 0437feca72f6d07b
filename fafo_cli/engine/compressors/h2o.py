"""`h2o` (Heavy-Hitter Oracle): keep the positions with the most accumulated attention plus a recent window.

Attention mass comes from the committed rows: at prefill from the last `window` prompt queries (the full
L×L weights would cost more than the prefill itself), then from each step's anchor row, whose weights are
computed for that single row only. The selection is refreshed every step: the heavy hitters among the
older positions fill `budget − recent` slots, the `recent` newest positions the rest.
"""

from __future__ import annotations

import torch

from ..cache import KVCache
from .scores import attention_weights
from .snapkv import ObservationScores
from .view import SlotView, ViewCompressor


class H2OCompressor(ViewCompressor):
    name = "h2o"
    needs_query = True

    def __init__(self, *, budget: int, recent: int, window: int, prompt_length: int, scale: float,
                 tail_rows: int):
        self.budget, self.recent, self.scale, self.tail_rows = budget, recent, scale, tail_rows
        self.mass = ObservationScores(window, prompt_length, scale)
        self.observe_prefill = self.mass.observe_prefill
        self.slots: SlotView | None = None
        self.active = False

    def observe(self, layer: int, q: torch.Tensor, keys: torch.Tensor) -> None:
        weights = attention_weights(q[:, None], keys, self.scale)
        scores = self.mass.scores.get(layer)
        if scores is None or scores.shape[0] < weights.shape[0]:
            grown = torch.zeros(max(weights.shape[0], 2 * (0 if scores is None else scores.shape[0])),
                                device=weights.device)
            if scores is not None:
                grown[:scores.shape[0]] = scores
            scores = self.mass.scores[layer] = grown
        scores[:weights.shape[0]] += weights

    def select(self, cache: KVCache) -> torch.Tensor:
        length = cache.length
        recent = torch.arange(length - self.recent, length)
        chosen = []
        for layer in range(cache.keys.shape[0]):
            older = self.mass.layer(layer, length)[:length - self.recent]
            heavy = torch.topk(older, self.budget - self.recent).indices.sort().values
            chosen.append(torch.cat([heavy, recent]))
        return torch.stack(chosen).to(cache.device)

    def rebuild(self, cache: KVCache) -> None:
        self.active = cache.length > self.budget
        if self.active:
            if self.slots is None:
                self.slots = SlotView(cache, self.budget, self.tail_rows)
            self.slots.fill(cache, self.select(cache))

    prepare = rebuild  # every step: the recent window slides and the masses change

    def committed(self, cache: KVCache, start: int, count: int) -> None:
        pass  # the next step's prepare selects again
