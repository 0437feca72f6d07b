"""`fafo serve` against real clients: uvicorn on loopback serving a tiny float32 model, spoken to with the official
`openai` client and raw HTTP (httpx). Answers equal the engine's own (which equal transformers' generate), under
concurrency too; a client that leaves frees the engine; bad input gets the right status in OpenAI's error shape;
the command itself starts, refuses bad addresses and stops cleanly on a signal."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx
import openai
import pytest

from fafo_cli import load
from fafo_cli.cli import entrypoint
from fafo_cli.serve import server as server_mod

from .conftest import build_tiny_model, hf_greedy

KEY = "sk-test-5ecret"
ORIGIN = "http://page.example"
LONG = 1800  # tokens of an answer that is still running when the test needs it to be (the tiny model's context: 2048)


@dataclass
class Live:
    """A `fafo serve` server running in a thread of the test process, and the lines it logged."""
    url: str
    name: str
    server: server_mod.Server
    thread: threading.Thread
    log: list[str] = field(default_factory=list)

    @property
    def health(self) -> str:
        return self.url.removesuffix("/v1") + "/health"

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=kwargs.pop("api_key", "unused"), max_retries=0, timeout=60,
                             **kwargs)

    def logged(self, pattern: str, timeout: float = 10.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [line for line in self.log if re.search(pattern, line)]
            if found:
                return found[-1]
            time.sleep(0.02)
        raise AssertionError(f"nothing logged matches {pattern!r}: {self.log[-5:]}")


_LEVEL_BEFORE: list[int] = []  # the request log's level before the servers running now set it to DEBUG (_start)


class Lines(logging.Handler):
    def __init__(self, lines: list[str]):
        super().__init__()
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _start(engine, loopback: bool | None = None, sock: socket.socket | None = None, **options) -> Live:
    """A server on a free loopback port (or `sock`); `loopback=False`: as if it listened beyond loopback too."""
    sock = sock or server_mod.bind("127.0.0.1", 0)
    loopback = server_mod.is_loopback(sock) if loopback is None else loopback
    server = server_mod.create(engine, server_mod.Options(**options), loopback=loopback)
    thread = threading.Thread(target=server.serve_on, args=(sock,), daemon=True)
    live = Live(server_mod.url(sock), engine.name, server, thread)
    live.handler = Lines(live.log)
    logger = logging.getLogger("fafo.serve")
    if not any(isinstance(handler, Lines) for handler in logger.handlers):  # the first of the servers running now
        _LEVEL_BEFORE[:] = [logger.level]
    logger.addHandler(live.handler)
    logger.setLevel(logging.DEBUG)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    return live


def _stop(live: Live) -> None:
    live.server.stop()
    live.thread.join(30)
    logger = logging.getLogger("fafo.serve")
    logger.removeHandler(live.handler)
    if not any(isinstance(handler, Lines) for handler in logger.handlers):
        logger.setLevel(_LEVEL_BEFORE.pop())
    assert not live.thread.is_alive()


@pytest.fixture(scope="module")
def served(tiny):
    live = _start(load(str(tiny), dtype="float32"))
    yield live
    _stop(live)


@pytest.fixture(scope="module")
def guarded(tiny):
    """With an API key, CORS for one origin and room for one waiting request."""
    live = _start(load(str(tiny), dtype="float32"), api_key=KEY, cors=(ORIGIN,), queue=1)
    yield live
    _stop(live)


@pytest.fixture(scope="module")
def reference(tiny):
    """The engine as `fafo run` uses it, the same settings as the server's: what every answer must equal."""
    return load(str(tiny), dtype="float32")


def _sse(response: httpx.Response) -> list:
    """The data of a server-sent event stream, JSON decoded ([DONE] as is)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]
TEXT = "The list of colours: red, green,"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind", ["chat", "text"])
def test_answers_equal_the_engine_and_transformers(served, reference, tiny, kind, stream):
    client = served.client()
    if kind == "chat":
        expected = reference.complete(CHAT, max_tokens=20)
        prompt_ids = reference.encode(CHAT)
        call = client.chat.completions.create
        arguments = dict(model=served.name, messages=CHAT, max_tokens=20)
    else:
        expected = reference.complete(TEXT, max_tokens=20, chat_template=False)
        prompt_ids = reference.encode(TEXT, reference.request_config(chat_template=False))
        call = client.completions.create
        arguments = dict(model=served.name, prompt=TEXT, max_tokens=20)
    assert expected.token_ids == hf_greedy(tiny, prompt_ids, 20)  # the engine equals transformers' generate
    if stream:
        chunks = list(call(**arguments, stream=True, stream_options={"include_usage": True}))
        pieces = [(c.choices[0].delta.content if kind == "chat" else c.choices[0].text) or ""
                  for c in chunks if c.choices]
        text, usage = "".join(pieces), chunks[-1].usage
        finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(finishing) == 1 and finishing[0] is chunks[-2] and not chunks[-1].choices
        finish, fafo = finishing[0].choices[0].finish_reason, finishing[0].model_extra["fafo"]
        assert len({c.id for c in chunks}) == 1
        if kind == "chat":
            assert chunks[0].choices[0].delta.role == "assistant"
    else:
        response = call(**arguments)
        choice = response.choices[0]
        text = choice.message.content if kind == "chat" else choice.text
        usage, finish, fafo = response.usage, choice.finish_reason, response.model_extra["fafo"]
        assert response.object == ("chat.completion" if kind == "chat" else "text_completion")
        assert response.id.startswith("chatcmpl-" if kind == "chat" else "cmpl-") and response.model == served.name
    assert text == expected.text and finish == "length"
    assert usage.completion_tokens == len(expected.token_ids) == 20
    assert usage.prompt_tokens == len(prompt_ids) and usage.total_tokens == len(prompt_ids) + 20
    assert 0 <= usage.prompt_tokens_details.cached_tokens < len(prompt_ids)
    assert fafo["method"] == "fafo" and fafo["tau"] == pytest.approx(20 / fafo["steps"], abs=1e-3)
    assert 0 <= fafo["accepted"] <= fafo["drafted"] and fafo["tokens_per_s"] > 0
    assert fafo["draft_passes"] is None  # (FAFO's guesses cost no pass of their own)


def test_a_one_token_answer_has_no_speed(served):
    """A one-token answer has no decode time: its speed is null, not 0.0 (which pulled a client's average down)."""
    with httpx.Client(base_url=served.url, timeout=60) as http:
        response = http.post("/completions", json={"prompt": "Say one word.", "max_tokens": 1})
    assert response.status_code == 200 and response.json()["fafo"]["tokens_per_s"] is None


def test_settings_per_request(served, reference):
    """Our settings as extra fields, and OpenAI's sampling fields, reach the engine: the same answer as the engine
    gives with those settings."""
    client = served.client()
    peer = client.chat.completions.create(model=served.name, messages=CHAT, max_tokens=12,
                                          extra_body={"method": "prompt-lookup", "lookup_tokens": 4})
    assert peer.model_extra["fafo"]["method"] == "prompt-lookup"
    assert peer.choices[0].message.content == reference.complete(CHAT, max_tokens=12).text
    drafting = client.chat.completions.create(model=served.name, messages=CHAT, max_tokens=12,
                                              extra_body={"method": "quantspec"}).model_extra["fafo"]
    assert drafting["draft_passes"] > 0 and drafting["tau"] == pytest.approx(12 / drafting["steps"], abs=1e-3)
    sampled = [client.chat.completions.create(model=served.name, messages=CHAT, max_tokens=12, temperature=0.9,
                                              top_p=0.8, seed=7) for _ in range(2)]
    expected = reference.complete(CHAT, max_tokens=12, temperature=0.9, top_p=0.8, seed=7).text
    assert [s.choices[0].message.content for s in sampled] == [expected, expected]
    assert sampled[0].model_extra["fafo"]["seed"] == 7
    developer = [{"role": "developer", "content": "You are terse."}, CHAT[1]]  # OpenAI's newer name for system
    answer = client.chat.completions.create(model=served.name, messages=developer, max_tokens=12)
    assert answer.choices[0].message.content == reference.complete(CHAT, max_tokens=12).text
    # ids of the caller's end user and cache, storage off and a speaker's name (this template shows none): accepted
    named = [CHAT[0], {**CHAT[1], "name": "bob"}]
    answer = client.chat.completions.create(model=served.name, messages=named, max_tokens=12, user="u1", store=False,
                                            extra_body={"safety_identifier": "u1", "prompt_cache_key": "k"})
    assert answer.choices[0].message.content == reference.complete(CHAT, max_tokens=12).text
    from fafo_cli.serve import schema

    assert schema.parse({"messages": named}, "chat", reference, served.name).prompt[1]["name"] == "bob"  # kept


def test_a_request_without_a_limit_gets_openais_default(served, reference):
    """As OpenAI's: a chat without max_tokens is bound by the context only (no cut at `fafo run`'s 512), a completion
    gets 16 tokens."""
    messages = [{"role": "user", "content": ("red green blue " * 120)[:1300]}]
    room = reference.model.max_context - len(reference.encode(messages))
    assert room > 512
    with httpx.Client(base_url=served.url, timeout=120) as http:
        chat = http.post("/chat/completions", json={"messages": messages, "method": "vanilla"}).json()
        text = http.post("/completions", json={"prompt": messages[0]["content"]}).json()
    assert chat["usage"]["completion_tokens"] == room and chat["choices"][0]["finish_reason"] == "length"
    assert text["usage"]["completion_tokens"] == 16 and text["choices"][0]["finish_reason"] == "length"


def test_a_server_limit_bounds_requests_without_one(tiny):
    """`--max-tokens` given to `fafo serve` (Options.max_tokens): the limit of requests that give none."""
    live = _start(load(str(tiny), dtype="float32"), max_tokens=7)
    try:
        with httpx.Client(base_url=live.url, timeout=30) as http:
            unlimited = http.post("/chat/completions", json={"messages": MESSAGES}).json()
            asked = http.post("/chat/completions", json={"messages": MESSAGES, "max_completion_tokens": 9}).json()
        assert unlimited["usage"]["completion_tokens"] == 7 and asked["usage"]["completion_tokens"] == 9
    finally:
        _stop(live)


def test_the_command_gives_the_request_log_back_as_it_found_it(tiny, monkeypatch):
    """A handler left on the stderr of a finished command (here pytest's capture, since closed) would fail every later
    log line of every server in the process, each with a 'Logging error' traceback."""
    from fafo_cli.serve import server

    loggers = [logging.getLogger(name) for name in ("fafo.serve", "uvicorn", "uvicorn.error", "uvicorn.access")]

    def state():
        return [(logger.handlers[:], logger.level, logger.propagate) for logger in loggers]

    before, seen = state(), []
    monkeypatch.setattr(server, "serve", lambda engine, sock, options: seen.append(state()))
    assert entrypoint(["serve", str(tiny), "--dtype", "float32", "--port", "0"]) == 0
    assert seen and seen[0] != before  # its own handlers while it ran
    assert state() == before


def test_the_command_tells_a_given_max_tokens_from_the_default(tiny, tmp_path, monkeypatch):
    """The server's limit is `--max-tokens` or the config file's `max_tokens` (even at 512); the default's is none."""
    from fafo_cli.serve import server

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "home"))
    served = []
    monkeypatch.setattr(server, "serve", lambda engine, sock, options: served.append(options.max_tokens))
    # while it ran it would drop the other servers' log lines
    monkeypatch.setattr(server, "request_log", lambda verbose: contextlib.nullcontext())
    command = ["serve", str(tiny), "--dtype", "float32", "--port", "0"]
    other = tmp_path / "other.yaml"
    other.write_text("temperature: 0.5\n")
    assert entrypoint(command) == 0 and entrypoint([*command, "--config", str(other)]) == 0
    assert entrypoint([*command, "--max-tokens", "64"]) == 0
    (tmp_path / "home" / "fafo").mkdir(parents=True)
    (tmp_path / "home" / "fafo" / "config.yaml").write_text("max_tokens: 512\n")
    assert entrypoint(command) == 0
    assert served == [None, None, 64, 512]


