"""A grouped-query-attention model's decoding step on CUDA with torch's `enable_gqa` (what steps use there) against
the query heads folded into their KV head's rows (runtime/model.py, folded_attention: what CPU steps use). With a
mask, which every graph step has, torch's CUDA kernels take `enable_gqa` only on the math path; folded, the
memory-efficient kernel takes it. A random-weight model of SmolLM2-135M's shape (9 query heads, 3 KV heads),
eager and as CUDA graphs, as `fafo doctor --gpu-report` measures steps.

    python scripts/gqa_steps.py --rows 1 8 64 --context 512 4096
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fafo_cli.bench import gpu_report
from fafo_cli.runtime.model import attention_kernels, folded_attention

import common


def enable_gqa_attention(mask: torch.Tensor, scaling: float):
    def attend(layer: int, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)

    return attend


def folded(mask: torch.Tensor, scaling: float):
    def attend(layer: int, q, k, v):
        return folded_attention(q, k, v, mask, scaling)

    return attend


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--shape", default="135m", choices=sorted(gpu_report.SHAPES), help="the model's shape")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64], help="rows a step")
    parser.add_argument("--context", type=int, nargs="+", default=[512, 4096], help="cached positions")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = gpu_report.random_llama(args.shape, device, gpu_report.report_dtype(device))
    print(f"{gpu_report.device_name(device)}, {args.shape} shape, {model.dtype}")
    print("| context | rows | enable_gqa eager ms | folded eager ms | enable_gqa graph ms | folded graph ms |")
    print("|---:|---:|---:|---:|---:|---:|")
    rows = tuple(args.rows)
    for context in args.context:
        with attention_kernels(device, max(rows)):  # as decoding steps run: no cuDNN attention
            gqa = gpu_report.measure(model, rows, context, print, attention=enable_gqa_attention)
            folds = gpu_report.measure(model, rows, context, print, attention=folded)
        cell = lambda t: "—" if t is None else f"{t:.3f}"  # noqa: E731
        for count in rows:
            print(f"| {context} | {count} | {gqa[count].eager_ms:.3f} | {folds[count].eager_ms:.3f} | "
                  f"{cell(gqa[count].graph_ms)} | {cell(folds[count].graph_ms)} |", flush=True)


if __name__ == "__main__":
    main()
