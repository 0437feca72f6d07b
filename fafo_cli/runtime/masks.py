"""Step masks shared by every decoder: an all-visible cached prefix followed by a step-local block."""

from __future__ import annotations

import torch


class PrefixMasks:
    """Boolean masks [rows, prefix + local]: prefix columns all visible, then a local block.

    One buffer per use; each call only restores the columns the previous local block covered and writes
    the new one, so the cost per step is the local block, not the prefix.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: dict[tuple[str, int], tuple[torch.Tensor, int, int]] = {}

    def get(self, use: str, prefix: int, local: torch.Tensor) -> torch.Tensor:
        rows, cols = local.shape
        end = prefix + cols
        buffer, dirty_start, dirty_end = self._buffers.get((use, rows), (None, 0, 0))
        if buffer is None or buffer.shape[1] < end:
            buffer = torch.ones(rows, max(2 * end, 256), dtype=torch.bool, device=self.device)
        else:
            buffer[:, dirty_start:dirty_end] = True
        buffer[:, prefix:end] = local
        self._buffers[(use, rows)] = (buffer, prefix, end)
        return buffer[:, :end]
