"""The compiled step: the model's forward pass compiled ahead of time by inductor (AOTInductor) into one
package on disk, which later runs load in about a second.

Why ahead of time: eager PyTorch spends most of a small model's step outside arithmetic (per-op dispatch,
generic matmul kernels that read bf16 weights at half the memory bandwidth). Inductor fuses the
elementwise work and generates GEMM kernels specialised to the frozen weights; `torch.compile` does the
same, but traces and re-generates them in every process (its disk cache skips packed weights), which costs
minutes per start on a CPU. A package is built once per model, dtype, device and row count.

Shapes: the cache length and capacity are dynamic dimensions (one graph for every step); the row count is
static (exact up to 16 rows, then in buckets): a decoder pads every step up to the size of its largest one,
because kernels generated for a fixed row count run twice as fast as dynamic ones at one row (measured: 9.4
vs 18 ms, SmolLM2 bf16). A package is built on first need per size, so a decoder costs one build.

Each layer runs one masked attention call: a row sees all cached positions where `sees_all` is true, those its
layer marks in `visible` where `sees_part` is (FAFO's fumble rows and C(kv)), none where neither is (padding
rows), plus the step's own rows through `local`.
On a CPU that call is our kernel (attention_op.cpp, via native.py), and bf16 GEMMs may use ours
(bf16_gemm.py): torch's own spend most of a decoding step's attention time outside arithmetic. A model from a
.gguf file multiplies with its quantized blocks instead (packed.py), rebuilt exactly into its bf16 weights.
New keys and values are written in place after the `visible.shape[0]` committed positions, exactly as the
eager path writes them. A bfloat16 model's CPU cache is stored in bfloat16 while compiled steps serve
(`stored_dtype`), with the queries in bf16 too (exact: a bf16 model's are): each step streams half the bytes.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ..files import atomic_path, write_atomic
from . import bf16_gemm, native, packed
from .cache import KVCache
from .model import Model

GRAPH_VERSION = 8  # bump when the traced computation or our ops' signatures change: old packages are rebuilt
MIN_LENGTH = 2  # export specialises sizes 0 and 1; a step after a one-token prompt runs eager
# A decoder pads every step to the size of its largest step, so it needs one package (FAFO's default 6 rows
# compiled, 9 with W=2; prompt lookup's 9), or to the smallest of a few sizes it names where that package measured
# cheaper (FAFO: its steps without candidates, 3 rows by default; CompiledSteps.size_for). Padding rows see no
# cached position, but they cost matrix arithmetic, which a many-row step on a CPU is bound by: an exact 9-row
# FAFO step took 23.2 ms where the 12-row bucket took 26.6 (1,300 cached tokens; 20.6 vs 24.4 after 300; SmolLM2
# bf16, side by side). So small steps get packages of their exact size; larger ones are bucketed to bound the
# number of builds. Not every exact size wins (a 10-row package ran 25.5 ms where the 12-row one ran 22.5:
# inductor's GEMM choice).
ROW_BUCKETS = (*range(1, 17), 20, 24, 28, 32, 48, 64, 96, 128, 192, 256)  # larger steps run eager


def bucket(rows: int) -> int | None:
    return next((b for b in ROW_BUCKETS if b >= rows), None)


def load_package(path: Path) -> Callable:
    """A package as a function of the step's inputs. Calling the loaded package directly re-reads its input
    and output specs (JSON) and walks the argument tree on every call: 0.2-0.4 ms of a 9-11 ms plain step here. The flat
    call below passes the same tensors in the same order (ids ... visible, then the layers' keys and values)."""
    package = torch._inductor.aoti_load_package(str(path))
    loader = getattr(package, "loader", None)
    if not hasattr(loader, "boxed_run"):  # another torch: its own call path
        return package

    def run(ids, positions, local, sees_all, sees_part, visible, keys, values):
        return loader.boxed_run([ids, positions, local, sees_all, sees_part, visible, *keys, *values])[0]

    return run


def uses_kernel(model: Model) -> bool:
    """Whether the graph's attention is our CPU kernel (it needs head_dim in whole 16-float vectors)."""
    return model.device.type == "cpu" and model.head_dim % 16 == 0


def stored_dtype(model: Model) -> torch.dtype:
    """The cache's dtype under compiled steps: our kernel reads a bf16 model's keys and values as they are,
    where eager CPU attention wants fp32 copies (twice the bytes to stream per step)."""
    return model.dtype if uses_kernel(model) and model.dtype == torch.bfloat16 else model.attention_dtype


class CompileError(RuntimeError):
    """Compilation is impossible here (no compiler, an unsupported op, ...): the caller runs eager."""


class _LayerCache:
    """The part of KVCache that Model.forward uses, over per-layer tensors inside the traced graph."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], start, rows: int):
        self.keys_list, self.values_list = keys, values
        self.end = start + rows
        self.slots = torch.arange(start, start + rows, device=keys[0].device)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys_list[layer], self.values_list[layer]
        keys.index_copy_(0, self.slots, k.to(keys.dtype))
        values.index_copy_(0, self.slots, v.to(values.dtype))
        return keys[:self.end], values[:self.end]


# Rotary variants whose factors depend on the position alone (the dynamic ones rescale with the sequence length).
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def rope_table(model: Model) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_context, 1, dim] of every position, by the model's own module (what eager steps compute for
    their rows, bit for bit: tested)."""
    return model.rotation(torch.arange(model.max_context, device=model.device))


class _Step(torch.nn.Module):
    """What gets traced: Model.forward with one masked attention call per layer."""

    def __init__(self, model: Model):
        super().__init__()
        self.model = model
        self.hf = model.hf  # registered, so the weights are the graph's (frozen) parameters
        # Every position's rotary factors, computed once by the model's own module and frozen into the package: a
        # step gathers its rows' where the graph would compute cos and sin again in each layer's fused kernel
        # (inductor inlines them there; 9 us of a 6-row step per layer). 2 MB for SmolLM2's 8,192 positions.
        self.rope_table = getattr(model.rotary, "rope_type", None) in STATIC_ROPE
        if self.rope_table:
            cos, sin = rope_table(model)
            self.register_buffer("rope_cos", cos)
            self.register_buffer("rope_sin", sin)

    def forward(self, ids, positions, local, sees_all, sees_part, visible, keys, values):
        scaling = self.model.scaling

        def attend(layer: int, q, k, v):
            if uses_kernel(self.model):  # ours: [rows, heads, dim], [slots, kv_heads, dim]; q in the cache's dtype
                q, k, v = (x[0].transpose(0, 1) for x in (q.to(k.dtype), k, v))  # exact: a bf16 model's q is bf16
                return torch.ops.fafo.attend(q, k, v, sees_all, sees_part, visible[:, layer], local,
                                             scaling).transpose(0, 1)[None]
            prefix = sees_all[:, None] | (sees_part[:, None] & visible[:, layer][None, :])
            mask = torch.cat([prefix, local], dim=1)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)

        def rotation(positions):
            return self.rope_cos[positions], self.rope_sin[positions]

        cache = _LayerCache(keys, values, visible.shape[0], ids.shape[0])
        # logits in the model's dtype: converting them in the graph cost 0.25 ms of a 6-row step, on the host 0.05
        return self.model.forward(ids, positions, cache, attend, rotation=rotation if self.rope_table else None,
                                  as_float=False)


