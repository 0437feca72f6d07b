"""Step masks shared by every decoder: an all-visible cached prefix followed by a step-local block."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .model import Attention, causal_attention

if TYPE_CHECKING:
    from .rows import RowLayout


class PrefixMasks:
    """Boolean masks [rows, prefix + local]: prefix columns all visible, then a local block.

    One buffer per use, as tall as the tallest step it served (a draft tree's size changes every step); each call
    only restores the columns the previous local block covered and writes the new one, so the cost per step is
    the local block, not the prefix.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: dict[str, tuple[torch.Tensor, int, int]] = {}

    def get(self, use: str, prefix: int, local: torch.Tensor) -> torch.Tensor:
        rows, cols = local.shape
        end = prefix + cols
        buffer, dirty_start, dirty_end = self._buffers.get(use, (None, 0, 0))
        if buffer is None or buffer.shape[0] < rows or buffer.shape[1] < end:
            height = rows if buffer is None else max(rows, buffer.shape[0])
            buffer = torch.ones(height, max(2 * end, 256), dtype=torch.bool, device=self.device)
        else:
            buffer[:, dirty_start:dirty_end] = True
        buffer[:rows, prefix:end] = local
        self._buffers[use] = (buffer, prefix, end)
        return buffer[:rows, :end]


def prefix_attention(masks: PrefixMasks, prefix: int, layout: "RowLayout", scaling: float) -> Attention:
    """Eager attention of a step whose rows all see the `prefix` cached positions, then `layout.local`."""
    if layout.rows == 1:
        return causal_attention(None, scaling)  # one row that sees everything needs no mask
    return causal_attention(masks.get("step", prefix, layout.local), scaling)
