"""Lookahead decoding: FAFO's step with full-KV fumbling (`compressor: none`) and a pool keyed by the single
last token (P = 1), which is the method FAFO extends: no copies from the text, no planner (every step verifies
every candidate and runs the window). Its window, guess length and candidate count are its
own settings (`lookahead_*`), chosen for CPUs by measurement."""

from __future__ import annotations

from dataclasses import replace
from typing import Iterator

from .fafo import step as fafo
from ..runtime.events import Step
from ..runtime.session import Emitter, Request, Session

# n-grams kept per pool key: fixed, so that FAFO's `pool_per_key` (its own setting, refused for this method) never
# moves this row of a comparison
POOL_PER_KEY = 8


def generate(session: Session, request: Request, emitter: Emitter) -> Iterator[Step]:
    c = request.config
    config = replace(c, streams=c.lookahead_streams, ngram=c.lookahead_ngram, guesses=c.lookahead_guesses,
                     prefix=1, pool_per_key=POOL_PER_KEY, compressor="none", attention="split", copies=0, planner=False,
                     draft_tokens=c.lookahead_guesses * c.lookahead_ngram)
    yield from fafo.generate(session, replace(request, config=config), emitter)