def test_sampling_fields_without_a_temperature_sample_at_temperature_1(served, reference):
    """OpenAI's temperature is 1 when not sent: top_p (top_k, min_p) alone samples on a model that is greedy by
    default, rather than being refused as useless while greedy."""
    client = served.client()
    greedy = reference.complete(CHAT, max_tokens=12).text
    for extra in ({"top_p": 0.8}, {"top_k": 5}, {"min_p": 0.05}):
        expected = reference.complete(CHAT, max_tokens=12, temperature=1.0, seed=7, **extra).text
        assert expected != greedy
        arguments = dict(model=served.name, messages=CHAT, max_tokens=12, seed=7)
        if "top_p" in extra:
            answer = client.chat.completions.create(**arguments, **extra)
        else:
            answer = client.chat.completions.create(**arguments, extra_body=extra)
        assert answer.choices[0].message.content == expected and answer.model_extra["fafo"]["seed"] == 7, extra
    # a neutral value asks for nothing: still the model's default, greedy
    neutral = client.chat.completions.create(model=served.name, messages=CHAT, max_tokens=12, top_p=1)
    assert neutral.choices[0].message.content == greedy and neutral.model_extra["fafo"]["seed"] is None
    fresh = client.chat.completions.create(model=served.name, messages=CHAT, max_tokens=12, temperature=1.0, seed=-1)
    assert isinstance(fresh.model_extra["fafo"]["seed"], int)  # -1: a fresh seed, as SillyTavern means it
    signed = client.chat.completions.create(model=served.name, messages=CHAT, max_tokens=12, temperature=1.0, seed=-7)
    expected = reference.complete(CHAT, max_tokens=12, temperature=1.0, seed=2**64 - 7).text
    assert signed.choices[0].message.content == expected and signed.model_extra["fafo"]["seed"] == 2**64 - 7
    # what clients send explicitly that asks for nothing (no tools, no biases, plain text)
    neutral = client.chat.completions.create(model=served.name, messages=CHAT, max_tokens=12, tools=[],
                                             tool_choice="none", logit_bias={}, response_format={"type": "text"},
                                             service_tier="auto", top_logprobs=0, metadata={"app": "test"})
    assert neutral.choices[0].message.content == greedy
    # a message's text parts are its lines, as vLLM and llama.cpp's server join them
    parts = [CHAT[0], {"role": "user", "content": [{"type": "text", "text": "Name three"},
                                                   {"type": "text", "text": "colours."}]}]
    joined = [CHAT[0], {"role": "user", "content": "Name three\ncolours."}]
    assert client.chat.completions.create(model=served.name, messages=parts, max_tokens=12).choices[0].message.content \
        == reference.complete(joined, max_tokens=12).text
    seeded = client.chat.completions.create(model=served.name, messages=CHAT, max_tokens=12, seed=7)  # greedy too
    assert seeded.choices[0].message.content == greedy and seeded.model_extra["fafo"]["seed"] is None
    # top_p beside temperature 0, as clients' presets send it (OpenAI takes it): greedy, as asked
    nucleus = client.chat.completions.create(model=served.name, messages=CHAT, max_tokens=12, temperature=0,
                                             top_p=0.5)
    assert nucleus.choices[0].message.content == greedy
    preset = client.chat.completions.create(model=served.name, messages=CHAT, max_tokens=12, temperature=0,
                                            extra_body={"top_k": 40, "min_p": 0.05})  # (Open WebUI's, SillyTavern's)
    assert preset.choices[0].message.content == greedy


def test_top_p_zero_is_greedy(served, reference):
    """OpenAI's top_p goes down to 0, which keeps the likeliest token only."""
    client = served.client()
    greedy = reference.complete(CHAT, max_tokens=12).text
    assert reference.complete(CHAT, max_tokens=12, temperature=0.9, seed=3).text != greedy
    for temperature in (None, 0, 0.9):
        answer = client.chat.completions.create(model=served.name, messages=CHAT, max_tokens=12, top_p=0,
                                                temperature=temperature, seed=3)
        assert answer.choices[0].message.content == greedy, temperature
    with httpx.Client(base_url=served.url, timeout=30) as http:
        for body, param, words in [({"top_p": 0, "top_k": 5}, "top_k", "no effect with top_p 0"),
                                   ({"top_p": -0.1}, "top_p", "between 0 and 1"),
                                   ({"top_p": 1.5}, "top_p", "between 0 and 1"),
                                   ({"top_p": False}, "top_p", "must be a number"),
                                   ({"seed": -2**63 - 1}, "seed", "from -2**63 to 2**64 - 1"),
                                   ({"seed": 2**64}, "seed", "from -2**63 to 2**64 - 1")]:
            error = _check_error(http.post("/chat/completions", json={"messages": MESSAGES, **body}), 400)
            assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_with_include_usage_every_chunk_before_the_usage_has_a_null_usage(served, kind):
    path, body = ("/chat/completions", {"messages": MESSAGES}) if kind == "chat" else ("/completions", {"prompt": TEXT})
    body = {**body, "max_tokens": 5, "stream": True}
    with httpx.Client(base_url=served.url, timeout=30) as http:
        with http.stream("POST", path, json={**body, "stream_options": {"include_usage": True}}) as response:
            *chunks, usage, done = _sse(response)
        with http.stream("POST", path, json=body) as response:
            *plain, _ = _sse(response)
    assert done == "[DONE]" and usage["usage"]["completion_tokens"] == 5 and not usage["choices"]
    assert len(chunks) >= 2 and all("usage" in c and c["usage"] is None for c in chunks), chunks
    assert not any("usage" in c for c in plain), plain


