"""Host-device synchronisations of a request's decoding on CUDA, counted (`fafo run --verbose`).

A step should read from the GPU once (the accepted tokens); every other read stalls the host until the GPU's queue
drains. torch's sync debug mode reports each synchronising call it sees (a copy to the host, `.item()`,
`.tolist()`, ...) as a warning: while counting, those warnings are recorded and counted instead of printed. Only
on CUDA; elsewhere nothing is counted (None).

`upload` is how a step hands the GPU what the host made for it (token ids, row indices, masks) without one.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Iterator

import torch


def upload(values, device: torch.device) -> torch.Tensor:
    """A small tensor made on the host (a list, or a CPU tensor) on `device`. To a GPU through pinned memory and
    without waiting: a copy from pageable memory makes the host wait until the GPU's queue has drained (measured on
    an H200: a second sync per plain step, docs/gpu.md), so the host could not queue the next step meanwhile."""
    tensor = values if isinstance(values, torch.Tensor) else torch.tensor(values)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class SyncCounter:
    def __init__(self, device: torch.device):
        self.count: int | None = 0 if device.type == "cuda" else None

    @contextmanager
    def counting(self) -> Iterator[None]:
        """Count the synchronisations inside the block (none is counted off CUDA)."""
        if self.count is None:
            yield
            return
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode(previous)
                self.count += sum("synchroniz" in str(warning.message) for warning in caught)


def counted(steps: Iterator, device: torch.device) -> Iterator:
    """A request's Step events with `stats.syncs` counted over its decoding steps: everything the decoder does
    after its first step (the prefill and the first token are not decoding steps); the consumer's work between
    steps is not counted. Off CUDA the steps pass through unchanged."""
    counter = SyncCounter(device)
    if counter.count is None:
        yield from steps
        return
    step = next(steps, None)
    while step is not None:
        yield step
        with counter.counting():
            step = next(steps, None)
        if step is not None:
            step.stats.syncs = counter.count
