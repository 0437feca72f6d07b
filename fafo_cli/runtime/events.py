"""What the engine yields: one `Step` per forward pass that emitted tokens, with running `Stats`.

The CLI, the live panel, the benchmark and the Python API all read these; nothing in the engine prints.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Stats:
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens whose KV was reused from the previous request
    generated_tokens: int = 0
    steps: int = 0  # forward passes of the full model that emitted tokens (the prefill pass included)
    drafted_tokens: int = 0  # guessed tokens sent for verification (0 for plain decoding)
    accepted_tokens: int = 0  # of those, accepted
    accepted_ngrams: int = 0  # steps that accepted at least one guessed token
    draft_steps: int = 0  # steps that verified at least one guessed token
    accepted_from: dict[str, int] | None = None  # accepted guessed tokens by where they came from (FAFO: text, window)
    step_rows: dict[int, int] = field(default_factory=dict)  # decoding steps by their row count (the planner's choice)
    pool_keys: int | None = None  # n-gram pool size (None: the method has no pool)
    pool_ngrams: int | None = None
    fumble_positions: int | None = None  # cache positions the fumble rows saw (the compressed budget in use)
    streams: int | None = None  # FAFO's lookahead streams W in this request (`streams: auto` resolved)
    draft_passes: int | None = None  # forward passes spent drafting (a self-draft or a draft model; not in steps)
    draft_memory_mb: float | None = None  # device memory drafting holds beyond the model and its cache (second
    # caches, a draft model, FAFO's copy of C(kv) with its compressor's scores), and FAFO's and SuffixDecoding's
    # host-side suffix indexes (estimated: they grow with the text); also inside peak_memory_mb, which alone covers
    # host-side n-gram tables
    prefill_s: float = 0.0  # time to prefill the uncached prompt tokens
    ttft_s: float = 0.0  # request start to the first emitted token
    decode_s: float = 0.0  # first emitted token to the last one
    peak_memory_mb: float = 0.0
    memory_kind: str = "rss"  # "rss" (process resident memory) or "cuda" (allocated device memory)
    syncs: int | None = None  # host-device synchronisations while decoding (CUDA, when counted: runtime/syncs.py)
    compiled_steps: int = 0  # decoding steps that ran compiled (packages, CUDA graphs); the others ran eager

    @property
    def tokens_per_step(self) -> float:
        """τ: mean tokens emitted per forward pass."""
        return self.generated_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: tokens after the first, over the time after the first (as mlx-lm and llama.cpp)."""
        return (self.generated_tokens - 1) / self.decode_s if self.generated_tokens > 1 and self.decode_s else 0.0

    @property
    def total_s(self) -> float:
        """The whole request, start to last token: what a short answer's user waits (tokens_per_s leaves out the
        prefill and the first token)."""
        return self.ttft_s + self.decode_s

    @property
    def prompt_tokens_per_s(self) -> float:
        prefilled = self.prompt_tokens - self.cached_prompt_tokens
        return prefilled / self.prefill_s if self.prefill_s else 0.0

    @property
    def mean_draft(self) -> float:
        """Guessed tokens verified per step that verified any."""
        return self.drafted_tokens / self.draft_steps if self.draft_steps else 0.0

    @property
    def mean_rows(self) -> float:
        steps = sum(self.step_rows.values())
        return sum(rows * n for rows, n in self.step_rows.items()) / steps if steps else 0.0

    @property
    def syncs_per_step(self) -> float | None:
        """Host-device synchronisations per decoding step (the prefill's token excluded); None: not counted."""
        return self.syncs / (self.steps - 1) if self.syncs is not None and self.steps > 1 else None

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted guessed tokens / drafted guessed tokens (None when nothing was drafted)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def eager_steps(self) -> int:
        """Decoding steps that ran eager (the prefill's pass is one of `steps`)."""
        return max(0, self.steps - 1 - self.compiled_steps)

    @property
    def steps_ran(self) -> str:
        """How the decoding steps ran: compiled, eager, or so many of them compiled. In bf16 the two part at
        near-ties (their sums round apart), so two answers are comparable token for token where they ran alike."""
        if self.compiled_steps == 0:
            return "eager"
        return "compiled" if self.eager_steps == 0 else f"compiled {self.compiled_steps}/{self.steps - 1}"

    def to_dict(self) -> dict:
        data = asdict(self)
        # (a one-token answer has no decode time: no speed, as the server's answers say, rather than 0.0)
        speed = self.tokens_per_s if self.generated_tokens > 1 else None
        data.update(steps_ran=self.steps_ran, tokens_per_step=self.tokens_per_step, tokens_per_s=speed,
                    total_s=self.total_s, prompt_tokens_per_s=self.prompt_tokens_per_s,
                    acceptance_rate=self.acceptance_rate, mean_draft=self.mean_draft, mean_rows=self.mean_rows,
                    syncs_per_step=self.syncs_per_step)
        return data


@dataclass(frozen=True)
class Prefill:
    """A request's prefill so far, after each chunk: what a face shows while a long prompt is read."""
    done: int  # prompt tokens in the cache (those reused from the previous request included)
    total: int  # prompt tokens
    elapsed_s: float  # since the request started


@dataclass(frozen=True)
class Step:
    token_ids: tuple[int, ...]  # emitted by this step
    text: str  # the text these tokens add (may lag a token behind for incomplete UTF-8)
    stats: Stats  # running totals, a snapshot
    accepted: int = 0  # guessed tokens accepted in this step
    finish_reason: str | None = None  # "stop", "length", "context" on the last step


@dataclass
class Result:
    text: str
    token_ids: list[int]
    stats: Stats
    finish_reason: str
    settings: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "stats": self.stats.to_dict(), "settings": self.settings}
