"""Writing a file so that no reader ever sees half of it: a `.partial` sibling, then one rename over it."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write `data` (text as UTF-8) to `path`. On failure the OSError propagates and only the old file, if
    any, remains: the partial sibling is removed."""
    partial = path.with_name(path.name + ".partial")
    try:
        if isinstance(data, str):
            partial.write_text(data, encoding="utf-8")
        else:
            partial.write_bytes(data)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)  # gone after a successful rename; removed after a failure
