"""Each GGUF type our packed kernel reads (packed_linear.cpp), random matrices of it: the kernel built for this
CPU, its plain C++ path (what CPUs without AVX512-BF16 would run), the same weights dense in bf16 (torch's
linear) and, with `--base REV`, the kernel at a git revision, called alternately, median of the rounds; one thread
unless `--threads`. Each call set multiplies four matrices of the shape in turn, so the weights stream from memory as
a step's do. Random blocks: random bytes with small float16 scales, rebuilt bit for bit as gguf dequantizes them
(checked first).

    python scripts/packed_kinds.py --shape 2048 1536 --rows 1 6
    python scripts/packed_kinds.py --shape 8960 1536 --rows 1 6 --kinds Q4_K Q6_K --base HEAD~1 --threads 2
"""

from __future__ import annotations

import statistics
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch

from fafo_cli.compiled import packed
from fafo_cli.compiled.kernels import loader

import common

SCALES = {"Q4_1": (0, 2), "Q8_0": (0,), "Q5_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}  # float16 fields' offsets


def matrix(kind: str, rows: int, columns: int, seed: int = 0):
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType[kind]
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, columns // block, size), dtype=np.uint8)
    for at in SCALES[kind]:
        raw[..., at:at + 2] = (rng.standard_normal((*raw.shape[:2], 1)) * 0.002).astype(np.float16).view(np.uint8)
    return types.SimpleNamespace(tensor_type=qtype, shape=(columns, rows), data=raw.reshape(rows, -1))


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--shape", type=int, nargs=2, default=[2048, 1536], metavar=("OUT", "IN"),
                        help="each matrix's shape")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 6], help="rows a call")
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds")
    parser.add_argument("--kinds", nargs="+", choices=tuple(SCALES), default=list(SCALES), help="GGUF types")
    parser.add_argument("--base", help="git revision whose kernel to time as well")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out_features, in_features = args.shape
    with tempfile.TemporaryDirectory() as folder:
        native = loader.load_as(loader.SOURCES[1].read_text(), "fafo_native", Path(folder))
        plain = loader.load_as(loader.SOURCES[1].read_text(), "fafo_plain", Path(folder), "#define FAFO_PLAIN 1\n")
        base = (loader.load_as(common.kernel_source(args.base, "packed_linear.cpp"), "fafo_base", Path(folder))
                if args.base else None)
        print(f"{out_features} x {in_features}, {args.threads} thread(s), median of {args.rounds} rounds, ms per "
              f"matrix (native: {native.packed_kernel()})")
        with torch.inference_mode():
            for kind in args.kinds:
                tensors = [matrix(kind, out_features, in_features, seed) for seed in range(4)]
                weights = [packed.tiled(packed.entries(tensor)) for tensor in tensors]
                denses = [packed.reference(tensor) for tensor in tensors]
                for weight, dense in zip(weights, denses):
                    assert torch.equal(native.packed_weight(weight, out_features).view(torch.int16),
                                       dense.view(torch.int16))
                kernels = {"native": native, "plain": plain} | ({args.base: base} if base else {})
                for rows in args.rows:
                    x = torch.randn(rows, in_features).bfloat16()
                    calls = {name: (lambda lib=lib: [lib.packed_linear(x, w, out_features, None) for w in weights])
                             for name, lib in kernels.items()}
                    calls["dense bf16"] = lambda: [torch.nn.functional.linear(x, dense) for dense in denses]
                    times: dict[str, list[float]] = {name: [] for name in calls}
                    for round in range(args.rounds + 2):
                        for name, call in calls.items():
                            started = time.perf_counter()
                            call()
                            if round >= 2:  # the first two warm up
                                times[name].append((time.perf_counter() - started) * 1e3 / len(weights))
                    print(f"{kind} {rows} rows: " + ", ".join(f"{name} {statistics.median(t):.3f}"
                                                              for name, t in times.items()), flush=True)


if __name__ == "__main__":
    main()
