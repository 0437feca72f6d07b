"""The packed GGUF matrices alone (fafo::packed_linear, packed_linear.cpp): every matrix of the model that packs,
called back to back as a compiled step calls them (its weights stream from memory), against the same matrices
as dense bf16 in eager torch; median of the rounds. `--no-amx` builds the kernel without AMX (its AVX-512
path) under its own op namespace, to compare the two on a CPU that has AMX.

    python scripts/packed_matrices.py --rows 1 6 9
    python scripts/packed_matrices.py --rows 1 6 9 --no-amx
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fafo_cli import hub, load
from fafo_cli.engine import native, packed


def no_amx_op(folder: Path):
    """packed_linear built with -DFAFO_NO_AMX, as torch.ops.fafo_noamx.packed_linear."""
    source = native.SOURCES[1].read_text().replace("(fafo,", "(fafo_noamx,")
    (folder / "noamx.cpp").write_text("#define FAFO_NO_AMX 1\n" + source)
    native.compile_library(folder / "noamx.so", (folder / "noamx.cpp",))
    torch.ops.load_library(str(folder / "noamx.so"))
    return torch.ops.fafo_noamx.packed_linear.default


def median_ms(calls, rounds: int) -> float:
    times = []
    for _ in range(rounds + 2):
        started = time.perf_counter()
        for call in calls:
            call()
        times.append(time.perf_counter() - started)
    return statistics.median(times[2:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a .gguf model (default: the embedded SmolLM2)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 6, 9])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--no-amx", action="store_true", help="the kernel's AVX-512 path instead of AMX")
    args = parser.parse_args()
    engine = load(args.model, dtype="bfloat16", compile="off")
    native.load(hub.cache_dir() / "compiled")
    gguf = hub.gguf_source(engine.folder)
    if gguf is None or not packed.supported(engine.model):
        raise SystemExit("needs a model from a .gguf file, in bf16, on a CPU with AVX512-BF16")
    modules = packed.pack_model(engine.model, gguf)
    with tempfile.TemporaryDirectory() as folder:
        op = no_amx_op(Path(folder)) if args.no_amx else torch.ops.fafo.packed_linear.default
        print(f"{len(modules)} packed matrices ({'AVX-512' if args.no_amx else 'AMX where the CPU has it'}), "
              f"median of {args.rounds}")
        with torch.inference_mode():
            for rows in args.rows:
                inputs = {n: torch.randn(rows, n, dtype=torch.bfloat16) for n in {m.packed.shape[1] * 64
                                                                                  for m in modules.values()}}
                dense, fast = [], []
                for name, module in modules.items():
                    x, linear = inputs[module.packed.shape[1] * 64], engine.model.hf.get_submodule(name)
                    dense.append(lambda x=x, linear=linear: linear(x))
                    fast.append(lambda x=x, m=module: op(x, m.packed, m.out_features, m.bias))
                print(f"{rows:2d} rows: packed {median_ms(fast, args.rounds):.2f} ms, "
                      f"dense bf16 (eager) {median_ms(dense, args.rounds):.2f} ms", flush=True)


if __name__ == "__main__":
    main()
