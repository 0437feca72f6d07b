"""The attention of a FAFO step: verify rows over the whole cache, fumble rows over C(kv) only.

Rows are [anchor, candidates..., window...]. With a compressed view, two attention calls per layer:
anchor + candidates attend over all L cached positions plus their step-local block; window rows attend over
the compressor's contiguous copy of C(kv) plus the anchor and their staircase. Without one (compressor
`none`, or a context within the budget) a single call serves all rows. Masks are the step-local templates
placed after an all-visible prefix in a reused buffer, never rebuilt from scratch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .cache import KVCache


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


class FafoAttention:
    """Callable handed to Model.forward for one step (see module docstring)."""

    def __init__(self, cache: KVCache, compressor, scaling: float, masks: PrefixMasks, *,
                 verify_rows: int, verify_local: torch.Tensor, window_local: torch.Tensor,
                 combined_local: torch.Tensor):
        self.cache, self.compressor, self.scaling = cache, compressor, scaling
        self.verify_rows = verify_rows
        length = cache.length
        self.split = compressor.view(0) is not None
        self.observe = getattr(compressor, "observe", None) if getattr(compressor, "needs_query", False) else None
        if self.split:
            self.visible = compressor.visible(cache)
            self.verify_mask = masks.get("verify", length, verify_local)
            self.window_mask = masks.get("window", self.visible, window_local)
            # the anchor's and the window rows' slots in the cache, copied after the view in each layer
            window = window_local.shape[0]
            start = length + verify_rows
            self.window_source = torch.cat([torch.tensor([length]), torch.arange(start, start + window)]).to(
                cache.device)
        else:
            self.mask = masks.get("all", length, combined_local)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n_verify, start = self.verify_rows, self.cache.length
        if self.observe is not None:  # query-aware compressors learn from the anchor row
            self.observe(layer, q[0, :, 0], self.cache.keys[layer, :start])
        if not self.split:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, scale=self.scaling, enable_gqa=True)
        verify_end = start + n_verify
        verify = F.scaled_dot_product_attention(q[:, :, :n_verify], k[:, :, :verify_end], v[:, :, :verify_end],
                                                attn_mask=self.verify_mask, scale=self.scaling, enable_gqa=True)
        # The window rows see C(kv), then the anchor and themselves: place those rows' keys after the view.
        view_k, view_v = self.compressor.view(layer)
        n = self.visible
        end = n + len(self.window_source)
        torch.index_select(self.cache.keys[layer], 0, self.window_source, out=view_k[n:end])
        torch.index_select(self.cache.values[layer], 0, self.window_source, out=view_v[n:end])
        fumble = F.scaled_dot_product_attention(q[:, :, n_verify:], view_k[:end].transpose(0, 1)[None],
                                                view_v[:end].transpose(0, 1)[None], attn_mask=self.window_mask,
                                                scale=self.scaling, enable_gqa=True)
        return torch.cat([verify, fumble], dim=2)
