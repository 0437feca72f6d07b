"""Our C++ kernels (attention_op.cpp), compiled once per machine and torch version with the C++ compiler
that compiled steps need anyway, cached next to the compiled packages, and loaded into torch as `fafo::` ops."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import torch

from ..files import atomic_path

SOURCE = Path(__file__).with_name("attention_op.cpp")
_loaded = False


class BuildError(RuntimeError):
    """The C++ compiler failed or is missing."""


def library_path(folder: Path) -> Path:
    """Named by the source, torch's version and the CPU's vector level (the code is built for this CPU)."""
    machine = f"{torch.__version__} {torch.backends.cpu.get_cpu_capability()}"
    key = hashlib.sha256(SOURCE.read_bytes() + machine.encode()).hexdigest()[:16]
    return folder / f"fafo-ops-{key}.so"


def compile_library(path: Path, source: Path = SOURCE) -> None:
    """Compile `source` into the shared library `path` (atomically)."""
    from torch.utils import cpp_extension

    path.parent.mkdir(parents=True, exist_ok=True)
    compiler = os.environ.get("CXX", "g++")
    try:
        with atomic_path(path) as partial:
            command = [compiler, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-w",
                       f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                       *(f"-I{p}" for p in cpp_extension.include_paths()), str(source), "-o", str(partial),
                       *(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu"]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                lines = (done.stderr or done.stdout).strip().splitlines()
                reason = next((line for line in lines if "error" in line), lines[0] if lines else done.returncode)
                raise BuildError(f"{compiler} failed: {reason}")
    except OSError as error:
        raise BuildError(f"cannot run {compiler}: {error.strerror}") from None


def load(folder: Path) -> None:
    """Make `torch.ops.fafo.attend` available, compiling the library into `folder` on first use."""
    global _loaded
    if _loaded:
        return
    path = library_path(folder)
    if not path.exists():
        compile_library(path)
    torch.ops.load_library(str(path))

    @torch.library.register_fake("fafo::attend")
    def _(q, k, v, sees_all, sees_part, visible, local, scale):  # for tracing: the queries' shape, float32
        return q.new_empty(q.shape, dtype=torch.float32)

    _loaded = True
