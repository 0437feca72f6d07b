"""Draft, then verify in one pass: the loop shared by every method whose guesses come from a `Drafter`.

Each step the drafter proposes a `DraftTree` after the anchor (the last emitted token); one forward pass of
the full model over [anchor] + tree, with tree attention over the whole cache, decides what is emitted:
the accepted path plus one token of the model's own, so the output is exactly plain decoding's. Only the
anchor's and the accepted path's keys and values are committed.

A drafter that samples its guesses from a distribution (a self-draft) returns those distributions with a
chain, and sampling then uses standard speculative sampling (`verify.accept_speculative`), exact in distribution;
one-hot guesses (tables, copies) are checked against the tokens plain sampling picks with the same draws
(`verify.accept`), so the output is plain decoding's token for token.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterator, Protocol

import torch

from ..runtime.events import Step
from ..runtime.memory import MB
from ..runtime.rows import draft_step
from ..runtime.cache import KVCache
from ..runtime.model import Model
from ..runtime.sampling import Draws, Sampling, draw, next_token, target_probs
from ..runtime.session import Emitter, Request, Session
from ..runtime.syncs import upload
from .tree import DraftTree
from .verify import accept, accept_speculative


@dataclass
class Draft:
    tree: DraftTree = field(default_factory=DraftTree)
    q: list[torch.Tensor] | None = None  # sampled self-drafts: the distribution each chain token was drawn from
    passes: int = 0  # forward passes the drafting took

    def within(self, depth: int) -> "Draft":
        """No path longer than `depth` guesses (a chain's distributions cut with it)."""
        tree = self.tree.within(max(0, depth))
        return self if tree is self.tree else Draft(tree, self.q and self.q[:len(tree)], self.passes)

    @classmethod
    def chain(cls, tokens: list[int], q: list[torch.Tensor] | None = None, passes: int = 0) -> "Draft":
        tree = DraftTree()
        tree.add_chain(tokens)
        return cls(tree, q, passes)


class Drafter(Protocol):
    max_rows: int  # the most tree nodes a draft can have (cache room reserved up front)
    runs_model: bool  # drafting costs forward passes (counted in `Stats.draft_passes`)

    def start(self, session: Session, request: Request, text: list[int], draws: Draws | None) -> None:
        """After the prefill; `text` is the prompt and the first emitted token; `draws` are the request's random
        numbers (None when greedy): a drafter that samples takes `draws.below()`."""

    def draft(self, text: list[int], room: int) -> Draft:
        """Guesses to follow `text` (whose last token is the anchor), at most `room` nodes."""

    def accepted(self, text: list[int], new: int) -> None:
        """`text` grew by `new` emitted tokens, whose keys and values (but the last) are now committed."""

    def nbytes(self) -> int:
        """Memory the drafter holds beyond the model and its cache."""


def generate(session: Session, request: Request, emitter: Emitter, drafter: Drafter) -> Iterator[Step]:
    model, cache, sampling = session.model, session.cache, request.sampling
    draws = sampling.draws()
    logits, reused = session.prefill(request.prompt_ids, reserve=request.max_tokens + drafter.max_rows + 1,
                                     observe=getattr(drafter, "observe_prefill", None), steps=1 + drafter.max_rows,
                                     progress=emitter.prefilling)
    anchor = next_token(logits, sampling, draws, len(request.prompt_ids))
    emitter.prefilled(reused)  # the drafter's own set-up (quantizing, indexing the prompt) is not the prefill's
    text = list(request.prompt_ids) + [anchor]
    drafter.start(session, request, text, draws)
    stats = emitter.stats
    stats.draft_memory_mb = drafter.nbytes() / MB
    stats.draft_passes = 0 if drafter.runs_model else None
    step = emitter.emit([anchor])
    yield step
    while not step.finish_reason:
        start = cache.length
        # no guess past the answer's tokens left (it would never be emitted; a self-draft's pass for it wasted), and
        # no path longer than them in a tree
        draft = drafter.draft(text, room=min(model.max_context - start - 1, emitter.left - 1)).within(emitter.left - 1)
        tree = draft.tree
        if drafter.runs_model:
            stats.draft_passes += draft.passes
        rows = draft_step(anchor, tree.tokens, tree.parents, model.device, size=1 + drafter.max_rows)
        session.reserve(start + len(rows.ids))
        logits = session.run(rows)
        if draft.q is not None:  # a chain sampled from q (only when sampling): row j is the target at position j
            emitted = check_chain(logits, tree.tokens, draft.q, sampling, draws, len(text))
            path = list(range(len(emitted) - 1))
        else:
            path, emitted = accept(tree, logits, sampling, draws, len(text))
        session.accept(rows, [0] + [1 + node for node in path])  # the anchor and the accepted guesses
        step = emitter.emit(emitted, drafted=len(tree), accepted=len(path), rows=len(rows.ids))
        text.extend(step.token_ids)  # tokens past a stop or limit are no part of the text (a drafter's history)
        drafter.accepted(text, len(step.token_ids))
        stats.draft_memory_mb = drafter.nbytes() / MB
        yield replace(step, stats=replace(step.stats, draft_memory_mb=stats.draft_memory_mb))  # (grown just now)
        anchor = emitted[-1]


def draft_chain(model: Model, cache: KVCache, attend, anchor: int, position: int, n: int, sampling: Sampling,
                draws: Draws | None, linear=None) -> tuple[list[int], list[torch.Tensor] | None]:
    """A self-draft: `n` tokens after `anchor` (at `position`), one forward pass each over `cache` with `attend`
    (and `linear`, Model.forward's, for weights other than the model's own), sampled with the drafting level's
    `draws`.

    Each pass's row is committed so the next one sees it, and the cache is cut back afterwards: draft keys
    and values are never kept. Returns the tokens and, when sampling, the distributions they were drawn from.
    """
    base = cache.length
    cache.reserve(base + n)
    tokens: list[int] = []
    drafts: list[torch.Tensor] = []
    token = anchor
    try:
        for j in range(n):
            logits = model.forward(upload([token], model.device), upload([position + j], model.device), cache, attend,
                                   linear=linear)
            cache.commit(1)
            token, probs = draw(logits[-1], sampling, draws, position + j + 1)
            tokens.append(token)
            if probs is not None:
                drafts.append(probs)
    finally:
        cache.truncate(base)
    return tokens, (drafts if not sampling.greedy else None)


def check_chain(logits: torch.Tensor, tokens: list[int], q: list[torch.Tensor] | None, sampling: Sampling,
                draws: Draws | None, position: int) -> list[int]:
    """Emitted tokens for a chain verified by `logits` (row j: the target after the anchor and j tokens; `tokens[0]`
    at `position`): greedy agreement, or speculative sampling against the draft distributions `q`."""
    if sampling.greedy:
        return accept(DraftTree.chains([tokens]), logits, sampling, None, position)[1]
    return accept_speculative(tokens, lambda j: target_probs(logits[j], sampling), q, draws, position)
