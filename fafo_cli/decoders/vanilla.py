"""Plain decoding: one token per forward pass. The speed reference for every other method."""

from __future__ import annotations

from typing import Iterator

from ..runtime.events import Step
from ..runtime.sampling import next_token
from ..runtime.session import Emitter, Request, Session


def generate(session: Session, request: Request, emitter: Emitter) -> Iterator[Step]:
    draws = request.sampling.draws()
    logits, reused = session.prefill(request.prompt_ids, reserve=request.max_tokens, steps=1,
                                     progress=emitter.prefilling)
    position = len(request.prompt_ids)
    token = next_token(logits, request.sampling, draws, position)
    emitter.prefilled(reused)  # after the first token's read: on a GPU the prefill has then run, not just launched
    rows = None  # the prefill's token; every later one a one-row step's
    while True:
        position += 1
        step = emitter.emit([token], rows=rows)
        yield step
        if step.finish_reason:
            return
        logits = session.step(token)
        token = next_token(logits, request.sampling, draws, position)
        rows = 1
