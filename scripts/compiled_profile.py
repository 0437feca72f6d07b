"""Where a compiled step's time goes, kernel by kernel: builds a package with inductor's kernel profiling on
(in a temporary folder, not the user's cache; our kernel library is the cached one `fafo run` uses; minutes),
times a FAFO-shaped step and prints torch.profiler's table. The default shape is FAFO's W=2 step after a
summarize-length prompt: 9 rows, of which 4 verify rows see the whole cache and 5 window rows a StreamingLLM view
(4 sink + 252 recent positions); rows beyond those two groups are padding. FAFO's compiled default (W=1) is
`--rows 6 --see-part 2`.

    python scripts/compiled_profile.py --context 1300
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch._inductor.config as inductor_config

from fafo_cli.compiled import build as compiled

import common


def main() -> None:
    parser = common.parser(__doc__, "model", "dtype")
    parser.add_argument("--context", type=int, default=1300)
    parser.add_argument("--rows", type=int, default=9)
    parser.add_argument("--see-all", type=int, default=4, help="rows that see the whole cache")
    parser.add_argument("--see-part", type=int, default=5, help="rows that see the sink and recent positions")
    parser.add_argument("--recent", type=int, default=252)
    args = parser.parse_args()
    engine = common.load_engine(args, method="vanilla", compile="on")  # on: a CompiledSteps; nothing is built yet
    model, rows = engine.model, args.rows
    with tempfile.TemporaryDirectory() as folder:
        package = Path(folder) / "packages" / f"rows{rows}.pt2"
        # as `fafo run --compile` builds it (a model from a .gguf file multiplies with its packed blocks), with each
        # generated kernel named after its graph node and timed on its own
        with inductor_config.patch({"cpp.enable_kernel_profile": True, "cpp.descriptive_names": "inductor_node"}):
            compiled.build(model, rows, package, engine.compiled.packed_modules(),
                           shared_constants=engine.compiled.constants() is not None)
        profile_step(compiled.load_package(package, engine.compiled.constants()), model, args)


def profile_step(runner, model, args) -> None:
    rows, context = args.rows, args.context
    cache = common.filled_cache(model, context, context + rows)
    inputs = common.step_inputs(model, cache, rows, context, args.see_all, args.see_part, recent=args.recent)
    with torch.inference_mode():
        for _ in range(5):
            runner(*inputs)
        times = []
        for _ in range(20):
            start = time.perf_counter()
            runner(*inputs)
            times.append(time.perf_counter() - start)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            for _ in range(10):
                runner(*inputs)
    print(f"{rows}-row step after {context} cached tokens: {statistics.median(times) * 1e3:.2f} ms (median of 20);"
          " the table sums 10 steps")
    print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))


if __name__ == "__main__":
    main()
