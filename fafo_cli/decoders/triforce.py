"""TriForce: hierarchical self-speculation through a retrieval KV cache.

Middle level: the model's own weights attending to a retrieval cache, a second KV cache of fixed size
(`triforce_budget`): the context's chunks that score best against the latest query, the most recent positions,
and room for the tokens accepted since (their full-cache keys and values). When that room fills, or when the
acceptance since the last rebuild falls to half of the period before's, the cache is rebuilt from the whole
context, so its memory stays bounded however long the answer. It drafts `triforce_gamma2` tokens for the top
level, one full-cache pass that verifies them exactly.
Bottom level (with `--draft-model`): a small model sharing the tokenizer, with a StreamingLLM cache (sink +
recent positions), proposes `triforce_gamma1` tokens at a time that the middle level checks in one pass.
Every level verifies the one below with the same rules as the top, so the output is plain decoding's.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F

from ..runtime.events import Step
from ..runtime.model import Model, causal_attention, prefix_causal_mask
from .retrieval import gather_positions, select_positions
from ..runtime.sampling import Sampling, draw, target_probs
from ..runtime.session import PREFILL_CHUNK, Emitter, Request, Session
from ..runtime.syncs import upload
from . import speculative
from .speculative import Draft, check_chain, draft_chain

SINK = 4  # the draft model's StreamingLLM cache: first positions always kept


class StreamingDraftModel:
    """The bottom level: a small model over the text with a StreamingLLM cache (sink + recent positions).

    As in StreamingLLM, positions are numbered within the cache (slot = position): when the middle of the
    cache is evicted, the recent keys are rotated back to follow the sink, so the draft model never runs past
    the positions it was trained on. Tokens of a round are committed tentatively and cut back at its end.
    """

    def __init__(self, model: Model, size: int, target_vocab: int):
        self.model, self.size = model, size
        self.recent = size - SINK
        slack = self.recent // 4 + PREFILL_CHUNK + 64  # a prompt chunk and a round's rows beyond the size
        self.cache = model.new_cache(initial_slots=min(size + slack, 4096), max_slots=size + slack)
        self.pad = target_vocab - model.vocab_size  # a smaller vocabulary proposes none of the missing ids
        self.ids: list[int] = []  # every token seen (the cache holds the sink and the most recent ones)
        self.logits: torch.Tensor | None = None  # for the token after ids[-1]
        self.mark = (0, 0, None)  # (slots, ids, logits) at the start of a round
        self.passes = 0

    def _forward(self, tokens: list[int]) -> None:
        """Process `tokens` after the cache (committed), keeping the last one's logits."""
        cached = self.cache.length
        self.cache.reserve(cached + len(tokens))
        mask = prefix_causal_mask(cached, len(tokens), self.model.device) if len(tokens) > 1 else None
        positions = torch.arange(cached, cached + len(tokens), device=self.model.device)
        logits = self.model.forward(upload(tokens, self.model.device), positions, self.cache,
                                    causal_attention(mask, self.model.scaling), slice(-1, None))[-1]
        self.logits = F.pad(logits, (0, self.pad), value=float("-inf")) if self.pad else logits
        self.passes += 1
        self.ids.extend(tokens)
        self.cache.commit(len(tokens))

    def _evict(self) -> None:
        length = self.cache.length
        if length <= self.size + self.recent // 4:  # some slack: evict in batches, not every token
            return
        delta = length - self.size
        keys, values = self.cache.keys, self.cache.values
        for layer in range(keys.shape[0]):
            keys[layer, SINK:self.size] = self.model.shift_positions(keys[layer, length - self.recent:length], delta)
        values[:, SINK:self.size] = values[:, length - self.recent:length].clone()
        self.cache.truncate(self.size)

    def begin(self, text: list[int]) -> None:
        """Bring the cache to `text` (a new conversation starts over: evicted slots cannot be rolled back)."""
        if self.ids != text[:len(self.ids)]:
            self.cache.truncate(0)
            self.ids, self.logits = [], None
        new = text[len(self.ids):]
        for start in range(0, len(new), PREFILL_CHUNK):
            self._forward(new[start:start + PREFILL_CHUNK])
            self._evict()
        self.mark = (self.cache.length, len(self.ids), self.logits)

    def extend(self, tokens: list[int]) -> None:
        """Tokens the middle level accepted in this round (cut back by `end`)."""
        self._forward(tokens)

    def propose(self, n: int, sampling: Sampling, draws, position: int) -> tuple[list[int], list[torch.Tensor] | None]:
        """`n` tokens sampled with `draws`, the first at `position`."""
        tokens: list[int] = []
        drafts: list[torch.Tensor] = []
        mark = self.cache.length, len(self.ids), self.logits
        for j in range(n):
            token, probs = draw(self.logits, sampling, draws, position + j)
            tokens.append(token)
            if probs is not None:
                drafts.append(probs)
            if j < n - 1:
                self._forward([token])
        self.cache.truncate(mark[0])
        del self.ids[mark[1]:]
        self.logits = mark[2]
        return tokens, (drafts if not sampling.greedy else None)

    def end(self) -> None:
        slots, ids, self.logits = self.mark  # (the next round may begin with no new token: its logits are these)
        self.cache.truncate(slots)
        del self.ids[ids:]

    def nbytes(self) -> int:
        weights = sum(p.numel() * p.element_size() for p in self.model.hf.parameters())
        return weights + self.cache.nbytes()


