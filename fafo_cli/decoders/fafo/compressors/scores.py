"""Attention weights for the few rows compressors learn from (never the full L×L matrix)."""

from __future__ import annotations

import torch


def attention_weights(q: torch.Tensor, keys: torch.Tensor, scale: float, query_positions: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """Softmax attention of queries over keys, summed over rows and query heads: [keys].

    q: [heads, rows, dim]; keys: [slots, kv_heads, dim] (cache layout). GQA: each kv head serves
    heads / kv_heads query heads. With `query_positions`, a row does not see keys after its own position.
    """
    heads, rows, dim = q.shape
    kv_heads = keys.shape[1]
    grouped = q.float().reshape(kv_heads, heads // kv_heads * rows, dim)
    logits = torch.einsum("gqd,sgd->gqs", grouped, keys.float()) * scale  # g: kv head, q: its query rows
    if query_positions is not None:
        hidden = torch.arange(keys.shape[0], device=keys.device)[None, :] > query_positions[:, None]  # [rows, slots]
        logits = logits.view(kv_heads, heads // kv_heads, rows, -1).masked_fill(hidden, float("-inf"))
    return logits.softmax(-1).reshape(-1, keys.shape[0]).sum(0)
