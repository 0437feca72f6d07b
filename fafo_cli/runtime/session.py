"""A model with its KV cache, kept across requests, and the bookkeeping every decoder shares.

`Session` remembers which token ids its cache holds. A new request prefills only what differs from that
(the longest common prefix is kept), which is how a chat turn costs only its new tokens, whatever the
decoder; a session may also keep a few earlier conversations (`keep_conversations`, for a server's clients taking
turns). `Emitter` turns a decoder's accepted tokens into `Step` events: stop tokens, stop strings, the token limit
and the context limit are checked token by token, so nothing is emitted past them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Protocol

import torch

from ..errors import ModelOutputError, is_out_of_memory
from .cache import KVCache
from .conversations import KeptConversation, KeptConversations, shared_prefix
from .detok import CONTEXT_IDS, Detokenizer
from .events import Prefill, Stats, Step
from .memory import PeakMemory
from .masks import PrefixMasks, prefix_attention
from .model import Model, causal_attention, prefix_causal_mask
from .rows import StepRows, plain_step
from .sampling import Sampling
from .stops import StopStrings
from .syncs import upload

PREFILL_CHUNK = 512  # bounds the prefill's attention mask and activations on long prompts
# Slots reserved past the prompt at once; the cache grows as a longer answer needs it, so an answer
# without a limit does not hold the whole context's cache from its first token
RESERVE_AHEAD = 2048
# A request that would cut fewer of the live conversation's tokens than this does not keep a copy of it: a chat turn
# often re-encodes the end of the previous answer differently, and a copy would only duplicate the live conversation.
KEEP_AT_LEAST = 16
MEMORY_EVERY_S = 0.1  # peak memory is sampled at most this often (and at the last step): a read of /proc per step
# is a measurable share of a compiled step


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling
    stop_ids: frozenset[int]
    config: Any = None  # the request's Config: method-specific settings for the decoder
    stop_strings: tuple[str, ...] = ()  # the answer ends before the first of these in its text
    on_prefill: Callable[[Prefill], None] | None = None  # told after each prefill chunk (a face's progress bar)
    continues_text: bool = False  # the answer goes on with the prompt's text (no chat template began a message)


class CompiledStepRunner(Protocol):
    """Compiled steps as the session uses them (compiled.steps.CompiledSteps): it never imports them."""

    def __call__(self, step: StepRows, ids: torch.Tensor, positions: torch.Tensor,
                 cache: KVCache) -> torch.Tensor | None:
        """The step's logits [rows, vocab] in the model's dtype; None when no compiled step serves it."""

    def serves(self, rows: int) -> bool:
        """Whether a decoder whose largest step has `rows` rows runs compiled."""

    def notify_once(self, message: str) -> None:
        """Tell the user `message`, once per process."""

    def forget_cache(self) -> None:
        """Let go of what refers to the cache's tensors (they are about to be reallocated)."""

    def step_costs(self, sizes: list[int], refresh: bool = False) -> dict[int, float] | None:
        """What a step takes in the package serving each of `sizes` (ms, timed side by side; `refresh`: timed
        again); None: not measured."""


