"""The packed GGUF matrices alone (fafo::packed_linear, packed_linear.cpp): every matrix of the model that packs,
called back to back as a step calls them (its weights stream from memory), against the same matrices dense in eager
torch as a step multiplies them (float32: W @ xᵀ for several rows); median of the rounds, every variant timed
alternately in each round. Each kernel runs the matrices both as the step calls them (a layer's q, k and v stacked
into one call, gate and up into another) and one call per matrix. `--base REV` adds the kernel of a git revision,
`--no-amx` the working tree's kernel built without AMX (its AVX-512 path), each under its own op namespace.

    python scripts/packed_matrices.py --rows 1 6 9
    python scripts/packed_matrices.py --rows 1 6 9 --base HEAD --no-amx
    python scripts/packed_matrices.py --model Q.gguf --rows 1 6 --plain
    python scripts/packed_matrices.py --dtype float32 --rows 1 2 4 8 16
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from fafo_cli import hub
from fafo_cli.compiled import packed
from fafo_cli.compiled.kernels import loader

import common


def one_per_matrix(modules: dict) -> list[tuple[torch.Tensor, int, torch.Tensor | None]]:
    """(packed, out_features, bias) of every matrix on its own: a stacked one's tiles and bias cut back apart."""
    separate = []
    for module in modules.values():
        if isinstance(module, packed.FusedPart):
            fused, first = module.fused, sum(module.fused.sizes[:module.index])
            tiles = slice(first // packed.TILE, (first + module.out_features) // packed.TILE)
            bias = None if fused.bias is None else fused.bias[first:first + module.out_features]
            separate.append((fused.packed[tiles].contiguous(), module.out_features, bias))
        else:
            separate.append((module.packed, module.out_features, module.bias))
    return separate


def main() -> None:
    parser = common.parser(__doc__, "model")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 6, 9])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--base", help="git revision whose kernel to time as well")
    parser.add_argument("--no-amx", action="store_true", help="also the kernel's AVX-512 path instead of AMX")
    parser.add_argument("--plain", action="store_true", help="also the kernel's plain C++ path")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = parser.parse_args()
    engine = common.load_engine(args, compile="off")  # dense: the packed modules are made here, not installed
    loader.load(hub.cache_dir() / "compiled")
    gguf = hub.gguf_source(engine.folder)
    if gguf is None or not packed.supported(engine.model):
        raise SystemExit(f"needs a model from a .gguf file, on a CPU where our kernel serves {args.dtype}")
    modules = packed.pack_model(engine.model, gguf)
    stacked = [(m.packed, m.out_features, m.bias) for m in packed.kernels(modules)]
    separate = one_per_matrix(modules)
    with tempfile.TemporaryDirectory() as folder:
        kernels = {"tree": torch.ops.fafo.packed_linear.default}
        if args.base:
            source = common.kernel_source(args.base, "packed_linear.cpp")
            kernels[args.base] = loader.load_as(source, "fafo_base", Path(folder)).packed_linear.default
        if args.no_amx:
            kernels["tree, no AMX"] = loader.load_as(loader.SOURCES[1].read_text(), "fafo_noamx", Path(folder),
                                                     "#define FAFO_NO_AMX 1\n").packed_linear.default
        if args.plain:
            kernels["tree, plain"] = loader.load_as(loader.SOURCES[1].read_text(), "fafo_plain", Path(folder),
                                                    "#define FAFO_PLAIN 1\n").packed_linear.default
        print(f"{len(separate)} packed matrices, as {len(stacked)} calls (stacked) or one call each; "
              f"median of {args.rounds} rounds, ms for all of them")
        with torch.inference_mode():
            for rows in args.rows:
                widths = {w.shape[1] * 64 for w, _, _ in separate}
                inputs = {n: torch.randn(rows, n, dtype=engine.model.dtype) for n in widths}
                dense = engine.model.step_linear or (lambda linear, x: linear(x))
                variants = {f"dense {args.dtype} (eager)": [
                    lambda x=inputs[linear.in_features], linear=linear: dense(linear, x)
                    for linear in map(engine.model.hf.get_submodule, modules)]}
                for name, op in kernels.items():
                    for calls, matrices in (("stacked", stacked), ("one each", separate)):
                        variants[f"{name}, {calls}"] = [
                            lambda x=inputs[w.shape[1] * 64], w=w, n=n, b=b, op=op: op(x, w, n, b)
                            for w, n, b in matrices]
                times: dict[str, list[float]] = {name: [] for name in variants}
                for round in range(args.rounds + 2):
                    for name, calls in variants.items():
                        started = time.perf_counter()
                        for call in calls:
                            call()
                        if round >= 2:  # the first two warm up
                            times[name].append(time.perf_counter() - started)
                print(f"{rows:2d} rows: " + ", ".join(f"{name} {statistics.median(t) * 1e3:.2f}"
                                                      for name, t in times.items()), flush=True)


if __name__ == "__main__":
    main()
