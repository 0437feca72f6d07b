"""A float32 CPU step's linear layers two ways: torch's `x @ Wᵀ` (F.linear) against `W @ xᵀ`, which eager float32
CPU steps of several rows use (runtime/model.py, `_columns_linear`). First each kind of matrix of the model, every
layer's in turn so that the weights come from memory as in a step (ms per pass over all layers, the two ways
alternated); then whole eager passes by row count (`fafo bench`'s step-cost measurement), one way then the other
in one process.

    python scripts/linear_layouts.py --rows 1 2 3 4 8 16
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import common
from fafo_cli.bench import tune
from fafo_cli.compiled.timing import median_ms

MATRICES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "o": "self_attn.o_proj", "gate": "mlp.gate_proj",
            "down": "mlp.down_proj"}


def main() -> None:
    parser = common.parser(__doc__, "model", "repeats", repeats=9)
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 3, 4, 8, 16], help="row counts to measure")
    args = parser.parse_args()
    engine = common.load_engine(args, dtype="float32", compile="off")  # dense: the layouts are of nn.Linear weights
    model = engine.model
    if model.step_linear is None:
        raise SystemExit("this model's steps do not use W @ xᵀ (a float32 model on the CPU does)")
    with torch.inference_mode():
        print(f"{engine.name} · float32 · ms per pass over {len(model.layers)} layers, F.linear / W @ xᵀ")
        for kind, path in [*MATRICES.items(), ("head", None)]:
            weights = ([model.lm_head.weight] if path is None else
                       [layer.get_submodule(path).weight for layer in model.layers])
            line = f"{kind:5s} {tuple(weights[0].shape)!s:14s}"
            for rows in args.rows:
                x = torch.randn(rows, weights[0].shape[1])
                ms = median_ms({"plain": lambda: [F.linear(x, w) for w in weights],
                                "columns": lambda: [w @ x.T for w in weights]}, args.repeats, x.device)
                line += f"  {rows}: {ms['plain']:6.2f} / {ms['columns']:6.2f}"
            print(line, flush=True)
        layouts = {"F.linear": None, "W @ xᵀ": model.step_linear}
        for name, layout in layouts.items():
            model.step_linear = layout
            costs = tune.step_costs(engine, row_counts=tuple(args.rows))
            print(f"whole pass, {name:8s} " + "  ".join(f"{rows}: {ms:6.1f}" for rows, ms in costs.items()), flush=True)


if __name__ == "__main__":
    main()
