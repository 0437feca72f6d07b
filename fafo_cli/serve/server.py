"""Running the server: the address bound before the model loads (a taken port fails at once) and answering 503
while it loads, uvicorn serving the app, the request log on stderr, and a clean stop on SIGINT/SIGTERM.

On a signal the server stops accepting connections, cancels the queued requests and the running one (each client
is told: 503 "the server is shutting down", or that error as the stream's last event), waits for the answers in
flight to close and for the engine's step in flight to end, and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass, replace

import uvicorn
import uvicorn.logging

from .. import config as config_mod
from ..api import Engine
from ..errors import FafoError
from ..files import user_path
from .app import create_app, create_loading_app
from .worker import Worker

log = logging.getLogger("fafo.serve")

BODY_BASE = 64 * 1024  # the JSON around a prompt, and short prompts on small-context models
BODY_PER_TOKEN = 32  # bytes of request body per token of context: text runs a few bytes a token, JSON escapes more
GRACE_S = 10  # after a signal, the longest wait for answers in flight to close (they end within a step)
LOADING_SAID_S = 1.0  # a load that takes longer says that the port answers 503 meanwhile


@dataclass(frozen=True)
class Options:  # (the address is the socket's: `bind`)
    api_key: str | None = None
    cors: tuple[str, ...] = ()
    queue: int = 32  # requests that may wait while one runs
    conversations: int = 4  # earlier conversations whose caches are kept (Engine.keep_conversations)
    conversations_mb: float = 1024
    max_tokens: int | None = None  # the limit of a request that gives none (None: OpenAI's, schema.parse)


def default_max_tokens(config: config_mod.Config, config_file: str | None, flags: dict) -> int | None:
    """`config`'s max_tokens where `--max-tokens` or the config file (`config_mod.resolve`'s) gave it, else None:
    a request that gives no limit then gets OpenAI's (schema.parse: a chat the context left after its prompt, a
    completion 16 tokens; the 512 that `fafo run` defaults to would cut chat answers short)."""
    if flags.get("max_tokens") is not None:
        return config.max_tokens
    path = user_path(config_file) if config_file is not None else config_mod.user_config_path()
    if not path.exists():
        return None
    unset = replace(config_mod.Config(), max_tokens=None)  # (read again: the file was checked when resolved)
    given = config_mod.load_file(path, unset, together=False).max_tokens  # (what fits together: `resolve` said)
    return config.max_tokens if given is not None else None


def bind(host: str, port: int) -> socket.socket:
    """A listening socket, or a one-line FafoError (port in use, unknown host, not an address of this machine)."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise FafoError(f"--host {host}: not an address or a known host name ({e})") from None
    # a name with both kinds of address (localhost) listens on its IPv4 one, as uvicorn's own bind does: most
    # clients are set up with 127.0.0.1, which a socket on ::1 (often listed first) would refuse
    family, kind, proto, _, address = next((info for info in found if info[0] == socket.AF_INET), found[0])
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
        sock.bind(address)
        sock.listen(128)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise FafoError(f"cannot listen on {host}:{port}: the port is in use (choose another with --port)") \
                from None
        if e.errno == errno.EACCES:
            raise FafoError(f"cannot listen on {host}:{port}: permission denied (ports below 1024 need privileges)") \
                from None
        raise FafoError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def is_loopback(sock: socket.socket) -> bool:
    return ipaddress.ip_address(sock.getsockname()[0]).is_loopback


def url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


@contextlib.contextmanager
def loading(sock: socket.socket, cors: tuple[str, ...] = ()):
    """While the model loads (seconds; minutes where it is converted or its compiled steps are built), every request
    to the bound address is answered at once, as llama.cpp's server does (`create_loading_app`), rather than left on
    a connection nobody answers. The loading runs in the caller's thread, where Ctrl-C interrupts it as in `fafo
    run`; these answers come from a thread of their own."""
    # a client that stops reading its answers holds up the handover no longer than the grace
    server = uvicorn.Server(uvicorn.Config(create_loading_app(cors), log_config=None, log_level=None,
                                           access_log=True, lifespan="off", timeout_graceful_shutdown=1))
    # uvicorn closes the sockets it served on: the model's server takes over `sock` itself, and the connections
    # made between the two wait in its backlog
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock.dup()]}, name="fafo-loading", daemon=True)
    # said where the load takes a while (a conversion, a build), not before a quick one or a refusal's one line
    said = threading.Timer(LOADING_SAID_S, log.info, ("loading the model; until then %s answers 503", url(sock)))
    said.daemon = True
    thread.start()
    said.start()
    try:
        yield
    finally:
        said.cancel()
        server.should_exit = True
        thread.join()