def _example(model: Model, rows: int, length: int = 64, capacity: int = 128):
    device, n_layers = model.device, len(model.layers)
    cache = model.new_cache(capacity, capacity)
    cache.store_as(stored_dtype(model))
    return (torch.zeros(rows, dtype=torch.long, device=device), torch.arange(length, length + rows, device=device),
            torch.ones(rows, rows, dtype=torch.bool, device=device).tril(),
            torch.ones(rows, dtype=torch.bool, device=device), torch.zeros(rows, dtype=torch.bool, device=device),
            torch.ones(length, n_layers, dtype=torch.bool, device=device),
            list(cache.keys.unbind(0)), list(cache.values.unbind(0)))


def build(model: Model, rows: int, path: Path, packed_modules: dict | None = None) -> None:
    """Trace, compile and package the `rows`-row step at `path` (atomically). Minutes on a CPU.
    `packed_modules` (packed.pack_model) replace the model's projections in the traced graph."""
    from torch.export import Dim

    length = Dim("length", min=MIN_LENGTH, max=model.max_context)
    capacity = Dim.DYNAMIC  # its range follows from the slicing (at least length + rows)
    layer_dims = [{0: capacity}] * len(model.layers)
    shapes = (None, None, None, None, None, {0: length}, layer_dims, layer_dims)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        load_kernels(model, path.parent.parent)
        with (torch.inference_mode(), warnings.catch_warnings(), atomic_path(path) as partial,
              packed.swapped_in(model, packed_modules or {})):
            warnings.simplefilter("ignore")  # torch's own deprecation notices, not the user's business
            exported = torch.export.export(_Step(model), _example(model, rows), dynamic_shapes=shapes, strict=False)
            # Quiet: no autotuning tables on the user's terminal. emulate_precision_casts: round to bf16 wherever
            # the model's code does, as eager does. Without it SmolLM2's 1-row and 6-row packages gave a token
            # different logits, so compiled FAFO parted from compiled plain decoding at near-ties; with it each
            # row is bit for bit the eager step's with the same kernels, whatever the row count (no slower).
            options = {"freezing": True, "autotune_num_choices_displayed": 0,
                       "max_autotune_report_choices_stats": False, "emulate_precision_casts": True}
            if model.device.type == "cpu":  # GEMM kernels generated for the frozen weights (measured: 2-3x)
                options.update(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN")
                bf16_gemm.register()  # offered to the autotuner beside the others; it keeps the fastest
            torch._inductor.aoti_compile_and_package(exported, package_path=str(partial), inductor_configs=options)
    except Exception as error:  # noqa: BLE001 - whatever failed, the answer is the same: run eager
        raise CompileError(_first_line(error)) from error


def load_kernels(model: Model, folder: Path) -> None:
    """Our own kernels, which the CPU graphs call: compiled into `folder` once (seconds), loaded per process."""
    if model.device.type == "cpu":
        native.load(folder)


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


def identity(model: Model, source: str) -> str:
    """Names a model's packages: its source and config, dtype, device kind, our kernels' version (with the
    CPU's features, for which kernels are generated, and torch's version), graph version."""
    key = json.dumps([source, model.config.to_json_string(), str(model.dtype), model.device.type,
                      native.version(), GRAPH_VERSION])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class CompiledSteps:
    """The compiled steps of one model: a package per row count, loaded from disk or built on first need.

    mode "on" builds what is missing; "auto" uses only packages that measured faster than eager when they
    were built (their record says so). Any failure prints one notice and leaves that size to eager.
    """

    def __init__(self, model: Model, folder: Path, *, mode: str, notify: Callable[[str], None],
                 gguf: Path | None = None):
        self.model, self.folder, self.mode, self.notify = model, folder, mode, notify
        self.gguf = gguf  # the .gguf file the model came from: its blocks serve the projections (packed.py)
        self._packed: dict | None = None
        self._runners: dict[int, object | None] = {}
        self._layers: tuple | None = None  # per-layer views of the cache, rebuilt when it is reallocated
        self._everything = torch.ones(0, len(model.layers), dtype=torch.bool, device=model.device)
        self._all_rows = torch.ones(ROW_BUCKETS[-1], dtype=torch.bool, device=model.device)
        self._no_rows = torch.zeros(ROW_BUCKETS[-1], dtype=torch.bool, device=model.device)
        self._cheaper: dict[tuple[int, int], bool] = {}  # (size, larger): whether steps pad to size (size_for)
        self.calls, self.seconds = 0, 0.0  # steps run compiled and their time inside the package (diagnostics)
        self.calls_by_size: dict[int, int] = {}
        self._said: set[str] = set()

    def notify_once(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            self.notify(message)

    def packed_modules(self) -> dict:
        """The projections that run on packed GGUF blocks in this model's graphs (packed.py); read once."""
        if self._packed is None:
            self._packed = {}
            load_kernels(self.model, self.folder.parent)
            if self.gguf is not None and packed.supported(self.model):
                try:
                    self._packed = packed.pack_model(self.model, self.gguf)
                except Exception as error:  # noqa: BLE001 - an unreadable file: the graphs keep dense weights
                    self.notify_once(f"cannot read the packed weights of {self.gguf.name} ({_first_line(error)}); "
                                     "compiling with bf16 weights")
        return self._packed

    def paths(self, rows: int) -> tuple[Path, Path]:
        return self.folder / f"rows{rows}.pt2", self.folder / f"rows{rows}.json"

    def serves(self, rows: int) -> bool:
        """Whether a decoder whose largest step has `rows` rows runs compiled (under "on" this builds the
        package now rather than at the first step)."""
        size = bucket(rows)
        return size is not None and self.runner(size) is not None

    def runner(self, rows: int):
        """The loaded package for `rows` rows, building it when allowed; None: run eager."""
        if rows not in self._runners:
            self._runners[rows] = self._load(rows)
        return self._runners[rows]

    def size_for(self, rows: int, sizes: tuple[int, ...]) -> int | None:
        """The package a `rows`-row step runs in, for a decoder whose steps have at most max(sizes) rows: the bucket of
        the smallest of `sizes` that holds it where that package runs at least 10% faster than the largest's, timed
        side by side when first needed (extra rows cost arithmetic on CPUs without AMX, next to nothing with it; timed
        apart, at their builds, the VM's drift hid the difference), else the largest's."""
        largest = bucket(max(*sizes, rows))
        if largest is None:
            return None
        for size in sorted({bucket(s) for s in sizes if s >= rows} - {largest, None}):
            if self.runner(largest) is None:
                break
            if (size, largest) not in self._cheaper:
                small, ms = self.runner(size), {}
                if small is not None:
                    try:
                        ms = side_by_side(self.model, {size: small, largest: self.runner(largest)})
                    except Exception:  # noqa: BLE001 - a package that fails here fails at its steps too: pad
                        pass
                cheaper = self._cheaper[size, largest] = bool(ms) and ms[size] < 0.9 * ms[largest]
                if not cheaper:  # not worth its memory; loaded again if it is some decoder's largest step
                    self._runners.pop(size, None)
            if self._cheaper[size, largest]:
                return size
        return largest

    def _load(self, rows: int):
        package, record = self.paths(rows)
        if package.exists() and record.exists():
            timing = Timing.read(record)
            if self.mode == "auto" and timing is not None and not timing.pays_off:
                return None
            try:
                load_kernels(self.model, self.folder.parent)
                return load_package(package)
            except Exception as error:  # noqa: BLE001 - a damaged or foreign package: rebuild under "on"
                if self.mode == "auto":
                    self.notify(f"compiled step unusable ({_first_line(error)}); running eager")
                    return None
        if self.mode != "on":
            return None
        self.notify(f"compiling the {rows}-row step for this model once (minutes on a CPU; later runs load it)")
        started = time.perf_counter()
        try:
            build(self.model, rows, package, self.packed_modules())
            runner = load_package(package)
            timing = measure(self.model, runner, rows)
            timing.build_s = time.perf_counter() - started
            timing.write(record)
        except Exception as error:  # noqa: BLE001 - build, load, first run or record: whatever failed, run eager
            reason = error if isinstance(error, CompileError) else _first_line(error)
            self.notify(f"compilation failed, running eager: {reason}")
            return None
        self.notify(f"compiled in {timing.build_s:.0f} s: a {rows}-row step takes {timing.compiled_ms:.1f} ms "
                    f"(eager {timing.eager_ms:.1f} ms)")
        return runner

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, local: torch.Tensor, *,
                 sees_all: torch.Tensor | None = None, visible: Callable[[], torch.Tensor | None] | None = None,
                 sizes: tuple[int, ...] = (1,)) -> torch.Tensor | None:
        """Logits [rows, vocab] in the model's dtype of `ids` at `positions`, written after the committed prefix
        of `cache`; None when no compiled step serves this step (the caller runs eager). Rows are padded to a
        package of `sizes`, the step sizes the decoder pads to (see size_for).

        `local` [rows, rows]: which of this step's rows each row sees. Cached positions: every row sees all of
        them unless `sees_all` [rows] is false for it; such a row sees those `visible()` [length, layers] marks
        (None: all; a callable, so that eager steps never build it).
        """
        rows, length, device = ids.shape[0], cache.length, self.model.device
        size = self.size_for(rows, sizes)
        if size is None or length < MIN_LENGTH or length + size > cache.max_slots:
            return None
        runner = self.runner(size)
        if runner is None:
            return None
        cache.store_as(stored_dtype(self.model))  # once: the package was traced with it
        cache.reserve(length + size)
        visible = visible() if visible is not None else None
        local = local.contiguous()  # the package was traced with contiguous inputs
        sees_all = self._all_rows[:rows] if sees_all is None else sees_all
        sees_part = ~sees_all
        if size > rows:  # padding rows: token 0 at the anchor's position, seeing only themselves
            pad = size - rows
            ids = torch.cat([ids, ids.new_zeros(pad)])
            positions = torch.cat([positions, positions[:1].expand(pad)])
            padded = torch.eye(size, dtype=torch.bool, device=device)
            padded[:rows, :rows] = local
            local = padded
            sees_all, sees_part = (torch.cat([part, self._no_rows[:pad]]) for part in (sees_all, sees_part))
        if self._everything.shape[0] < cache.capacity:
            self._everything = torch.ones(cache.capacity, len(self.model.layers), dtype=torch.bool, device=device)
        storage = (cache.keys.data_ptr(), cache.capacity)
        if self._layers is None or self._layers[0] != storage:
            self._layers = (storage, list(cache.keys.unbind(0)), list(cache.values.unbind(0)))
        started = time.perf_counter()
        try:
            visible = self._everything[:length] if visible is None else visible
            logits = runner(ids, positions, local, sees_all, sees_part, visible, self._layers[1], self._layers[2])
        except Exception as error:  # noqa: BLE001 - e.g. a shape the package was not built for: run eager
            self.notify(f"compiled step failed, running eager: {_first_line(error)}")
            self._runners[size] = None
            return None
        self.calls += 1
        self.calls_by_size[size] = self.calls_by_size.get(size, 0) + 1
        self.seconds += time.perf_counter() - started
        return logits[:rows]


@dataclass
class Timing:
    rows: int
    eager_ms: float
    compiled_ms: float
    build_s: float = 0.0

    @property
    def pays_off(self) -> bool:
        return self.compiled_ms < self.eager_ms

    def write(self, path: Path) -> None:
        write_atomic(path, json.dumps(asdict(self)))

    @classmethod
    def read(cls, path: Path) -> "Timing | None":
        try:
            return cls(**json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            return None


def _step_inputs(model: Model, rows: int, context: int):
    """A `rows`-row step after `context` cached positions: ids, positions, the eager mask and the compiled step's
    visibility pieces (every row sees the whole cache)."""
    from .model import prefix_causal_mask

    device = model.device
    ids = torch.zeros(rows, dtype=torch.long, device=device)
    positions = torch.arange(context, context + rows, device=device)
    mask = prefix_causal_mask(context, rows, device)
    sees_all = torch.ones(rows, dtype=torch.bool, device=device)
    visible = torch.ones(context, len(model.layers), dtype=torch.bool, device=device)
    return ids, positions, mask, mask[:, context:].contiguous(), sees_all, ~sees_all, visible


def _median_ms(runs: dict, repeats: int) -> dict:
    """Median ms of each of `runs`, called in turn (A B A B ...) so that the machine's drift hits all alike."""
    times: dict = {name: [] for name in runs}
    for _ in range(repeats + 2):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t[2:]) * 1e3 for name, t in times.items()}


