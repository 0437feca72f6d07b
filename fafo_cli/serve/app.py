"""The HTTP face: Starlette routes over the worker's queue, in OpenAI's shapes.

Every answer, errors included, is JSON (or server-sent events for a stream); no traceback reaches a client. A
request whose client leaves, while it waits in the queue or while it streams, is cancelled at once.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import socket
import time
from typing import AsyncIterator, Awaitable

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..api import Engine
from ..runtime.events import Step
from . import responses, schema
from ..errors import is_out_of_memory
from .errors import ApiError, out_of_memory, shutting_down
from .worker import Ticket, Worker

log = logging.getLogger("fafo.serve")

OPEN_PATHS = {"/health"}  # answered without the API key: a liveness probe tells nothing about the model's use
# A stream's headers wait this long for its first step, so an error found by then (out of memory in the prefill) is
# still a real status; after that the stream starts, with a comment line every KEEP_ALIVE_S while the request waits
# in the queue or prefills (a proxy drops a connection that stays silent: nginx after 60 s)
STREAM_HOLD_S = 2.0
KEEP_ALIVE_S = 5.0
LOADING_RETRY_S = 5  # a client told "loading" may ask again after this long (OpenAI's clients wait it, twice)


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def create_app(engine: Engine, worker: Worker, *, api_key: str | None = None, cors: tuple[str, ...] = (),
               max_body: int, loopback: bool, max_tokens: int | None = None) -> Starlette:
    """`loopback`: the server listens on a loopback address only (requests must then be addressed to this machine:
    see `_foreign_host`); `max_tokens`: the limit of a request that gives none (None: OpenAI's, schema.parse)."""
    served, started = engine.name, int(time.time())
    prompts = schema.Prompts(engine)

    async def chat(request: Request) -> Response:
        return await _complete(request, "chat")

    async def text(request: Request) -> Response:
        return await _complete(request, "text")

    async def _complete(request: Request, kind: str) -> Response:
        try:
            body = await request.body()
        except ClientDisconnect:  # nothing was submitted: no error, nobody to tell
            log.debug("%s %s: the client left while sending its body", request.method, request.url.path)
            return Response(status_code=499)
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if not media and "origin" in request.headers:  # a web page's post without a type goes out unchecked (a
            raise ApiError(415, "a request from a web page must send its body as Content-Type: application/json",
                           code="unsupported_media_type")  # CORS "simple request"), as its form and text posts do
        if media and media != "application/json" and not media.endswith("+json"):
            raise ApiError(415, f"the request body must be JSON, sent as Content-Type: application/json (got {media})",
                           code="unsupported_media_type")
        job = schema.parse(schema.read_json(body), kind, engine, served, max_tokens)
        worker.check_room()  # a full queue refuses at once, not after the prompt's encoding
        job = await asyncio.to_thread(prompts.encoded, job)  # (a long prompt takes a while: not in the event loop)
        ticket = worker.submit(job, asyncio.get_running_loop())
        first = asyncio.ensure_future(ticket.next())

        def close() -> None:
            first.cancel()
            worker.cancel(ticket)

        try:
            await _unless_gone(request, asyncio.wait({first}, timeout=STREAM_HOLD_S if job.stream else None))
            if first.done() and isinstance(first.result(), ApiError):
                return first.result().response()
            if job.stream:
                return EventStream(_events(ticket, first, served), on_close=close)
            return await _unless_gone(request, _whole(ticket, first.result(), served))
        except ClientGone:
            close()
            return Response(status_code=499)  # nobody reads it (nginx's code for a client that closed the request)
        except asyncio.CancelledError:  # uvicorn stopped waiting at shutdown: a step in flight outlasted its grace
            close()
            return shutting_down().response()
        except Exception:  # (answered as an internal error): the answer must not go on for nobody
            close()
            raise

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [_model(served, started)]})

    async def model(request: Request) -> Response:
        if request.path_params["name"] != served:
            raise ApiError(404, f"the model '{request.path_params['name']}' does not exist: this server serves "
                                f"'{served}'", param="model", code="model_not_found")
        return JSONResponse(_model(served, started))

    # /health is open, as a liveness probe needs it; behind a key it does not name the model (a path on this machine)
    named = {} if api_key else {"model": served}

    async def health(request: Request) -> Response:
        if not worker.running:  # (shutting down, or its thread died): what a probe must see to restart it
            return JSONResponse({"status": "unavailable", **named}, status_code=503)
        return JSONResponse({"status": "ok", **named, **worker.load})

    # each API path without its /v1 too, as llama.cpp's server answers them (a client given the bare address)
    api = [("/chat/completions", chat, "POST"), ("/completions", text, "POST"), ("/models", models, "GET"),
           ("/models/{name:path}", model, "GET")]
    routes = [Route(prefix + path, _answers_errors(handler), methods=[method])
              for prefix in ("/v1", "") for path, handler, method in api]
    routes.append(Route("/health", _answers_errors(health), methods=["GET"]))
    middleware = [Middleware(Guard, api_key=api_key, max_body=max_body, loopback=loopback)]
    if cors:  # outermost: it answers browsers' preflight requests, which carry no API key
        middleware.insert(0, Middleware(Cors, **_cors_settings(cors)))
    handlers = {404: _http_error, 405: _http_error, Exception: _internal_error}
    return Starlette(routes=routes, middleware=middleware, exception_handlers=handlers)


