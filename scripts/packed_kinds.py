"""Each GGUF type our packed kernel reads (packed_linear.cpp), one random matrix of it: the kernel built for this
CPU, its plain C++ path (what CPUs without AVX512-BF16 would run) and the same weights dense in bf16 (torch's
linear), called alternately, median of the rounds; one thread. Random blocks: random bytes with small float16
scales, rebuilt bit for bit as gguf dequantizes them (checked first).

    python scripts/packed_kinds.py --shape 2048 1536 --rows 1 6
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch

from fafo_cli.compiled import packed
from fafo_cli.compiled.kernels import loader

SCALES = {"Q4_1": (0, 2), "Q8_0": (0,), "Q5_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}  # float16 fields' offsets


def matrix(kind: str, rows: int, columns: int):
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType[kind]
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (rows, columns // block, size), dtype=np.uint8)
    for at in SCALES[kind]:
        raw[..., at:at + 2] = (rng.standard_normal((*raw.shape[:2], 1)) * 0.002).astype(np.float16).view(np.uint8)
    return types.SimpleNamespace(tensor_type=qtype, shape=(columns, rows), data=raw.reshape(rows, -1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs=2, default=[2048, 1536], metavar=("OUT", "IN"))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 6])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out_features, in_features = args.shape
    with tempfile.TemporaryDirectory() as folder:
        native = loader.load_as(loader.SOURCES[1].read_text(), "fafo_native", Path(folder))
        plain = loader.load_as(loader.SOURCES[1].read_text(), "fafo_plain", Path(folder), "#define FAFO_PLAIN 1\n")
        print(f"{out_features} x {in_features}, one thread, median of {args.rounds} rounds, ms per call "
              f"(native: {native.packed_kernel()})")
        with torch.inference_mode():
            for kind in SCALES:
                tensor = matrix(kind, out_features, in_features)
                weight, dense = packed.tiled(packed.entries(tensor)), packed.reference(tensor)
                assert torch.equal(native.packed_weight(weight, out_features).view(torch.int16), dense.view(torch.int16))
                for rows in args.rows:
                    x = torch.randn(rows, in_features).bfloat16()
                    calls = {"native": lambda: native.packed_linear(x, weight, out_features, None),
                             "plain": lambda: plain.packed_linear(x, weight, out_features, None),
                             "dense bf16": lambda: torch.nn.functional.linear(x, dense)}
                    times: dict[str, list[float]] = {name: [] for name in calls}
                    for round in range(args.rounds + 2):
                        for name, call in calls.items():
                            started = time.perf_counter()
                            call()
                            if round >= 2:  # the first two warm up
                                times[name].append((time.perf_counter() - started) * 1e3)
                    print(f"{kind} {rows} rows: " + ", ".join(f"{name} {statistics.median(t):.3f}"
                                                              for name, t in times.items()), flush=True)


if __name__ == "__main__":
    main()
