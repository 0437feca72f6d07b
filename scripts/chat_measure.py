"""Sampling speed of fafo vs vanilla on chat prompts, and greedy speed of turn 1 vs turn 4 of a chat.

    python scripts/chat_measure.py --tokens 128
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from fafo_cli import load


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompts", default="examples/chat-prompts.txt")
    args = parser.parse_args()
    engine = load(args.model, dtype=args.dtype)

    prompts = [line for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    rows = {"vanilla": [], "fafo": []}
    for i, prompt in enumerate(prompts):
        for method in ("vanilla", "fafo"):  # interleaved per prompt
            engine.reset()
            result = engine.complete(prompt, method=method, max_tokens=args.tokens, temperature=0.7, top_p=0.9,
                                     seed=i)
            rows[method].append(result.stats)
    print(f"sampling T=0.7 top-p 0.9, {len(prompts)} prompts, {args.tokens} tokens max, {args.dtype}")
    base = statistics.median(s.tokens_per_s for s in rows["vanilla"])
    for method, stats in rows.items():
        speed = statistics.median(s.tokens_per_s for s in stats)
        total = sum(s.generated_tokens for s in stats) / sum(s.decode_s + s.ttft_s for s in stats)
        tau = sum(s.generated_tokens for s in stats) / sum(s.steps for s in stats)
        print(f"  {method:8s} median {speed:6.1f} tok/s ({speed / base:.2f}x)  overall {total:6.1f} tok/s  "
              f"tau {tau:.2f}  accepted/drafted {sum(s.accepted_tokens for s in stats)}/"
              f"{sum(s.drafted_tokens for s in stats)}")

    print("greedy chat, 4 turns (each answer up to", args.tokens, "tokens):")
    for method in ("vanilla", "fafo"):
        engine.reset()
        messages = []
        for turn, prompt in enumerate(prompts[:4], 1):
            messages.append({"role": "user", "content": prompt})
            result = engine.complete(messages, method=method, max_tokens=args.tokens, temperature=0.0)
            messages.append({"role": "assistant", "content": result.text})
            s = result.stats
            print(f"  {method:8s} turn {turn}: prompt {s.prompt_tokens} tokens ({s.cached_prompt_tokens} cached, "
                  f"prefill {s.prefill_s * 1e3:.0f} ms)  {s.tokens_per_s:.1f} tok/s  tau {s.tokens_per_step:.2f}")


if __name__ == "__main__":
    main()