def test_the_context_length_error_names_the_field_sent(served):
    with httpx.Client(base_url=served.url, timeout=30) as http:
        for name in ("max_tokens", "max_completion_tokens"):
            error = _check_error(http.post("/chat/completions", json={"messages": MESSAGES, name: 5000}), 400)
            assert error["code"] == "context_length_exceeded" and error["param"] == name
            assert f"so {name} can be at most" in error["message"], error


def test_continued_conversations_prefill_only_their_new_tokens(served, reference):
    """A second turn reuses the first's cache, even after another client's conversation came in between."""
    client = served.client()
    first = [{"role": "user", "content": "Tell me about the sea, please."}]
    answer = client.chat.completions.create(model=served.name, messages=first, max_tokens=16)
    other = [{"role": "user", "content": "Something else entirely: what is a prime?"}]
    client.chat.completions.create(model=served.name, messages=other, max_tokens=16)
    second = first + [{"role": "assistant", "content": answer.choices[0].message.content},
                      {"role": "user", "content": "And the mountains?"}]
    again = client.chat.completions.create(model=served.name, messages=second, max_tokens=16)
    assert again.usage.prompt_tokens == len(reference.encode(second))
    assert again.usage.prompt_tokens_details.cached_tokens >= len(reference.encode(first))
    assert again.choices[0].message.content == reference.complete(second, max_tokens=16).text
    assert re.search(rf"prompt={again.usage.prompt_tokens} cached={again.usage.prompt_tokens_details.cached_tokens} ",
                     served.logged(again.id))


def test_an_event_is_one_line_for_every_reader():
    """JSON leaves U+2028, U+2029 and NEL raw, which str.splitlines and httpx's iter_lines take for line ends."""
    from fafo_cli.serve.responses import event

    data = {"text": "a\u2028b\u2029c\x85d\n"}
    lines = [line for line in event(data).decode().splitlines() if line]
    assert len(lines) == 1 and json.loads(lines[0].removeprefix("data: ")) == data


def test_stop_strings(served, reference):
    full = reference.complete(TEXT, max_tokens=40, chat_template=False).text
    at = next(i for i in range(6, len(full) - 2) if full[i:i + 2].isprintable() and full.find(full[i:i + 2]) == i)
    client = served.client()
    for stream in (False, True):
        # (more than OpenAI's 4 strings, as clients written for llama.cpp's server send)
        stops = [*(f"\x00none{i}" for i in range(5)), full[at:at + 2]]
        arguments = dict(model=served.name, prompt=TEXT, max_tokens=40, stop=stops)
        if stream:
            chunks = list(client.completions.create(**arguments, stream=True))
            text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            choice = client.completions.create(**arguments).choices[0]
            text, finish = choice.text, choice.finish_reason
        assert (text, finish) == (full[:at], "stop")


def test_sixteen_concurrent_streams_each_get_their_own_answer(served, reference):
    prompts = [f"Client {i} asks about topic number {i * 7 % 11}." for i in range(16)]
    expected = [reference.complete([{"role": "user", "content": p}], max_tokens=12) for p in prompts]
    results: list = [None] * len(prompts)

    def ask(i: int) -> None:
        chunks = served.client().chat.completions.create(
            model=served.name, messages=[{"role": "user", "content": prompts[i]}], max_tokens=12, stream=True,
            stream_options={"include_usage": True})
        chunks = list(chunks)
        results[i] = ("".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for (text, usage), want in zip(results, expected):
        assert text == want.text and usage.completion_tokens == len(want.token_ids)


def test_a_client_that_leaves_frees_the_engine(served):
    body = {"prompt": TEXT, "max_tokens": LONG, "stream": True, "method": "vanilla"}
    with httpx.Client(base_url=served.url, timeout=30) as http:
        with http.stream("POST", "/completions", json=body) as response:
            lines = response.iter_lines()
            first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        # the connection is closed here, mid-answer
        line = served.logged(rf"{first['id']} .* cancelled")
        assert int(re.search(r"generated=(\d+)", line).group(1)) < LONG // 2
        after = http.post("/completions", json={"prompt": "next", "max_tokens": 4})
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4
        deadline = time.monotonic() + 10  # the worker finishes its bookkeeping just after the answer is sent
        while http.get(served.health).json()["running"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)


def _wait_in_queue(url: str, auth: dict, waited: dict) -> None:
    """A client whose short request waits behind a running one; its answer lands in `waited`."""
    with httpx.Client(base_url=url, headers=auth, timeout=60) as http:
        response = http.post("/completions", json={"prompt": "waiting", "max_tokens": 3})
        waited.update(status=response.status_code, body=response.json())


def test_a_full_queue_answers_503(guarded, monkeypatch):
    _slowed(monkeypatch, guarded)  # the running answer outlasts the test on a busy machine
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": TEXT, "max_tokens": LONG, "stream": True, "method": "vanilla"}
    waited: dict = {}

    with httpx.Client(base_url=guarded.url, headers=auth, timeout=30) as http:
        with http.stream("POST", "/completions", json=body) as running:
            events = running.iter_lines()  # held: a dropped iterator would close the connection
            next(line for line in events if line.startswith("data: "))
            waiter = threading.Thread(target=_wait_in_queue, args=(guarded.url, auth, waited))
            waiter.start()
            deadline = time.monotonic() + 10
            while http.get(guarded.health).json()["waiting"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            full = http.post("/completions", json={"prompt": "one too many", "max_tokens": 3})
            assert full.status_code == 503 and full.headers["retry-after"] == "1"
            assert full.json()["error"]["code"] == "queue_full"
            with pytest.raises(openai.APIStatusError) as refused:
                guarded.client(api_key=KEY).completions.create(model=guarded.name, prompt="again", max_tokens=3)
            assert refused.value.status_code == 503
    waiter.join(30)  # the running answer was dropped: the waiting one is answered
    assert waited["status"] == 200 and waited["body"]["usage"]["completion_tokens"] == 3


def _slowed(monkeypatch, live: Live) -> None:
    """The server's answers take 10 ms a step: a long one is still running however long the test takes."""
    engine = live.server.engine
    generate = engine.generate

    def slow(*args, **kwargs):
        steps = generate(*args, **kwargs)
        try:
            for step in steps:
                time.sleep(0.01)
                yield step
        finally:
            steps.close()

    monkeypatch.setattr(engine, "generate", slow)


def test_queue_zero_serves_one_request_at_a_time(tiny, monkeypatch):
    """--queue 0: nothing waits; a request to an idle server runs, one beside a running one gets 503."""
    live = _start(load(str(tiny), dtype="float32"), queue=0)
    _slowed(monkeypatch, live)
    try:
        body = {"prompt": TEXT, "max_tokens": LONG, "stream": True, "method": "vanilla"}
        with httpx.Client(base_url=live.url, timeout=30) as http:
            for _ in range(3):  # one after another: each finds the engine free, even while it closes the last one
                alone = http.post("/completions", json={"prompt": "alone", "max_tokens": 3})
                assert alone.status_code == 200 and alone.json()["usage"]["completion_tokens"] == 3
            with http.stream("POST", "/completions", json=body) as running:
                events = running.iter_lines()  # held: a dropped iterator would close the connection
                next(line for line in events if line.startswith("data: "))
                refused = http.post("/completions", json={"prompt": "beside", "max_tokens": 3})
                assert refused.status_code == 503 and refused.json()["error"]["code"] == "queue_full"
            deadline = time.monotonic() + 10  # the dropped stream ends after the step in flight
            while http.get(live.health).json()["running"]:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            after = http.post("/completions", json={"prompt": "after", "max_tokens": 3})
            assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 3
    finally:
        _stop(live)


def test_a_client_that_leaves_the_queue_frees_its_place(guarded, monkeypatch):
    """--queue 1: a waiting client that disconnects leaves the queue, so the next one may wait and is served."""
    _slowed(monkeypatch, guarded)
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": TEXT, "max_tokens": LONG, "stream": True, "method": "vanilla"}
    waited: dict = {}

    def queued(count: int, http: httpx.Client) -> None:
        deadline = time.monotonic() + 10
        while http.get(guarded.health).json()["waiting"] != count:
            assert time.monotonic() < deadline
            time.sleep(0.02)

    with httpx.Client(base_url=guarded.url, headers=auth, timeout=30) as http:
        with http.stream("POST", "/completions", json=body) as running:
            events = running.iter_lines()  # held: a dropped iterator would close the connection
            next(line for line in events if line.startswith("data: "))
            address = httpx.URL(guarded.url)
            with socket.create_connection((address.host, address.port), timeout=30) as impatient:
                payload = json.dumps({"prompt": "impatient", "max_tokens": 3}).encode()
                impatient.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {address.host}\r\nAuthorization: Bearer "
                                  f"{KEY}\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
                                  f"\r\n".encode() + payload)
                queued(1, http)
            queued(0, http)  # its client closed the connection while it waited
            waiter = threading.Thread(target=_wait_in_queue, args=(guarded.url, auth, waited))
            waiter.start()
            queued(1, http)
    waiter.join(30)  # the running answer was dropped: the waiting one is answered
    assert waited["status"] == 200 and waited["body"]["usage"]["completion_tokens"] == 3


def test_a_stream_that_waits_in_the_queue_starts_and_keeps_its_connection_alive(guarded, monkeypatch):
    """Behind a running answer, a streamed request gets its headers and the role chunk after STREAM_HOLD_S, then
    comment lines until its first step (a proxy would drop a silent connection), then its answer."""
    from fafo_cli.serve import app

    monkeypatch.setattr(app, "STREAM_HOLD_S", 0.05)
    monkeypatch.setattr(app, "KEEP_ALIVE_S", 0.05)
    _slowed(monkeypatch, guarded)
    auth = {"Authorization": f"Bearer {KEY}"}
    long = {"prompt": TEXT, "max_tokens": LONG, "stream": True, "method": "vanilla"}
    waiting = {"messages": CHAT, "max_tokens": 3, "stream": True}
    with httpx.Client(base_url=guarded.url, headers=auth, timeout=30) as http:
        with http.stream("POST", "/completions", json=long) as running:
            events = running.iter_lines()  # held: a dropped iterator would close the connection
            next(line for line in events if line.startswith("data: "))
            with httpx.Client(base_url=guarded.url, headers=auth, timeout=30) as other:
                with other.stream("POST", "/chat/completions", json=waiting) as queued:
                    assert queued.status_code == 200
                    lines = queued.iter_lines()
                    role = json.loads(next(line for line in lines if line)[len("data: "):])
                    assert role["choices"][0]["delta"]["role"] == "assistant"
                    assert [next(line for line in lines if line) for _ in range(2)] == [": waiting"] * 2
                    running.close()  # the running answer is dropped: the waiting one runs
                    rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][len("data: "):])["choices"][0]["finish_reason"]


