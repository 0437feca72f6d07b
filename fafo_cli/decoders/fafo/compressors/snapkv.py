"""`snapkv` (SnapKV): select prompt positions by what the end of the prompt attends to.

At every prefill (so at each new chat turn too: re-selecting per turn avoids SnapKV's multi-turn failure)
the last `window` prompt queries score every prompt position by attention weight (summed over queries and
heads), the scores are smoothed by 1-D max pooling of width `kernel`, and the top positions per layer are
kept with the window itself. Tokens generated since the prefill follow, in a ring of a quarter of the
budget (the oldest dropped first when over budget).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ....runtime.cache import KVCache
from .scores import attention_weights
from .view import ViewCompressor


class ObservationScores:
    """Attention mass each position receives, per layer: from the last `window` prompt queries at prefill, then
    from whatever the compressor adds. One [layers, positions] tensor, grown as layers and the context arrive."""

    def __init__(self, window: int, prompt_length: int, scale: float):
        self.window, self.prompt_length, self.scale = window, prompt_length, scale
        self.scores: torch.Tensor | None = None

    def observe_prefill(self, layer: int, q: torch.Tensor, keys: torch.Tensor, first: int) -> None:
        # the observed rows are the chunk's tail from the window's first position on: a slice, known on the host
        # (no read of a device's tensor per layer and chunk)
        start = max(0, self.prompt_length - self.window - first)
        if start >= q.shape[1]:
            return
        positions = torch.arange(first + start, first + q.shape[1], device=q.device)
        self.add(layer, attention_weights(q[:, start:], keys, self.scale, positions))

    def _room(self, layers: int, length: int, device: torch.device) -> torch.Tensor:
        total = self.scores
        rows, columns = (0, 0) if total is None else total.shape
        if layers > rows or length > columns:
            # positions doubled as they fall short (they come a step at a time); layers as they arrive (one by one,
            # at the first prefill chunk: a few small copies, and no row more than the model has)
            grown = torch.zeros(max(rows, layers), columns if length <= columns else max(length, 2 * columns),
                                device=device)
            if total is not None:
                grown[:rows, :columns] = total
            total = self.scores = grown
        return total

    def add(self, layer: int, weights: torch.Tensor) -> None:
        """Accumulate attention mass for a layer: `weights` [positions] from the first position on."""
        self._room(layer + 1, weights.shape[0], weights.device)[layer, :weights.shape[0]] += weights

    def add_layers(self, positions: torch.Tensor, weights: torch.Tensor, length: int) -> None:
        """Accumulate `weights` [layers, n] at each layer's `positions` [layers, n], all below `length` (so no read
        of a device's tensor to know how far they reach)."""
        layers = positions.shape[0]
        self._room(layers, length, weights.device)[:layers].scatter_add_(1, positions, weights)

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.scores is None else [self.scores]

    def layer(self, layer: int, length: int) -> torch.Tensor:
        """[length] on the host: a layer's mass (0 where none was added)."""
        out = torch.zeros(length)
        if self.scores is not None and layer < self.scores.shape[0]:
            n = min(length, self.scores.shape[1])
            out[:n] = self.scores[layer, :n].cpu()
        return out

    def gather(self, positions: torch.Tensor, length: int) -> torch.Tensor:
        """[layers, n]: each layer's mass at its own `positions` [layers, n], all below `length`."""
        return self._room(positions.shape[0], length, positions.device)[:positions.shape[0]].gather(1, positions)


def _top_newest_first(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """The positions of the `keep` highest `scores`, the newest first among equal ones: where the answer outgrew the
    budget, its tokens have no observed mass (all 0), and topk's choice among ties is no order at all."""
    newest_first = torch.argsort(scores.flip(0), descending=True, stable=True)[:keep]
    return scores.numel() - 1 - newest_first


class SnapKVCompressor(ViewCompressor):
    name = "snapkv"

    def __init__(self, *, budget: int, window: int, kernel: int, prompt_length: int, scale: float, tail_rows: int):
        self.budget, self.window, self.kernel = budget, window, kernel
        self.ring = max(1, budget // 4)  # room for generated tokens
        self.observed = ObservationScores(window, prompt_length, scale)
        self.observed_rows = window  # the prompt's last rows its prefill must see (Session.prefill)
        self.observe_prefill = self.observed.observe_prefill
        self.tail_rows = tail_rows
        self.prefix = 0  # slots holding the prompt selection
        self.prefilled = 0  # cache length at the selection

    def state(self) -> list[torch.Tensor]:
        return self.observed.tensors()

    def select_prompt(self, cache: KVCache) -> torch.Tensor:
        """[layers, n] prompt positions: the pooled top scores plus the observation window."""
        length = cache.length
        window = min(self.window, length, self.budget - self.ring)  # the ring's slots stay free whatever the budget
        keep = max(0, min(length - window, self.budget - self.ring - window))
        chosen = []
        for layer in range(cache.keys.shape[0]):
            scores = self.observed.layer(layer, length)[:length - window]
            if self.kernel > 1 and scores.numel():
                scores = F.max_pool1d(scores[None, None], self.kernel, stride=1, padding=self.kernel // 2)[0, 0]
            chosen.append(torch.cat([_top_newest_first(scores[:length - window], keep).sort().values,
                                     torch.arange(length - window, length)]))
        return torch.stack(chosen).to(cache.device)

    def rebuild(self, cache: KVCache) -> None:
        self.active = cache.length > self.budget - self.ring
        self.prefilled = cache.length
        if not self.active:
            return
        self._slots(cache, self.budget).fill(self.select_prompt(cache))
        self.prefix = self.slots.size

    def committed(self, cache: KVCache, start: int, count: int) -> None:
        if not self.active:
            if cache.length > self.budget:  # the answer outgrew the budget: fall back to the ring alone
                self.rebuild(cache)
            return
        positions = list(range(max(start, start + count - self.ring), start + count))  # a ring's worth
        self.slots.put([self.prefix + (p - self.prefilled) % self.ring for p in positions], positions)
        self.slots.size = self.prefix + min(self.ring, cache.length - self.prefilled)
