"""A 7B-shaped step as a CUDA graph of torch's eager kernels (what `cuda_graphs` captures) against a CUDA graph of
the same step compiled by torch.compile (Inductor fuses the norms, rotary, residual adds and activation between
the matrix products), each against the memory-bandwidth bound, as `fafo doctor --gpu-report` measures it.

    python scripts/fused_steps.py --rows 1 8 64            # CUDA: the 7B shape (about a minute of compiling a size)
    python scripts/fused_steps.py --shape tiny --rows 1 4  # anywhere: the tiny shape, eager and compiled, no graphs
"""

from __future__ import annotations

import time

import torch

from fafo_cli.bench import gpu_report
from fafo_cli.compiled.timing import synchronize
from fafo_cli.runtime.model import Model, causal_attention

import common

# Model.forward without its inference_mode: torch.compile cannot trace inference tensors (no grad is kept anyway)
forward = Model.forward.__wrapped__


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--shape", default="7b", choices=sorted(gpu_report.SHAPES), help="the model's shape")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64], help="rows a step")
    parser.add_argument("--context", type=int, default=gpu_report.CONTEXT, help="cached positions")
    parser.add_argument("--mode", default="default", help="torch.compile's mode (default, max-autotune-no-cudagraphs)")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu_report.check(device, args.shape)
    graphs = device.type == "cuda"
    model = gpu_report.random_llama(args.shape, device, gpu_report.report_dtype(device))
    bandwidth = gpu_report.bandwidth_gbs(device, 1024 if graphs else 64)
    bound_ms = gpu_report.step_bytes(model, args.context) / (bandwidth * 1e9) * 1e3
    print(f"{gpu_report.device_name(device)}: bandwidth {bandwidth:.0f} GB/s, bound {bound_ms:.3f} ms a step")

    cache = model.new_cache(initial_slots=args.context + max(args.rows), max_slots=args.context + max(args.rows))
    cache.keys[:, :args.context].normal_()
    cache.values[:, :args.context].normal_()
    cache.commit(args.context)
    print("| rows | eager ms | graph ms | bound share | compiled ms | compiled graph ms | bound share | compile s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rows in args.rows:
        ids = torch.zeros(rows, dtype=torch.long, device=device)
        positions = torch.arange(args.context, args.context + rows, device=device)
        mask = torch.ones(rows, args.context + rows, dtype=torch.bool, device=device)
        attend = causal_attention(mask, model.scaling)

        def step():  # written after the cached positions, never committed: every run is the same step
            return forward(model, ids, positions, cache, attend, as_float=False)

        eager = gpu_report.timed_ms(step, device)
        graph = gpu_report.timed_ms(gpu_report.graph_replay(step, device), device) if graphs else None
        compiled = torch.compile(step, mode=None if args.mode == "default" else args.mode, dynamic=False)
        start = time.perf_counter()
        compiled()
        synchronize(device)
        compile_s = time.perf_counter() - start
        fused = gpu_report.timed_ms(compiled, device)
        fused_graph = gpu_report.timed_ms(gpu_report.graph_replay(compiled, device), device) if graphs else None
        best_plain = min(t for t in (eager, graph) if t is not None)
        best_fused = min(t for t in (fused, fused_graph) if t is not None)
        cell = lambda t: "—" if t is None else f"{t:.3f}"  # noqa: E731
        print(f"| {rows} | {eager:.3f} | {cell(graph)} | {bound_ms / best_plain:.0%} | {fused:.3f} | "
              f"{cell(fused_graph)} | {bound_ms / best_fused:.0%} | {compile_s:.0f} |", flush=True)


if __name__ == "__main__":
    with torch.no_grad():
        main()
