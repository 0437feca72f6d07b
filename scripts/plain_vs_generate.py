"""Our plain engine vs transformers' generate on the same model, prompt and machine (issue 2's measurement).

Runs interleaved (ours, generate, ours, generate, ...) so machine drift hits both equally and prints the
median tokens/s of each (new tokens / wall time of the whole call, prefill included) and their ratio.
`fafo bench` will supersede this with the full side-by-side benchmark.

    python scripts/plain_vs_generate.py --dtype bfloat16 --tokens 256 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fafo_cli import load

PROMPT = "Write a detailed story about a lighthouse keeper who finds a message in a bottle."


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    engine = load(args.model, dtype=args.dtype)
    hf = engine.model.hf
    ids = engine.encode(PROMPT)
    prompt = torch.tensor([ids])

    def ours() -> tuple[int, float]:
        engine.reset()  # no cache reuse between repetitions: both sides prefill the whole prompt
        start = time.perf_counter()
        result = engine.complete(PROMPT, max_tokens=args.tokens)
        return len(result.token_ids), time.perf_counter() - start

    def theirs() -> tuple[int, float]:
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.tokens,
                              do_sample=False)
        return out.shape[1] - len(ids), time.perf_counter() - start

    ours(), theirs()  # warm-up
    rates = {"fafo-cli vanilla": [], "transformers generate": []}
    counts = {}
    for _ in range(args.repeats):
        for name, fn in (("fafo-cli vanilla", ours), ("transformers generate", theirs)):
            n, seconds = fn()
            rates[name].append(n / seconds)
            counts[name] = n
    print(f"model={engine.name} dtype={args.dtype} prompt={len(ids)} tokens, threads={torch.get_num_threads()}")
    for name, values in rates.items():
        print(f"{name:24s} {statistics.median(values):7.2f} tok/s (median of {len(values)}; "
              f"min {min(values):.2f}, max {max(values):.2f}; {counts[name]} new tokens)")
    ratio = statistics.median(rates["fafo-cli vanilla"]) / statistics.median(rates["transformers generate"])
    print(f"ratio ours/generate: {ratio:.2f}x")


if __name__ == "__main__":
    main()
