"""One engine, many clients: requests wait in arrival order in a bounded queue, and one thread runs them one at a
time, handing each Step to the event loop of the request that asked.

A cancelled request (its client left, or the server is stopping) ends after the step in flight: the flag is read
between steps, and between the chunks of a long prompt's prefill (one chunk can take seconds on a CPU); closing the
engine's stream rolls its cache back to a consistent state for the next request.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections import deque

from ..api import Engine
from ..errors import FafoError, ModelOutputError, is_out_of_memory
from ..runtime.events import Step
from .errors import ApiError, out_of_memory, shutting_down
from .schema import Job

log = logging.getLogger("fafo.serve")


class _Cancelled(Exception):
    """Raised between two prefill chunks of a cancelled request: the prefill stops there."""


class Ticket:
    """A request in the queue: its job, and what the worker hands back (Steps, the last with a finish_reason; or an
    ApiError)."""

    def __init__(self, job: Job, loop: asyncio.AbstractEventLoop):
        self.job = job
        self.id = ("chatcmpl-" if job.kind == "chat" else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.queued_at = time.perf_counter()
        self._loop = loop
        self._events: asyncio.Queue = asyncio.Queue()
        self._cancelled = threading.Event()
        self.ending: ApiError | None = None  # told to the client when the server cancels the request
        self.answered = False  # its last event (a finish_reason or an error) is handed over

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def post(self, item: Step | ApiError) -> None:
        """From the worker's thread: hand an event to the request's loop."""
        if isinstance(item, ApiError) or item.finish_reason:
            self.answered = True
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    async def next(self) -> Step | ApiError:
        return await self._events.get()


class Worker:
    def __init__(self, engine: Engine, max_waiting: int):
        self.engine = engine
        self.max_waiting = max_waiting
        self._waiting: deque[Ticket] = deque()
        self._running: Ticket | None = None
        self._closing = False
        self._lock = threading.Condition()
        self._thread = threading.Thread(target=self._serve, name="fafo-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job, loop: asyncio.AbstractEventLoop) -> Ticket:
        """Queue an encoded job (Prompts.encoded); a full queue is a 503 with Retry-After (OpenAI's status for an
        overloaded engine)."""
        if not job.ids:
            raise ValueError("a job must be encoded (Prompts.encoded) before it queues")
        with self._lock:
            self._check_room()
            ticket = Ticket(job, loop)
            self._waiting.append(ticket)
            self._lock.notify()
        return ticket

    def check_room(self) -> None:
        """The 503 a request would get now (the server stopping, the queue full), before the work of encoding it."""
        with self._lock:
            self._check_room()

    def _check_room(self) -> None:  # holding the lock
        if self._closing or not self._thread.is_alive():  # (a dead engine thread would leave requests queued forever)
            raise shutting_down()
        # A worker that is idle, or only closing the stream of a request it has answered, takes the first waiting
        # request next: that one is not waiting (else a client's next request could find it "busy").
        busy = self._running is not None and not self._running.answered
        if len(self._waiting) >= self.max_waiting + (not busy):
            raise ApiError(503, f"the server is busy: {len(self._waiting)} requests are waiting (--queue "
                                f"{self.max_waiting}); retry later", code="queue_full", headers={"Retry-After": "1"})

    def cancel(self, ticket: Ticket, ending: ApiError | None = None) -> None:
        """Stop a request: a waiting one leaves the queue, a running one ends after its current step. `ending`: what
        the client is told (None: the client is gone)."""
        with self._lock:
            self._cancel(ticket, ending)

    def _cancel(self, ticket: Ticket, ending: ApiError | None) -> None:  # holding the lock
        if ticket.cancelled:
            return
        ticket.ending = ending
        ticket._cancelled.set()
        if ticket in self._waiting:
            self._waiting.remove(ticket)
            if ending is not None:
                ticket.post(ending)
            log.info("%s %s %s cancelled in the queue after %.2fs", ticket.id, ticket.job.kind,
                     ticket.job.config.method, time.perf_counter() - ticket.queued_at)

    def close(self) -> None:
        """Accept nothing more: in one step, every waiting request leaves the queue answered `shutting_down`, the
        running one is cancelled (it ends after its step in flight) and the worker is told to start nothing new.
        Does not wait. Not from a signal handler: the handler may interrupt this thread inside the lock."""
        with self._lock:
            self._closing = True
            for ticket in [*self._waiting, *([self._running] if self._running else [])]:
                self._cancel(ticket, shutting_down())
            self._lock.notify()

    def join(self, timeout: float | None) -> None:
        self._thread.join(timeout)

    @property
    def running(self) -> bool:
        """Whether the engine's thread still runs (close() ends it after its step in flight)."""
        return self._thread.is_alive()

    @property
    def load(self) -> dict:
        with self._lock:
            return {"running": int(self._running is not None), "waiting": len(self._waiting)}

    def _serve(self) -> None:
        while True:
            with self._lock:
                while not self._waiting and not self._closing:
                    self._lock.wait()
                if self._closing:  # close() answered the waiting requests
                    return
                ticket = self._running = self._waiting.popleft()
            try:
                self._run(ticket)
            except Exception as e:  # noqa: BLE001 - outside _run's own handling (its log lines): the engine serves on
                log.error("%s failed after its answer: %s: %s", ticket.id, type(e).__name__, e)
            finally:
                with self._lock:
                    self._running = None

    def _run(self, ticket: Ticket) -> None:
        job, engine = ticket.job, self.engine
        if ticket.cancelled:  # between leaving the queue and starting
            if ticket.ending is not None:
                ticket.post(ticket.ending)
            return
        log.debug("%s %s start after %.2fs in the queue: %s", ticket.id, job.kind,
                  time.perf_counter() - ticket.queued_at, _settings(job))
        last: Step | None = None
        try:
            def prefilled(_) -> None:  # told after each chunk of the prompt's prefill
                if ticket.cancelled:
                    raise _Cancelled

            stream = engine.generate(list(job.ids), job.config, job.stop, prefilled)
            try:
                for last in stream:
                    ticket.post(last)
                    if ticket.cancelled and not last.finish_reason:
                        break
            finally:
                stream.close()
        except _Cancelled:
            pass
        except ApiError as e:
            return self._failed(ticket, e)
        except ModelOutputError as e:  # (the server's setup, not the request)
            return self._failed(ticket, ApiError(500, str(e), code="model_output_invalid"))
        except FafoError as e:
            return self._failed(ticket, ApiError(400, str(e), code="invalid_value"))
        except Exception as e:
            if is_out_of_memory(e):
                kept = engine.session.kept
                dropped = bool(kept)
                if dropped:  # their room for the next request (a GPU's memory, which ran out)
                    kept.clear()
                return self._failed(ticket, out_of_memory(dropped))
            # a bug: the client gets a 500 without the traceback, the log keeps it
            log.error("%s failed: %s: %s", ticket.id, type(e).__name__, e, exc_info=log.isEnabledFor(logging.DEBUG))
            return self._failed(ticket, ApiError(500, f"internal error ({type(e).__name__}); the server's log has "
                                                      "the details", code="internal_error"))
        if ticket.cancelled and ticket.ending is not None and not (last and last.finish_reason):
            ticket.post(ticket.ending)
        finish = last.finish_reason if last is not None and last.finish_reason else "cancelled"
        log.info("%s", request_line(ticket, last, finish))

    def _failed(self, ticket: Ticket, error: ApiError) -> None:
        ticket.post(error)
        log.info("%s %s %s error %d: %s", ticket.id, ticket.job.kind, ticket.job.config.method, error.status,
                 error.message)


def request_line(ticket: Ticket, last: Step | None, finish: str) -> str:
    """The request's log line: id, method, prompt / cached / generated tokens, tokens/s, τ, finish reason."""
    job = ticket.job
    method = job.config.method
    if last is None:
        return f"{ticket.id} {job.kind} {method} {finish} before its first token"
    s = last.stats
    speed = f"{s.tokens_per_s:.1f}" if s.generated_tokens > 1 else "-"  # decoding's: from the second token on
    return (f"{ticket.id} {job.kind} {method} prompt={s.prompt_tokens} cached={s.cached_prompt_tokens} "
            f"generated={s.generated_tokens} {speed} tok/s τ={s.tokens_per_step:.2f} {finish} {s.total_s:.2f}s")


def _settings(job: Job) -> str:
    c = job.config
    return (f"max_tokens={c.max_tokens} temperature={c.temperature:g} top_p={c.top_p:g} seed={c.seed} "
            f"stop={len(job.stop)} stream={job.stream}")
