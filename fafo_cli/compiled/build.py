"""The compiled step: the model's forward pass compiled ahead of time by inductor (AOTInductor) into one
package on disk, which later runs load in about a second.

Why ahead of time: eager PyTorch spends most of a small model's step outside arithmetic (per-op dispatch,
generic matmul kernels that read bf16 weights at half the memory bandwidth). Inductor fuses the
elementwise work and generates GEMM kernels specialised to the frozen weights; `torch.compile` does the
same, but traces and re-generates them in every process (its disk cache skips packed weights), which costs
minutes per start on a CPU. A package is built once per model, dtype, device and row count.

Shapes: the cache length and capacity are dynamic dimensions (one graph for every step); the row count is
static (exact up to 16 rows, then in buckets): a decoder pads every step up to the size of its largest one,
because kernels generated for a fixed row count run much faster than dynamic ones (docs/compiled-steps.md). A
package is built on first need per size, so a decoder costs one build.

Each layer runs one masked attention call: a row sees all cached positions where `sees_cache` is true, those its
layer marks in `view_mask` where `sees_view` is (FAFO's fumble rows and C(kv)), none where neither is (padding
rows), plus the step's own rows through `local`.
On a CPU that call is our kernel (attention_op.cpp, via kernels/loader.py), and bf16 GEMMs may use ours
(bf16_gemm.py): torch's own spend most of a decoding step's attention time outside arithmetic. A model from a
.gguf file multiplies with its quantized blocks instead (packed.py), rebuilt exactly into its bf16 weights.
New keys and values are written in place after the `view_mask.shape[0]` committed positions, exactly as the
eager path writes them. A bfloat16 model's CPU cache is stored in bfloat16 while compiled steps serve
(`stored_dtype`), with the queries in bf16 too (exact: a bf16 model's are): each step streams half the bytes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ..errors import first_line, is_out_of_memory, says_out_of_memory
from ..files import atomic_path
from ..runtime.model import Model, folded_attention
from . import packed
from .kernels import bf16_gemm, loader


MIN_LENGTH = 2  # export specialises sizes 0 and 1; a step after a one-token prompt runs eager
# bump when the traced computation, our ops' signatures or the packed formats (packed.py) change: old packages are
# rebuilt (the Python the graph is traced from is in the packages' name too: `traced_code`)
GRAPH_VERSION = 15
# the Python a step's graph is traced from, besides transformers' own layers (by its version)
TRACED_SOURCES = tuple(Path(__file__).parent.parent / name for name in (
    "compiled/build.py", "compiled/packed.py", "compiled/kernels/bf16_gemm.py", "compiled/kernels/loader.py",
    "runtime/model.py", "runtime/llama.py", "runtime/cache.py"))  # (loader: our ops' shapes as traced, which it serves)


def load_package(path: Path, constants: dict[str, torch.Tensor] | None = None) -> Callable:
    """A package as a function of the step's inputs. Calling the loaded package directly re-reads its input
    and output specs (JSON) and walks the argument tree on every call, a visible share of a small step. The flat
    call below passes the same tensors in the same order (ids ... view_mask, then the layers' keys and values).

    `constants` (step_constants): the tensors a package built without its own copies reads, by name; the package
    holds pointers to them, so they are kept alive with it."""
    loader = getattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader", None)
    if loader is None or not hasattr(loader, "boxed_run"):  # another torch: its own load and call path
        if constants is not None:  # (a package without weights of its own would run on none: garbage, no error)
            raise CompileError("this torch cannot load a package with the model's own weights")
        package = torch._inductor.aoti_load_package(str(path))
        package.shared_constants = constants
        return package
    # torch's own loader without aoti_load_package's Python around it, which imports the compiler (about a second)
    aoti = loader(str(path), "model", False, 1, -1)  # model name, single-threaded, runners, device index
    if constants is not None:
        names = aoti.get_constant_fqns()
        missing = sorted(set(names) - set(constants))
        if missing:
            raise CompileError(f"the package reads constants the model does not have ({missing[0]}, ...)")
        aoti.load_constants({name: constants[name] for name in names}, False, True, True)  # user-managed

    def run(ids, positions, local, sees_cache, sees_view, view_mask, keys, values):
        return aoti.boxed_run([ids, positions, local, sees_cache, sees_view, view_mask, *keys, *values])[0]

    run.package, run.constants = aoti, constants  # the package points into them: they live as long as it does
    return run


def step_constants(model: Model, packed_modules: dict) -> dict[str, torch.Tensor] | None:
    """The tensors a step's graph reads (weights, packed blocks, rotary tables), by the names a package gives them,
    where every one of them is the model's own: then each package is built without copies of them and loaded with
    these, so a model's packages share one set of weights with it instead of holding one each. None where a matrix
    stays dense: inductor lays dense weights out its own way for its GEMMs (new tensors the model does not have)."""
    with packed.swapped_in(model, packed_modules):
        if any(isinstance(module, torch.nn.Linear) for module in model.hf.modules()):
            return None
        step = _Step(model)
        return {**dict(step.named_parameters(remove_duplicate=False)),
                **dict(step.named_buffers(remove_duplicate=False))}


def uses_kernel(model: Model) -> bool:
    """Whether the graph's attention is our CPU kernel: it needs head_dim in whole 16-float vectors, and a CPU whose
    registers its vectors are built for (`loader.attends`)."""
    return model.device.type == "cpu" and model.head_dim % 16 == 0 and loader.attends()


def stored_dtype(model: Model) -> torch.dtype:
    """The cache's dtype under compiled steps: our kernel reads a bf16 model's keys and values as they are,
    where eager CPU attention wants fp32 copies (twice the bytes to stream per step)."""
    return model.dtype if uses_kernel(model) and model.dtype == torch.bfloat16 else model.attention_dtype


class CompileError(RuntimeError):
    """Compilation is impossible here (no compiler, an unsupported op, ...): the caller runs eager. `transient`: it
    failed for a reason of the moment (the building process killed, memory running out), not to be remembered."""

    def __init__(self, message: str, *, transient: bool = False):
        super().__init__(message)
        self.transient = transient


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
        # (inductor inlines them there).
        self.rope_table = getattr(model.rotary, "rope_type", None) in STATIC_ROPE
        if self.rope_table:
            cos, sin = rope_table(model)
            self.register_buffer("rope_cos", cos)
            self.register_buffer("rope_sin", sin)

    def forward(self, ids, positions, local, sees_cache, sees_view, view_mask, keys, values):
        scaling = self.model.scaling

        def attend(layer: int, q, k, v):
            if uses_kernel(self.model):  # ours: [rows, heads, dim], [slots, kv_heads, dim]; q in the cache's dtype
                q, k, v = (x[0].transpose(0, 1) for x in (q.to(k.dtype), k, v))  # exact: a bf16 model's q is bf16
                return torch.ops.fafo.attend(q, k, v, sees_cache, sees_view, view_mask[:, layer], local,
                                             scaling).transpose(0, 1)[None]
            prefix = sees_cache[:, None] | (sees_view[:, None] & view_mask[:, layer][None, :])
            mask = torch.cat([prefix, local], dim=1)
            if q.device.type == "cpu":  # a CPU's enable_gqa path is several times slower (see folded_attention)
                return folded_attention(q, k, v, mask, scaling)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)

        def rotation(positions):
            return self.rope_cos[positions], self.rope_sin[positions]

        cache = _LayerCache(keys, values, view_mask.shape[0], ids.shape[0])
        # logits in the model's dtype: converting them in the graph costs more than on the host
        return self.model.forward(ids, positions, cache, attend, rotation=rotation if self.rope_table else None,
                                  as_float=False)


def _example(model: Model, rows: int, length: int = 64):
    """The traced step's inputs. The cache holds more than the step's rows after `length`: a capacity export saw
    exceeded would be traced as a slice clamped to it, a graph that serves no real cache."""
    device, n_layers = model.device, len(model.layers)
    capacity = length + rows + 64
    cache = model.new_cache(capacity, capacity)
    cache.store_as(stored_dtype(model))
    return (torch.zeros(rows, dtype=torch.long, device=device), torch.arange(length, length + rows, device=device),
            torch.ones(rows, rows, dtype=torch.bool, device=device).tril(),
            torch.ones(rows, dtype=torch.bool, device=device), torch.zeros(rows, dtype=torch.bool, device=device),
            torch.ones(length, n_layers, dtype=torch.bool, device=device),
            list(cache.keys.unbind(0)), list(cache.values.unbind(0)))


def build(model: Model, rows: int, path: Path, packed_modules: dict | None = None, *,
          shared_constants: bool = False) -> None:
    """Trace, compile and package the `rows`-row step at `path` (atomically). Minutes on a CPU.
    `packed_modules` (packed.pack_model) replace the model's projections in the traced graph. `shared_constants`:
    the package holds no copy of the weights; it is loaded with the model's own (step_constants)."""
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
            # No precompiled header: a build's compiler files are thrown away after it (Engine.build_elsewhere), and
            # one made afresh for each build (150 MB) made it slower (docs/benchmarks.md).
            options = {"freezing": True, "autotune_num_choices_displayed": 0,
                       "max_autotune_report_choices_stats": False, "emulate_precision_casts": True,
                       "aot_inductor.package_constants_in_so": not shared_constants}
            if hasattr(torch._inductor.config.aot_inductor, "precompile_headers"):  # (torch 2.8 on)
                options["aot_inductor.precompile_headers"] = False
            if model.device.type == "cpu":  # GEMM kernels generated for the frozen weights
                options.update(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN")
                bf16_gemm.register()  # offered to the autotuner beside the others; it keeps the fastest
            torch._inductor.aoti_compile_and_package(exported, package_path=str(partial), inductor_configs=options)
    except Exception as error:  # noqa: BLE001 - whatever failed, the answer is the same: run eager
        raise failure(error) from error


def failure(error: BaseException) -> CompileError:
    """What stopped a build, in one line: where the C++ compiler failed, its first error line (torch's own first
    line says only "C++ compile error"); transient where memory ran out (the compiler killed, say)."""
    line = first_line(error, named=True)
    said = next((text.strip() for text in str(error).splitlines()[1:] if "error:" in text.lower()), None)
    if said is not None:
        line = f"{line}: {said}"[:300]
    return CompileError(line, transient=is_out_of_memory(error) or says_out_of_memory(line))


def load_kernels(model: Model, folder: Path) -> None:
    """Our own kernels, which the CPU graphs call: compiled into `folder` once (seconds), loaded per process."""
    if model.device.type == "cpu":
        loader.load(folder)


def identity(model: Model, source: str) -> str:
    """Names a model's packages: its source and config, dtype, device kind (a GPU's with its compute capability,
    whose kernels a package holds: a cache shared by machines), our kernels' version (with the CPU's features, for
    which kernels are generated, and torch's version), graph version."""
    described = model.config.to_json_string()
    if '"_name_or_path"' in described:  # the path as typed, where transformers keeps it: `source` names the folder
        config = json.loads(described)
        del config["_name_or_path"]
        described = json.dumps(config, sort_keys=True)
    device = model.device.type
    if device == "cuda":
        device += "-sm{}{}".format(*torch.cuda.get_device_capability(model.device))
    key = json.dumps([source, described, str(model.dtype), device, loader.version(), GRAPH_VERSION, traced_code()])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


@functools.cache
def traced_code() -> str:
    """Names the code a package is traced from: our modules' sources and transformers' version (an upgrade that
    changes a layer's arithmetic is another graph, whether or not anyone bumped GRAPH_VERSION)."""
    from importlib import metadata

    digest = hashlib.sha256()
    for path in TRACED_SOURCES:
        try:
            digest.update(path.read_bytes())
        except OSError:  # (an install without its sources, frozen: GRAPH_VERSION alone names them)
            digest.update(path.name.encode())
    try:
        digest.update(metadata.version("transformers").encode())
    except metadata.PackageNotFoundError:  # (a source checkout on the path: its version is not recorded)
        digest.update(b"transformers")
    return digest.hexdigest()[:16]