class Session:
    def __init__(self, model: Model, tokenizer=None):
        self.model = model
        self.tokenizer = tokenizer
        self.cache = model.new_cache()
        self.ids: list[int] = []  # the tokens whose keys and values are committed in the cache
        self.carry: dict = {}  # decoder state that follows the conversation (e.g. FAFO's n-gram pool)
        # decoder state learned from every earlier answer, whatever the conversation, keyed by method (SuffixDecoding's
        # index of earlier answers); unlike `carry` no decoder clears it: only reset() does
        self.learned: dict = {}
        self.draft_model: Model | None = None  # a small model sharing the tokenizer (TriForce's bottom level)
        self.compiled: CompiledStepRunner | None = None  # the model's compiled steps (`compile` on/auto)
        self.compiled_runs = 0  # decoding steps run compiled so far (Stats.compiled_steps counts a request's)
        self.loading_s = 0.0  # of the last prefill, loading the decoder's compiled step (not the prompt's time)
        # one pass's measured ms against its rows (compiled/timing.STEP_COSTS): Model.eager_mode's here; compiled
        # packages' times are read through CompiledSteps.step_costs; for decoders that plan their steps
        self.step_costs: dict[str, dict[int, float]] = {}
        self._masks = PrefixMasks(model.device)  # eager steps' masks
        self.kept: KeptConversations | None = None  # earlier conversations besides the live one (keep_conversations)

    def reset(self) -> None:
        self.cache.truncate(0)
        self.ids = []
        self.carry.clear()
        self.learned.clear()
        if self.kept is not None:
            self.kept.clear()

    def keep_conversations(self, count: int, max_bytes: int) -> None:
        """Keep up to `count` earlier conversations (at most `max_bytes` of keys and values) for `recall`."""
        self.kept = KeptConversations(count, max_bytes) if count else None

    def recall(self, prompt_ids: list[int]) -> None:
        """Before a request's prefill: make the live conversation the one, live or kept, that shares the most of
        `prompt_ids`; keep a copy of the live one first when the request would cut it."""
        if self.kept is None:
            return
        reusable = prompt_ids[:-1]  # prefill always computes the last prompt token
        live = shared_prefix(self.ids, reusable)
        entry, longest = self.kept.best(reusable)
        if longest <= live:
            entry = None
        else:
            self.kept.take(entry)  # before keep() below, which could drop it
        # (not copied where it could never be kept: a long context's copy is GBs, on the GPU where the model is)
        copy = self.cache.snapshot_bytes(self.model.dtype)
        if len(self.ids) - live >= KEEP_AT_LEAST and self.kept.takes(copy):
            self.kept.make_room(self.ids, copy)  # (before the copy: the bound holds while it is made)
            try:
                keys, values = self.cache.snapshot(self.model.dtype)
            except (MemoryError, RuntimeError) as e:  # (no room for the copy: a GPU's memory full)
                if not is_out_of_memory(e):
                    raise
                self.kept.clear()  # this conversation is not kept, and the others give back their room: every
                # later request would run out the same way copying it
            else:
                self.kept.keep(KeptConversation(list(self.ids), keys, values, self.carry))
                self.carry = {}
        if entry is not None:
            self._before_growing(len(entry.ids))
            try:
                self.cache.load(entry.keys, entry.values)
            except BaseException:  # (out of memory as the cache grows for it): kept still, for a later request
                self.kept.keep(entry)
                raise
            self.ids, self.carry = list(entry.ids), entry.carry

    def rollback(self, length: int) -> None:
        self.cache.truncate(length)
        del self.ids[length:]

    def prefill(self, prompt_ids: list[int], reserve: int, observe=None, steps: int | None = None,
                progress: Callable[[int, int], None] | None = None, observed_rows: int = 1) -> tuple[torch.Tensor, int]:
        """Bring the cache to `prompt_ids` and return the last prompt token's logits; reserve slots beyond.

        `observe(layer, q [heads, rows, dim], keys [slots, kv_heads, dim], first_position)` sees each
        prefilled chunk's queries (compressors that learn from the prompt use it), the last `observed_rows` of the
        prompt at least, recomputed where the cache holds them (a chat turn's few new tokens, a question asked
        again: SnapKV's and H2O's selection learned from one query instead of their window's). `steps`: the rows the
        decoder's steps are padded to, where they run compiled; their package is loaded first, so that its load
        counts in the time to the first token, not in decoding speed (None: the decoder loads its own).
        `progress(done, total)` is told after each chunk. Chunks of PREFILL_CHUNK rows bound what a long prompt
        holds at once: a chunk's activations and its attention over the cache (never a score matrix over the whole
        prompt).
        Returns (logits of the last prompt token, number of prompt tokens reused from the cache).
        """
        self.loading_s = 0.0
        if self.compiled is not None and steps is not None:
            loading = time.perf_counter()
            self.compiled.serves(steps)
            self.loading_s = time.perf_counter() - loading
        reused = shared_prefix(self.ids, prompt_ids[:-1])
        if observe is not None:
            reused = min(reused, max(0, len(prompt_ids) - observed_rows))
        self.rollback(reused)
        self._attend_eagerly()
        self.cache.limit = min(self.model.max_context, len(prompt_ids) + reserve)  # (the cache grows up to it)
        self.reserve(min(self.model.max_context, len(prompt_ids) + min(reserve, RESERVE_AHEAD)))
        logits = None
        for start in range(reused, len(prompt_ids), PREFILL_CHUNK):
            chunk = prompt_ids[start:start + PREFILL_CHUNK]
            attend = causal_attention(prefix_causal_mask(start, len(chunk), self.model.device), self.model.scaling)
            if observe is not None:
                attend = _observed(attend, observe, self.cache, start)
            logits = self.forward(chunk, attend, last_only=True)
            self.commit(chunk)
            if progress is not None:
                progress(self.cache.length, len(prompt_ids))
        if not bool(torch.isfinite(logits[-1]).all()):  # (the first token reads these logits anyway: no extra wait)
            self.cache.forget(reused)  # a later request must not read keys and values that are no numbers either
            self.rollback(reused)
            raise ModelOutputError(non_finite(self.model.dtype))
        return logits[-1], reused

    def use_compiled(self, steps: CompiledStepRunner | None) -> None:
        """Run steps on `steps` from now on (None: eager). Compiled steps set aside let go of their views of the
        cache, which eager steps may reallocate (see `_attend_eagerly`)."""
        if self.compiled is not None and steps is not self.compiled:
            self.compiled.forget_cache()
        self.compiled = steps

    def reserve(self, slots: int) -> None:
        """Room in the cache for `slots` positions (a prefill's, a decoding step's rows), the compiled steps' hold
        on it let go first where it grows (`_before_growing`)."""
        self._before_growing(slots)
        self.cache.reserve(slots)

    def _before_growing(self, slots: int) -> None:
        """Before the cache grows to `slots` (a prefill, a step, a kept conversation loaded back): compiled steps let
        go of their views of it, or graphs, which would keep the old storage alive through the growth, its memory's
        peak (and be stale after it). Not where it does not grow: a GPU's graphs would be captured again."""
        if self.compiled is not None and slots > self.cache.capacity:
            self.compiled.forget_cache()

    def _attend_eagerly(self) -> None:
        """The cache as eager attention reads it (`KVCache.attend_in`). Where that converts a compiled step's compact
        copy, the compiled steps let go of their views of it first: else both copies stay alive until the next
        compiled step (a long prompt's prefill held the cache twice)."""
        if self.compiled is not None and self.cache.dtype != self.model.attention_dtype:
            self.compiled.forget_cache()
        self.cache.attend_in(self.model.attention_dtype)

    def forward(self, ids: list[int], attend, *, last_only: bool = False) -> torch.Tensor:
        """One forward pass of `ids` placed right after the committed tokens (written, not committed)."""
        device = self.model.device
        start = self.cache.length
        positions = torch.arange(start, start + len(ids), device=device)
        rows = slice(-1, None) if last_only else None
        return self.model.forward(upload(ids, device), positions, self.cache, attend, rows)

    def run(self, step: StepRows) -> torch.Tensor:
        """Run one decoding step, its rows written after the committed prefix (not committed); return the float32
        logits of the rows `step.layout.logit_rows` names (all when None). A compiled step runs it where one serves
        this many rows; else the eager forward pass."""
        layout = step.layout
        ids, positions = upload(step.ids, self.model.device), self.cache.length + layout.offsets
        if self.compiled is not None and step.compiled:
            logits = self.compiled(step, ids, positions, self.cache)
            if logits is not None:  # in the model's dtype
                self.compiled_runs += 1
                return (logits if layout.logit_rows is None else logits[layout.logit_rows]).float()
        self._attend_eagerly()  # (the step's attention, FAFO's included, finds it so)
        self.reserve(self.cache.length + len(step.ids))
        attention = (step.view.attention(layout) if step.view is not None
                     else prefix_attention(self._masks, self.cache.length, layout, self.model.scaling))
        return self.model.forward(ids, positions, self.cache, attention, layout.logit_rows)

    def accept(self, step: StepRows, rows: list[int]) -> None:
        """Commit these rows of the step just run (increasing; row 0 is the anchor): their keys and values, computed
        in that very pass, join the cache, and their tokens the committed ids."""
        self.cache.commit_rows(rows)
        self.ids.extend(step.ids[row] for row in rows)

    def commit(self, ids: list[int]) -> None:
        """Commit the rows of a forward pass of `ids` (a prefill chunk)."""
        self.cache.commit(len(ids))
        self.ids.extend(ids)

    def step(self, token: int) -> torch.Tensor:
        """Plain decoding: process one token, commit it, return the next token's logits."""
        step = plain_step(token, self.model.device)
        logits = self.run(step)
        self.accept(step, [0])
        return logits[-1]