RETRIEVAL_SLOTS = 4096  # the retrieval cache's first allocation at most; it grows as a rebuild or new tokens fill it


class TriForce:
    runs_model = True
    MIN_ROUNDS = 4  # rounds since a rebuild before their acceptance may call for the next one

    def __init__(self, config, bottom: StreamingDraftModel | None):
        self.chunk, self.budget = config.triforce_chunk, config.triforce_budget
        self.keep = config.triforce_recent // 2  # recent positions each rebuild keeps verbatim
        self.room = config.triforce_recent - self.keep  # new tokens appended until the next rebuild
        self.gamma1, self.gamma2 = config.triforce_gamma1, config.triforce_gamma2
        self.max_rows = self.gamma2
        self.bottom = bottom
        self.queries: dict[int, torch.Tensor] = {}  # layer -> the latest query [heads, dim] (prefill, then drafts)
        self.rebuilds = 0
        self.period = [0, 0]  # drafted and accepted tokens since the last rebuild
        self.rounds = 0  # draft rounds since the last rebuild
        self.before: float | None = None  # the acceptance rate of the period before the last rebuild

    def observe_prefill(self, layer: int, q: torch.Tensor, keys: torch.Tensor, first: int) -> None:
        self.queries[layer] = q[:, -1].clone()  # the last chunk's last row is the last prompt token

    def start(self, session: Session, request: Request, text: list[int], draws) -> None:
        self.model, self.main = session.model, session.cache
        self.sampling, self.draws = request.sampling, draws and draws.below()  # the middle level's
        # slots are not positions here: the draft rows of a round may pass the model's context by a few slots
        slack = self.gamma2 + self.gamma1 + 1
        # grown as filled: allocated for what the first rebuild and its room hold (a budget beyond the context is
        # never allocated, nor counted as the draft's memory)
        filled = min(self.budget, self.main.length + self.room) + slack
        self.retrieval = self.model.new_cache(initial_slots=min(filled, RETRIEVAL_SLOTS),
                                              max_slots=self.budget + slack)
        self._rebuild()

    def _rebuild(self) -> None:
        """Select the retrieval cache from the whole context: the best chunks before the last `keep` positions by the
        latest query (the first chunk always), then those positions."""
        length, keys, values = self.main.length, self.main.keys, self.main.values
        keep = min(self.keep, length)
        cut = length - keep
        recent = torch.arange(cut, length, device=keys.device)
        self.retrieval.truncate(0)
        self.retrieval.reserve(min(self.budget, length))
        for layer in range(len(self.model.layers)):
            chosen = (select_positions(keys[layer, :cut], self.queries[layer], self.chunk,
                                       self.budget - self.keep - self.room) if cut else
                      recent[:0].expand(keys.shape[2], 0))
            positions = torch.cat([chosen, recent.expand(chosen.shape[0], -1)], dim=1)
            kept = positions.shape[1]  # whole chunks: up to a chunk less than the budget
            self.retrieval.keys[layer, :kept] = gather_positions(keys[layer, :length], positions)
            self.retrieval.values[layer, :kept] = gather_positions(values[layer, :length], positions)
        self.retrieval.commit(kept)
        self.synced = self.rebuilt_at = length  # main-cache positions the retrieval cache has seen
        self.rebuilds += 1

    def draft(self, text: list[int], room: int) -> Draft:
        n = min(self.gamma2, room)
        if n <= 0:
            return Draft()
        anchor, position = text[-1], len(text) - 1
        if self.bottom is None:
            tokens, drafts = draft_chain(self.model, self.retrieval,
                                         self._recording(causal_attention(None, self.model.scaling)), anchor,
                                         position, n, self.sampling, self.draws)
            passes = n
        else:
            tokens, drafts, passes = self._draft_hierarchically(text, n)
        self.period[0] += n
        return Draft.chain(tokens, drafts, passes)

    def _recording(self, attend):
        """`attend`, keeping each layer's anchor query (a round's first row) for the next rebuild's selection. Over
        the retrieval cache it is the model's query of that token but for the layers below: close enough to choose
        chunks by, and free, unlike a pass over the whole cache."""
        fresh: set[int] = set()

        def recorded(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if layer not in fresh:
                fresh.add(layer)
                self.queries[layer] = q[0, :, 0].clone()
            return attend(layer, q, k, v)

        return recorded

    def _draft_hierarchically(self, text: list[int], n: int) -> tuple[list[int], list[torch.Tensor] | None, int]:
        """The middle level's n tokens, each check of the bottom level's proposals one middle pass."""
        model, cache, sampling = self.model, self.retrieval, self.sampling
        bottom = self.bottom
        bottom_passes = bottom.passes
        bottom.begin(text)
        base = cache.length
        tokens: list[int] = []
        drafts: list[torch.Tensor] = []
        pending, position, passes = text[-1], len(text) - 1, 0
        try:
            while len(tokens) < n:
                proposed, proposed_q = bottom.propose(min(self.gamma1, n - len(tokens)), sampling,
                                                      self.draws and self.draws.below(), position + 1)
                rows = [pending] + proposed
                cache.reserve(cache.length + len(rows))
                mask = prefix_causal_mask(cache.length, len(rows), model.device)
                attend = causal_attention(mask, model.scaling)
                logits = model.forward(upload(rows, model.device),
                                       torch.arange(position, position + len(rows), device=model.device), cache,
                                       self._recording(attend) if not tokens else attend)
                passes += 1
                emitted = check_chain(logits, proposed, proposed_q, sampling, self.draws, position + 1)
                if not sampling.greedy:  # what the middle level emitted was drawn from its own distribution
                    drafts += [target_probs(logits[j], sampling) for j in range(len(emitted))]
                cache.commit(len(emitted))  # the pending token's and the accepted proposals' rows
                tokens += emitted
                bottom.extend(emitted)
                pending, position = emitted[-1], position + len(emitted)
        finally:
            cache.truncate(base)
            bottom.end()
        return tokens[:n], (drafts[:n] if not sampling.greedy else None), passes + bottom.passes - bottom_passes

    def accepted(self, text: list[int], new: int) -> None:
        """Append the full-cache keys and values of the newly committed tokens to the retrieval cache; rebuild it
        when they fill its room or when acceptance has halved since the last rebuild."""
        self.period[1] += new - 1  # the emitted tokens but the model's own last one were accepted guesses
        self.rounds += 1
        length = self.main.length
        added = length - self.synced
        start = self.retrieval.length
        rate = self.period[1] / self.period[0] if self.period[0] else None
        dropped = (self.before is not None and rate is not None and self.rounds >= self.MIN_ROUNDS
                   and rate < self.before / 2)
        if length - self.rebuilt_at > self.room or dropped:  # the room is full: at most budget slots in use
            self.before = rate
            self.period, self.rounds = [0, 0], 0
            self._rebuild()
            return
        self.retrieval.reserve(start + added)
        self.retrieval.keys[:, start:start + added] = self.main.keys[:, self.synced:length]
        self.retrieval.values[:, start:start + added] = self.main.values[:, self.synced:length]
        self.retrieval.commit(added)
        self.synced = length

    def nbytes(self) -> int:
        return self.retrieval.nbytes() + (self.bottom.nbytes() if self.bottom else 0)


def generate(session: Session, request: Request, emitter: Emitter) -> Iterator[Step]:
    config, bottom = request.config, None
    if session.draft_model is not None:
        # the draft model's cache follows the conversation like the main one (begin() restarts it on a branch)
        key = ("triforce-draft", config.triforce_draft_cache)
        bottom = session.carry.get(key) or StreamingDraftModel(session.draft_model, config.triforce_draft_cache,
                                                                session.model.vocab_size)
        session.carry[key] = bottom
    yield from speculative.generate(session, request, emitter, TriForce(config, bottom))