def serve(engine: Engine, sock: socket.socket, options: Options) -> None:
    """Serve on a bound socket until SIGINT or SIGTERM; return when every answer in flight has closed."""
    create(engine, options, loopback=is_loopback(sock)).serve_on(sock)


def create(engine: Engine, options: Options, *, loopback: bool) -> "Server":
    """The server for `engine`; `loopback`: it will listen on a loopback address only."""
    engine.keep_conversations(options.conversations, options.conversations_mb)
    worker = Worker(engine, options.queue)
    app = create_app(engine, worker, api_key=options.api_key, cors=options.cors,
                     max_body=BODY_BASE + BODY_PER_TOKEN * engine.model.max_context, loopback=loopback,
                     max_tokens=options.max_tokens)
    # uvicorn's loggers are set by request_log (the access log's level says whether its lines are written)
    config = uvicorn.Config(app, log_config=None, log_level=None, access_log=True,
                            timeout_graceful_shutdown=GRACE_S, lifespan="off")
    return Server(config, engine, worker, options)


class Server(uvicorn.Server):
    """uvicorn's server, which on a signal (or `stop`) also cancels the engine's work, and exits normally afterwards
    (uvicorn raises the signal again once stopped, which would turn a requested stop into an error exit)."""

    def __init__(self, config: uvicorn.Config, engine: Engine, worker: Worker, options: Options):
        super().__init__(config)
        self.engine, self.worker, self.options = engine, worker, options
        self._loop: asyncio.AbstractEventLoop | None = None  # the serving loop, while signals are captured

    def serve_on(self, sock: socket.socket) -> None:
        log.info("serving %s on %s (method %s, context %d tokens, queue %d); Ctrl-C stops", self.engine.name,
                 url(sock), self.engine.config.method, self.engine.model.max_context, self.options.queue)
        try:
            self.run(sockets=[sock])
        finally:
            self.worker.close()
            self._wait_for_engine()
        log.info("stopped")

    def _wait_for_engine(self) -> None:
        """The engine's thread ends after its step in flight (a prefill chunk of a long prompt at most); a process
        that exits while it runs a torch operation aborts, so wait for it. Ctrl-C meanwhile exits at once."""
        try:
            self.worker.join(0.2)
            if self.worker.running:
                log.info("waiting for the engine's step in flight to end (Ctrl-C exits at once)")
                self.worker.join(None)
        except KeyboardInterrupt:
            os._exit(130)

    def stop(self) -> None:
        """What a signal does, from any thread."""
        self.worker.close()
        self.should_exit = True

    def handle_exit(self, sig, frame) -> None:
        # A signal handler runs between two bytecodes of the main thread, which runs the event loop, maybe inside
        # the worker's lock in submit(): the queue is closed by the loop as its next callback, not from here.
        self._loop.call_soon_threadsafe(self.worker.close)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():  # only the main thread receives signals
            yield
            return
        self._loop = asyncio.get_running_loop()  # entered by uvicorn's serve(), on the loop
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._loop = None


@contextlib.contextmanager
def request_log(verbose: bool):
    """The logs while the server runs, on stderr: ours, a line per request (`--verbose`: also each request's
    settings), and uvicorn's warnings (`--verbose`: its access log too). The loggers are given back as they were: a
    Python caller may serve again, and a handler left on a stderr that has since closed would fail every later line.
    (uvicorn is given no logging config of its own: its dictConfig would close every handler in the process.)"""
    def on_stderr(formatter: logging.Formatter) -> list[logging.Handler]:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(formatter)
        return [handler]

    # logger: (handlers, level, propagate); uvicorn.error's lines go to uvicorn's handler, at its level
    setup = {log: (on_stderr(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S")),
                   logging.DEBUG if verbose else logging.INFO, False),
             logging.getLogger("uvicorn"): (on_stderr(uvicorn.logging.DefaultFormatter("%(levelprefix)s %(message)s")),
                                            logging.INFO if verbose else logging.WARNING, False),
             logging.getLogger("uvicorn.error"): ([], logging.NOTSET, True),
             logging.getLogger("uvicorn.access"): (on_stderr(uvicorn.logging.AccessFormatter(
                 '%(levelprefix)s %(client_addr)s - "%(request_line)s" %(status_code)s')),
                 logging.INFO if verbose else logging.WARNING, False)}
    saved = {logger: (logger.handlers[:], logger.level, logger.propagate) for logger in setup}
    for logger, (handlers, level, propagate) in setup.items():
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate
    try:
        yield
    finally:
        for logger, (handlers, level, propagate) in saved.items():
            logger.handlers[:] = handlers
            logger.setLevel(level)
            logger.propagate = propagate
