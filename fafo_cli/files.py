"""Writing a file or a folder so that no reader ever sees half of it: a partial sibling, then one rename.

A partial name carries its writer's process id, and which machine and process-id namespace that id belongs to
(`WRITER`). A writer that is killed (SIGKILL, a power cut) cannot remove its partial, so each write first removes
the partials beside it whose writer is gone: a cut-off conversion's staging folder (gigabytes for a 1.5B model) does
not stay in the cache for good. Only a writer of this machine and namespace can be seen to be gone: another
machine's (a home folder on NFS) or another container's is removed once it is a day old, as one without an id, as is
one that carries this process's own id but that it did not make (in containers fafo is often process 1).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import socket
import stat
import struct
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

if TYPE_CHECKING:
    import torch


# a partial whose writer cannot be told (from before partial names carried a process id, with this process's id but
# not made by it, or another machine's or namespace's): removed once it is this old
UNOWNED_AGE_S = 24 * 3600
_made: set[str] = set()  # the partials this process is writing


def _namespace() -> str:
    """This machine and process-id namespace, as 8 hex digits: whose process ids a partial's writer id names."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:  # (not Linux: the host name alone)
        namespace = ""
    return hashlib.sha256(f"{socket.gethostname()}|{namespace}".encode()).hexdigest()[:8]


NAMESPACE = _namespace()
WRITER = r"(?P<pid>\d+)(?:@(?P<namespace>[0-9a-f]{8}))?"  # a partial name's writer: its id, and where it runs


def _writer() -> str:
    return f"{os.getpid()}@{NAMESPACE}"


def _gone(pid: int) -> bool:
    """Whether no process `pid` runs here (one of another user's counts as running; on Windows, where a signal to
    a process ends it, every writer counts as running)."""
    if os.name == "nt":
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists (not ours to signal), or no such check here
        return False
    return False


def scratch_dir(folder: Path, prefix: str) -> Path:
    """A new folder `prefix-WRITER-...` in `folder` for this process's own work (a build's scratch, unpacked
    packages, a test session's cache), which `remove_abandoned` leaves to it."""
    path = Path(tempfile.mkdtemp(prefix=f"{prefix}-{_writer()}-", dir=folder))
    _made.add(os.path.abspath(path))
    return path


def remove_abandoned(folder: Path, prefix: str) -> None:
    """Remove the folders `prefix-WRITER-...` in `folder` (`scratch_dir`'s) whose writer is gone, judged as a
    partial's (`_sweep`): what a killed process left. Another machine's or container's, sharing the folder, is
    left a day: its process ids mean nothing here."""
    _sweep(folder, re.compile(rf"{re.escape(prefix)}-{WRITER}-.+"))


def _sweep(folder: Path, pattern: re.Pattern) -> None:
    """Remove the entries of `folder` whose names match `pattern` and whose writer (the pattern's group "pid")
    is gone, or, without one, that are older than UNOWNED_AGE_S."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None:
            continue
        try:
            pid, namespace = match.groupdict().get("pid"), match.groupdict().get("namespace")
            if os.path.abspath(entry.path) in _made:
                continue
            # judged by its id where that is a process of this machine and namespace (a name without a namespace:
            # an older fafo's), but never our own id on one we did not make (an earlier process 1's)
            ours = pid and int(pid) != os.getpid() and namespace in (None, NAMESPACE)
            if not (_gone(int(pid)) if ours else time.time() - entry.stat().st_mtime > UNOWNED_AGE_S):
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.unlink(entry.path)
        except (OSError, ValueError):  # removed meanwhile by another writer, or not ours to remove
            continue


def _settle(partial: Path, path: Path) -> None:
    """Give the new file `partial` the permissions of the `path` it replaces (a 0600 config stays private) and
    flush it to disk: renamed before its data reached the disk, a power cut could leave an empty file."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:  # a new file: readable as the umask allows, whatever a tool gave it (safetensors: 0600)
        mode = _opened_up(partial)
    os.chmod(partial, mode)
    _flush(partial)  # (written by a tool, perhaps: flushed by name)


NEW_FILE_MODE = 0o666


def _opened_up(path: Path) -> int:
    """`path`'s mode with the permissions a new file gets under the umask added (an executable stays one)."""
    return stat.S_IMODE(os.stat(path).st_mode) | (NEW_FILE_MODE & ~_umask())