def test_a_prompt_the_model_cannot_take_is_refused_with_its_status_even_behind_a_running_answer(guarded,
                                                                                                 monkeypatch):
    """The prompt is encoded, and its stop strings read, before it queues: beyond the context, or with a stop string
    that could never match, a streamed request that would wait is a 400, not a 200 whose stream carries the error."""
    from fafo_cli.serve import app

    monkeypatch.setattr(app, "STREAM_HOLD_S", 0.05)
    _slowed(monkeypatch, guarded)
    auth = {"Authorization": f"Bearer {KEY}"}
    long = {"prompt": TEXT, "max_tokens": LONG, "stream": True, "method": "vanilla"}
    with httpx.Client(base_url=guarded.url, headers=auth, timeout=30) as http:
        with http.stream("POST", "/completions", json=long) as running:
            events = running.iter_lines()
            next(line for line in events if line.startswith("data: "))
            with httpx.Client(base_url=guarded.url, headers=auth, timeout=30) as other:
                beyond = other.post("/completions", json={"prompt": "x " * 2100, "stream": True})
                assert beyond.status_code == 400, beyond.text
                assert beyond.json()["error"]["code"] == "context_length_exceeded"
                never = other.post("/completions", json={"prompt": "x", "stream": True, "stop": "<|im_end|>\n"})
                assert never.status_code == 400 and never.json()["error"]["param"] == "stop", never.text
                assert other.get(guarded.health).json()["waiting"] == 0  # neither queued


def test_a_client_that_leaves_while_sending_its_body_is_no_error(served):
    address, logged = httpx.URL(served.url), len(served.log)
    with socket.create_connection((address.host, address.port), timeout=30) as leaving:
        leaving.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {address.host}\r\nContent-Type: application/json"
                        f"\r\nContent-Length: 1000\r\n\r\n{{\"prompt\": \"half".encode())
        time.sleep(0.2)  # the server is reading the body
    served.logged("the client left while sending its body")
    assert not [line for line in served.log[logged:] if "failed" in line or "ClientDisconnect" in line]
    with httpx.Client(base_url=served.url, timeout=30) as http:
        assert http.get(served.health).json() == {"status": "ok", "model": served.name, "running": 0, "waiting": 0}


def test_closing_answers_every_waiting_request_and_starts_none(tiny):
    """close(): each waiting request is answered `shutting_down` at once and never starts, the running one ends
    after its step in flight, the worker stops and later requests are refused."""
    import asyncio

    from fafo_cli.serve import schema
    from fafo_cli.serve.errors import ApiError
    from fafo_cli.serve.worker import Worker

    engine = load(str(tiny), dtype="float32")
    prompts, started = schema.Prompts(engine), []
    generate = engine.generate
    engine.generate = lambda ids, *args: started.append(engine.tokenizer.decode(ids)) or generate(ids, *args)

    def job(prompt: str, tokens: int):
        parsed = schema.parse({"prompt": prompt, "max_tokens": tokens, "method": "vanilla"}, "text", engine,
                              engine.name)
        return prompts.encoded(parsed)

    async def scenario():
        loop = asyncio.get_running_loop()
        worker = Worker(engine, max_waiting=4)
        running = worker.submit(job("long", LONG), loop)
        assert not isinstance(await running.next(), ApiError)  # it runs
        waiting = [worker.submit(job(f"waiting {i}", 3), loop) for i in range(3)]
        worker.close()
        answers = [await asyncio.wait_for(ticket.next(), 10) for ticket in waiting]
        last = await asyncio.wait_for(running.next(), 10)
        while not isinstance(last, ApiError):
            last = await asyncio.wait_for(running.next(), 10)
        await loop.run_in_executor(None, worker.join, 10)
        with pytest.raises(ApiError) as refused:
            worker.submit(job("late", 3), loop)
        return worker, answers, last, refused.value

    worker, answers, last, refused = asyncio.run(scenario())
    assert [(a.status, a.code) for a in answers] == [(503, "shutting_down")] * 3
    assert (last.code, refused.code) == ("shutting_down", "shutting_down")
    assert started == ["long"] and not worker._thread.is_alive()


def test_a_request_cancelled_mid_prefill_stops_after_the_chunk_in_flight(tiny, caplog):
    """A long prompt's prefill runs in chunks of seconds each on a CPU: a client that leaves (or a server that stops)
    during it ends the request after the chunk in flight, not after the whole prompt, and the engine serves the
    next request from a consistent cache."""
    import asyncio

    from fafo_cli.runtime.session import PREFILL_CHUNK
    from fafo_cli.serve import schema
    from fafo_cli.serve.errors import ApiError, shutting_down
    from fafo_cli.serve.worker import Worker

    engine = load(str(tiny), dtype="float32", chat_template=False)
    prompt = ("red green blue " * 200)[:1700]  # over three chunks, within the tiny model's context of 2048
    assert 3 * PREFILL_CHUNK < len(engine.encode(prompt, engine.config)) < engine.model.max_context - 8
    worker, tickets, chunks = Worker(engine, max_waiting=4), [], []
    forward = engine.session.forward

    def chunk(ids, *args, **kwargs):  # the first chunk of the long prompt: its client leaves meanwhile
        chunks.append(len(ids))
        if len(chunks) == 1:
            worker.cancel(tickets[0], shutting_down())
        return forward(ids, *args, **kwargs)

    engine.session.forward = chunk

    def job(text: str, tokens: int):
        parsed = schema.parse({"prompt": text, "max_tokens": tokens, "method": "vanilla"}, "text", engine, engine.name)
        return schema.Prompts(engine).encoded(parsed)

    async def scenario():
        loop = asyncio.get_running_loop()
        tickets.append(worker.submit(job(prompt, 8), loop))
        told = await asyncio.wait_for(tickets[0].next(), 30)
        following = worker.submit(job("next", 3), loop)
        answer = [await asyncio.wait_for(following.next(), 30)]
        while not answer[-1].finish_reason:
            answer.append(await asyncio.wait_for(following.next(), 30))
        worker.close()
        return told, answer

    with caplog.at_level(logging.INFO, logger="fafo.serve"):
        told, answer = asyncio.run(scenario())
    assert isinstance(told, ApiError) and told.code == "shutting_down"
    # the long prompt's first chunk only, then the next request's prefill
    assert chunks[:2] == [PREFILL_CHUNK, len(engine.encode("next", engine.config))]
    assert len(engine.session.ids) == engine.session.cache.length
    assert [step.stats.generated_tokens for step in answer][-1] == 3
    assert re.search(r"cmpl-\w+ text vanilla cancelled before its first token", caplog.text)


