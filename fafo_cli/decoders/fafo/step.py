"""FAFO decoding: one forward pass per step that verifies guesses on the full cache ("Find Out") and makes
new ones from a compressed view of it ("Fumble Around"). See ../shared/design/fafo.md.

Step rows: [anchor x_t] + G candidates of k tokens from the pool + the lookahead window. Verify rows decide
what is emitted (the longest candidate prefix that greedy decoding agrees with, plus one bonus token), so
the output is exactly plain greedy decoding's; the window only feeds the pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from typing import TYPE_CHECKING, Iterator

import torch

from ...config import MIN_BUDGET
from .attention import KV_BLOCK, BlockSparseMasks, FafoAttention, flex_attention_kernel
from ...runtime.masks import PrefixMasks
from .compressors import make_compressor, reads_queries
from ...runtime.events import Step
from ...runtime.model import causal_attention
from .pool import NgramPool
from ...runtime.session import Emitter, Request, Session
from ...runtime.sampling import argmax_ids, next_token, target_probs
from ..tree import DraftTree
from ..verify import accept_greedy, accept_sampling
from .window import LookaheadWindow, window_layout

if TYPE_CHECKING:
    from ...compiled.steps import CompiledSteps


def step_rows(streams: int, ngram: int, guesses: int) -> int:
    """The most rows a step carries: the anchor, G candidates of k tokens, the window's W·k − 1 rows."""
    return (guesses + streams) * ngram


def compiled_for(compiled: CompiledSteps | None, compressor: str) -> CompiledSteps | None:
    """The compiled steps FAFO may use with `compressor`: none where it learns from each step's queries (the
    compiled step has no per-layer hook to hand them out)."""
    return None if reads_queries(compressor) else compiled


def window_streams(streams: int | str, ngram: int, guesses: int, compiled: CompiledSteps | None) -> int:
    """W as configured; `auto` picks 1 where the step runs compiled and 2 where it runs eager. An eager CPU step
    is mostly overhead, so a second stream's rows cost little; a compiled step's rows cost arithmetic, and W=1
    measured 1.64x (chat) and 1.74x (summarize) compiled plain decoding against 0.87x and 1.29x for W=2."""
    if streams != "auto":
        return streams
    return 1 if compiled is not None and compiled.serves(step_rows(1, ngram, guesses)) else 2


@dataclass(frozen=True)
class FafoSettings:
    streams: int | str  # W, or "auto" until generate() resolves it
    ngram: int  # k
    guesses: int  # G
    prefix: int  # P
    pool_per_key: int
    seed_pool: bool
    compressor: str
    budget: int | float  # B: tokens, or a fraction of the prompt
    sink: int  # stream
    page_size: int  # quest
    refresh: int  # quest
    window: int  # snapkv, h2o
    kernel: int  # snapkv
    recent: int  # h2o
    attention: str  # auto | split | block

    @property
    def max_rows(self) -> int:
        return step_rows(self.streams, self.ngram, self.guesses)

    @property
    def step_sizes(self) -> tuple[int, ...]:
        """A step's rows with no candidate from the pool (the anchor and the window: 28-43% of SmolLM2's steps on the
        bench's chat prompts, 11-13% on summarize), and with all G."""
        return step_rows(self.streams, self.ngram, 0), self.max_rows

    def budget_tokens(self, prompt_length: int) -> int:
        """B in tokens: as given, or the fraction of the prompt (at least what the compressor's parts need)."""
        if isinstance(self.budget, int):
            return self.budget
        least = MIN_BUDGET[self.compressor](self)[1] if self.compressor in MIN_BUDGET else 1
        return max(least, math.ceil(self.budget * prompt_length))

    @classmethod
    def from_config(cls, config) -> "FafoSettings":
        return cls(*(getattr(config, f.name) for f in fields(cls)))


@dataclass(frozen=True)
class StepLayout:
    verify_rows: int
    offsets: torch.Tensor  # positions relative to the anchor, all rows
    verify_local: torch.Tensor  # [verify, verify]
    window_local: torch.Tensor  # [window, 1 + window]
    window_local_padded: torch.Tensor  # [window + 1, 1 + window]: an all-hidden last row (block-sparse indexing)
    combined_local: torch.Tensor  # [rows, rows]
    logit_rows: torch.Tensor  # rows whose logits are read: all verify rows, then the window's predictors
    sees_all: torch.Tensor  # [rows]: verify rows see the whole cache, window rows only C(kv)
    predictors: tuple[int, ...]  # per stream, index into the logits read (0 = the anchor)


@lru_cache(maxsize=256)
def step_layout(candidates: int, ngram: int, streams: int, levels: int,
                device: torch.device = torch.device("cpu")) -> StepLayout:
    """Everything about a step's rows that depends only on its shape: built once per shape and device (the
    tensors live for the process, which FlexAttention's mask functions rely on)."""
    window = window_layout(streams, levels)
    n_verify = 1 + candidates * ngram
    n_window = len(window.offsets)
    verify_local = torch.zeros(n_verify, n_verify, dtype=torch.bool)
    verify_local[:, 0] = True
    for c in range(candidates):
        first = 1 + c * ngram
        block = torch.tril(torch.ones(ngram, ngram, dtype=torch.bool))
        verify_local[first:first + ngram, first:first + ngram] = block
    combined = torch.zeros(n_verify + n_window, n_verify + n_window, dtype=torch.bool)
    combined[:n_verify, :n_verify] = verify_local
    combined[n_verify:, 0] = True
    combined[n_verify:, n_verify:] = window.local_mask[:, 1:]
    offsets = [0] + [1 + j for _ in range(candidates) for j in range(ngram)] + list(window.offsets)
    window_rows = sorted({p for p in window.predictors if p >= 0})
    logit_rows = list(range(n_verify)) + [n_verify + p for p in window_rows]
    predictors = tuple(0 if p < 0 else n_verify + window_rows.index(p) for p in window.predictors)
    padded = torch.cat([window.local_mask, torch.zeros(1, n_window + 1, dtype=torch.bool)])
    return StepLayout(n_verify, torch.tensor(offsets, device=device), verify_local.to(device),
                      window.local_mask.to(device), padded.to(device), combined.to(device),
                      torch.tensor(logit_rows, device=device),
                      (torch.arange(n_verify + n_window) < n_verify).to(device), predictors)