def _umask() -> int:
    """This process's umask, read without setting it where the system says it (setting it races other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _flush(path: Path) -> None:
    """Flush a file or a folder (a rename) to disk by name, best effort: some systems cannot open a folder, and
    Windows flushes only descriptors open for writing."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A sibling path to write `path`'s new content to (by us or by a tool: a compiler, a plotter); when the
    block ends without an exception it is flushed to disk, given the replaced file's permissions and renamed over
    `path`. Either way no partial file remains. The name carries the process id (two processes may build the same
    file) and keeps the suffix (tools read it)."""
    if path.is_symlink():  # a dotfiles link: its file gets the new content, the link stays
        try:
            path = path.resolve()
        except RuntimeError:  # a loop of links (an OSError from Python 3.13 on)
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(path)) from None
    partial = path.with_name(f"{path.name}.{_writer()}.partial{path.suffix}")
    _sweep(path.parent, re.compile(re.escape(path.name) + r"\." + WRITER + r"\.partial" + re.escape(path.suffix)))
    _made.add(os.path.abspath(partial))
    try:
        yield partial
        _settle(partial, path)
        os.replace(partial, path)
        _flush(path.parent)  # the rename itself
    except OSError as e:  # a write's error names no file, a rename's the partial: name the file asked for
        if e.errno is None or e.filename not in (None, str(partial)):
            raise
        raise OSError(e.errno, e.strerror, str(path)) from None
    finally:
        partial.unlink(missing_ok=True)  # gone after a successful rename; removed after a failure
        _made.discard(os.path.abspath(partial))


def _new_dir(parent: Path, prefix: str) -> Path:
    """A new folder `prefix` + a random name in `parent`, with the umask's permissions (tempfile's are 0700: a
    published model would be unreadable to the other users of a shared cache)."""
    while True:
        path = parent / (prefix + secrets.token_hex(4))
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue


PARTIAL_DIR = re.compile(r"\.partial-(?:" + WRITER + r"-)?[^-]+")  # publish_dir's staging, remove_dir's leftovers


def sweep_partial_dirs(folder: Path) -> None:
    """Remove what writers that are gone left in `folder` (publish_dir's staging, remove_dir's leftovers): before
    a check of the disk's free space, which their bytes would otherwise fail for good."""
    _sweep(folder, PARTIAL_DIR)


@contextmanager
def publish_dir(target: Path, done: str) -> Iterator[Path]:
    """A staging folder (`.partial-*`, beside `target`) to fill; when the block ends without an exception it is
    renamed to `target`, which so appears complete or not at all. Where another process published `target` first
    (its file `done` is there) that copy is kept; a `target` without it was damaged since (a published one is
    whole), and is replaced. Either way no staging folder remains."""
    target.parent.mkdir(parents=True, exist_ok=True)
    sweep_partial_dirs(target.parent)
    staging = _new_dir(target.parent, f".partial-{_writer()}-")
    _made.add(os.path.abspath(staging))
    try:
        yield staging
        for path in staging.rglob("*"):  # the umask's permissions: tools write some files 0600 (safetensors)
            if path.is_file() and not path.is_symlink():
                os.chmod(path, _opened_up(path))
                _flush(path)  # on disk before the rename publishes it (a power cut leaves no empty `done`)
        for folder in [*(path for path in staging.rglob("*") if path.is_dir()), staging]:
            _flush(folder)
        try:
            os.rename(staging, target)
            _flush(target.parent)
        except OSError:
            if not (target / done).is_file():  # else a concurrent writer won the race: its copy is kept
                _replace_damaged(staging, target, done)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        _made.discard(os.path.abspath(staging))


def _replace_damaged(staging: Path, target: Path, done: str) -> None:
    """`target` lacks `done`: damaged since it was published. Moved aside for `staging`; where what was moved turns
    out whole (another process repairing it published first), that is put back instead."""
    aside = target.with_name(f".partial-{_writer()}-{secrets.token_hex(4)}")
    _made.add(os.path.abspath(aside))
    try:
        try:
            os.rename(target, aside)
        except FileNotFoundError:
            pass  # (removed meanwhile)
        else:
            if (aside / done).is_file():
                with contextlib.suppress(OSError):  # (a third one's copy there now: as good)
                    os.rename(aside, target)
                return
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / done).is_file():
                raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)
        _made.discard(os.path.abspath(aside))


