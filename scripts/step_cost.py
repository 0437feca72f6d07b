"""Cost of one forward pass against the number of rows it carries (what sets FAFO's per-step price).

    python scripts/step_cost.py --dtype bfloat16 --context 300
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fafo_cli import load
from fafo_cli.engine.model import causal_attention


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    args = parser.parse_args()
    engine = load(args.model, dtype=args.dtype, method="vanilla")
    session, model = engine.session, engine.model
    ids = (engine.encode("Tell me a story.") * args.context)[:args.context]
    session.prefill(ids, reserve=max(args.rows))
    length = session.cache.length
    base = None
    for rows in args.rows:
        mask = torch.ones(rows, length + rows, dtype=torch.bool)
        times = []
        for _ in range(12):
            start = time.perf_counter()
            model.forward(torch.randint(0, 1000, (rows,)), torch.arange(length, length + rows), session.cache,
                          causal_attention(mask, model.scaling))  # written after the prefix, never committed
            times.append(time.perf_counter() - start)
        ms = statistics.median(times[2:]) * 1e3
        base = base or ms
        print(f"{rows:3d} rows: {ms:6.1f} ms  ({ms / base:.2f}x one row)")


if __name__ == "__main__":
    main()
