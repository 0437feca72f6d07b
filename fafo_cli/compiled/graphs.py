"""CUDA graphs of decoding steps (`cuda_graphs`, on a CUDA GPU by default): one captured graph per step size,
replayed every step.

A replayed graph launches a step's hundreds of kernels at once instead of one by one from Python, which is most of
a small model's GPU step. A graph replays fixed kernels on fixed memory, so the step it captures reads nothing from
the host: its rows are padded to the step size (as compiled steps pad theirs: padding rows see only themselves),
attention reads each layer's whole cache capacity under a mask built on the device from the committed length (a
device tensor), and new keys and values are written at slots computed from it. Inputs are copied into the graph's
own buffers before each replay; the logits are copied out of its output. A graph is captured per (step size, cache
storage): a cache that grows or moves is captured again. Capture failing (an op CUDA graphs do not allow) is one
notice, and every step runs eager from then on; running out of memory drops the graphs, and steps of that size run
eager until the cache changes.

Like compiled steps, this plugs into the Session through runtime.session.CompiledStepRunner. `capture=False` runs
the same static step without a graph: how CPU tests check its masks and slots against eager decoding.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..runtime.cache import KVCache
from ..runtime.model import Model
from ..runtime.rows import StepRows
from ..errors import first_line, is_out_of_memory
from .steps import OnceNotices, bucket

WARMUP = 2  # runs on a side stream before capture (cuBLAS workspaces, lazy initialisation)


class _StaticCache:
    """The part of KVCache that Model.forward uses: writes at `slots` (a device tensor), reads the whole capacity."""

    def __init__(self, cache: KVCache, slots: torch.Tensor):
        self.cache, self.slots = cache, slots

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.cache.keys[layer], self.cache.values[layer]
        keys.index_copy_(0, self.slots, k.to(keys.dtype))
        values.index_copy_(0, self.slots, v.to(values.dtype))
        return keys, values


class _Static:
    """One step size's buffers and the static step over them (captured as a graph on CUDA)."""

    def __init__(self, model: Model, cache: KVCache, size: int, capture: bool):
        device, capacity = model.device, cache.capacity
        self.model, self.cache, self.size = model, cache, size
        self.ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.eye = torch.eye(size, dtype=torch.bool, device=device)
        self.local = self.eye.clone()
        self.sees_cache = torch.zeros(size, dtype=torch.bool, device=device)
        self.sees_view = torch.zeros(size, dtype=torch.bool, device=device)
        self.view_mask = torch.ones(capacity, len(model.layers), dtype=torch.bool, device=device)
        self.length = torch.zeros((), dtype=torch.long, device=device)
        self._columns = torch.arange(capacity, device=device)
        self._rows = torch.arange(size, device=device)
        self.logits: torch.Tensor | None = None
        self.replay: Callable[[], None] = self._run
        self.captured = not capture  # captured on first replay, once the inputs hold a real step

    def run(self) -> None:
        """The step on the current inputs: captured first if not yet (its warm-up runs write after the committed
        positions only, since the inputs already hold this step), then replayed."""
        if not self.captured:
            self.replay, self.captured = self._capture(), True
        self.replay()

    def _run(self) -> None:
        self.logits = self.step()

    def step(self) -> torch.Tensor:
        """The step: row r sees column c where c < length and (r sees the cache, or the view and the view marks c
        in this layer), or where c is row j = c - length of this step and `local[r, j]`."""
        model, length = self.model, self.length
        relative = self._columns - length
        in_step = (relative >= 0) & (relative < self.size)
        local = self.local[:, relative.clamp(0, self.size - 1)] & in_step[None, :]
        before = (self._columns < length)[None, :]

        def attend(layer: int, q, k, v):
            seen = self.sees_cache[:, None] | (self.sees_view[:, None] & self.view_mask[:, layer][None, :])
            mask = (before & seen) | local
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=model.scaling, enable_gqa=True)

        cache = _StaticCache(self.cache, length + self._rows)
        return model.forward(self.ids, self.positions, cache, attend, as_float=False)

    def _capture(self) -> Callable[[], None]:
        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(side):  # writes land after the committed positions: overwritten by the real step
            for _ in range(WARMUP):
                self._run()
        torch.cuda.current_stream(self.model.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.logits = self.step()
        return graph.replay


class GraphSteps(OnceNotices):
    """Decoding steps as CUDA graphs, per step size (compiled.steps' row buckets); None where a step cannot run
    as one (more rows than the largest bucket, a cache spread over devices, a capture that failed)."""

    def __init__(self, model: Model, notify: Callable[[str], None], *, capture: bool = True):
        self.model, self.notify, self.capture = model, notify, capture
        self._static: dict[int, _Static] = {}
        self._storage: tuple | None = None  # the cache storage the graphs were captured on
        self.failed = False
        self._refused: set[int] = set()  # sizes out of memory on the current cache storage: eager until it changes
        self.calls_by_size: dict[int, int] = {}
        self._said: set[str] = set()

    def serves(self, rows: int) -> bool:
        return not self.failed and bucket(rows) is not None

    def step_costs(self, sizes: list[int], refresh: bool = False) -> dict[int, float] | None:
        return None  # not measured: the planner starts from an accelerator's default curve

    def forget_cache(self) -> None:
        self._static.clear()  # (each graph holds the storage it was captured on)

    def __call__(self, step: StepRows, ids: torch.Tensor, positions: torch.Tensor,
                 cache: KVCache) -> torch.Tensor | None:
        layout = step.layout
        rows, length = ids.shape[0], cache.length
        size = bucket(max(rows, step.size))
        if size is not None and length + size > cache.max_slots:  # near the context's end: the rows alone
            size = bucket(rows)
        if self.failed or size is None or cache.spread or length + size > cache.max_slots:
            return None
        if length + size > cache.capacity:  # the cache grows: the graphs' memory goes first, not after the copy
            self._static.clear()
        cache.reserve(length + size)
        storage = (cache.keys.data_ptr(), cache.values.data_ptr(), cache.capacity)
        if storage != self._storage:  # grown or moved: the graphs' memory is gone
            self._static.clear()
            self._storage = storage
            self._refused.clear()
        if size in self._refused:
            return None
        static = self._static.get(size)
        if static is None:
            try:
                static = self._static[size] = _Static(self.model, cache, size, self.capture)
            except Exception as error:  # noqa: BLE001 - its buffers: out of memory, as a capture may be
                return self._refuse(size, error)
        static.ids[:rows] = ids
        static.ids[rows:] = 0
        static.positions[:rows] = positions
        static.positions[rows:] = positions[0]  # padding rows: token 0 at the anchor's position
        static.local.copy_(static.eye)
        static.local[:rows, :rows] = layout.local
        sees_cache = layout.sees_cache
        static.sees_cache[:rows] = True if sees_cache is None else sees_cache
        static.sees_cache[rows:] = False
        static.sees_view[:rows] = False if sees_cache is None else ~sees_cache
        static.sees_view[rows:] = False
        view_mask = step.view.view_mask() if step.view is not None else None
        # positions past the length are masked anyway: only the live ones are set (no view: all of them)
        static.view_mask[:length] = True if view_mask is None else view_mask
        static.length.fill_(length)
        try:
            static.run()
        except Exception as error:  # noqa: BLE001 - whatever capture refused
            return self._refuse(size, error)
        self.calls_by_size[size] = self.calls_by_size.get(size, 0) + 1
        return static.logits[:rows].clone()  # the next replay overwrites the graph's output

    def _refuse(self, size: int, error: Exception) -> None:
        """After a graph failed: out of memory, this size runs eager until the cache changes (the graphs' memory
        given back); anything else, every step runs eager from now on."""
        self._static.clear()
        if is_out_of_memory(error):
            self._refused.add(size)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self.notify_once("out of GPU memory for a step's CUDA graph: such steps run eager")
            return None
        self.failed = True
        self.notify(f"CUDA graph capture failed, decoding eager: {first_line(error, named=True)}")
        return None
