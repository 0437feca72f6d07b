"""Writing a file or a folder so that no reader ever sees half of it: a partial sibling, then one rename."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A sibling path to write `path`'s new content to (by us or by a tool: a compiler, a plotter); when the
    block ends without an exception it is renamed over `path`. Either way no partial file remains. The name
    carries the process id (two processes may build the same file) and keeps the suffix (tools read it)."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial{path.suffix}")
    try:
        yield partial
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)  # gone after a successful rename; removed after a failure


@contextmanager
def publish_dir(target: Path, done: str) -> Iterator[Path]:
    """A staging folder (`.partial-*`, beside `target`) to fill; when the block ends without an exception it is
    renamed to `target`, which so appears complete or not at all. Where another process published `target` first
    (its file `done` is there) that copy is kept. Either way no staging folder remains."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".partial-", dir=target.parent))
    try:
        yield staging
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / done).is_file():  # not a concurrent writer that won the race
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write `data` (text as UTF-8) to `path`. On failure the OSError propagates and only the old file, if
    any, remains."""
    with atomic_path(path) as partial:
        if isinstance(data, str):
            partial.write_text(data, encoding="utf-8")
        else:
            partial.write_bytes(data)
