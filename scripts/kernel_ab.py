"""Our attention kernel at a git revision against the working tree's, side by side in one process (both
libraries loaded under their own op namespace, called alternately, median of the rounds), on decoding-shaped
calls: 30 layers of SmolLM2-135M's attention (9 query heads, 3 KV heads, dim 64; `--heads` another shape), a
separate cache per layer (30 MB in all after 1,300 tokens: the size of a CPU's L3), by default one row (a plain
step), 6 rows (4 see the whole cache, 2 a 256-position StreamingLLM view) and 12 verify rows (a long draft), each
after 300, 1,300 and 2,250 positions (`--rows`, `--contexts`). Between two layers' calls it reads 9 MB (untimed),
as a compiled step's matrix products do, so each layer's cache comes from memory: called back to back (`--evict-mb
0`) the caches stay in the L3, which flatters changes that rest on memory access. Also prints how far the first
two results are apart.
`--dtype float32` takes a float32 cache (what CPUs without AVX512-BF16 run), `--torch` adds torch's kernel as eager
steps call it where ours does not serve (the query heads folded into their KV head's rows, the mask built per call
as a step's attention builds it).

    python scripts/kernel_ab.py --base HEAD~1
    python scripts/kernel_ab.py --base 43739a5 --dtype float32 --torch
    python scripts/kernel_ab.py --base HEAD~1 --contexts 1300 8192 --rows 1 3 4+2 9
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from fafo_cli.compiled.kernels import loader
from fafo_cli.runtime.model import folded_attention

import common


def shape(text: str) -> tuple[int, int, int]:
    """`--rows` item: "N" (N rows that see the whole cache) or "A+P" (A that do, P that see the view)."""
    see_all, _, see_part = text.partition("+")
    return int(see_all) + int(see_part or 0), int(see_all), int(see_part or 0)


def query_dtype(op) -> torch.dtype:
    """bfloat16 queries with a bf16 cache, or float32 ones as earlier kernels took."""
    cache, rows = torch.zeros(2, 1, 16, dtype=torch.bfloat16), torch.ones(1, dtype=torch.bool)
    try:
        op(torch.zeros(1, 1, 16, dtype=torch.bfloat16), cache, cache, rows, ~rows, torch.ones(1, dtype=torch.bool),
           torch.ones(1, 1, dtype=torch.bool), 1.0)
        return torch.bfloat16
    except RuntimeError:
        return torch.float32


def torch_attend(q, k, v, sees_all, sees_part, visible, local, scale):
    """fafo::attend's call by torch's kernel: [rows, heads, dim] over [slots, kv_heads, dim]."""
    mask = torch.cat([sees_all[:, None] | (sees_part[:, None] & visible[None, :]), local], dim=1)
    out = folded_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, scale)
    return out[0].transpose(0, 1)


def compare(ops: dict, slots: int, rows: int, see_all: int, see_part: int, rounds: int, evict: torch.Tensor | None,
            dtype: torch.dtype, heads: int = 9, kv_heads: int = 3, dim: int = 64, layers: int = 30) -> str:
    cached = slots - rows
    keys = [torch.randn(slots, kv_heads, dim).to(dtype) for _ in range(layers)]
    values = [torch.randn(slots, kv_heads, dim).to(dtype) for _ in range(layers)]
    q = torch.randn(rows, heads, dim).to(dtype)
    sees_all = torch.arange(rows) < see_all
    sees_part = ~sees_all & (torch.arange(rows) < see_all + see_part)
    visible = torch.zeros(cached, layers, dtype=torch.bool)
    visible[:4] = visible[-252:] = True
    local = torch.ones(rows, rows, dtype=torch.bool).tril()
    queries = {name: q.to(query_dtype(op) if dtype == torch.bfloat16 and op is not torch_attend else dtype)
               for name, op in ops.items()}  # converted before the clock starts
    first = [op(queries[name], keys[0], values[0], sees_all, sees_part, visible[:, 0], local, 0.125)
             for name, op in ops.items()]
    apart = (first[0] - first[1]).abs().max().item()
    times: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(rounds):
        for name, op in ops.items():
            spent = 0.0
            for layer in range(layers):
                if evict is not None:  # what a layer's matrix products read between two attention calls
                    evict.sum()
                start = time.perf_counter()
                op(queries[name], keys[layer], values[layer], sees_all, sees_part, visible[:, layer], local, 0.125)
                spent += time.perf_counter() - start
            times[name].append(spent)
    cells = "  ".join(f"{name} {statistics.median(t) * 1e3:6.2f} ms" for name, t in times.items())
    return f"{rows:2d} rows after {cached:4d} cached: {cells}  (results apart by {apart:.1e})"


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--base", default="HEAD", help="git revision of the kernel to compare with")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--evict-mb", type=float, default=9.0,
                        help="megabytes read between two layers' calls, untimed (SmolLM2's weights per layer: 9), so "
                             "each layer's cache comes from memory as inside a compiled step; 0: back to back")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="the cache's dtype")
    parser.add_argument("--torch", action="store_true", help="torch's kernel too, as a third column")
    parser.add_argument("--contexts", type=int, nargs="+", default=[300, 1300, 2250], help="cached positions + rows")
    parser.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], metavar=("HEADS", "KV_HEADS", "DIM"),
                        help="the attention's shape (default SmolLM2-135M's; Qwen2.5-1.5B's: 12 2 128)")
    parser.add_argument("--rows", type=shape, nargs="+", default=[shape("1"), shape("4+2"), shape("12")],
                        help='rows per call: "N" verify rows (see the whole cache), or "A+P" (P see a 256-slot view)')
    args = parser.parse_args()
    evict = torch.ones(int(args.evict_mb * 1e6 / 4)) if args.evict_mb > 0 else None
    base = common.kernel_source(args.base, "attention_op.cpp")
    with tempfile.TemporaryDirectory() as folder:
        ops = {"base": loader.load_as(base, "fafo_base", Path(folder)).attend,
               "tree": loader.load_as(loader.SOURCES[0].read_text(), "fafo_tree", Path(folder)).attend}
        if args.torch:
            ops["torch"] = torch_attend
        print(f"{args.base} (base) against the working tree (tree), 30 layers per call set, median of {args.rounds}, "
              f"{args.evict_mb:g} MB read between layers")
        for rows, see_all, see_part in args.rows:
            for slots in args.contexts:
                print(compare(ops, slots, rows, see_all, see_part, rounds=args.rounds, evict=evict,
                              dtype=getattr(torch, args.dtype), heads=args.heads[0], kv_heads=args.heads[1],
                              dim=args.heads[2]), flush=True)


if __name__ == "__main__":
    main()
