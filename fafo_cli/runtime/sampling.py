"""From logits to the next token: greedy, or sampling from the target distribution.

`target_probs` is the single definition of the distribution a sampled token must follow (temperature,
then top-k, then top-p, then min-p: the order transformers applies them); every decoder samples through it, so a
lossless method only has to match this one function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    min_p: float = 0.0  # 0 = off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self, device: torch.device) -> torch.Generator | None:
        if self.greedy:
            return None
        generator = torch.Generator(device=device)
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed(self.seed)
        return generator


def target_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Probabilities over the vocabulary (last dim) after temperature, top-k and top-p."""
    logits = logits.float() / sampling.temperature
    vocab = logits.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token once the mass before it already reaches top_p; the first token always stays
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= sampling.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(-1)
    if sampling.min_p > 0.0:  # keep tokens at least min_p times as likely as the likeliest
        probs = probs.masked_fill(probs < sampling.min_p * probs.amax(-1, keepdim=True), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def argmax_ids(logits: torch.Tensor) -> list[int]:
    """Each row's argmax, the first on ties as torch's. On a CPU numpy's: torch's costs a few percent of a compiled
    step over a large vocabulary, numpy's a tenth of that."""
    if logits.device.type != "cpu":
        return logits.argmax(-1).tolist()
    return logits.detach().float().numpy().argmax(-1).tolist()  # numpy has no bf16


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """One token from a single row of logits."""
    if sampling.greedy:
        return argmax_ids(logits.reshape(1, -1))[0]
    return int(torch.multinomial(target_probs(logits, sampling), 1, generator=generator))


def draw(logits: torch.Tensor, sampling: Sampling,
         generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
    """A drafted token and the distribution it was drawn from (None when greedy: the draft is the argmax)."""
    if sampling.greedy:
        return argmax_ids(logits.reshape(1, -1))[0], None
    probs = target_probs(logits, sampling)
    return int(torch.multinomial(probs, 1, generator=generator)), probs
