"""FAFO decoding: one forward pass per step that verifies guesses on the full cache ("Find Out") and makes
new ones from a compressed view of it ("Fumble Around"). See docs/how-it-works.md.

Step rows: [anchor x_t] + G candidates of k tokens from the pool + the lookahead window. Verify rows decide
what is emitted (the longest candidate prefix that greedy decoding agrees with, plus one bonus token), so
the output is exactly plain greedy decoding's; the window only feeds the pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Iterator

from ...config import MIN_BUDGET
from ...runtime.events import Step
from ...runtime.rows import draft_step, plain_step
from ...runtime.sampling import argmax_ids, next_token, target_probs
from ...runtime.session import CompiledStepRunner, Emitter, Request, Session
from ..tree import DraftTree
from ..verify import accept_greedy, accept_sampling
from .attention import KV_BLOCK, BlockSparseMasks, CompressedView, flex_attention_kernel
from .compressors import make_compressor, reads_queries
from .pool import NgramPool
from .window import LookaheadWindow


def step_rows(streams: int, ngram: int, guesses: int) -> int:
    """The most rows a step carries: the anchor, G candidates of k tokens, the window's W·k − 1 rows."""
    return (guesses + streams) * ngram


def compiled_for(compiled: CompiledStepRunner | None, compressor: str) -> CompiledStepRunner | None:
    """The compiled steps FAFO may use with `compressor`: none where it learns from each step's queries (the
    compiled step has no per-layer hook to hand them out)."""
    return None if reads_queries(compressor) else compiled


def window_streams(streams: int | str, ngram: int, guesses: int, compiled: CompiledStepRunner | None) -> int:
    """W as configured; `auto` picks 1 where the step runs compiled and 2 where it runs eager. An eager CPU step
    is mostly overhead, so a second stream's rows cost little; a compiled step's rows cost arithmetic, and there
    W=1 measured clearly faster than W=2 (docs/benchmarks.md)."""
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
        """A step's rows with no candidate from the pool (the anchor and the window: frequent on free prose, where the
        pool often has nothing to offer), and with all G."""
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
    compressor = make_compressor(settings, prompt_length=len(request.prompt_ids), scale=model.scaling,
                                 tail_rows=settings.streams * k, max_commit=k + 1)
    logits, reused = session.prefill(request.prompt_ids, reserve=request.max_tokens + settings.max_rows,
                                     observe=getattr(compressor, "observe_prefill", None))
    compressor.rebuild(cache)
    emitter.prefilled(reused)
    view = CompressedView(cache, compressor, model.scaling,
                          block_masks=BlockSparseMasks.for_device(model.device) if block else None,
                          flex=flex_attention_kernel(model.device) if block else None)

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
    step = emitter.emit([anchor])
    yield step
    while not step.finish_reason:
        start = cache.length
        compressor.prepare(cache)
        emitter.stats.fumble_positions = compressor.view_size(cache)
        candidates = pool.lookup(text, settings.guesses)
        tree = DraftTree.chains(candidates)  # node i is row 1 + i
        shape = window.layout
        rows = draft_step(anchor, tree.tokens, tree.parents, model.device, sizes=settings.step_sizes,
                          view_tokens=window.tokens(), view_rows=shape.rows, view=view, compiled=compiled)
        if start + len(rows.ids) <= model.max_context:
            cache.reserve(start + len(rows.ids))
            logits = session.run(rows)  # the verify rows' logits, then the window's predictor rows'
            argmax = argmax_ids(logits)
            n_verify = rows.layout.verify_rows
            if sampling.greedy:
                path, emitted = accept_greedy(tree, argmax[:n_verify])
            else:
                path, emitted = accept_sampling(tree, lambda row: target_probs(logits[row], sampling), generator)
            # the window itself stays greedy: it only proposes guesses
            predicted = [argmax[0 if r < 0 else n_verify + r] for r in shape.predictor_logits]
            for before, ngram in window.advance(anchor, predicted):
                pool.add(before, ngram)
        else:  # the context's last few positions: no room for guesses, a plain eager step
            candidates, path, rows = [], [], replace(plain_step(anchor, model.device), compiled=False)
            emitted = [next_token(session.run(rows)[-1], sampling, generator)]
        session.accept(rows, [0] + [1 + node for node in path])  # the anchor and the accepted guesses
        compressor.committed(cache, start, len(emitted))
        text.extend(emitted)
        if settings.seed_pool:
            pool.add_text(text, new=len(emitted))
        emitter.stats.pool_keys, emitter.stats.pool_ngrams = pool.keys, pool.ngrams
        step = emitter.emit(emitted, drafted=len(candidates) * k, accepted=len(path))
        yield step
        anchor = emitted[-1]
