"""TriForce's retrieval cache selection: the prompt's KV in chunks, scored by the last prompt query.

Per layer and per KV head, the prompt's keys are cut into chunks of `chunk` tokens; a chunk's score is the
last prompt query (the query heads of a GQA group summed) against the chunk's mean key. The first chunk is
always kept (attention sinks), so is the last partial chunk (the most recent tokens, which keeps every
head's selection the same length); the best-scoring chunks fill the rest of the budget.
"""

from __future__ import annotations

import torch


def chunk_scores(keys: torch.Tensor, query: torch.Tensor, chunk: int) -> torch.Tensor:
    """[kv_heads, whole chunks]: `keys` [positions, kv_heads, dim], `query` [heads, dim]."""
    n_chunks = keys.shape[0] // chunk
    kv_heads, dim = keys.shape[1], keys.shape[2]
    means = keys[:n_chunks * chunk].float().view(n_chunks, chunk, kv_heads, dim).mean(1)
    grouped = query.float().view(kv_heads, -1, dim).sum(1)  # sum over a group's heads of q·k = (sum q)·k
    return torch.einsum("ckd,kd->kc", means, grouped)


def select_positions(keys: torch.Tensor, query: torch.Tensor, chunk: int, budget: int) -> torch.Tensor:
    """Positions kept per KV head, [kv_heads, kept] in increasing order (everything if it fits the budget)."""
    length, kv_heads = keys.shape[0], keys.shape[1]
    if length <= budget:
        return torch.arange(length, device=keys.device).expand(kv_heads, length)
    n_chunks = length // chunk
    tail = torch.arange(n_chunks * chunk, length, device=keys.device).expand(kv_heads, -1)
    chosen = (budget - tail.shape[1]) // chunk  # whole chunks that fit besides the tail, the first one included
    scores = chunk_scores(keys, query, chunk)[:, 1:]
    top = scores.topk(chosen - 1, dim=-1).indices + 1
    chunks = torch.cat([torch.zeros(kv_heads, 1, dtype=torch.long, device=keys.device), top], dim=1).sort(-1).values
    within = torch.arange(chunk, device=keys.device)
    return torch.cat([(chunks[:, :, None] * chunk + within).flatten(1), tail], dim=1)


def gather_positions(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`values` [positions, kv_heads, dim] at per-head `positions` [kv_heads, kept] -> [kept, kv_heads, dim]."""
    index = positions.t()[:, :, None].expand(-1, -1, values.shape[2])
    return values.gather(0, index)
