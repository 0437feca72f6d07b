"""Attention weights for the few rows compressors learn from (never the full L×L matrix)."""

from __future__ import annotations

import torch


def attention_weights(q: torch.Tensor, keys: torch.Tensor, scale: float, query_positions: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """Softmax attention of queries over keys, summed over rows and query heads: [..., keys].

    q: [..., heads, rows, dim]; keys: [..., slots, kv_heads, dim] (cache layout), the leading dimensions (layers,
    say) the same in both. GQA: each kv head serves heads / kv_heads query heads. With `query_positions`, a row
    does not see keys after its own position.
    """
    *lead, heads, rows, dim = q.shape
    slots, kv_heads = keys.shape[-3], keys.shape[-2]
    # g: kv head, q: its query rows; scaled first (fp16 keeps its range for the logits, not their 1/scale multiple)
    grouped = (q * scale).to(keys.dtype).reshape(*lead, kv_heads, heads // kv_heads * rows, dim)
    # [..., g, s, q]: one batched product over the keys as the cache lays them out, in their dtype (a bf16 cache's
    # logits rounded to bf16: these weights only rank positions)
    logits = torch.matmul(keys.transpose(-3, -2), grouped.transpose(-1, -2)).float().transpose(-1, -2)
    if query_positions is not None:
        hidden = torch.arange(slots, device=keys.device)[None, :] > query_positions[:, None]  # [rows, slots]
        logits = logits.view(*lead, kv_heads, heads // kv_heads, rows, slots).masked_fill(hidden, float("-inf"))
    return logits.softmax(-1).reshape(*lead, -1, slots).sum(-2)
