"""`fafo serve` against `fafo run`'s engine on the same prompts: decoding tokens/s and time to the first token seen
by a streaming client, then the throughput of several clients at once.

The server is the real command in a subprocess (its own process, as a user runs it); the in-process engine
streams the same prompts exactly as `fafo run` does. They alternate per prompt and repetition, so drift hits
both alike; one never runs while the other does. Each side answers a prompt once untimed first, so both reuse its
cached prefix and the times compare the serving itself. Then `--clients` clients stream different prompts at once.

    python scripts/serve_load.py --dtype float32 --tokens 128 --repeats 3 --clients 4
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import threading
import time

import common

READY = re.compile(r"serving .* on (http://\S+?)/? ")


def start_server(args) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "fafo_cli", "serve", *([args.model] if args.model else []), "--port", "0",
               "--dtype", args.dtype, "--no-compile", "--queue", str(max(32, args.clients))]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=os.environ)
    for line in server.stderr:
        found = READY.search(line)
        if found:
            threading.Thread(target=server.stderr.read, daemon=True).start()  # keep its log from filling the pipe
            return server, found.group(1).rstrip("/").removesuffix("/v1") + "/v1"
    raise SystemExit(f"fafo serve exited with {server.wait()} before serving")


def through_server(client, model: str, messages, tokens: int) -> tuple[float, float, int]:
    """(tokens/s after the first token, seconds to the first token, tokens) as a streaming client sees them."""
    started, first, count = time.perf_counter(), None, 0
    stream = client.chat.completions.create(model=model, messages=list(messages), max_tokens=tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter()
        if chunk.usage:
            count = chunk.usage.completion_tokens
    last = time.perf_counter()
    return (count - 1) / (last - first) if count > 1 else 0.0, first - started, count


def through_engine(engine, messages, tokens: int) -> tuple[float, float, int]:
    """The same as `fafo run` streams it: the engine's own figures."""
    stats = list(engine.stream(list(messages), max_tokens=tokens, temperature=0.0))[-1].stats
    return stats.tokens_per_s, stats.ttft_s, stats.generated_tokens


def main() -> None:
    parser = common.parser(__doc__, "model", "dtype", "tokens", "repeats", "suites", "samples", suites="chat,code",
                           samples=2)
    parser.add_argument("--clients", type=int, default=4, help="clients streaming at once in the throughput part")
    args = parser.parse_args()
    from openai import OpenAI

    engine = common.load_engine(args, compile="off")
    samples = common.prompts(args, engine)
    server, url = start_server(args)
    try:
        client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        for sample in samples:
            # both sides have seen the prompt once (its cache kept), so the times compare the serving, not prefill
            through_server(client, model, sample.messages, 8)
            through_engine(engine, sample.messages, 8)
            ours, served = [], []
            for _ in range(args.repeats):
                ours.append(through_engine(engine, sample.messages, args.tokens))
                served.append(through_server(client, model, sample.messages, args.tokens))
            run_speed, serve_speed = (statistics.median(r[0] for r in runs) for runs in (ours, served))
            run_ttft, serve_ttft = (statistics.median(r[1] for r in runs) for runs in (ours, served))
            print(f"{sample.suite:10s} {sample.id:28s} run {run_speed:6.1f} tok/s TTFT {run_ttft:5.2f} s · serve "
                  f"{serve_speed:6.1f} tok/s TTFT {serve_ttft:5.2f} s · {serve_speed / run_speed:.0%} of run "
                  f"({ours[0][2]}/{served[0][2]} tokens)", flush=True)
        del engine  # the throughput part measures the server alone
        results: list[tuple[float, float, int]] = []
        chosen = [samples[i % len(samples)] for i in range(args.clients)]
        threads = [threading.Thread(target=lambda s=s: results.append(through_server(client, model, s.messages,
                                                                                     args.tokens)))
                   for s in chosen]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - started
        total = sum(r[2] for r in results)
        print(f"{args.clients} clients at once: {total} tokens in {wall:.1f} s = {total / wall:.1f} tok/s in all; "
              f"first tokens after {min(r[1] for r in results):.2f}-{max(r[1] for r in results):.2f} s")
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
