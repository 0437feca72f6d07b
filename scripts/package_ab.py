"""Two ways of running a compiled step, side by side in one process (called alternately, median of the
rounds), on FAFO-shaped inputs: the first 4 rows see the whole cache, the next 5 a StreamingLLM view (4 sink +
252 recent positions), any further rows are padding. Uses the packages already built for the model (`fafo run
--compile`, or `fafo bench --compile`); prints whether the compared rows' logits are equal and how much of
each step our attention kernel and our packed GGUF matrices (packed_linear.cpp) took.

    python scripts/package_ab.py --rows 9 12      # FAFO's 9-row step: its exact package against the 12-row one
    python scripts/package_ab.py --rows 1 --calls  # one package: our flat call against the package's own call
    python scripts/package_ab.py --rows 1 6        # a plain and FAFO's default step, and their attention's share
    python scripts/package_ab.py --rows 6 --against ~/.cache/fafo/compiled/OLD  # packages of another build
    python scripts/package_ab.py --model Q.gguf --rows 1 --dense /tmp/dense  # packed GGUF weights against dense
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from fafo_cli.compiled import build as compiled

import common


def main() -> None:
    parser = common.parser(__doc__, "model", "dtype")
    parser.add_argument("--rows", type=int, nargs="+", required=True, help="one package, or two to compare")
    parser.add_argument("--calls", action="store_true", help="compare the two ways of calling one package")
    parser.add_argument("--contexts", type=int, nargs="+", default=[300, 1300])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--against", type=Path, help="a folder of packages of the same model to compare with, "
                        "row count for row count (e.g. built before a change)")
    parser.add_argument("--dense", type=Path, help="a folder for packages of the same model with dense bf16 "
                        "weights instead of packed GGUF blocks: built there where missing, then compared as --against")
    args = parser.parse_args()
    engine = common.load_engine(args, compile="on")  # on: always a CompiledSteps; nothing is built
    model, folder = engine.model, engine.compiled.folder
    compiled.load_kernels(model, folder.parent)
    constants = engine.compiled.constants()  # a packed model's packages read the model's own weights
    if args.dense:
        for rows in args.rows:
            if not (args.dense / f"rows{rows}.pt2").exists():
                started = time.perf_counter()
                compiled.build(model, rows, args.dense / f"rows{rows}.pt2", packed_modules={})
                print(f"built the dense {rows}-row package in {time.perf_counter() - started:.0f} s")
        args.against = args.dense
    paths = {rows: folder / f"rows{rows}.pt2" for rows in args.rows}
    for rows, path in paths.items():
        if not path.exists():
            raise SystemExit(f"no {rows}-row package in {folder}: build it first (fafo run --compile, ...)")
    if args.calls:
        path = paths[args.rows[0]]
        flat = compiled.load_package(path, constants)
        if not hasattr(flat, "package"):
            raise SystemExit("this torch loads a package through its own call only: there is no flat call to compare")
        from torch._inductor.package.package import AOTICompiledModel

        # torch's own call over the same loaded package (the same weights), which reads the specs at every call
        runners = {"package call": AOTICompiledModel(flat.package), "flat call": flat}
        sizes = dict.fromkeys(runners, args.rows[0])
    elif args.against:
        runners, sizes = {}, {}
        for rows, path in paths.items():
            for name, package in ((f"{rows} rows", path), (f"{rows} rows ({args.against.name})",
                                                            args.against / path.name)):
                runners[name], sizes[name] = compiled.load_package(package, constants), rows
    else:
        runners = {f"{rows} rows": compiled.load_package(path, constants) for rows, path in paths.items()}
        sizes = dict(zip(runners, args.rows))
    shared = min(sizes.values())  # the rows every runner computes
    with torch.inference_mode():
        for context in args.contexts:
            cache = common.filled_cache(model, context, context + max(sizes.values()))
            inputs = {name: common.step_inputs(model, cache, sizes[name], context) for name in runners}
            logits = [runners[name](*inputs[name])[:shared] for name in runners]
            equal = all(torch.equal(logits[0], other) for other in logits[1:])
            times: dict[str, list[float]] = {name: [] for name in runners}
            for _ in range(args.rounds):
                for name, runner in runners.items():
                    started = time.perf_counter()
                    for _ in range(4):
                        runner(*inputs[name])
                    times[name].append((time.perf_counter() - started) / 4 * 1e3)
            kernels = {name: kernel_ms(runner, inputs[name]) for name, runner in runners.items()}
            figures = ", ".join(f"{name} {statistics.median(t):.2f} ms (attention kernel "
                                f"{kernels[name].get('fafo::attend', 0):.2f}, packed matrices "
                                f"{kernels[name].get('fafo::packed_linear', 0):.2f})" for name, t in times.items())
            print(f"after {context} cached tokens: {figures} (median of {args.rounds}; logits of the first {shared} "
                  f"rows {'equal' if equal else 'differ'})")


def kernel_ms(runner, inputs, steps: int = 10) -> dict[str, float]:
    """Milliseconds per step inside each of our kernels (fafo::attend, fafo::packed_linear; all layers), by
    torch.profiler: their own time inside the graph, where the matrix weights push the cache out of the L3."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for _ in range(steps):
            runner(*inputs)
    return {e.key: e.self_cpu_time_total / steps / 1e3 for e in profile.key_averages() if e.key.startswith("fafo::")}


if __name__ == "__main__":
    main()
