"""Plain decoding against the memory-bandwidth roofline: a one-row step must read every weight once, so it takes at
least (the weights' bytes) / (memory bandwidth). The bound here is the model file's size (a .gguf file's quantized
blocks, as llama.cpp reads them) over the bandwidth of a large copy (bytes read + written per second, all threads),
and, as a step only reads its weights, over that of a large sum (bytes read per second: on a 2-core VM the copy's
figure was 1.4-1.6x the sum's); each mode's decoding speed is the same prompt's plain greedy answer, eager and compiled
alternated.

    python scripts/roofline.py --model qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --tokens 64 --repeats 3
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

import common
from fafo_cli.bench.gpu_report import bandwidth_gbs, read_bandwidth_gbs


def main() -> None:
    parser = common.parser(__doc__, "model", "dtype", "tokens", "repeats", "suites", "samples", "prompts",
                           suites="code", samples=1, tokens=64)
    parser.add_argument("--modes", nargs="+", default=["off", "on"], help="compile settings to compare")
    parser.add_argument("--copy-mb", type=int, default=1024, help="size of the bandwidth copy (well past the caches)")
    args = parser.parse_args()
    engines = {mode: common.load_engine(args, compile=mode) for mode in args.modes}
    first = next(iter(engines.values()))
    source = Path(args.model) if args.model and Path(args.model).is_file() else None
    weights = source.stat().st_size if source else sum(p.numel() * p.element_size() for p in first.model.hf.parameters())
    cpu = torch.device("cpu")
    bandwidth, read = bandwidth_gbs(cpu, args.copy_mb), read_bandwidth_gbs(cpu, args.copy_mb)
    bound_ms, read_ms = (weights / (gbs * 1e9) * 1e3 for gbs in (bandwidth, read))
    print(f"{first.name} · {first.weights} · {weights / 1e6:,.0f} MB read per token (the {'file' if source else 'weights'})"
          f" · bandwidth {bandwidth:.1f} GB/s (copy), {read:.1f} GB/s (sum) · bound {bound_ms:.1f} ms/token "
          f"({1e3 / bound_ms:.1f} tok/s), {read_ms:.1f} ms/token at the sum's bandwidth")
    for sample in common.prompts(args, first):
        for engine in engines.values():  # untimed: loads or builds packages, warms caches
            engine.complete(list(sample.messages), max_tokens=8, method="vanilla")
        times: dict[str, list[float]] = {mode: [] for mode in engines}
        for _ in range(args.repeats):
            for mode, engine in engines.items():
                engine.reset()
                result = engine.complete(list(sample.messages), max_tokens=args.tokens, method="vanilla")
                times[mode].append(common.ms_per_step(result.stats))
        for mode, ms in times.items():
            step = statistics.median(ms)
            compiled = engines[mode].compiled
            where = f"compiled ({', '.join(map(str, compiled.built()))} rows)" if compiled and compiled.built() else "eager"
            print(f"{sample.id:24s} compile {mode:4s} {where:22s} {step:7.1f} ms/step  {1e3 / step:6.1f} tok/s  "
                  f"{bound_ms / step:5.0%} of the roofline ({read_ms / step:.0%} at the sum's bandwidth)")


if __name__ == "__main__":
    main()
