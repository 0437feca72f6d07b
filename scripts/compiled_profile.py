"""Where a compiled step's time goes, kernel by kernel: builds a package with inductor's kernel profiling on
(in a temporary folder, not the user's cache; minutes), times a FAFO-shaped step and prints torch.profiler's
table. The default shape is FAFO's default step after a summarize-length prompt: 9 rows, of which 4 verify
rows see the whole cache and 5 window rows a StreamingLLM view (4 sink + 252 recent positions); rows beyond
those two groups (`--rows 12`: the previous versions' padded package) are padding.

    python scripts/compiled_profile.py --context 1300
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch._inductor.config as inductor_config

from fafo_cli import load
from fafo_cli.engine import compiled


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context", type=int, default=1300)
    parser.add_argument("--rows", type=int, default=9)
    parser.add_argument("--see-all", type=int, default=4, help="rows that see the whole cache")
    parser.add_argument("--see-part", type=int, default=5, help="rows that see the sink and recent positions")
    parser.add_argument("--recent", type=int, default=252)
    args = parser.parse_args()
    inductor_config.cpp.enable_kernel_profile = True
    inductor_config.cpp.descriptive_names = "inductor_node"
    model = load(args.model, dtype=args.dtype, method="vanilla").model
    rows = args.rows
    with tempfile.TemporaryDirectory() as folder:
        package = Path(folder) / "packages" / f"rows{rows}.pt2"
        compiled.build(model, rows, package)
        profile_step(compiled.load_package(package), model, args)


def profile_step(runner, model, args) -> None:
    rows, context = args.rows, args.context
    cache = model.new_cache(context + rows, context + rows)
    cache.keys.normal_()
    cache.values.normal_()
    cache.commit(context)
    cache.store_as(compiled.stored_dtype(model))  # what the package was traced with
    sees_all = torch.arange(rows) < args.see_all
    sees_part = ~sees_all & (torch.arange(rows) < args.see_all + args.see_part)
    visible = torch.zeros(context, len(model.layers), dtype=torch.bool)
    visible[:4] = visible[-args.recent:] = True
    inputs = (torch.zeros(rows, dtype=torch.long), torch.arange(context, context + rows),
              torch.ones(rows, rows, dtype=torch.bool).tril(), sees_all, sees_part, visible,
              list(cache.keys.unbind(0)), list(cache.values.unbind(0)))
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
