"""Eager decoding with CPU attention as it is now (`grouped_attention`: the query heads that share a KV head folded into
its rows, since 352fd4e) against torch's own grouped-query attention (`enable_gqa`, as before), side by side in one
process: the long suite's recall prompt at each context, prefilled once (every later request reuses it), then each
method's answer with one attention and then the other, alternately, `--repeats` times; medians of ms per step.

    python scripts/attention_ab.py --contexts 2048 8192 --tokens 48 --repeats 3
"""

from __future__ import annotations

import statistics
from contextlib import contextmanager

import torch.nn.functional as F

import common
from context_cost import prompt_at
from fafo_cli.decoders.fafo import attention as fafo_attention
from fafo_cli.runtime import model as runtime_model


def torch_grouped(q, k, v, mask, scale, memo=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


@contextmanager
def attention_as(function):
    """Every eager attention call of plain decoding and FAFO through `function` for a while."""
    saved = runtime_model.grouped_attention
    runtime_model.grouped_attention = fafo_attention.grouped_attention = function
    try:
        yield
    finally:
        runtime_model.grouped_attention = fafo_attention.grouped_attention = saved


def main() -> None:
    parser = common.parser(__doc__, "model", "dtype", "tokens", "repeats", "settings", tokens=48, repeats=3,
                           settings=["M=vanilla", "C=none", "C=stream"])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192], help="prompt lengths in tokens")
    args = parser.parse_args()
    engine = common.load_engine(args, compile="off")
    variants = {"folded": runtime_model.grouped_attention, "enable_gqa": torch_grouped}
    for context in args.contexts:
        messages = prompt_at(engine, context, args.tokens)
        engine.reset()
        engine.complete(messages, max_tokens=1, method="vanilla")  # the prefill, reused from here on
        for spec in args.settings:
            settings = common.parse_setting(spec)
            times: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(args.repeats):
                for name, function in variants.items():
                    with attention_as(function):
                        result = engine.complete(messages, max_tokens=args.tokens, **settings)
                    times[name].append(common.ms_per_step(result.stats))
            folded, before = (statistics.median(times[name]) for name in variants)
            print(f"{context:6d} {spec:12s} folded {folded:7.1f} ms/step  enable_gqa {before:7.1f} ms/step  "
                  f"{before / folded:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