def non_finite(dtype: torch.dtype) -> str:
    """Why a model's logits are NaN or infinite, and what to do."""
    if dtype == torch.float16:
        return ("the model's logits after the prompt are not numbers (NaN or infinite): float16 overflows in some "
                "models (Qwen2's among them); run it in bfloat16 where this device has it, else float32 (--dtype)")
    name = str(dtype).removeprefix("torch.")
    return (f"the model's logits after the prompt are not numbers (NaN or infinite) in {name}: its weights or this "
            "device's kernels give none; try --dtype float32")


def _observed(attend, observe, cache, first: int):
    def wrapped(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        observe(layer, q[0], cache.readable(cache.keys[layer, :first + q.shape[2]]), first)
        return attend(layer, q, k, v)

    return wrapped


class Emitter:
    """Per-request output: stop/limit checks, incremental text, statistics, Step events."""

    def __init__(self, session: Session, request: Request, tokenizer):
        self.request = request
        self.session = session
        self._compiled_before = session.compiled_runs
        self.context_left = session.model.max_context - len(request.prompt_ids)
        # a continuation's first token is decoded after the prompt's last ones (its space kept); a message's is not
        self.detok = Detokenizer(tokenizer, request.prompt_ids[-CONTEXT_IDS:] if request.continues_text else ())
        self.stops = StopStrings(request.stop_strings) if request.stop_strings else None
        self.memory = PeakMemory(session.model.devices)
        self.stats = Stats(prompt_tokens=len(request.prompt_ids), memory_kind=self.memory.kind)
        self.token_ids: list[int] = []
        self.started = time.perf_counter()
        self.first_token_at: float | None = None
        self.finish_reason: str | None = None
        self._memory_at = float("-inf")  # when memory was last sampled

    def prefilling(self, done: int, total: int) -> None:
        """After a prefill chunk: the chunk's memory is sampled (its activations are freed by the first token) and the
        request's `on_prefill` told."""
        self.stats.peak_memory_mb = self.memory.sample()
        if self.request.on_prefill is not None:
            self.request.on_prefill(Prefill(done, total, time.perf_counter() - self.started))

    def prefilled(self, reused: int) -> None:
        """The prompt is read: its time, without the compiled step's load (the time to the first token has it; a
        package's second's load made a short prompt read at a twentieth of its speed)."""
        self.stats.cached_prompt_tokens = reused
        self.stats.prefill_s = time.perf_counter() - self.started - self.session.loading_s

    def emit(self, tokens: list[int], *, drafted: int = 0, accepted: int = 0, rows: int | None = None,
             sources: list[str] | None = None) -> Step:
        """Record one forward pass's output; tokens past a stop token or a limit are dropped. `sources`: where each
        accepted guess came from (counted in `Stats.accepted_from` as far as it was emitted)."""
        kept: list[int] = []
        for token in tokens:
            kept.append(token)
            produced = len(self.token_ids) + len(kept)
            if token in self.request.stop_ids:
                self.finish_reason = "stop"
            elif produced >= self.request.max_tokens:
                self.finish_reason = "length"
            elif produced >= self.context_left:
                self.finish_reason = "context"
            if self.finish_reason:
                break
        kept, text = self._text(kept)
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
            self.stats.ttft_s = now - self.started
        self.token_ids.extend(kept)
        stats = self.stats
        stats.generated_tokens = len(self.token_ids)
        stats.steps += 1
        stats.compiled_steps = self.session.compiled_runs - self._compiled_before
        stats.drafted_tokens += drafted
        stats.draft_steps += drafted > 0
        if rows is not None:
            stats.step_rows[rows] = stats.step_rows.get(rows, 0) + 1
        accepted = min(accepted, len(kept))  # guesses cut by a stop or limit were not emitted
        stats.accepted_tokens += accepted
        if sources is not None:
            stats.accepted_from = dict(stats.accepted_from or {})
            for source in sources[:accepted]:
                stats.accepted_from[source] = stats.accepted_from.get(source, 0) + 1
        stats.accepted_ngrams += accepted > 0
        stats.decode_s = now - self.first_token_at
        if self.finish_reason or now - self._memory_at >= MEMORY_EVERY_S:
            stats.peak_memory_mb, self._memory_at = self.memory.sample(), now
        # accepted_from is replaced, not changed in place, so the snapshot may share it
        return Step(tuple(kept), text, replace(stats, step_rows=dict(stats.step_rows)), accepted, self.finish_reason)

    def _text(self, kept: list[int]) -> tuple[list[int], str]:
        """The text these tokens add (stop tokens are not shown). With stop strings, token by token: the tokens
        end with the one that completes a stop string, and the text before that stop string."""
        stop_ids = self.request.stop_ids
        if self.stops is None:
            text = self.detok.add([t for t in kept if t not in stop_ids])
            if self.finish_reason:
                text += self.detok.flush()
            return kept, text
        text = ""
        for i, token in enumerate(kept):
            text += self.stops.feed(self.detok.add([] if token in stop_ids else [token]))
            if self.stops.found:
                self.finish_reason = "stop"
                return kept[:i + 1], text
        if self.finish_reason:
            text += self.stops.feed(self.detok.flush()) + self.stops.flush()
            if self.stops.found:  # in the last token's held-back bytes
                self.finish_reason = "stop"
        return kept, text

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def left(self) -> int:
        """Tokens this answer may still emit (its limit or the context's end, whichever comes first)."""
        return min(self.request.max_tokens, self.context_left) - len(self.token_ids)