def remove_dir(path: Path) -> None:
    """Remove the folder `path` so that no reader sees part of it: renamed to a partial name first (one rename),
    then deleted; if this process is cut off meanwhile, the next publish_dir or remove_dir beside it finishes the
    job. FileNotFoundError where it is gone already (another process removed it)."""
    sweep_partial_dirs(path.parent)
    doomed = path.with_name(f".partial-{_writer()}-{secrets.token_hex(4)}")
    _made.add(os.path.abspath(doomed))
    try:
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    except OSError as e:  # (a rename's error names both paths: the folder asked for is the one to say)
        if isinstance(e, FileNotFoundError):
            raise
        raise OSError(e.errno, e.strerror, str(path)) from None
    finally:
        _made.discard(os.path.abspath(doomed))


# safetensors' names of the dtypes we write
SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "uint8": "U8", "int8": "I8",
                      "int16": "I16", "int32": "I32", "int64": "I64"}
SAFETENSORS_ALIGNMENT = 8  # safetensors pads its header so that the data that follows starts 8-byte aligned


def write_safetensors(path: Path, tensors: Iterable[tuple[str, list[int], "torch.dtype", Callable[[], Iterable]]],
                      metadata: dict[str, str] | None = None) -> None:
    """A safetensors file of `tensors`, atomically (atomic_path): each (name, shape, dtype, a function that makes it
    as blocks of rows: their concatenation), made and written a block at a time, so that a file larger than memory
    can be written; the header is laid out from the shapes first. Wider items first (stable), as safetensors' own
    writer orders them, so each tensor starts aligned to its items."""
    import torch

    from .errors import FafoError

    tensors = sorted(tensors, key=lambda entry: -entry[2].itemsize)
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, shape, dtype, _ in tensors:
        size = dtype.itemsize * math.prod(shape)
        header[name] = {"dtype": SAFETENSORS_DTYPES[str(dtype).removeprefix("torch.")], "shape": shape,
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % SAFETENSORS_ALIGNMENT)
    with atomic_path(path) as partial, open(partial, "wb") as file:
        file.write(struct.pack("<Q", len(text)) + text)
        for name, shape, dtype, make in tensors:
            rows = 0
            for block in make():
                block = block.to(dtype).contiguous()
                if list(block.shape[1:]) != shape[1:]:
                    raise FafoError(f"the tensor {name} came out as {list(block.shape)}, not rows of {shape}")
                file.write(memoryview(block.reshape(-1).view(torch.uint8).numpy()))
                rows += block.shape[0] if block.dim() else 1
            if rows != (shape[0] if shape else 1):
                raise FafoError(f"the tensor {name} came out with {rows} rows, not {shape}")


def whole(name: str, tensor: "torch.Tensor") -> tuple:
    """A tensor in memory as one of write_safetensors' entries."""
    return name, list(tensor.shape), tensor.dtype, lambda: [tensor]


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write `data` (text as UTF-8) to `path`. On failure the OSError propagates and only the old file, if
    any, remains."""
    with atomic_path(path) as partial:
        if isinstance(data, str):
            partial.write_text(data, encoding="utf-8")
        else:
            partial.write_bytes(data)


def user_path(text: str | os.PathLike) -> Path:
    """A path as the user gave it (an argument, a setting, an environment variable): `~` and `~user` expanded as a
    shell does, and left as given where that user or home is unknown (as a shell leaves it)."""
    try:
        return Path(text).expanduser()
    except RuntimeError:  # (pathlib: "Could not determine home directory")
        return Path(text)


def xdg_dir(variable: str, default: str) -> Path:
    """An XDG base directory: $variable, or ~/`default` where it is unset, empty or relative (the XDG spec: such a
    value is ignored)."""
    value = user_path(os.environ.get(variable, ""))
    return value if value.is_absolute() else Path(os.path.expanduser("~")) / default


@contextmanager
def exclusive(path: Path, waiting: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Hold an exclusive lock on the file `path` (created where missing) for the block, across processes;
    `waiting()` is called where another process holds it first. Where the system has no flock (Windows) or the file
    system refuses locks (NFS without its lock service, some FUSE mounts), the block runs without one."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as handle:
        locked = False
        try:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                waiting()
                fcntl.flock(handle, fcntl.LOCK_EX)
            locked = True
        except OSError:  # (ENOLCK, EOPNOTSUPP...): unlocked
            pass
        try:
            yield
        finally:
            if locked:
                fcntl.flock(handle, fcntl.LOCK_UN)