def test_a_stop_while_a_step_outlasts_the_grace_answers_503_and_waits_for_the_engine(tiny, monkeypatch):
    """A big model's prefill chunk on a CPU can outlast the grace uvicorn gives answers in flight: the request is
    still answered 503 `shutting_down` in JSON (not a plain-text 500 and a traceback), and the server returns only
    once the engine's thread has ended (a process that exits while it runs a torch operation aborts)."""
    monkeypatch.setattr(server_mod, "GRACE_S", 0.5)
    engine = load(str(tiny), dtype="float32", chat_template=False)
    forward = engine.session.forward

    def slow_chunk(ids, *args, **kwargs):
        time.sleep(3)
        return forward(ids, *args, **kwargs)

    engine.session.forward = slow_chunk
    live, answer = _start(engine), {}

    def ask() -> None:
        with httpx.Client(base_url=live.url, timeout=30) as http:
            response = http.post("/completions", json={"prompt": "red green blue", "max_tokens": 4})
            answer.update(status=response.status_code, body=response.json())

    client = threading.Thread(target=ask)
    client.start()
    live.logged("start after")  # the request runs: its prefill is in its 3 s chunk
    _stop(live)
    client.join(30)
    assert answer["status"] == 503 and answer["body"]["error"]["code"] == "shutting_down", answer
    assert not live.server.worker.running
    assert any("waiting for the engine's step in flight" in line for line in live.log), live.log


def test_a_stop_while_a_streamed_step_outlasts_the_grace_ends_the_stream_with_the_error(tiny, monkeypatch):
    """As above, mid-stream: the answer's last event is the `shutting_down` error, with no traceback logged."""
    monkeypatch.setattr(server_mod, "GRACE_S", 0.5)
    engine = load(str(tiny), dtype="float32", chat_template=False)
    run = engine.session.run

    def slow_step(*args, **kwargs):
        time.sleep(3)
        return run(*args, **kwargs)

    engine.session.run = slow_step
    live, events = _start(engine), []
    errors: list[logging.LogRecord] = []  # uvicorn's own log, where a failed response's traceback goes
    uvicorn_log, catch = logging.getLogger("uvicorn.error"), logging.Handler()
    catch.emit = errors.append
    uvicorn_log.addHandler(catch)

    def ask() -> None:
        with httpx.Client(base_url=live.url, timeout=30) as http:
            body = {"prompt": "red green blue", "max_tokens": 8, "stream": True, "method": "vanilla"}
            with http.stream("POST", "/completions", json=body) as response:
                events.extend(json.loads(line[6:]) for line in response.iter_lines()
                              if line.startswith("data: {"))

    client = threading.Thread(target=ask)
    client.start()
    try:
        deadline = time.monotonic() + 20
        while not events:  # the first token is streamed: the second step takes 3 s
            assert time.monotonic() < deadline
            time.sleep(0.02)
        _stop(live)
        client.join(30)
    finally:
        uvicorn_log.removeHandler(catch)
    assert events[-1]["error"]["code"] == "shutting_down", events
    assert not any(record.exc_info for record in errors), [record.getMessage() for record in errors]


