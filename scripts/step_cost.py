"""Cost of one forward pass against the number of rows it carries (what sets FAFO's per-step price); the
same measurement `fafo bench --tune` makes, with any row counts.

    python scripts/step_cost.py --dtype bfloat16 --context 300
"""

from __future__ import annotations

import argparse

from fafo_cli import load
from fafo_cli.bench.tune import step_costs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    args = parser.parse_args()
    engine = load(args.model, dtype=args.dtype, method="vanilla")
    costs = step_costs(engine, args.context, tuple(args.rows), repeats=12)
    base = costs[args.rows[0]]
    for rows, ms in costs.items():
        print(f"{rows:3d} rows: {ms:6.1f} ms  ({ms / base:.2f}x one row)")

if __name__ == "__main__":
    main()
