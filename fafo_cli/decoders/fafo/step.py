"""FAFO decoding: one forward pass per step that verifies guesses on the full cache ("Find Out") and makes
new ones from a compressed view of it ("Fumble Around"). See docs/how-it-works.md.

Step rows: [anchor x_t] + a draft tree + the lookahead window (runtime/rows.py draws them). The tree merges
candidates from two sources: the text (the suffix index: continuations of earlier occurrences of its ending,
as long as they keep matching, and the paths of what most often followed it) and the pool's k-grams, which the
window found. The planner (planner.py) decides
each step which guesses to verify and whether the window runs. Verify rows decide what is emitted (the deepest
path greedy decoding agrees with, plus one token of its own), so the output is exactly plain decoding's; the
window only feeds the pool.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields, replace
from typing import Iterator

from ...config import MIN_BUDGET, runs_window, view_compressor
from ...runtime.conversations import shared_prefix
from ...runtime.events import Step
from ...runtime.memory import MB
from ...runtime.rows import draft_step
from ...runtime.sampling import argmax_ids, next_token
from ...runtime.session import CompiledStepRunner, Emitter, Request, Session
from ..suffix_index import SuffixIndex
from ..verify import accept
from .attention import KV_BLOCK, BlockSparseMasks, CompressedView, flex_attention_kernel
from .compressors import make_compressor, reads_queries
from .planner import SOURCES, Acceptance, Chain, Planner, StepCosts
from .pool import NgramPool
from .window import LookaheadWindow


def compiled_for(compiled: CompiledStepRunner | None, compressor: str) -> CompiledStepRunner | None:
    """The compiled steps FAFO may use with `compressor` (a config value): none where it learns from each step's
    queries (the compiled step has no per-layer hook to hand them out)."""
    return None if reads_queries(view_compressor(compressor)) else compiled


SHORT_COPY = 3  # without a window, the guessed tokens of the middle package (G·k at their defaults, with one)


@dataclass(frozen=True)
class FafoSettings:
    streams: int | str  # W, or "auto" until generate() resolves it
    ngram: int  # k
    guesses: int  # G
    prefix: int  # P
    pool_per_key: int
    copies: int | str  # or "auto" until generate() resolves it
    planner: bool
    draft_tokens: int  # D
    compressor: str  # the window's, `auto` resolved (see from_config)
    budget: int | float  # B: tokens, or a fraction of the prompt
    sink: int  # stream
    page_size: int  # quest
    refresh: int  # quest
    window: int  # snapkv, h2o
    kernel: int  # snapkv
    recent: int  # h2o
    attention: str  # auto | split | block
    compressor_named: bool = True  # whether the configuration named the compressor (asking for a window)

    @property
    def window_rows(self) -> int:
        """W·k − 1: the window's rows (its level 0 has the anchor in column 0)."""
        return self.streams * self.ngram - 1 if self.streams else 0

    @property
    def max_rows(self) -> int:
        """The anchor, D guessed tokens and the window."""
        return 1 + self.draft_tokens + self.window_rows

    @property
    def step_sizes(self) -> tuple[int, ...]:
        """The row counts the planner chooses among on compiled steps (a package each): plain decoding's one row,
        the anchor with its likeliest guess (where each row costs arithmetic, as on a CPU, a guess accepted a third
        of the time pays for one row but not for the three of the next size), the window alone (free prose,
        nothing worth verifying), the window with G of its n-grams (the paper's step; without a window, a short copy
        of SHORT_COPY tokens), with D/2 guesses where that is more (a copy: on a CPU the largest package costs several
        plain steps, a middle one far less) and with D (a long copy). Few, because each is a build on first use."""
        plain, window = 1, 1 + self.window_rows
        guesses = min(self.draft_tokens, self.guesses * self.ngram if self.window_rows else SHORT_COPY)
        return tuple(sorted({plain, plain + 1, window, window + guesses,
                             window + max(self.draft_tokens // 2, guesses), self.max_rows}))

    def budget_tokens(self, prompt_length: int) -> int:
        """B in tokens: as given, or the fraction of the prompt (at least what the compressor's parts need)."""
        if isinstance(self.budget, int):
            return self.budget
        least = MIN_BUDGET[self.compressor](self)[1] if self.compressor in MIN_BUDGET else 1
        return max(least, math.ceil(self.budget * prompt_length))

    @classmethod
    def from_config(cls, config) -> "FafoSettings":
        values = {f.name: getattr(config, f.name) for f in fields(cls) if f.name != "compressor_named"}
        return cls(**{**values, "compressor": view_compressor(config.compressor)},
                   compressor_named=config.compressor != "auto")


# `streams: auto`, where a window runs: on eager steps the widest window whose step costs at most WINDOW_SHARE more
# than a plain step, by the measured cost curve (a GPU's nearly free rows give a wide window), and never fewer than
# W=2, which measured best for eager steps over dense weights on CPUs, whose rows cost a few percent each
# (docs/benchmarks.md)
WINDOW_SHARE = 0.25
EAGER_LEAST_STREAMS = 2
MOST_AUTO_STREAMS = 32  # the paper ablates W 10-40 on a GPU


def window_streams(settings: "FafoSettings", compiled: CompiledStepRunner | None,
                   eager: StepCosts | None = None, accelerator: bool = False, packed: bool = False) -> int:
    """W as configured; `auto` is no window on a CPU unless the configuration names a compressor: there the
    window's rows cost more than its n-grams earned in every measurement (docs/benchmarks.md). With one named, 1
    where the step's rows cost arithmetic: compiled, or eager over packed GGUF blocks (`packed`: the same kernel;
    W=1 measured faster than W=2 on both), else `widest_window` by the eager cost curve (`eager`; before one is
    measured, the device's default curve), as on an accelerator."""
    if not runs_window(settings.streams, settings.compressor_named, accelerator):
        return 0
    if settings.streams != "auto":
        return settings.streams
    if steps_cost_arithmetic(settings, compiled, accelerator, packed):
        return 1
    return max(EAGER_LEAST_STREAMS, widest_window(eager or StepCosts.default(accelerator), settings.ngram))


def steps_cost_arithmetic(settings: "FafoSettings", compiled: CompiledStepRunner | None, accelerator: bool,
                          packed: bool) -> bool:
    """Whether a CPU's window steps run compiled (a package serves one stream's window) or eager over packed
    blocks: their rows cost arithmetic, and `streams: auto` runs one stream (`window_streams`)."""
    compiled_window = compiled is not None and compiled.serves(1 + replace(settings, streams=1).window_rows)
    return not accelerator and (packed or compiled_window)


def model_streams(settings: "FafoSettings", compiled: CompiledStepRunner | None, costs: StepCosts | None,
                  model) -> int:
    """`window_streams` for `model`: on its device, and over its packed blocks where it reads them."""
    return window_streams(settings, compiled, costs, accelerator=model.device.type != "cpu",
                          packed=model.packed_matrices > 0)


def widest_window(costs: StepCosts, ngram: int) -> int:
    """The most streams W (at least 1) whose window step (the anchor and W·k − 1 window rows) costs at most
    WINDOW_SHARE more than a one-row step, as every narrower window's does (a noisy point ends the widening)."""
    plain, streams = costs.of(1), 1
    while streams < MOST_AUTO_STREAMS and costs.of((streams + 1) * ngram) <= plain * (1 + WINDOW_SHARE) + 1e-9:
        streams += 1
    return streams


def eager_costs(session: Session) -> StepCosts:
    """One eager pass's cost against its rows: as measured here (`fafo bench --tune`, `fafo doctor --write`), else
    the default curve of this kind of device."""
    measured = session.step_costs.get(session.model.eager_mode)
    return StepCosts(measured) if measured else StepCosts.default(session.model.device.type != "cpu")


def step_costs(session: Session, settings: FafoSettings, compiled: CompiledStepRunner | None) -> StepCosts:
    """What a pass costs against its rows, for the planner: on compiled steps, per package size that serves (timed
    side by side: `CompiledSteps.step_costs`); eager, the tuned curve. Before anything is measured, a default curve.
    FAFO runs compiled where the plain step and the window's step are served; larger sizes that are not (under
    `compile: auto`, a package that measured slower than eager) only bound the step's rows, so a long copy is
    verified over more steps rather than the whole answer running eager."""
    accelerator = session.model.device.type != "cpu"
    sizes = [size for size in settings.step_sizes if compiled is not None and compiled.serves(size)]
    if {1, 1 + settings.window_rows} <= set(sizes):
        ms = compiled.step_costs(sizes)
        return StepCosts(ms, sizes) if ms else StepCosts.default(accelerator, sizes)
    return eager_costs(session)


# `copies: auto`: the two longest earlier occurrences when greedy, where only the one plain decoding picks counts;
# four when sampling, where each further distinct first token is another chance that one is what sampling picks
# (measured: docs/benchmarks.md, "Sampled chat")
AUTO_COPIES = {True: 2, False: 4}  # greedy -> copies

# A copy runs at most COPY_FACTOR times as long as the match that found it (SuffixDecoding's α·p rule, its α;
# Arctic's default): a short match is a weak hint, and a long continuation of one takes a better candidate's rows.
# α = 1 replayed up to 1% faster than α = 2 on 55 prompts, eager and compiled (docs/benchmarks.md, s30)
COPY_FACTOR = 1
# The frequency tree grows from the longest ending of the text of at most TREE_DEPTH tokens that occurred before,
# TREE_NODES nodes at most (SuffixDecoding's defaults), down to paths TREE_LEAST likely by the text's counts: the
# planner then keeps the nodes worth their rows
TREE_DEPTH = 24
TREE_NODES = 8
TREE_LEAST = 0.02


def text_index(copies: int = 1) -> "SuffixIndex | Unindexed":
    """The index of the text FAFO drafts from, with the occurrence counts its frequency tree reads; none where no
    copy is drafted (`copies` 0: Lookahead decoding)."""
    return SuffixIndex(counts=True, count_depth=TREE_DEPTH + TREE_NODES) if copies else Unindexed()


class Unindexed:
    """The text where no copy is drafted from it: not indexed (it cost the prefill and every step host time, and
    counted as the draft's memory, for guesses nobody read)."""

    def extend(self, tokens) -> None:
        pass

    def nbytes(self) -> int:
        return 0


def text_chains(index: SuffixIndex, copies: int, draft_tokens: int) -> list[Chain]:
    """Guesses from the text: the continuations of the `copies` longest earlier occurrences of its ending, each at
    most COPY_FACTOR × its match length and `draft_tokens` long (a long copy, as the text last went on), and the
    paths of its frequency tree, up to TREE_NODES nodes (what most often followed that ending: at long
    contexts a short ending has many earlier occurrences, and the most recent one is seldom the likeliest). No
    copies: no guesses from the text."""
    return TextGuesses(index, copies, draft_tokens).chains()


class TextGuesses:
    """`text_chains` read in two parts: where the text's ending occurred before (a few links of the index), and the
    chains themselves, whose frequency tree is grown only for a planner that may verify them: `firsts` is all the
    planner needs to rule that out."""

    def __init__(self, index: SuffixIndex, copies: int, draft_tokens: int):
        self.index, self.draft_tokens = index, draft_tokens
        self.matches = index.matches(copies) if copies else []
        self.ending = index.match_state(TREE_DEPTH) if copies else None

    def firsts(self) -> list[Chain]:
        """One-token chains as likely as each candidate's first token: each copy's, and the frequency tree's first
        tokens (one chain per distinct frequency: only how often a token followed matters to the planner)."""
        if self.ending is None:
            return []
        chains = [Chain("text", match.length, tuple(self.index.continuation(match.end, 1))) for match in self.matches]
        state, length = self.ending
        given = {odds for odds in self.index.given(state, length, smoothing=1) if odds >= TREE_LEAST}
        return [chain for chain in chains if chain.tokens] + [Chain("text", length, (0,), (odds,)) for odds in given]

    def chains(self) -> list[Chain]:
        if self.ending is None:
            return []
        index, draft_tokens = self.index, self.draft_tokens
        chains = [Chain("text", match.length, tuple(index.continuation(match.end,
                                                                       min(draft_tokens, COPY_FACTOR * match.length))))
                  for match in self.matches]
        state, length = self.ending
        paths: list[tuple] = []  # each node's path from the ending (parents come first)
        for node in index.likeliest(state, length, min(TREE_NODES, draft_tokens), TREE_LEAST, smoothing=1):
            paths.append((paths[node.parent] if node.parent >= 0 else ()) + (node,))
        leaves = sorted(set(range(len(paths))) - {path[-1].parent for path in paths})
        return chains + [Chain("text", length, tuple(n.token for n in paths[leaf]), tuple(n.given for n in paths[leaf]))
                         for leaf in leaves]


@dataclass
class Conversation:
    """What FAFO learns from a conversation: the window's n-grams, the index of the text, how often guesses were
    accepted. A request that continues the previous one (a chat turn: it extends that whole prompt) keeps them;
    a re-run or a branch starts afresh, so the same prompt and seed always meet the same guesses."""

    pool: NgramPool
    index: SuffixIndex | Unindexed
    acceptance: Acceptance
    text: list[int]  # the tokens indexed: the conversation so far
    prompt_length: int  # of the request that left it

    @classmethod
    def follow(cls, session: Session, settings: FafoSettings, prompt_ids: list[int], text: list[int],
               continued: int) -> "Conversation":
        key = ("fafo", settings.ngram, settings.prefix, settings.pool_per_key, settings.copies > 0)
        carried: Conversation | None = session.carry.get(key)
        session.carry.clear()
        if carried is not None and continued >= carried.prompt_length:
            state = carried
            if text[:len(carried.text)] == carried.text:
                state.index.extend(text[len(carried.text):])
            else:  # the new prompt re-encodes the old answer differently: index it afresh
                state.index = text_index(settings.copies)
                state.index.extend(text)
            state.text, state.prompt_length = text, len(prompt_ids)
        else:
            index = text_index(settings.copies)
            index.extend(text)
            state = cls(NgramPool(settings.ngram, settings.prefix, settings.pool_per_key), index, Acceptance(), text,
                        len(prompt_ids))
        session.carry[key] = state
        return state


def generate(session: Session, request: Request, emitter: Emitter) -> Iterator[Step]:
    settings = FafoSettings.from_config(request.config)
    streams = model_streams(settings, compiled_for(session.compiled, settings.compressor), eager_costs(session),
                            session.model)
    # without a window nothing reads C(kv): no compressor keeps a copy of it, or stops the step from running compiled
    settings = replace(settings, streams=streams, compressor=settings.compressor if streams else "none")
    steps = compiled_for(session.compiled, settings.compressor)
    if session.compiled is not None and steps is None:
        session.compiled.notify_once(f"the {settings.compressor} compressor reads each step's queries per layer, "
                                     "which the compiled step cannot hand out: FAFO with it runs eager")
    sampling = request.sampling
    if settings.copies == "auto":
        settings = replace(settings, copies=AUTO_COPIES[sampling.greedy])
    stats = emitter.stats
    stats.streams = settings.streams
    draws = sampling.draws()
    model, cache = session.model, session.cache
    # auto is the split path everywhere: stock attention calls only, until a GPU measurement shows block faster
    block = settings.attention == "block"
    compressor = make_compressor(settings, prompt_length=len(request.prompt_ids), scale=model.scaling,
                                 tail_rows=1 + settings.window_rows, max_commit=settings.draft_tokens + 1)
    # block-sparse layout: C(kv) in the cache tensor's leading blocks, as many as its view takes (its slots, a
    # commit's, the window's rows) where the context may outgrow the budget, before the prefill: asked for after
    # it, the whole cache was copied to make room
    budget = getattr(compressor, "budget", 0)
    view_slots = budget + settings.draft_tokens + 1 + 1 + settings.window_rows
    outgrows = budget < len(request.prompt_ids) + request.max_tokens
    cache.use_lead(max(KV_BLOCK, view_slots if outgrows else 0) if block else 0)
    # (whether this request continues the conversation the cache holds: however much of it the prefill recomputes)
    continued = shared_prefix(session.ids, request.prompt_ids[:-1])
    logits, reused = session.prefill(request.prompt_ids, reserve=request.max_tokens + settings.max_rows,
                                     observe=getattr(compressor, "observe_prefill", None),
                                     observed_rows=getattr(compressor, "observed_rows", 1),
                                     progress=emitter.prefilling)
    anchor = next_token(logits, sampling, draws, len(request.prompt_ids))
    emitter.prefilled(reused)  # after the first token's read: on a GPU the prefill has then run, not just launched
    compressor.rebuild(cache)  # (after it: the prefill's speed is the model's, as every method reports it)
    view = CompressedView(cache, compressor, model.scaling,
                          block_masks=BlockSparseMasks.for_device(model.device) if block else None,
                          flex=flex_attention_kernel(model.device) if block else None)
    text = list(request.prompt_ids) + [anchor]  # everything emitted so far, the anchor last
    conversation = Conversation.follow(session, settings, request.prompt_ids, text, continued)
    pool, index = conversation.pool, conversation.index
    planner = Planner(conversation.acceptance, step_costs(session, settings, steps), settings.window_rows,
                      settings.draft_tokens, fixed=not settings.planner, burst=settings.ngram)
    compiled = planner.costs.sizes is not None
    window = (LookaheadWindow(settings.streams, settings.ngram, settings.prefix, request.prompt_ids)
              if settings.streams else None)
    stats.accepted_from = dict.fromkeys(SOURCES, 0)
    stats.draft_memory_mb = (compressor.nbytes() + index.nbytes()) / MB
    step = emitter.emit([anchor])
    yield step
    while not step.finish_reason:
        began = time.perf_counter()  # the step's whole cost, host work included, teaches the planner its costs
        start = cache.length
        guesses = TextGuesses(index, settings.copies, settings.draft_tokens)
        # without a window no pool n-grams are offered (an earlier turn's, where its window ran)
        found = ([Chain("window", key, ngram) for ngram, key in pool.lookup(text, settings.guesses)]
                 if window is not None else [])
        plan = planner.plan(lambda: guesses.chains() + found, room=model.max_context - start,
                            firsts=guesses.firsts() + found, depth=emitter.left - 1)
        tree, shape = plan.tree, window.layout if plan.window else None
        view_tokens = window.tokens() if shape else None
        # (a step without window rows reads no C(kv): its selection waits for the next one that does; one stream's
        # first step after a prefill has none, its anchor alone predicting the next level)
        reads_view = bool(view_tokens)
        if reads_view:
            compressor.prepare(cache)
        # the rows that run: a window warming up (its first k - 1 steps of a request) has fewer than the plan's
        ran = 1 + len(tree) + len(view_tokens or ())
        rows = draft_step(anchor, tree.tokens, tree.parents, model.device, size=planner.costs.size(ran),
                          view_tokens=view_tokens if reads_view else None,
                          view_rows=shape.rows if reads_view else None, view=view if reads_view else None,
                          compiled=compiled)
        session.reserve(start + len(rows.ids))
        logits = session.run(rows)  # the verify rows' logits, then the window's predictor rows'
        # every row's argmax: greedy acceptance and the window's predictions read it (a sampled step without the
        # window reads only the rows it samples)
        argmax = argmax_ids(logits) if sampling.greedy or shape else None
        n_verify = rows.layout.verify_rows
        path, emitted = accept(tree, logits, sampling, draws, len(text), None if argmax is None else argmax[:n_verify])
        if shape:  # the window itself stays greedy: it only proposes guesses
            if reads_view:
                stats.fumble_positions = compressor.view_size(cache)
            predicted = [argmax[0 if r < 0 else n_verify + r] for r in shape.predictor_logits]
            for before, ngram in window.advance(anchor, predicted):
                pool.add(before, ngram)
        session.accept(rows, [0] + [1 + node for node in path])  # the anchor and the accepted guesses
        compressor.committed(cache, start, len(emitted))
        sources = planner.observe(plan, path)
        stats.pool_keys, stats.pool_ngrams = pool.keys, pool.ngrams
        # the copy of C(kv), created and grown as needed, and the text's index (as SuffixDecoding counts its own)
        stats.draft_memory_mb = (compressor.nbytes() + index.nbytes()) / MB
        emitting = time.perf_counter()
        step = emitter.emit(emitted, drafted=len(tree), accepted=len(path), rows=ran, sources=sources)
        emitted_at = time.perf_counter()
        text.extend(step.token_ids)  # tokens past a stop or limit are no part of the text (the next turn's prompt)
        index.extend(step.token_ids)
        # (what emitting costs, plain decoding pays too)
        planner.costs.observe(ran, reads_view, (emitting - began + time.perf_counter() - emitted_at) * 1e3)
        yield step
        anchor = emitted[-1]
