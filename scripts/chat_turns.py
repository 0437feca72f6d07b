"""A greedy chat of several turns, one engine throughout as `fafo chat` keeps it: each turn's prompt tokens, how
many were reused from the cache, the prefill time, tokens/s and τ, for vanilla and each setting. No bench suite
measures this: the bench prefills every prompt from scratch.

    python scripts/chat_turns.py --tokens 128 --settings M=fafo
"""

from __future__ import annotations

from pathlib import Path

import common


def main() -> None:
    parser = common.parser(__doc__, "model", "dtype", "tokens", "compile", "settings", tokens=128)
    parser.add_argument("--messages", default="examples/chat-prompts.txt", help="the user's messages, one a line")
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args()
    engine = common.load_engine(args)
    lines = Path(args.messages).read_text(encoding="utf-8").splitlines()
    user_messages = [line for line in lines if line.strip()][:args.turns]
    print(f"greedy chat, {len(user_messages)} turns (each answer up to {args.tokens} tokens):")
    for spec in ["M=vanilla", *args.settings]:
        engine.reset()
        messages = []
        for turn, text in enumerate(user_messages, 1):
            messages.append({"role": "user", "content": text})
            result = engine.complete(messages, max_tokens=args.tokens, temperature=0.0, **common.parse_setting(spec))
            messages.append({"role": "assistant", "content": result.text})
            s = result.stats
            print(f"  {spec:12s} turn {turn}: prompt {s.prompt_tokens} tokens ({s.cached_prompt_tokens} cached, "
                  f"prefill {s.prefill_s * 1e3:.0f} ms)  {s.tokens_per_s:.1f} tok/s  τ {s.tokens_per_step:.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
