"""OpenAI's response shapes, built from the engine's Steps: the whole answer, the streamed chunks and the usage,
plus our `fafo` object (method, τ, accepted and drafted tokens, tokens/s) on a response and on the last chunk."""

from __future__ import annotations

import json

from ..runtime.events import Stats
from .schema import Job

# OpenAI has no "context": an answer cut by the model's context is reported as cut by length
FINISH = {"stop": "stop", "length": "length", "context": "length"}


def usage(stats: Stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_prompt_tokens}}


def fafo(stats: Stats, job: Job) -> dict:
    """How the answer was decoded: τ is tokens per forward pass; accepted of drafted are the guessed tokens."""
    return {"method": job.config.method, "tau": round(stats.tokens_per_step, 3), "accepted": stats.accepted_tokens,
            "drafted": stats.drafted_tokens, "steps": stats.steps,
            "draft_passes": stats.draft_passes,  # (TriForce's and QuantSpec's drafting; null: a method without)
            # (a one-token answer has no decode time: no speed, where 0.0 pulled a client's average down)
            "tokens_per_s": round(stats.tokens_per_s, 2) if stats.generated_tokens > 1 else None,
            "ttft_s": round(stats.ttft_s, 4),
            "seed": job.config.seed if job.config.temperature > 0 else None}  # (a greedy answer used none)


def completion(ticket, model: str, text: str, stats: Stats, finish: str) -> dict:
    """The whole answer (not streamed)."""
    job = ticket.job
    if job.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": FINISH[finish]}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": FINISH[finish]}
    return {**_head(ticket, model, streamed=False), "choices": [choice], "usage": usage(stats),
            "fafo": fafo(stats, job)}


def chunk(ticket, model: str, text: str = "", *, first: bool = False) -> dict:
    """A streamed piece of the answer (the chat's first one names the role)."""
    return {**_head(ticket, model, streamed=True), "choices": [_choice(ticket, text, first=first)],
            **_no_usage_yet(ticket)}


def last_chunk(ticket, model: str, stats: Stats, finish: str) -> dict:
    """The chunk that ends the answer: its finish_reason, and our `fafo` object."""
    choice = {**_choice(ticket, ""), "finish_reason": FINISH[finish]}
    if ticket.job.kind == "chat":
        choice["delta"] = {}
    return {**_head(ticket, model, streamed=True), "choices": [choice], **_no_usage_yet(ticket),
            "fafo": fafo(stats, ticket.job)}


def usage_chunk(ticket, model: str, stats: Stats) -> dict:
    """After the last chunk when stream_options.include_usage asks for it: no choices, the usage."""
    return {**_head(ticket, model, streamed=True), "choices": [], "usage": usage(stats)}


# characters JSON leaves raw that some SSE readers (str.splitlines, httpx's iter_lines) take for line ends
_LINE_ENDS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def event(data: dict | str) -> bytes:
    """One server-sent event (one line of data, whichever reader splits it)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False).translate(_LINE_ENDS)
    return f"data: {text}\n\n".encode()


def _head(ticket, model: str, *, streamed: bool) -> dict:
    kind = ("chat.completion.chunk" if streamed else "chat.completion") if ticket.job.kind == "chat" \
        else "text_completion"
    return {"id": ticket.id, "object": kind, "created": ticket.created, "model": model}


def _no_usage_yet(ticket) -> dict:
    """With stream_options.include_usage, every chunk before the usage chunk has `"usage": null`, as OpenAI's."""
    return {"usage": None} if ticket.job.include_usage else {}


def _choice(ticket, text: str, *, first: bool = False) -> dict:
    if ticket.job.kind == "chat":
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