def create_loading_app(cors: tuple[str, ...] = ()):
    """What answers while the model loads: /health 503 {"status": "loading"}, any other request 503 `model_loading`
    (with Retry-After), to the web pages `cors` allows too."""
    error = ApiError(503, "the model is loading; retry shortly", code="model_loading",
                     headers={"Retry-After": str(LOADING_RETRY_S)})

    async def loading(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/health":
            await JSONResponse({"status": "loading"}, status_code=503, headers=error.headers)(scope, receive, send)
        else:
            await error.response()(scope, receive, send)

    return Cors(loading, **_cors_settings(cors)) if cors else loading


def _cors_settings(origins: tuple[str, ...]) -> dict:
    # any request header: the openai JS client adds its own (X-Stainless-*), and a refused one fails the call
    return {"allow_origins": list(origins), "allow_methods": ["GET", "POST"], "allow_headers": ["*"]}


class EventStream(StreamingResponse):
    """Server-sent events; `on_close` runs however the stream ends (finished, or the client gone mid-stream)."""

    def __init__(self, events: AsyncIterator[bytes], on_close):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except asyncio.CancelledError:  # uvicorn stopped waiting at shutdown: the stream's last event told the client
            pass
        finally:
            self.on_close()


async def _events(ticket: Ticket, first: asyncio.Future, model: str) -> AsyncIterator[bytes]:
    """The answer as OpenAI's chunks, then `data: [DONE]`; an error after the stream began is one error event.
    Until the `first` step comes, a comment line now and then (clients skip them)."""
    if ticket.job.kind == "chat":
        yield responses.event(responses.chunk(ticket, model, first=True))
    try:
        while not first.done():
            await asyncio.wait({first}, timeout=KEEP_ALIVE_S)
            if not first.done():
                yield b": waiting\n\n"
        item = first.result()
    except asyncio.CancelledError:  # uvicorn stopped waiting at shutdown
        item = shutting_down()
    while True:
        if isinstance(item, ApiError):
            yield responses.event(item.body())
            return
        if item.text:
            yield responses.event(responses.chunk(ticket, model, item.text))
        if item.finish_reason:
            yield responses.event(responses.last_chunk(ticket, model, item.stats, item.finish_reason))
            if ticket.job.include_usage:
                yield responses.event(responses.usage_chunk(ticket, model, item.stats))
            yield responses.event("[DONE]")
            return
        try:
            item = await ticket.next()
        except asyncio.CancelledError:  # uvicorn stopped waiting at shutdown: a step in flight outlasted its grace
            item = shutting_down()


async def _whole(ticket: Ticket, item: Step | ApiError, model: str) -> Response:
    parts = []
    while True:
        if isinstance(item, ApiError):
            return item.response()
        parts.append(item.text)
        if item.finish_reason:
            return JSONResponse(responses.completion(ticket, model, "".join(parts), item.stats, item.finish_reason))
        item = await ticket.next()


async def _unless_gone(request: Request, work: Awaitable):
    """`work`'s result, or ClientGone as soon as the client disconnects (the body has been read by then)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        watch.cancel()
        return task.result()
    task.cancel()
    raise ClientGone


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _model(served: str, started: int) -> dict:
    return {"id": served, "object": "model", "created": started, "owned_by": "fafo-cli"}


def _answers_errors(endpoint):
    """An endpoint whose failures are OpenAI-shaped JSON: ApiError with its status, anything else a 500."""
    async def answering(request: Request) -> Response:
        try:
            return await endpoint(request)
        except ApiError as e:
            return e.response()
        except Exception as e:
            return await _internal_error(request, e)

    return answering


async def _http_error(request: Request, exc) -> Response:
    what = {404: f"no such endpoint: {request.method} {request.url.path}",
            405: f"{request.method} is not allowed on {request.url.path}"}[exc.status_code]
    return ApiError(exc.status_code, what, headers=dict(exc.headers or {})).response()


async def _internal_error(request: Request, exc: Exception) -> Response:
    if is_out_of_memory(exc):  # (encoding a long prompt, outside the worker's steps)
        return out_of_memory().response()
    log.error("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc,
              exc_info=log.isEnabledFor(logging.DEBUG))
    return ApiError(500, f"internal error ({type(exc).__name__}); the server's log has the details",
                    code="internal_error").response()


class Cors(CORSMiddleware):
    """Starlette's CORS, with its refusal of a preflight request in OpenAI's error shape like every other error."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        return ApiError(400, bytes(response.body).decode(), code="cors_refused").response()


class Guard:
    """The API key (Authorization: Bearer) and the body size bound, before any route reads a byte of the body."""

    def __init__(self, app, *, api_key: str | None, max_body: int, loopback: bool):
        self.app, self.api_key, self.max_body, self.loopback = app, api_key, max_body, loopback

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            return await refusal.response()(scope, receive, send)
        read = 0

        async def bounded() -> dict:  # a body sent without Content-Length (chunked) is counted as it arrives
            nonlocal read
            message = await receive()
            read += len(message.get("body", b""))
            if read > self.max_body:
                raise self._too_large(scope["path"])
            return message

        await self.app(scope, bounded, send)

    def _refusal(self, scope, headers: Headers) -> ApiError | None:
        # with an API key a rebound page gets nowhere (it does not know the key), and a reverse proxy on this
        # machine that passes its clients' Host on (Caddy's default) must get through
        host = _foreign_host(headers) if self.loopback and not self.api_key else None
        if host is not None:
            return ApiError(403, f"this server listens on loopback without an API key and answers requests addressed "
                                 f"to localhost or an IP address, not to '{host}' (a web page's DNS rebinding sends "
                                 "its own name); to be reached by other names (a reverse proxy), set an API key "
                                 "(--api-key) or listen on another address (--host)",
                            code="host_not_allowed")
        if self.api_key and scope["path"] not in OPEN_PATHS:
            scheme, _, key = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not key.strip():
                return ApiError(401, "missing API key: send the header 'Authorization: Bearer YOUR_KEY'",
                                code="invalid_api_key")
            if not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
                return ApiError(401, "incorrect API key", code="invalid_api_key")  # never echoed, never logged
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return self._too_large(scope["path"]) if length.isdigit() else ApiError(400, "invalid Content-Length")
        return None

    def _too_large(self, path: str) -> ApiError:
        # (what a prompt beyond the context gets, so that a client that shortens its prompt then does so here too)
        field = PROMPT_FIELDS.get(path.rstrip("/").removeprefix("/v1"))
        return ApiError(400, f"the request body exceeds {self.max_body:,} bytes, more than a prompt that fits "
                             "this model's context takes", param=field, code="context_length_exceeded")


PROMPT_FIELDS = {"/chat/completions": "messages", "/completions": "prompt"}  # where a path's prompt is
# names no public domain can have, which a web page's DNS rebinding therefore cannot send (ollama's list):
# Docker Desktop's host.docker.internal (Open WebUI in a container), a machine's mDNS name
LOCAL_SUFFIXES = (".localhost", ".local", ".internal")


def _foreign_host(headers: Headers) -> str | None:
    """On a server that listens on loopback, the Host a request names when that is neither localhost, this machine's
    name, a name of a local-only domain (LOCAL_SUFFIXES) nor an IP address: a web page whose domain was rebound to
    127.0.0.1 (DNS rebinding) counts as same-origin in the browser and sends its own name (ollama refuses those
    too). None where the request may go on."""
    host = headers.get("host", "").strip().lower()
    name = host[1:host.find("]")] if host.startswith("[") else host.rsplit(":", 1)[0]
    if not name or name in ("localhost", socket.gethostname().lower()) or name.endswith(LOCAL_SUFFIXES):
        return None
    try:
        ipaddress.ip_address(name)
        return None
    except ValueError:
        return name
