"""From logits to the next token: greedy, or sampling from the target distribution.

`target_probs` is the single definition of the distribution a sampled token must follow (temperature,
then top-k, then top-p, then min-p: the order transformers applies them); every decoder samples through it, so a
lossless method only has to match this one function.

The random numbers are `Draws`: one uniform per position of the text, a function of the seed and the position
alone, turned into a token by inverting the distribution's CDF (`pick`). Nothing a method guesses can change which
number a position gets, so every method that verifies one-hot guesses samples exactly the tokens plain decoding
samples with the same seed, not only the same distribution.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash of a 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class Draws:
    """Uniform random numbers in [0, 1) keyed by (position, stream): the same seed gives the same number for a
    position however many were asked for before, and in whatever order.

    Stream 0 samples the token at a position; rules that need more numbers for one position (speculative
    sampling's coin and residual) use other streams. A drafting level below the verified one (a self-draft)
    takes `below()`, so its draws never reuse the numbers that judge them.
    """

    def __init__(self, seed: int, level: int = 0):
        self.seed, self.level = seed, level
        self.key = _mix(_mix(seed & _MASK) + level)

    def uniform(self, position: int, stream: int = 0) -> float:
        return (_mix(_mix(self.key ^ stream) ^ (position & _MASK)) >> 11) / float(1 << 53)

    def below(self) -> "Draws":
        return Draws(self.seed, self.level + 1)


def pick(probs: torch.Tensor, u: float) -> int:
    """The token whose CDF interval holds `u`: a sample from `probs` (one row) when u is uniform. The CDF is summed
    in float64 (on the CPU for MPS, which has none), so rounding cannot lose a token's mass over a large vocabulary."""
    cdf = (probs.cpu() if probs.device.type == "mps" else probs).double().cumsum(-1)
    return int(torch.searchsorted(cdf, cdf[-1:] * u, right=True).clamp_max(cdf.shape[-1] - 1))


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    min_p: float = 0.0  # 0 = off

    @classmethod
    def of(cls, config) -> "Sampling":
        """A request's sampling from its config (`api.Engine.request_config`: the model's defaults filled in)."""
        return cls(config.temperature, config.top_p, config.top_k, config.seed, config.min_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def draws(self) -> Draws | None:
        """The request's random numbers (None when greedy); no seed draws a fresh one."""
        if self.greedy:
            return None
        return Draws(secrets.randbits(63) if self.seed is None else self.seed)


# below it logits / T can pass float32's range (inf, then NaN probabilities; a GPU divides as x · (1/T), which is
# inf below 3e-39): the likeliest tokens alone, as any such temperature leaves them
TINY_TEMPERATURE = 1e-30


def target_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Probabilities over the vocabulary (last dim) after temperature, top-k and top-p."""
    logits = logits.float()
    if sampling.temperature < TINY_TEMPERATURE:
        logits = torch.where(logits == logits.amax(-1, keepdim=True), 0.0, float("-inf"))
    else:
        logits = logits / sampling.temperature
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


def next_token(logits: torch.Tensor, sampling: Sampling, draws: Draws | None, position: int) -> int:
    """The token at `position` from a single row of logits."""
    return draw(logits, sampling, draws, position)[0]


def draw(logits: torch.Tensor, sampling: Sampling, draws: Draws | None,
         position: int) -> tuple[int, torch.Tensor | None]:
    """The token at `position` and the distribution it was drawn from (None when greedy: the token is the argmax)."""
    if sampling.greedy:
        return argmax_ids(logits.reshape(1, -1))[0], None
    probs = target_probs(logits, sampling)
    return pick(probs, draws.uniform(position)), probs