def test_api_key(guarded):
    with httpx.Client(base_url=guarded.url, timeout=30) as http:
        health = http.get(guarded.health)  # open: a liveness probe; it does not name the model (a local path)
        assert health.status_code == 200 and health.json()["status"] == "ok" and "model" not in health.json()
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic a2V5Og=="}):
            response = http.get("/models", headers=headers)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
            assert KEY not in response.text
        assert http.get("/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        guarded.client(api_key="wrong").models.list()
    models = guarded.client(api_key=KEY).models.list()
    assert [m.id for m in models.data] == [guarded.name]
    assert not any(KEY in line for line in guarded.log)


def test_cors_only_for_the_given_origin(served, guarded):
    # the headers the openai JavaScript client sends besides these
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type,x-stainless-os,x-stainless-lang"}
    with httpx.Client(timeout=30) as http:
        allowed = http.options(f"{guarded.url}/chat/completions", headers=preflight)
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
        assert "x-stainless-os" in allowed.headers["access-control-allow-headers"].lower()
        other = http.options(f"{guarded.url}/chat/completions", headers={**preflight, "Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers
        assert _check_error(other, 400)["code"] == "cors_refused"
        off = http.get(f"{served.url}/models", headers={"Origin": ORIGIN})
        assert off.status_code == 200 and "access-control-allow-origin" not in off.headers


def test_health_says_unavailable_once_the_engine_has_stopped(tiny):
    from starlette.testclient import TestClient

    from fafo_cli.serve.app import create_app
    from fafo_cli.serve.worker import Worker

    engine = load(str(tiny), dtype="float32")
    worker = Worker(engine, max_waiting=4)
    with TestClient(create_app(engine, worker, max_body=1 << 20, loopback=False)) as http:
        assert http.get("/health").status_code == 200
        worker.close()
        worker.join(10)
        answer = http.get("/health")
        assert answer.status_code == 503 and answer.json() == {"status": "unavailable", "model": engine.name}


def test_a_dead_engine_thread_takes_no_requests(tiny):
    """Only a BaseException could end it, but a queue no thread serves would hold its requests forever."""
    from fafo_cli.serve.errors import ApiError
    from fafo_cli.serve.worker import Worker

    worker = Worker(load(str(tiny), dtype="float32"), max_waiting=4)
    worker.close()
    worker.join(10)
    worker._closing = False  # (as if its thread had died, not been closed)
    dead = threading.Thread(target=lambda: None)
    dead.start()
    dead.join()
    worker._thread = dead
    with pytest.raises(ApiError) as refused:
        worker.check_room()
    assert refused.value.status == 503


def test_models_and_health(served):
    with httpx.Client(base_url=served.url, timeout=30) as http:
        models = http.get("/models").json()
        assert models["object"] == "list" and [m["id"] for m in models["data"]] == [served.name]
        assert http.get(f"/models/{served.name}").json()["id"] == served.name
        assert http.get("/models/gpt-4").status_code == 404
        assert http.get(served.health).json()["status"] == "ok"


MESSAGES = [{"role": "user", "content": "hi"}]
# (endpoint, body: a JSON value or raw bytes, status, the error's param or code)
BAD = [
    ("chat", b'{"messages": [', 400, None),
    ("chat", b"[1, 2]", 400, None),
    ("chat", b"\xff\xfe{}", 400, None),
    ("chat", {}, 400, "messages"),
    ("chat", {"messages": []}, 400, "messages"),
    ("chat", {"messages": "hi"}, 400, "messages"),
    ("chat", {"messages": [1]}, 400, "messages[0]"),
    ("chat", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ("chat", {"messages": [{"role": "tool", "content": "hi"}]}, 400, "messages[0].role"),
    ("chat", {"messages": [{"role": ["user"], "content": "hi"}]}, 400, "messages[0].role"),  # (was a 500)
    ("chat", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0]"),
    ("chat", {"messages": [{"role": "user", "content": "hi", "name": 5}]}, 400, "messages[0].name"),
    ("chat", {"messages": MESSAGES, "n": 2}, 400, "n"),
    ("chat", {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("chat", {"messages": MESSAGES, "tool_choice": "auto"}, 400, "tool_choice"),
    ("chat", {"messages": MESSAGES, "logprobs": True}, 400, "logprobs"),
    ("chat", {"messages": MESSAGES, "response_format": {"type": "json_object"}}, 400, "response_format"),
    ("chat", {"messages": MESSAGES, "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("chat", {"messages": MESSAGES, "frobnicate": 1}, 400, "frobnicate"),
    ("chat", {"messages": MESSAGES, "max_tokens": "ten"}, 400, "max_tokens"),
    ("chat", {"messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
    ("chat", {"messages": MESSAGES, "max_tokens": 5000}, 400, "context_length_exceeded"),
    ("chat", {"messages": MESSAGES, "max_tokens": 5, "max_completion_tokens": 6}, 400, "max_tokens"),
    ("chat", {"messages": MESSAGES, "temperature": "hot"}, 400, "temperature"),
    ("chat", {"messages": MESSAGES, "temperature": "hot", "top_p": 0}, 400, "temperature"),
    ("chat", {"messages": MESSAGES, "logit_bias": {"42": 5}}, 400, "logit_bias"),
    ("chat", {"messages": MESSAGES, "stop": "<|im_end|>\n"}, 400, "stop"),
    ("chat", {"messages": MESSAGES, "temperature": -1}, 400, "temperature"),
    ("chat", {"messages": MESSAGES, "top_p": -0.5}, 400, "top_p"),
    ("chat", {"messages": MESSAGES, "seed": 2**64}, 400, "seed"),
    ("chat", {"messages": MESSAGES, "store": True}, 400, "store"),
    ("chat", {"messages": MESSAGES, "prompt_cache_key": 5}, 400, "prompt_cache_key"),
    ("chat", {"messages": MESSAGES, "stream": True, "stream_options": {"include_obfuscation": True}}, 400,
     "stream_options.include_obfuscation"),
    ("chat", {"messages": MESSAGES, "seed": 1.5}, 400, "seed"),
    ("chat", {"messages": MESSAGES, "stream": "yes"}, 400, "stream"),
    ("chat", {"messages": MESSAGES, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("chat", {"messages": MESSAGES, "stream": True, "stream_options": {"every": 1}}, 400, "stream_options.every"),
    ("chat", {"messages": MESSAGES, "stop": [str(i) for i in range(17)]}, 400, "stop"),
    ("chat", {"messages": MESSAGES, "service_tier": "flex"}, 400, "service_tier"),
    ("chat", {"messages": MESSAGES, "stop": [1]}, 400, "stop"),
    ("chat", {"messages": MESSAGES, "stop": ""}, 400, "stop"),
    ("chat", {"messages": MESSAGES, "method": "warp"}, 400, "method"),
    ("chat", {"messages": MESSAGES, "compressor": "zip"}, 400, "compressor"),
    ("chat", {"messages": MESSAGES, "budget": 0}, 400, "budget"),
    ("chat", {"messages": MESSAGES, "dtype": "float16"}, 400, "dtype"),
    ("chat", {"messages": MESSAGES, "cacheback_table": "/etc/passwd"}, 400, "cacheback_table"),
    ("chat", {"messages": MESSAGES, "suffix_outputs": 0}, 400, "suffix_outputs"),  # every client's answers
    ("chat", {"messages": MESSAGES, "model": "gpt-4"}, 404, "model"),
    ("chat", {"messages": MESSAGES, "seed": 2**64}, 400, "seed"),
    ("chat", {"messages": MESSAGES, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    # asked for, but would change nothing: another method's setting, a sampling setting while greedy, a second
    # system prompt
    ("chat", {"messages": MESSAGES, "method": "suffix", "compressor": "h2o"}, 400, "compressor"),
    ("chat", {"messages": MESSAGES, "budget": 64}, 400, "budget"),  # no window runs on a CPU by default
    ("chat", {"messages": CHAT, "system": "Be brief."}, 400, "system"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache": 1}]}]}, 400,
     "messages[0].content[0].cache"),
    # lone surrogate escapes are valid JSON but no text, wherever they are (an echo of one was a 500)
    ("chat", b'{"messages": [{"role": "user", "content": "\\ud800 hi"}]}', 400, None),
    ("chat", b'{"messages": [{"role": "user", "content": "hi"}], "model": "\\ud800"}', 400, None),
    ("chat", b'{"messages": [{"role": "user", "content": "hi"}], "\\udfff": 1}', 400, None),
    ("chat", b"[" * 50_000 + b"]" * 50_000, 400, None),  # nested deeper than the parser goes
    ("text", {}, 400, "prompt"),
    ("text", {"prompt": ""}, 400, "prompt"),
    ("text", {"prompt": "hi", "logprobs": 0}, 400, "unsupported_value"),  # (a count: only null is neutral)
    ("text", {"prompt": [1, 2, 3]}, 400, "prompt"),
    ("text", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("text", {"prompt": "x " * 2100}, 400, "context_length_exceeded"),
    ("text", {"prompt": "hi", "echo": True}, 400, "echo"),
    ("text", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("text", {"prompt": "hi", "suffix": "there"}, 400, "suffix"),
    ("text", {"prompt": "hi", "max_completion_tokens": 4}, 400, "max_completion_tokens"),
    ("text", {"prompt": "hi", "system": "Be brief."}, 400, "system"),
]


def _check_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json") and "Traceback" not in response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["type"]
    return error


@pytest.mark.parametrize("endpoint, body, status, where", BAD,
                         ids=[f"{i}-{case[0]}-{case[3]}" for i, case in enumerate(BAD)])
def test_bad_input_gets_an_openai_error(served, endpoint, body, status, where):
    path = "/chat/completions" if endpoint == "chat" else "/completions"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with httpx.Client(base_url=served.url, timeout=30) as http:
        error = _check_error(http.post(path, content=content, headers={"Content-Type": "application/json"}), status)
        if where is not None:
            assert where in (error["param"], error["code"]), error


def test_a_body_that_begins_with_a_byte_order_mark_is_read(served):
    """A file saved on Windows and posted as it is (curl --data-binary @body.json): RFC 8259 lets a reader skip the
    mark, as llama.cpp's server does."""
    with httpx.Client(base_url=served.url, timeout=30) as http:
        body = "\ufeff".encode() + json.dumps({"prompt": TEXT, "max_tokens": 2}).encode()
        response = http.post("/completions", content=body, headers={"Content-Type": "application/json"})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2, response.text


def test_a_body_that_is_not_sent_as_json_is_a_415(served):
    """Form and text posts (what a web page may send another origin without asking first) are refused."""
    with httpx.Client(base_url=served.url, timeout=30) as http:
        body = json.dumps({"prompt": TEXT, "max_tokens": 2})
        for media in ("text/plain", "application/x-www-form-urlencoded"):
            error = _check_error(http.post("/completions", content=body, headers={"Content-Type": media}), 415)
            assert error["code"] == "unsupported_media_type"
        for media in ("application/json; charset=utf-8", "application/vnd.api+json"):
            assert http.post("/completions", content=body, headers={"Content-Type": media}).status_code == 200
        # no type: a client's JSON, unless a web page sent it (its post without a type goes out unchecked)
        assert http.post("/completions", content=body, headers={"Content-Type": ""}).status_code == 200
        error = _check_error(http.post("/completions", content=body,
                                       headers={"Content-Type": "", "Origin": "http://evil.example"}), 415)
        assert error["code"] == "unsupported_media_type" and "web page" in error["message"]


def test_a_loopback_server_answers_only_requests_addressed_to_this_machine(served):
    """DNS rebinding: a web page whose domain resolves to 127.0.0.1 sends its own name as Host."""
    with httpx.Client(base_url=served.url, timeout=30) as http:
        port = served.url.split(":")[2].split("/")[0]
        # (and names no public domain has, which a rebound page cannot send: Docker Desktop's name of the host, the
        # machine's mDNS and own names, as ollama answers them)
        for host in (f"localhost:{port}", f"app.localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}",
                     f"host.docker.internal:{port}", f"mybox.local:{port}", f"{socket.gethostname().upper()}:{port}"):
            assert http.get("/models", headers={"Host": host}).status_code == 200, host
        for path in ("/models", "/completions"):
            error = _check_error(http.request("POST" if "compl" in path else "GET", path, headers={
                "Host": f"evil.example:{port}", "Content-Type": "application/json"}, content=b"{}"), 403)
            assert error["code"] == "host_not_allowed" and "'evil.example'" in error["message"]


def test_a_loopback_server_with_a_key_answers_any_host(guarded):
    """A reverse proxy on this machine that passes its clients' Host on: the key keeps rebound pages out."""
    with httpx.Client(base_url=guarded.url, timeout=30) as http:
        assert http.get("/models", headers={"Host": "myapp.example", "Authorization": f"Bearer {KEY}"}).status_code == 200
        assert _check_error(http.get("/models", headers={"Host": "myapp.example"}), 401)["code"] == "invalid_api_key"


def test_a_server_listening_beyond_loopback_answers_any_host(tiny):
    """Behind a reverse proxy on the same machine that passes the client's Host on (0.0.0.0 seen from 127.0.0.1)."""
    live = _start(load(str(tiny), dtype="float32"), loopback=False)
    try:
        with httpx.Client(base_url=live.url, timeout=30) as http:
            assert http.get("/models", headers={"Host": "myapp.example"}).status_code == 200
    finally:
        _stop(live)


def test_logits_that_are_not_numbers_are_a_500_and_leave_no_cache_behind(served, reference, monkeypatch):
    """The server's dtype, not the request, is at fault (float16 overflowing); the prompt's keys and values are no
    numbers either, and a later request reusing them would fail too."""
    from fafo_cli.runtime.model import Model

    forward = Model.forward
    with monkeypatch.context() as patch:
        patch.setattr(Model, "forward", lambda self, *a, **k: forward(self, *a, **k) * float("nan"))
        with httpx.Client(base_url=served.url, timeout=30) as http:
            error = _check_error(http.post("/completions", json={"prompt": TEXT + " again", "max_tokens": 3}), 500)
    assert error["code"] == "model_output_invalid" and "NaN" in error["message"]
    answer = served.client().completions.create(model=served.name, prompt=TEXT + " again", max_tokens=3)
    assert answer.choices[0].text == reference.complete(TEXT + " again", max_tokens=3, chat_template=False).text


def test_out_of_memory_is_its_own_error(served, monkeypatch):
    """Memory running out (here: torch's CPU allocator, a plain RuntimeError) is a 500 `out_of_memory`, not a bug."""
    def exhausted(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: you "
                           "tried to allocate 4294967296 bytes.")
        yield

    engine = served.server.engine
    for prompt in ("a conversation long enough to be kept for later, one", "and another, as long as the first one"):
        served.client().completions.create(model=served.name, prompt=prompt, max_tokens=24)
    assert len(engine.session.kept) >= 1
    monkeypatch.setattr(engine, "generate", exhausted)
    with httpx.Client(base_url=served.url, timeout=30) as http:
        response = http.post("/completions", json={"prompt": TEXT, "max_tokens": 3})
        error = _check_error(response, 500)
    assert error["code"] == "out_of_memory"
    assert response.headers["x-should-retry"] == "false"  # OpenAI's clients would send it twice more
    assert len(engine.session.kept) == 0 and "kept for reuse were dropped" in error["message"]  # room given back
    monkeypatch.setattr(engine, "encode", lambda *args, **kwargs: exhausted().send(None))  # encoding a long prompt
    with httpx.Client(base_url=served.url, timeout=30) as http:
        error = _check_error(http.post("/completions", json={"prompt": TEXT, "max_tokens": 3}), 500)
    assert error["code"] == "out_of_memory", error


def test_a_request_that_fails_inside_the_server_stops_its_answer(served, monkeypatch):
    """A fault of ours while an answer is gathered (here: a stand-in that raises) is a 500, and the answer that was
    running for it stops: the worker takes the next request at once, not after a long answer for nobody."""
    from fafo_cli.serve import app

    _slowed(monkeypatch, served)

    async def broken(ticket, item, model):
        raise RuntimeError("a bug")

    monkeypatch.setattr(app, "_whole", broken)
    with httpx.Client(base_url=served.url, timeout=30) as http:
        assert http.post("/completions", json={"prompt": TEXT, "max_tokens": LONG}).status_code == 500
        deadline = time.monotonic() + 10
        while http.get(served.health).json()["running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert http.get(served.health).json()["running"] == 0


def test_a_chat_template_that_refuses_the_messages_is_a_400(tmp_path):
    from .test_cli import NO_SYSTEM_TEMPLATE

    folder = build_tiny_model(tmp_path / "nosystem", "llama-gqa", chat_template=NO_SYSTEM_TEMPLATE)
    live = _start(load(str(folder), dtype="float32"))
    try:
        with httpx.Client(base_url=live.url, timeout=30) as http:
            error = _check_error(http.post("/chat/completions", json={"messages": CHAT, "max_tokens": 3}), 400)
            assert error["message"] == "the model's chat template refused the messages: System role not supported"
            fine = http.post("/chat/completions", json={"messages": CHAT[1:], "max_tokens": 3})
            assert fine.status_code == 200 and fine.json()["usage"]["completion_tokens"] == 3
    finally:
        _stop(live)


def test_chat_template_variables_per_request(tmp_path):
    """vLLM's and llama.cpp's `chat_template_kwargs`: Qwen3's answers without their thinking part."""
    from .test_tokenizer import THINKING

    folder = build_tiny_model(tmp_path / "m", "llama-gqa", chat_template=THINKING)
    engine = load(str(folder), dtype="float32")
    live = _start(engine)
    off = {"enable_thinking": False}
    try:
        with httpx.Client(base_url=live.url, timeout=30) as http:
            prompts = [http.post("/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                             "max_tokens": 1, **extra}).json()["usage"]["prompt_tokens"]
                       for extra in ({}, {"chat_template_kwargs": off}, {"chat_template_kwargs": {}})]
            thinking_part = len(engine.tokenizer("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"])
            assert prompts == [prompts[0], prompts[0] + thinking_part, prompts[0]], prompts
            for body, param, message in [
                ({"prompt": "hi", "chat_template_kwargs": off}, "chat_template_kwargs", "'chat_template_kwargs' needs "
                 "the chat template: send \"chat_template\": true"),
                ({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"think": False}},
                 "chat_template_kwargs", " reads no variable 'think' (it reads: enable_thinking, eos_token)"),
                ({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": [1]},
                 "chat_template_kwargs", "must be a mapping of names to values")]:
                path = "/completions" if "prompt" in body else "/chat/completions"
                error = _check_error(http.post(path, json={**body, "max_tokens": 3}), 400)
                assert error["param"] == param and message in error["message"], error
            answer = http.post("/completions", json={"prompt": "hi", "chat_template": True, "chat_template_kwargs": off,
                                                     "max_tokens": 1})
            assert answer.json()["usage"]["prompt_tokens"] == prompts[1], answer.text
            plain = http.post("/completions", json={"prompt": "hi", "chat_template_kwargs": {}, "max_tokens": 1})
            assert plain.status_code == 200, plain.text  # (no variables: nothing that needs the template)
    finally:
        _stop(live)


def test_a_model_without_a_chat_template_refuses_what_needs_one(tmp_path):
    folder = build_tiny_model(tmp_path / "plain", "llama-gqa", chat_template=False)
    live = _start(load(str(folder), dtype="float32"))
    try:
        with httpx.Client(base_url=live.url, timeout=30) as http:
            for body in ({"prompt": "hi", "system": "Be brief."}, {"prompt": "hi", "chat_template": True},
                         {"prompt": "hi", "chat_template_kwargs": {"a": 1}}):
                error = _check_error(http.post("/completions", json={**body, "max_tokens": 3}), 400)
                assert "needs a chat template, and" in error["message"] and "has none" in error["message"], error
            assert http.post("/completions", json={"prompt": "hi", "max_tokens": 3}).status_code == 200
    finally:
        _stop(live)


def test_the_api_answers_without_its_v1_too(served):
    """As llama.cpp's server: a client given the bare address (http://127.0.0.1:8000) reaches the same endpoints."""
    assert served.url.endswith("/v1")
    with httpx.Client(base_url=served.url.removesuffix("/v1"), timeout=30) as http:
        assert http.get("/models").json()["data"][0]["id"] == served.name
        answer = http.post("/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2, answer.text
        error = _check_error(http.post("/chat/completions", content=b" " * 400_000), 400)
        assert (error["code"], error["param"]) == ("context_length_exceeded", "messages"), error


def test_wrong_routes_and_oversized_bodies(served):
    with httpx.Client(base_url=served.url, timeout=30) as http:
        _check_error(http.get("/chat/completions"), 405)
        _check_error(http.post("/nothing/here", json={}), 404)
        # (what a prompt beyond the context gets: a client that shortens its prompt on that code does so here too)
        huge = json.dumps({"prompt": "x" * 300_000}).encode()
        error = _check_error(http.post("/completions", content=huge), 400)
        assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt"), error

        def chunked():  # no Content-Length: counted as it arrives
            for _ in range(40):
                yield b" " * 10_000

        error = _check_error(http.post("/chat/completions", content=chunked()), 400)
        assert (error["code"], error["param"]) == ("context_length_exceeded", "messages"), error
        # the server keeps serving
        assert http.post("/completions", json={"prompt": "still there?", "max_tokens": 2}).status_code == 200


def test_a_name_with_both_kinds_of_address_listens_on_its_ipv4_one(monkeypatch):
    """localhost is often ::1 first: clients set up with 127.0.0.1 (most) would be refused."""
    from fafo_cli.serve import server

    found = socket.getaddrinfo("127.0.0.1", 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    six = (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", 0, 0, 0))
    monkeypatch.setattr(server.socket, "getaddrinfo", lambda *args, **kwargs: [six, *found])
    with server.bind("localhost", 0) as sock:
        assert sock.family == socket.AF_INET and sock.getsockname()[0] == "127.0.0.1"


def test_command_refuses_bad_addresses_in_one_line(tiny, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = entrypoint(["serve", str(tiny), "--port", str(port)])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "in use" in err
    for argv, code, message in [(["--host", "no-such-host.invalid"], 1, "not an address"),
                                (["--host", "192.0.2.1"], 1, "cannot listen on 192.0.2.1"),  # not this machine's
                                (["--port", "70000"], 2, "--port")]:
        assert entrypoint(["serve", str(tiny), *argv]) == code
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


def test_command_refuses_a_key_no_header_could_carry_and_a_cacheback_table_it_cannot_read(tiny, tmp_path, capsys,
                                                                                            monkeypatch):
    """Checked at start, whatever the default method (any request may ask for cacheback): a client must not get a
    400 naming the server's file for the server's own setting."""
    from fafo_cli.decoders.ngram_table import build_table
    from fafo_cli.serve import server

    monkeypatch.setattr(server, "serve", lambda engine, sock, options: pytest.fail("served"))
    for key in (" secret", "secret\r", "clé"):
        assert entrypoint(["serve", str(tiny), "--port", "0", "--api-key", key]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "must be printable ASCII without spaces at its ends" in err, err
    assert entrypoint(["serve", str(tiny), "--port", "0", "--cacheback-table", str(tmp_path / "none.bin")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not found" in err, err
    other = tmp_path / "other.bin"  # built with another tokenizer
    build_table([[1, 2, 3, 1, 4, 5]], leader=1, follower=2, followers=2).save(other, "another tokenizer")
    assert entrypoint(["serve", str(tiny), "--dtype", "float32", "--port", "0", "--cacheback-table", str(other)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tokenizer" in err, err


def test_warns_when_listening_beyond_loopback_without_a_key(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("FAFO_API_KEY", raising=False)
    missing = str(tmp_path / "no-model")  # the command stops right after the warning, at loading the model
    assert entrypoint(["serve", missing, "--host", "0.0.0.0", "--port", "0"]) == 1
    assert "warning: listening on 0.0.0.0 without an API key" in capsys.readouterr().err
    monkeypatch.setenv("FAFO_API_KEY", KEY)
    assert entrypoint(["serve", missing, "--host", "0.0.0.0", "--port", "0"]) == 1
    assert "warning" not in capsys.readouterr().err


def test_the_port_answers_503_while_the_model_loads_then_the_model_serves_on_it(tiny):
    """A client that connects while the model loads is told so at once (a connection nobody accepted hung until the
    load ended: minutes where compiled steps are built); a connection made as the load ends waits for the model."""
    sock = server_mod.bind("127.0.0.1", 0)
    url = server_mod.url(sock)
    with server_mod.loading(sock, cors=(ORIGIN,)):
        health = httpx.get(url.removesuffix("/v1") + "/health", timeout=10)
        preflight = httpx.options(url + "/chat/completions", timeout=10, headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "x-a"})
        page = httpx.get(url.removesuffix("/v1") + "/health", headers={"Origin": ORIGIN}, timeout=10)
        answer = httpx.post(url + "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                            timeout=10)
        with pytest.raises(openai.InternalServerError) as refused:
            openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=10).models.list()
    early = socket.create_connection(sock.getsockname()[:2], timeout=10)  # before the model's server accepts
    assert health.status_code == 503 and health.json() == {"status": "loading"}
    assert answer.status_code == 503 and answer.headers["retry-after"] == "5"
    assert answer.json()["error"] == {"message": "the model is loading; retry shortly", "type": "server_error",
                                      "param": None, "code": "model_loading"}
    assert refused.value.status_code == 503 and refused.value.code == "model_loading"
    # a web page the server lets in (--cors) reads the 503 too, rather than a browser's CORS failure
    assert preflight.status_code == 200 and page.headers["access-control-allow-origin"] == ORIGIN
    live = _start(load(str(tiny), dtype="float32"), sock=sock)
    try:
        with early:
            early.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            assert early.recv(100).startswith(b"HTTP/1.1 200")
        assert live.client().models.list().data[0].id == live.name
    finally:
        _stop(live)


def test_the_command_answers_while_it_loads(tiny, monkeypatch):
    from fafo_cli import cli

    bound, seen = [], []
    real_bind, real_load = server_mod.bind, cli._load
    monkeypatch.setattr(server_mod, "bind", lambda host, port: bound.append(real_bind(host, port)) or bound[-1])

    def load_while_asked(*args, **kwargs):
        seen.append(httpx.get(server_mod.url(bound[0]).removesuffix("/v1") + "/health", timeout=10).status_code)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(cli, "_load", load_while_asked)
    monkeypatch.setattr(server_mod, "serve", lambda engine, sock, options: seen.append(engine.name))
    assert entrypoint(["serve", str(tiny), "--dtype", "float32", "--port", "0"]) == 0
    assert seen == [503, load(str(tiny), dtype="float32").name]


def test_the_command_serves_and_stops_cleanly_on_a_signal(tiny):
    """`fafo serve` as a user starts it; SIGINT mid-answer: the stream ends with an error event, the server exits 0
    and the API key never reaches its log."""
    command = [sys.executable, "-m", "fafo_cli", "serve", str(tiny), "--dtype", "float32", "--port", "0",
               "--method", "vanilla", "--api-key", KEY, "--verbose"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stderr), daemon=True)
    try:
        url = None
        while url is None:  # the line saying where it serves, once the model is loaded
            lines.append(process.stderr.readline())
            assert lines[-1], "".join(lines)
            url = re.search(r" on (http://\S+/v1) ", lines[-1])
        reader.start()
        with httpx.Client(base_url=url.group(1), headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as http:
            body = {"prompt": TEXT, "max_tokens": LONG, "stream": True}
            with http.stream("POST", "/completions", json=body) as response:
                events = response.iter_lines()
                next(line for line in events if line.startswith("data: "))
                process.send_signal(signal.SIGINT)
                rest = [json.loads(line[6:]) for line in events if line.startswith("data: ")]
        assert rest and rest[-1]["error"]["code"] == "shutting_down"
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    reader.join(10)
    log = "".join(lines)
    assert re.search(r"cmpl-\w+ text vanilla .* cancelled", log) and "stopped" in log
    assert "start after" in log and '"POST /v1/completions HTTP/1.1" 200' in log  # --verbose: settings, access log
    assert KEY not in log and "Traceback" not in log


@pytest.mark.slow
def test_smollm2_answers_through_the_server_as_through_the_engine(smollm2):
    engine = load(str(smollm2), dtype="float32")
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    expected = engine.complete(messages, max_tokens=24)  # before the server owns the engine
    live = _start(engine)
    try:
        chunks = list(live.client().chat.completions.create(model=live.name, messages=messages, max_tokens=24,
                                                            stream=True, stream_options={"include_usage": True}))
    finally:
        _stop(live)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert expected.text.strip()


def test_a_draft_model_loads_at_start_whatever_the_default_method(tiny, monkeypatch):
    """Any request may ask for TriForce, which reads the draft model: `--draft-model` under another default method
    loads it at start (it was dropped, and TriForce requests ran without their bottom level)."""
    from fafo_cli.serve import server

    served = []
    monkeypatch.setattr(server, "serve", lambda engine, sock, options: served.append(engine))
    assert entrypoint(["serve", str(tiny), "--dtype", "float32", "--port", "0", "--draft-model", str(tiny)]) == 0
    assert served[0].config.method == "fafo" and served[0].session.draft_model is not None


def test_compile_on_builds_the_methods_steps_before_serving(tiny, monkeypatch):
    """Under `--compile` the default method's packages are built at start: a step size first met by a request
    would be built inside the engine's thread, every client waiting minutes."""
    from fafo_cli.compiled import ahead
    from fafo_cli.serve import server

    events = []

    def build_ahead(engine, methods):
        events.append(("build", methods))
        yield methods[0], []

    monkeypatch.setattr(ahead, "build_ahead", build_ahead)
    # and then builds nothing more: a request's own settings that meet another size run that step eager
    monkeypatch.setattr(server, "serve", lambda engine, sock, options: events.append(
        ("serve", getattr(engine.compiled, "builds", None))))  # (under compile "auto" nothing is ever built)
    command = ["serve", str(tiny), "--dtype", "float32", "--port", "0", "--method", "suffix"]
    assert entrypoint([*command, "--compile"]) == 0
    assert entrypoint(command) == 0 and entrypoint([*command, "--no-compile"]) == 0
    assert events == [("build", ["suffix"]), ("serve", False), ("serve", True), ("serve", None)]
