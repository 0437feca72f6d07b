"""The benchmark loop: every method on every prompt, interleaved, as a generator of measured runs.

Per prompt and repetition the rows run in turn (A B C A B C ...), each from an empty cache, so machine drift
hits all of them equally. Two external rows time transformers' own `generate` on the same weights: greedy,
and with its prompt-lookup decoding. Vanilla always runs: it is the speed reference and, for greedy runs, the
exactness reference (every other row's tokens are compared with it; see `exactness`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..errors import FafoError, first_line, is_out_of_memory
from ..runtime.memory import PeakMemory
from ..runtime.model import STEP_ROWS
from ..runtime.sampling import Sampling
from ..runtime.session import MEMORY_EVERY_S
from .suites import Sample

# transformers' own decoding on the same weights; 10 lookup tokens is the value its documentation uses
EXTERNAL = {"hf-generate": {}, "hf-prompt-lookup": {"prompt_lookup_num_tokens": 10}}


@dataclass(frozen=True)
class Row:
    """One row of the results: a method (with its compressor for fafo) or an external reference."""
    name: str
    method: str
    overrides: tuple[tuple[str, object], ...] = ()
    compiled: bool | None = None  # True: the engine's compiled steps; False: eager; None: as the engine loaded

    @property
    def external(self) -> bool:
        return self.method in EXTERNAL

    @property
    def compressor(self) -> str | None:
        return dict(self.overrides).get("compressor")


def plan_rows(methods: list[str], compressors: list[str], external: bool, compiled: bool = False) -> list[Row]:
    """vanilla first (the reference), then each method; fafo once per compressor (the row "fafo" for `auto`).
    `compiled`: each of our rows also runs compiled, right after its eager twin (named "...+compiled")."""
    rows = [Row("vanilla", "vanilla")]
    for method in methods:
        if method == "vanilla":
            continue
        if method == "fafo":
            rows += [Row("fafo" if c == "auto" else f"fafo-{c}", "fafo", (("compressor", c),)) for c in compressors]
        else:
            rows.append(Row(method, method))
    if compiled:
        rows = [twin for row in rows for twin in (Row(row.name, row.method, row.overrides, False),
                                                  Row(f"{row.name}+compiled", row.method, row.overrides, True))]
    if external:
        rows += [Row(name, name) for name in EXTERNAL]
    return rows


@dataclass
class Run:
    row: Row
    sample: Sample
    repeat: int
    token_ids: list[int]
    tokens_per_s: float
    steps: int  # full-model passes (0: not known, for the external rows)
    step_ms: float | None  # None: an external row's passes are not known (transformers' prompt lookup drafts)
    drafted: int
    accepted: int
    peak_memory_mb: float
    draft_memory_mb: float = 0.0
    extra: dict = field(default_factory=dict)
    ttft_s: float = 0.0  # request start to the first token: the prefill, and what a method sets up before decoding


class _Timing:
    """A transformers streamer that timestamps the first and last generated tokens."""

    def __init__(self, memory: PeakMemory):
        self.prompt_seen = False
        self.first = self.last = None
        self.first_tokens = 0  # in the first batch: the prefill's pass, untimed (prompt lookup's may hold several)
        self.memory = memory
        self.sampled = float("-inf")  # when memory was last sampled: as often as our rows' steps sample it

    def put(self, value) -> None:
        if not self.prompt_seen:  # generate() first puts the prompt
            self.prompt_seen = True
            return
        now = time.perf_counter()
        if self.first is None:
            self.first, self.first_tokens = now, value.numel()
        self.last = now
        if now - self.sampled >= MEMORY_EVERY_S:  # (and once at the end, as the answer returns)
            self.memory.sample()
            self.sampled = now

    def end(self) -> None:
        pass


def _run_external(engine, row: Row, ids: list[int], tokens: int, sampling
                  ) -> tuple[list[int], float, float, float]:
    from transformers import GenerationConfig

    model = engine.hf_model
    memory = PeakMemory(engine.model.devices)
    timing = _Timing(memory)
    prompt = torch.tensor([ids], device=engine.model.device)
    options = dict(EXTERNAL[row.method])
    if sampling.greedy:
        options.update(do_sample=False)
    else:
        options.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                       top_k=sampling.top_k or None, min_p=sampling.min_p or None)
        torch.manual_seed(sampling.seed or 0)
    # generate() fills every setting not given from the model's generation_config.json, whose processors (Qwen's
    # files set a repetition penalty) apply even greedily: plain decoding is compared with plain decoding
    kept, model.generation_config = model.generation_config, GenerationConfig(
        bos_token_id=model.generation_config.bos_token_id, pad_token_id=model.generation_config.pad_token_id)
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens,
                                 min_new_tokens=0, streamer=timing, eos_token_id=sorted(engine.stop_ids) or None,
                                 **options)
    finally:
        model.generation_config = kept
    generated = out[0, len(ids):].tolist()
    decode = (timing.last - timing.first) if timing.first else 0.0
    counted = len(generated) - timing.first_tokens  # as our rows count: the tokens after the prefill's
    speed = counted / decode if counted > 0 and decode > 0 else 0.0
    return generated, speed, memory.sample(), (timing.first - start) if timing.first else 0.0


def run_once(engine, row: Row, sample: Sample, repeat: int, tokens: int, settings: dict) -> Run:
    """One measured run from an empty cache."""
    engine.reset()
    if row.external:
        config = engine.request_config(**settings)
        sampling = Sampling.of(config)
        ids = engine.encode(list(sample.messages), config)
        generated, speed, peak, ttft = _run_external(engine, row, ids, tokens, sampling)
        # one token per pass for plain generate(); its prompt lookup's passes are hidden
        step_ms = (1e3 / speed if speed else 0.0) if row.method == "hf-generate" else None
        return Run(row, sample, repeat, generated, speed, 0, step_ms, 0, 0, peak,  # passes: generate() hides them
                   ttft_s=ttft)
    if row.compiled is not None:
        engine.session.use_compiled(engine.compiled if row.compiled else None)
    result = engine.complete(list(sample.messages), max_tokens=tokens, method=row.method,
                             **{**settings, **dict(row.overrides)})
    s = result.stats
    step_ms = s.decode_s / (s.steps - 1) * 1e3 if s.steps > 1 else 0.0  # the first step's token is the prefill's
    # a compiled row's steps that ran eager (no package of their size built or loaded): its figures are partly eager's
    eager = s.eager_steps if row.compiled or s.compiled_steps else 0
    return Run(row, sample, repeat, result.token_ids, s.tokens_per_s, s.steps, step_ms, s.drafted_tokens,
               s.accepted_tokens, s.peak_memory_mb, s.draft_memory_mb or 0.0,
               dict(draft_steps=s.draft_steps, step_rows=s.step_rows, accepted_from=s.accepted_from or {},
                    eager_steps=eager, draft_passes=s.draft_passes), s.ttft_s)


WARMUP_TOKENS = 32


@dataclass(frozen=True)
class Failed:
    """A row that could not run (out of memory, a setting it refuses): it runs no more, the other rows go on."""
    row: Row
    sample: Sample
    message: str


@dataclass(frozen=True)
class Progress:
    done: float  # in timed runs: a warm-up run counts as the share of a timed run's tokens it generates
    total: float
    label: str
    first_row: bool = False  # the first row of a round (logs print one line a round)


def measure(engine, rows: list[Row], samples: list[Sample], *, tokens: int, repeats: int, warmup: int,
            settings: dict) -> Iterator[Run | Progress | Failed]:
    """Warm-up runs (each row, first sample, not recorded), then samples × repeats × rows, interleaved, the rows'
    order turned by one each round.
    Compiled rows always get one short untimed run first: it builds or loads their package. A row that fails is
    reported once (`Failed`) and skipped from then on; vanilla's ends the measuring (nothing to compare with)."""
    warm = min(tokens, WARMUP_TOKENS) / tokens  # so the time left is estimated from what the runs really cost
    total = (warmup * len(rows) * warm if samples else 0) + len(samples) * repeats * len(rows)
    done = 0.0
    failed: set[str] = set()

    def attempt(row: Row, sample: Sample, repeat: int, tokens: int) -> Run | Failed:
        try:
            return run_once(engine, row, sample, repeat, tokens, settings)
        except Exception as e:  # (any: one row's failure must not cost the others' hours of measuring)
            failed.add(row.name)
            return Failed(row, sample, "out of memory" if is_out_of_memory(e) else
                          first_line(e, named=not isinstance(e, FafoError)))

    if samples:  # the whole answer's cache at once: steps captured as CUDA graphs are not captured again mid-run
        engine.session.cache.reserve(min(engine.model.max_context, max(
            len(engine.encode(list(sample.messages))) for sample in samples) + tokens + STEP_ROWS))
    for row in rows if samples and not warmup else []:
        if row.compiled:
            yield Progress(done, total, f"loading the compiled step · {row.name}")
            if isinstance(outcome := attempt(row, samples[0], -1, 2), Failed):
                yield outcome
    for _ in range(warmup if samples else 0):
        for row in rows:
            yield Progress(done, total, f"warm-up · {row.name}", row is rows[0])
            if row.name not in failed and isinstance(outcome := attempt(row, samples[0], -1,
                                                                        min(tokens, WARMUP_TOKENS)), Failed):
                yield outcome
            if "vanilla" in failed:
                return
            done += warm
    for index, sample in enumerate(samples):
        for repeat in range(repeats):
            # the rows take turns at going first: what running first or after another row costs (a CPU that has
            # cooled or boosted, caches another row warmed) falls on each in turn, not always on plain decoding
            turn = (index * repeats + repeat) % len(rows)
            ordered = rows[turn:] + rows[:turn]
            for row in ordered:
                yield Progress(done, total, f"{sample.suite} · {sample.id} · {row.name}", row is ordered[0])
                if row.name not in failed:
                    yield attempt(row, sample, repeat, tokens)
                if "vanilla" in failed:
                    return
                done += 1
    yield Progress(done, total, "done", True)
