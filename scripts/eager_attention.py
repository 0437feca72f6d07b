"""Eager CPU attention by our kernel (fafo::attend, what eager steps use where the CPU has AVX2 or AVX-512) against
torch's (what they use elsewhere), in whole eager passes of a model over its packed blocks: a prompt of each --contexts
length prefilled once, then passes of each --rows count with one attention and the other alternately; medians of
ms per pass.

    python scripts/eager_attention.py --dtype float32 --contexts 300 1500 --rows 1 2 4 8
"""

from __future__ import annotations

import statistics
import time

import torch

import common
from fafo_cli import hub
from fafo_cli.compiled.kernels import loader
from fafo_cli.runtime import model as runtime_model
from fafo_cli.runtime.model import causal_attention, prefix_causal_mask


def main() -> None:
    parser = common.parser(__doc__, "model", "dtype")
    parser.add_argument("--contexts", type=int, nargs="+", default=[300, 1500], help="cached positions")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    engine = common.load_engine(args)
    loader.load(hub.cache_dir() / "compiled")
    kernels = {"ours": torch.ops.fafo.attend, "torch's": None}
    session, model = engine.session, engine.model
    print(f"{engine.name} · {model.dtype} · {model.packed_matrices} packed matrices · ms per eager pass")
    with torch.inference_mode():
        for context in args.contexts:
            session.prefill([100 + (i * 7919) % 40000 for i in range(context)], reserve=max(args.rows))
            for rows in args.rows:
                attend = causal_attention(prefix_causal_mask(context, rows, model.device), model.scaling)
                times: dict[str, list[float]] = {name: [] for name in kernels}
                for round in range(args.rounds + 2):
                    for name, kernel in kernels.items():
                        runtime_model.serve_cpu_attention(kernel, reads_bf16=False)
                        started = time.perf_counter()
                        session.forward(list(range(5, 5 + rows)), attend)
                        if round >= 2:  # the first two warm up
                            times[name].append(time.perf_counter() - started)
                        session.rollback(context)
                print(f"{context:6d} cached, {rows:2d} rows: " + ", ".join(
                    f"{name} {statistics.median(t) * 1e3:.1f}" for name, t in times.items()), flush=True)
            session.rollback(0)


if __name__ == "__main__":
    main()