def measure(model: Model, runner, rows: int, context: int = 256, repeats: int = 8) -> Timing:
    """Median time of a `rows`-row step after `context` cached positions, eager and compiled."""
    from .model import causal_attention

    cache = model.new_cache(context + rows, context + rows)
    cache.commit(context)
    ids, positions, mask, local, sees_all, sees_part, visible = _step_inputs(model, rows, context)
    with torch.inference_mode():
        eager = _median_ms({0: lambda: model.forward(ids, positions, cache, causal_attention(mask, model.scaling))},
                           repeats)[0]
        cache.store_as(stored_dtype(model))  # each path with the cache it runs with
        keys, values = list(cache.keys.unbind(0)), list(cache.values.unbind(0))
        compiled = _median_ms({0: lambda: runner(ids, positions, local, sees_all, sees_part, visible, keys, values)},
                              repeats)[0]
    return Timing(rows, eager, compiled)


def side_by_side(model: Model, runners: dict, context: int = 256, repeats: int = 8) -> dict[int, float]:
    """Median ms of a step in each package of `runners` ({rows: runner}), called in turn after `context` positions."""
    cache = model.new_cache(context + max(runners), context + max(runners))
    cache.commit(context)
    cache.store_as(stored_dtype(model))
    keys, values = list(cache.keys.unbind(0)), list(cache.values.unbind(0))
    runs = {}
    for rows, runner in runners.items():
        ids, positions, _, local, sees_all, sees_part, visible = _step_inputs(model, rows, context)
        runs[rows] = (lambda runner=runner, args=(ids, positions, local, sees_all, sees_part, visible):
                      runner(*args, keys, values))
    with torch.inference_mode():
        return _median_ms(runs, repeats)
