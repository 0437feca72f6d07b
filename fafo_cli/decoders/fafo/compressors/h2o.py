"""`h2o` (Heavy-Hitter Oracle): keep the positions with the most accumulated attention plus a recent window.

Attention mass comes from the committed rows: at prefill from the last `window` prompt queries (the full
L×L weights would cost more than the prefill itself), then from each step's anchor row, whose weights are
computed for that single row only. The selection is refreshed every step: the heavy hitters among the
older positions fill `budget − recent` slots, the `recent` newest positions the rest.
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
        self.mass = ObservationScores(window, prompt_length, scale)
        self.observe_prefill = self.mass.observe_prefill

    def state(self) -> list[torch.Tensor]:
        return self.mass.tensors()

    def observe(self, layer: int, q: torch.Tensor, keys: torch.Tensor) -> None:
        self.mass.add(layer, attention_weights(q[:, None], keys, self.scale))

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
            self._slots(cache, self.budget).fill(self.select(cache))

    prepare = rebuild  # every step: the recent window slides and the masses change

    def committed(self, cache: KVCache, start: int, count: int) -> None:
        pass  # the next step's prepare selects again
