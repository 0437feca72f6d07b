"""A Hugging Face hub on loopback for the pull tests: the requests huggingface_hub's `snapshot_download` makes.

- `GET /api/models/{repo}[/revision/{rev}]`: the model's info (`sha`, `siblings` with their sizes, `gated`, `gguf`);
- `GET /api/models/{repo}/tree/{rev}`: its files (`path`, `size`, `oid`), listed once per commit and cached;
- `HEAD|GET /{repo}/resolve/{rev}/{file}`: a file, with the headers the client requires (`ETag`, which names
  the blob in the cache, `X-Repo-Commit`, `Content-Length`) and byte ranges (a resumed download).

Refusals carry the hub's `X-Error-Code` (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo), from which
huggingface_hub picks its error class; a token it does not know is a 401 without one. Every request is recorded in `requests` as (method, path).
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

REPO = r"(?P<repo>[\w.-]+/[\w.-]+)"
ROUTES = [
    ("tree", re.compile(rf"^/api/models/{REPO}/tree/(?P<rev>[^/]+)$")),
    ("info", re.compile(rf"^/api/models/{REPO}(?:/revision/(?P<rev>[^/]+))?$")),
    ("file", re.compile(rf"^/{REPO}/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")),
]


@dataclass
class Repo:
    files: dict[str, bytes]
    gated: int | None = None  # 401 or 403: every file download refused as a gated repo's (the info stays public)
    sha: str = ""
    gguf: dict | None = None  # what the hub read from a GGUF file's header (`architecture`, `total` parameters)

    def __post_init__(self):
        listing = json.dumps({name: hashlib.sha256(data).hexdigest() for name, data in sorted(self.files.items())})
        self.sha = self.sha or hashlib.sha1(listing.encode()).hexdigest()  # a commit id: 40 hex digits


@dataclass
class Cut:
    """The next GET of a file sends its Content-Length and `sent` bytes, then drops the connection; later GETs of
    it answer 503 (its server stays down) until the cut is removed from `FakeHub.cuts`."""
    sent: int
    dropped: bool = False


@dataclass
class FakeHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)
    cuts: dict[str, Cut] = field(default_factory=dict)
    forbidden: set[str] = field(default_factory=set)  # files whose bytes are refused (403), their metadata not
    tokens: set[str] = field(default_factory=set)  # the tokens it knows: any other one sent is refused (401)
    url: str = ""

    def add(self, repo_id: str, files: dict[str, bytes], gated: int | None = None, gguf: dict | None = None) -> Repo:
        self.repos[repo_id] = Repo(files, gated, gguf=gguf)
        return self.repos[repo_id]

    def add_folder(self, repo_id: str, folder: Path, extra: dict[str, bytes] | None = None) -> Repo:
        files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
        return self.add(repo_id, {**files, **(extra or {})})

    def cut(self, file: str, sent: int) -> Cut:
        self.cuts[file] = Cut(sent)
        return self.cuts[file]

    def downloads(self) -> list[str]:
        """The files whose bytes were asked for (GET), in order."""
        return [path for method, path in self.requests if method == "GET" and "/resolve/" in path]

    def file_requests(self) -> list[tuple[str, str]]:
        return [(method, path) for method, path in self.requests if "/resolve/" in path]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the hub: every answer has a Content-Length
    hub: FakeHub

    def log_message(self, *args) -> None:  # quiet: the tests read `requests`
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        self.hub.requests.append((self.command, path))
        token = self.headers.get("Authorization", "").removeprefix("Bearer ")
        if token and token not in self.hub.tokens:  # as the hub, whatever the repo: no error code of its own
            return self._refuse(401, None, body, message="Invalid credentials in Authorization header")
        for kind, pattern in ROUTES:
            match = pattern.match(path)
            if match:
                return getattr(self, f"_{kind}")(body=body, **match.groupdict())
        self._refuse(404, "EntryNotFound", body)

    def _repo(self, repo: str, rev: str | None, body: bool) -> Repo | None:
        found = next((known for name, known in self.hub.repos.items() if name.casefold() == repo.casefold()), None)
        if found is None:  # the hub says 401 to a client without a token: private and missing look alike
            self._refuse(401, "RepoNotFound", body)
        elif rev not in (None, "main", found.sha):
            self._refuse(404, "RevisionNotFound", body)
        else:
            return found
        return None

    def _info(self, repo: str, rev: str | None, body: bool) -> None:
        found = self._repo(repo, rev, body)
        if found is not None:
            canonical = next(name for name in self.hub.repos if name.casefold() == repo.casefold())  # (any case)
            self._json({"id": canonical, "sha": found.sha, "private": False,
                        "gated": "manual" if found.gated else False, "siblings": [{"rfilename": name, "size": len(data)}
                                     for name, data in sorted(found.files.items())],
                        **({"gguf": found.gguf} if found.gguf else {})}, body)

    def _tree(self, repo: str, rev: str, body: bool) -> None:
        found = self._repo(repo, rev, body)
        if found is not None:
            self._json([{"type": "file", "path": name, "size": len(data), "oid": _git_oid(data)}
                        for name, data in sorted(found.files.items())], body)

    def _file(self, repo: str, rev: str, file: str, body: bool) -> None:
        found = self._repo(repo, rev, body)
        if found is None:
            return
        if found.gated:
            return self._refuse(found.gated, "GatedRepo", body, commit=found.sha)
        if file not in found.files:
            return self._refuse(404, "EntryNotFound", body, commit=found.sha)
        data = found.files[file]
        cut = self.hub.cuts.get(file)
        if body and cut is not None and cut.dropped:
            return self._refuse(503, None, body)
        if body and file in self.hub.forbidden:  # as a download link that expired: no error code of the hub's
            return self._refuse(403, None, body, message="Request has expired")
        start = _range_start(self.headers.get("Range"), len(data)) if body else 0
        self.send_response(206 if start else 200)
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.send_header("X-Repo-Commit", found.sha)
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if not body:
            return
        if cut is not None:
            cut.dropped = True
            self.wfile.write(data[start:start + cut.sent])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)  # mid-file: fewer bytes than the Content-Length said
            self.close_connection = True
            return
        self.wfile.write(data[start:])

    def _json(self, value, body: bool) -> None:
        data = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _refuse(self, status: int, code: str | None, body: bool, commit: str | None = None,
                message: str | None = None) -> None:
        data = json.dumps({"error": message or code or "unavailable"}).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        if message:
            self.send_header("X-Error-Message", message)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _range_start(header: str | None, size: int) -> int:
    """The first byte of a `bytes=N-` range (what a resumed download asks for); 0 without one."""
    match = re.fullmatch(r"bytes=(\d+)-", header or "")
    return min(int(match.group(1)), size) if match else 0


def serve(hub: FakeHub) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """Start `hub` on a free loopback port (its `url` is set); stop with `server.shutdown()`."""
    handler = type("Handler", (_Handler,), {"hub": hub})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    # a short poll: shutdown() waits up to one interval, at every test's end
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), name="fake-hub", daemon=True)
    thread.start()
    return server, thread
