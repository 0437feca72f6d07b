"""Peak memory of one request: device memory on CUDA, resident memory of the process elsewhere (on Linux the
kernel's own peak since the request began)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import resource
import sys
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MB = 1e6  # every figure fafo shows in MB (peak and draft memory, `fafo list`'s sizes, --conversations-mb)


def _restart_high_water_mark() -> bool:
    """Linux: the kernel's peak resident size of this process counted afresh from now, so that it holds what
    sampling between steps misses (a prefill chunk's temporaries, freed before the chunk returns). False where it
    cannot be (not Linux, or /proc refuses)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _high_water_mark_bytes() -> int | None:
    """The kernel's peak resident size of this process; None where /proc/self/status does not say it."""
    try:
        with open("/proc/self/status", "rb") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith(b"VmHWM:")), None)
    except (OSError, ValueError, IndexError):
        return None


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:  # not Linux: the process-lifetime peak is the best we have (macOS counts it in bytes)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


class PeakMemory:
    """`devices`: the model's (Model.devices); on CUDA the peaks of all of them, summed (a model spread over GPUs)."""

    def __init__(self, devices: Iterable[torch.device]):
        import torch  # (not at import: `fafo list` reads MB from here without loading torch)

        self.devices = tuple(devices)
        self.cuda = self.devices[0].type == "cuda"
        self.kind = "cuda" if self.cuda else "rss"
        if self.cuda:
            for device in self.devices:
                torch.cuda.reset_peak_memory_stats(device)
        self.high_water = not self.cuda and _restart_high_water_mark()
        self.peak = 0
        self.sample()

    def sample(self) -> float:
        """Record the current usage; return the peak so far in MB."""
        if self.cuda:
            import torch

            now = sum(map(torch.cuda.max_memory_allocated, self.devices))
        else:
            now = (self.high_water and _high_water_mark_bytes()) or _rss_bytes()
        self.peak = max(self.peak, now)
        return self.peak / MB


def release_freed_memory() -> None:
    """Hand the heap that freed tensors left back to the system. glibc keeps freed memory for reuse, so after a
    .gguf conversion (every tensor dequantized, then written) or the first packing of its blocks a process kept
    gigabytes it no longer used for the rest of its life (docs/benchmarks.md). Another libc: nothing to do."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return
    if trim is not None:
        trim(0)


def release_dropped_models() -> None:
    """Free what the caller just dropped (a model, an engine: their reference cycles need a collection) before
    something large loads: its host memory to the system, its GPU memory (CUDA, MPS) from torch's cache."""
    gc.collect()
    release_freed_memory()
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        elif torch.backends.mps.is_available():
            torch.mps.empty_cache()
