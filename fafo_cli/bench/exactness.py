"""Is every greedy row still exact? Token ids compared with the vanilla run's, first divergences classified.

In float32 every row must equal vanilla. In bfloat16/float16 a pass over several rows rounds differently from
a one-row pass, so where vanilla's two best logits are (nearly) tied the other token can win: a numerical
near-tie, reported but expected. A divergence anywhere else is a bug, and is reported as one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}
TIE_ULPS = 4  # a gap within this many units in the last place of the top logit counts as a tie


@dataclass(frozen=True)
class Divergence:
    position: int  # index into the generated tokens
    ours: int | None  # the row's token there (None: it stopped earlier)
    reference: int | None  # vanilla's token there (None: vanilla stopped earlier)
    gap: float | None  # vanilla's top-1 minus top-2 logit at that position
    near_tie: bool

    def describe(self) -> str:
        kind = "near-tie" if self.near_tie else "NOT a near-tie"
        gap = "" if self.gap is None else f", top-2 gap {self.gap:.4g}"
        return f"token {self.position}: {self.ours} vs vanilla's {self.reference}{gap} ({kind})"


def first_divergence(ours: list[int], reference: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(ours, reference)):
        if a != b:
            return i
    return None if len(ours) == len(reference) else min(len(ours), len(reference))


def tie_tolerance(top: float, dtype: torch.dtype) -> float:
    if dtype == torch.float32:
        return 0.0  # float32 must be exact: no divergence is excused
    exponent = math.floor(math.log2(abs(top))) if top else 0
    return TIE_ULPS * 2.0 ** (exponent - MANTISSA_BITS.get(dtype, 7))


def classify(engine, prompt_ids: list[int], reference: list[int], ours: list[int], position: int) -> Divergence:
    """Vanilla's logits at the divergence (the prompt and vanilla's tokens before it, prefilled)."""
    ours_token = ours[position] if position < len(ours) else None
    reference_token = reference[position] if position < len(reference) else None
    if ours_token is None or reference_token is None:  # one stopped earlier: a different token decided that
        return Divergence(position, ours_token, reference_token, None, False)
    engine.reset()
    logits, _ = engine.session.prefill(prompt_ids + reference[:position], reserve=1)
    engine.reset()
    top = logits.topk(2)
    gap = float(top.values[0] - top.values[1])
    near = (gap <= tie_tolerance(float(top.values[0]), engine.model.dtype)
            and ours_token in top.indices.tolist())
    return Divergence(position, ours_token, reference_token, gap, near)
