"""Is every greedy row still exact? Token ids compared with the vanilla run's, first divergences classified.

In float32 on a CPU every row must equal vanilla. In bfloat16/float16, or on a GPU (whose libraries pick their
kernels by shape, float32's too), a pass over several rows rounds differently from a one-row pass, so where
vanilla's two best logits are (nearly) tied the other token can win: a numerical near-tie, reported but expected.
How near is measured, not assumed: `rounding_noise` compares one-row and multi-row passes over the same text on this
model and dtype. A divergence beyond that is a bug.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..runtime.conversations import shared_prefix
from ..runtime.rows import draft_step

CALIBRATION_ROWS = 9  # rows per pass when measuring the rounding noise (FAFO's default step)
MARGIN = 1.25  # the noise measured on one text, widened a little for others


@dataclass(frozen=True)
class Divergence:
    position: int  # index into the generated tokens
    ours: int | None  # the row's token there (None: it stopped earlier)
    reference: int | None  # vanilla's token there (None: vanilla stopped earlier)
    gap: float | None  # vanilla's logit of its token minus its logit of the row's token, at that position
    near_tie: bool | None  # None: not classified (the check was interrupted)

    def describe(self) -> str:
        kind = {True: "near-tie", False: "NOT a near-tie", None: "not classified: the check was interrupted"}[
            self.near_tie]
        gap = "" if self.gap is None else f", logit gap {self.gap:.4g}"
        return f"token {self.position}: {self.ours} vs vanilla's {self.reference}{gap} ({kind})"


def first_divergence(ours: list[int], reference: list[int]) -> int | None:
    """Where the two token lists first differ (one ending earlier included); None where they are equal."""
    same = shared_prefix(ours, reference)
    return None if same == len(ours) == len(reference) else same


@torch.no_grad()  # (not inference mode: a cache it grows, the masks it makes, are used by later answers)
def rounding_noise(engine, prompt_ids: list[int], generated: list[int], *, single=None, multi=None,
                   rows: int = CALIBRATION_ROWS) -> float:
    """How far a `rows`-row pass moves the gap between two near-top logits, against one-row passes, on this
    model and dtype: the largest change over the text, for vanilla's top-5 tokens at each position. 0 in
    float32 on a CPU, where every row must agree exactly (and so it measures 0 where our kernels serve every
    product).
    The one-row passes run on `single`, the others on `multi`: the compiled steps, or None for eager (a row and
    the plain decoding it is compared with, each in its own mode)."""
    if engine.model.dtype == torch.float32 and engine.model.device.type == "cpu" or not generated:
        return 0.0
    session, kept = engine.session, engine.session.compiled
    text = prompt_ids + generated[:128]
    engine.reset()
    try:
        session.use_compiled(single)
        logits, _ = session.prefill(prompt_ids, reserve=len(text))
        one_row = [logits]
        for token in text[len(prompt_ids):-1]:
            one_row.append(session.step(token))
        session.rollback(len(prompt_ids) - 1)  # the prompt's cache kept: a long prompt is prefilled once
        session.use_compiled(multi)
        many_rows = []
        for start in range(len(prompt_ids) - 1, len(text) - 1, rows):
            chunk = text[start:start + rows]  # a chain: each row sees the ones before it, as a causal pass
            step = draft_step(chunk[0], chunk[1:], list(range(-1, len(chunk) - 2)), engine.model.device, size=rows)
            many_rows.append(session.run(step))
            session.accept(step, list(range(len(chunk))))
    finally:
        session.use_compiled(kept)
        engine.reset()
    single_logits, multi_logits = torch.stack(one_row), torch.cat(many_rows)[:len(one_row)]
    top = single_logits.topk(5, dim=-1).indices
    one, many = single_logits.gather(-1, top), multi_logits.gather(-1, top)
    return float(((one[:, :1] - one) - (many[:, :1] - many)).abs().max()) * MARGIN


_AS_LOADED = object()  # classify's `steps` default: the compiled steps the session has


@torch.no_grad()  # (not inference mode: a cache it grows, the masks it makes, are used by later answers)
def classify(engine, prompt_ids: list[int], reference: list[int], ours: list[int], position: int,
             tolerance: float, steps=_AS_LOADED) -> Divergence:
    """Vanilla's logits at the divergence as plain decoding made them: the prompt prefilled from an empty cache,
    then vanilla's tokens before it one one-row step each, in `steps` (the compiled steps the reference ran in;
    None: eager). A near-tie when the row's token is within `tolerance` (`rounding_noise`) of vanilla's own. (A
    prefill of the whole text would round as a many-row pass: a gap off by up to the noise itself.)"""
    ours_token = ours[position] if position < len(ours) else None
    reference_token = reference[position] if position < len(reference) else None
    if ours_token is None or reference_token is None:  # one stopped earlier: a different token decided that
        return Divergence(position, ours_token, reference_token, None, False)
    session = engine.session
    kept = session.compiled
    engine.reset()
    try:
        session.use_compiled(kept if steps is _AS_LOADED else steps)
        logits, _ = session.prefill(prompt_ids, reserve=position + 1)
        for token in reference[:position]:
            logits = session.step(token)
    finally:
        session.use_compiled(kept)
        engine.reset()
    gap = abs(float(logits[reference_token] - logits[ours_token]))
    return Divergence(position, ours_token, reference_token, gap, gap <= tolerance)


def judge_float32(engine, prompt_ids: list[int], reference: list[int], ours: list[int], position: int) -> Divergence:
    """A float32 divergence (an engine in float32): on a CPU never a near-tie, float32 being exact by construction
    there (even a gap of 0 is a bug); on a GPU, whose float32 kernels are picked by shape, judged by the noise
    measured there."""
    cpu = engine.model.device.type == "cpu"
    divergence = classify(engine, prompt_ids, reference, ours, position,
                          0.0 if cpu else rounding_noise(engine, prompt_ids, reference))
    return replace(divergence, near_tie=bool(divergence.near_tie) and not cpu)