def generate(session: Session, request: Request, emitter: Emitter) -> Iterator[Step]:
    settings = FafoSettings.from_config(request.config)
    steps = compiled_for(session.compiled, settings.compressor)
    compiled = steps is not None
    if session.compiled is not None and not compiled:
        session.compiled.notify_once(f"the {settings.compressor} compressor reads each step's queries per layer, "
                                     "which the compiled step cannot hand out: FAFO with it runs eager")
    settings = replace(settings, streams=window_streams(settings.streams, settings.ngram, settings.guesses, steps))
    emitter.stats.streams = settings.streams
    sampling = request.sampling
    generator = sampling.generator(session.model.device)
    model, cache, k = session.model, session.cache, settings.ngram
    block = settings.attention == "block" or (settings.attention == "auto" and model.device.type == "cuda")
    cache.use_lead(KV_BLOCK if block else 0)  # block-sparse layout: C(kv) in the cache tensor's leading blocks
    block_masks = BlockSparseMasks.for_device(model.device) if block else None
    flex = flex_attention_kernel(model.device) if block else None
    compressor = make_compressor(settings, prompt_length=len(request.prompt_ids), scale=model.scaling,
                                 tail_rows=settings.streams * k, max_commit=k + 1)
    logits, reused = session.prefill(request.prompt_ids, reserve=request.max_tokens + settings.max_rows,
                                     observe=getattr(compressor, "observe_prefill", None))
    compressor.rebuild(cache)
    emitter.prefilled(reused)

    anchor = next_token(logits, sampling, generator)
    text = list(request.prompt_ids) + [anchor]  # everything emitted so far, the anchor last
    # The pool follows the conversation: a request that continues the previous one (a chat turn: it extends
    # that whole prompt) keeps what earlier turns taught it. A re-run or a branch starts a new pool, so the
    # same prompt and seed always meet the same guesses and give the same sample.
    pool_key = ("pool", k, settings.prefix, settings.pool_per_key, settings.seed_pool)
    carried = session.carry.get(pool_key)
    continues = carried is not None and reused >= carried[1]
    pool = carried[0] if continues else NgramPool(k, settings.prefix, settings.pool_per_key)
    if settings.seed_pool:
        pool.add_text(text, new=len(text) - reused if continues else None)
    session.carry.clear()
    session.carry[pool_key] = (pool, len(request.prompt_ids))
    window = LookaheadWindow(settings.streams, k, settings.prefix, request.prompt_ids)
    masks = PrefixMasks(model.device)
    step = emitter.emit([anchor])
    yield step
    while not step.finish_reason:
        start = cache.length
        compressor.prepare(cache)
        emitter.stats.fumble_positions = compressor.visible(cache)
        candidates = pool.lookup(text, settings.guesses)
        layout = step_layout(len(candidates), k, settings.streams, len(window.levels), model.device)
        rows = [anchor] + [t for c in candidates for t in c] + window.tokens()
        if start + len(rows) <= model.max_context:
            cache.reserve(start + len(rows))
            logits = session.run(
                rows, layout.offsets, layout.combined_local,
                lambda: FafoAttention(cache, compressor, model.scaling, masks, layout, block_masks=block_masks,
                                      flex=flex),
                sees_all=layout.sees_all, visible=lambda: compressor.visible_mask(cache),
                logit_rows=layout.logit_rows, allow_compiled=compiled, sizes=settings.step_sizes)
            argmax = argmax_ids(logits)
            tree = DraftTree.chains(candidates)  # node i is row 1 + i: the verify rows' layout
            if sampling.greedy:
                path, emitted = accept_greedy(tree, argmax[:layout.verify_rows])
            else:
                path, emitted = accept_sampling(tree, lambda row: target_probs(logits[row], sampling), generator)
            # the window itself stays greedy: it only proposes guesses
            for before, ngram in window.advance(anchor, [argmax[p] for p in layout.predictors]):
                pool.add(before, ngram)
        else:  # the context's last few positions: no room for guesses, a plain step
            candidates, path = [], []
            emitted = [next_token(session.forward([anchor], causal_attention(None, model.scaling))[-1], sampling,
                                  generator)]
        # Commit the anchor's and the accepted guesses' keys and values, computed in this very pass.
        cache.commit_rows([0] + [1 + node for node in path])
        session.ids.extend([anchor] + emitted[:-1])
        compressor.committed(cache, start, len(emitted))
        text.extend(emitted)
        if settings.seed_pool:
            pool.add_text(text, new=len(emitted))
        emitter.stats.pool_keys, emitter.stats.pool_ngrams = pool.keys, pool.ngrams
        step = emitter.emit(emitted, drafted=len(candidates) * k, accepted=len(path))
        yield step
        anchor = emitted[-1]
