"""`h2o` (Heavy-Hitter Oracle): keep the positions with the most accumulated attention plus a recent window.

Attention mass comes from the committed rows: at prefill from the last `window` prompt queries (the full
L×L weights would cost more than the prefill itself), then from each step's anchor row over the positions still
kept. As in the paper, eviction is final: a position that leaves the view is never scored or selected again, so a
step's scoring reads the budget's keys, not the whole cache (scored over every position, a step at 8K cost about
as much as the window's rows reading the whole cache). The selection is refreshed every step: the heavy hitters
among the older kept positions fill `budget − recent` slots, the `recent` newest positions the rest.
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
        self.evicted: dict[int, torch.Tensor] = {}  # per layer, [positions]: left the view for good

    def state(self) -> list[torch.Tensor]:
        return self.mass.tensors() + list(self.evicted.values())

    def _gone(self, layer: int, length: int) -> torch.Tensor:
        """[length] booleans: the positions evicted from `layer` (those committed since the last selection are not)."""
        gone = torch.zeros(length, dtype=torch.bool)
        evicted = self.evicted.get(layer)
        if evicted is not None:
            n = min(length, evicted.shape[0])
            gone[:n] = evicted[:n]
        return gone

    def observe(self, layer: int, q: torch.Tensor, keys: torch.Tensor) -> None:
        kept = (~self._gone(layer, keys.shape[0])).nonzero().squeeze(1).to(keys.device)
        weights = torch.zeros(keys.shape[0], device=keys.device)
        weights[kept] = attention_weights(q[:, None], keys[kept], self.scale)
        self.mass.add(layer, weights)

    def select(self, cache: KVCache) -> torch.Tensor:
        length, older = cache.length, cache.length - self.recent
        recent = torch.arange(older, length)
        chosen = []
        for layer in range(cache.keys.shape[0]):
            mass = self.mass.layer(layer, length)[:older]
            mass[self._gone(layer, older)] = float("-inf")
            heavy = torch.topk(mass, self.budget - self.recent).indices.sort().values
            gone = torch.ones(older, dtype=torch.bool)  # every older position not kept now
            gone[heavy] = False
            self.evicted[layer] = gone
            chosen.append(torch.cat([heavy, recent]))
        return torch.stack(chosen).to(cache.device)

    def rebuild(self, cache: KVCache) -> None:
        self.active = cache.length > self.budget
        if self.active:
            self._slots(cache, self.budget).fill(self.select(cache))

    prepare = rebuild  # every step: the recent window slides and the masses change

    def committed(self, cache: KVCache, start: int, count: int) -> None:
        pass  # the next step's prepare selects again
