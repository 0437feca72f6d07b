"""Plain decoding against transformers' own greedy generate (float32, token for token), and the engine's
bookkeeping: prefix reuse across requests, chunked prefill, stop tokens, limits, interruption."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from fafo_cli import load
from fafo_cli.runtime import session as session_mod
from fafo_cli.errors import FafoError

from .conftest import VARIANTS, build_tiny_model, hf_greedy

PROMPT = "The quick brown fox jumps over the lazy dog. Then what happened?"
BOTH = pytest.mark.parametrize("method", ["vanilla", "fafo"])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_transformers(tiny_models, variant):
    folder = tiny_models[variant]
    engine = load(str(folder), dtype="float32", chat_template=False, method="vanilla")
    prompt_ids = engine.encode(PROMPT)
    result = engine.complete(PROMPT, max_tokens=160)
    assert result.finish_reason == "length"
    assert result.token_ids == hf_greedy(folder, prompt_ids, 160)
    assert len(set(result.token_ids)) > 10  # the comparison covers a varied sequence, not one repeated token
    assert result.stats.steps == result.stats.generated_tokens == 160


def test_chat_template_and_system_prompt(tiny):
    engine = load(str(tiny), dtype="float32", system="Be brief.")
    ids = engine.encode("Hi")
    text = engine.tokenizer.decode(ids)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    plain = load(str(tiny), dtype="float32", chat_template=False).encode("Hi")
    assert engine.tokenizer.decode(plain) == "Hi"
    # a message's name goes to the template, as transformers passes it: this one ignores it, others show it
    named = [{"role": "user", "content": "Hi", "name": "bob"}]
    assert engine.encode(named) == ids
    engine.tokenizer.chat_template = "{% for m in messages %}{{ m.name or m.role }}: {{ m.content }}\n{% endfor %}"
    assert engine.tokenizer.decode(engine.encode(named)) == "system: Be brief.\nbob: Hi\n"


def test_chat_template_variables_reach_the_template(tmp_path):
    from .test_tokenizer import THINKING

    folder = build_tiny_model(tmp_path / "m", "llama-gqa", chat_template=THINKING)
    engine = load(str(folder), dtype="float32", chat_template_kwargs={"enable_thinking": False})
    assert engine.tokenizer.decode(engine.encode("Hi")).endswith("assistant\n<think>\n\n</think>\n\n")
    # a request's variables over the engine's, one by one (as llama.cpp's server takes them); shown as an object
    merged = engine.request_config(chat_template_kwargs={"eos_token": "."})
    assert engine.settings(merged)["chat_template_kwargs"] == {"enable_thinking": False, "eos_token": "."}
    thinking = engine.request_config(chat_template_kwargs="")  # (emptied: the template's own default)
    assert "<think>" not in engine.tokenizer.decode(engine.encode("Hi", thinking))
    assert engine.complete("Hi", max_tokens=3).stats.prompt_tokens == len(engine.encode("Hi"))
    # one the template does not read would change nothing: refused, naming the ones it reads
    with pytest.raises(FafoError, match="'chat_template_kwargs': the chat template of .* reads no variable 'think' "
                                        "\\(it reads: enable_thinking, eos_token\\)"):
        engine.check_given(engine.request_config(chat_template_kwargs={"think": False}), {"chat_template_kwargs"})
    # a request's variables checked, not the defaults it adds to (a config file's, for another model's template)
    defaults = load(str(folder), dtype="float32", chat_template_kwargs={"effort": 1})
    config = defaults.request_config(chat_template_kwargs={"enable_thinking": False})
    defaults.check_given(config, {"chat_template_kwargs"}, {"enable_thinking"})
    with pytest.raises(FafoError, match="reads no variable 'effort'"):
        defaults.check_given(config, {"chat_template_kwargs"})
    with pytest.raises(FafoError, match="'chat_template_kwargs' needs the chat template"):
        engine.check_given(engine.request_config(chat_template=False, chat_template_kwargs={"a": 1}),
                           {"chat_template_kwargs"})


@BOTH
def test_long_prompt_chunked_prefill_matches(tiny, monkeypatch, method):
    monkeypatch.setattr(session_mod, "PREFILL_CHUNK", 7)  # many chunks, uneven last one
    engine = load(str(tiny), dtype="float32", method=method, chat_template=False)
    prompt = PROMPT * 4
    result = engine.complete(prompt, max_tokens=40)
    assert result.token_ids == hf_greedy(tiny, engine.encode(prompt), 40)


@BOTH
def test_follow_up_request_reuses_cache_and_stays_exact(tiny, method):
    engine = load(str(tiny), dtype="float32", method=method)
    first = engine.complete([{"role": "user", "content": "Tell me a story."}], max_tokens=30)
    history = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": first.text},
               {"role": "user", "content": "And then?"}]
    second = engine.complete(history, max_tokens=50)
    assert second.stats.cached_prompt_tokens > 30  # only the new turn was prefilled
    fresh = load(str(tiny), dtype="float32", method=method)
    assert second.token_ids == fresh.complete(history, max_tokens=50).token_ids
    assert second.token_ids == hf_greedy(tiny, engine.encode(history), 50)


@BOTH
def test_interrupted_stream_leaves_engine_consistent(tiny, method):
    engine = load(str(tiny), dtype="float32", method=method, chat_template=False)
    stream = engine.stream(PROMPT, max_tokens=100)
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()
    assert engine.session.cache.length == len(engine.session.ids)
    again = engine.complete(PROMPT + " Again.", max_tokens=40)
    assert again.token_ids == hf_greedy(tiny, engine.encode(PROMPT + " Again."), 40)


@BOTH
def test_stop_token_ends_answer_and_is_not_in_text(tmp_path, method):
    folder = build_tiny_model(tmp_path / "m", "llama-gqa")
    engine = load(str(folder), dtype="float32", method=method, chat_template=False)
    ids = engine.complete(PROMPT, max_tokens=40).token_ids
    stop = ids[12]  # make a token the model emits a stop token
    first = ids.index(stop)
    engine.stop_ids = frozenset({stop})
    result = engine.complete(PROMPT, max_tokens=40)
    assert result.finish_reason == "stop"
    assert result.token_ids == ids[:first + 1]
    assert result.text == engine.tokenizer.decode(ids[:first], skip_special_tokens=True)


@BOTH
def test_context_limit_stops_generation(tmp_path, method):
    folder = build_tiny_model(tmp_path / "m", "llama-gqa", max_positions=40)
    engine = load(str(folder), dtype="float32", method=method, chat_template=False)
    prompt_ids = engine.encode("abcdefghij")
    result = engine.complete("abcdefghij", max_tokens=100)
    assert result.finish_reason == "context"
    assert len(prompt_ids) + len(result.token_ids) == 40
    with pytest.raises(FafoError, match="the prompt is 45 tokens; the model's context is 40 tokens"):
        engine.complete("x" * 45)
    with pytest.raises(FafoError, match="^the prompt is empty$"):  # ids given directly: the cache kept
        list(engine.generate([], engine.request_config(max_tokens=4)))
    vocab = engine.model.vocab_size  # (beyond the embedding: an index error on a CPU, a device-side assert on a GPU)
    for ids in ([1, vocab], [-1, 2], [1, 2.0], [True]):
        with pytest.raises(FafoError, match=f"^prompt token ids must be integers from 0 to {vocab - 1}$"):
            list(engine.generate(ids, engine.request_config(max_tokens=4)))
    assert engine.session.cache.length > 0


def test_seeded_sampling_is_reproducible(tiny):
    engine = load(str(tiny), dtype="float32", method="vanilla", chat_template=False)
    a = engine.complete(PROMPT, max_tokens=40, temperature=1.0, seed=7)
    b = engine.complete(PROMPT, max_tokens=40, temperature=1.0, seed=7)
    c = engine.complete(PROMPT, max_tokens=40, temperature=1.0, seed=8)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
    unseeded = engine.complete(PROMPT, max_tokens=40, temperature=1.0)
    replay = engine.complete(PROMPT, max_tokens=40, temperature=1.0, seed=unseeded.settings["seed"])
    assert unseeded.token_ids == replay.token_ids  # the reported seed reproduces the run


def test_top_k_one_is_greedy(tiny):
    engine = load(str(tiny), dtype="float32", method="vanilla", chat_template=False)
    greedy = engine.complete(PROMPT, max_tokens=30).token_ids
    assert engine.complete(PROMPT, max_tokens=30, temperature=0.7, top_k=1, seed=1).token_ids == greedy


def test_stats_are_consistent(tiny):
    engine = load(str(tiny), dtype="float32", method="vanilla", chat_template=False)
    steps = list(engine.stream(PROMPT, max_tokens=20))
    assert [s.finish_reason for s in steps] == [None] * 19 + ["length"]
    stats = steps[-1].stats
    assert stats.generated_tokens == 20 and stats.steps == 20 and stats.tokens_per_step == 1.0
    assert stats.prompt_tokens == len(engine.encode(PROMPT))
    assert stats.tokens_per_s > 0 and stats.ttft_s > 0 and stats.peak_memory_mb > 0
    assert stats.total_s == stats.ttft_s + stats.decode_s and stats.to_dict()["total_s"] == stats.total_s
    assert stats.acceptance_rate is None and stats.pool_keys is None


def test_request_cannot_change_load_settings(tiny):
    engine = load(str(tiny), dtype="float32")
    with pytest.raises(FafoError, match="fixed when the model is loaded"):
        engine.complete("hi", dtype="bfloat16")


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers(smollm2):
    engine = load(str(smollm2), dtype="float32", method="vanilla")
    prompts = ["Write a short poem about the ocean.",
               "Explain what a hash table is and give a Python example.",
               "List five countries in Europe and their capitals."]
    for prompt in prompts:
        result = engine.complete(prompt, max_tokens=128)
        expected = hf_greedy(smollm2, engine.encode(prompt), 128)
        assert result.token_ids == expected[:len(result.token_ids)]
        assert len(result.token_ids) == len(expected)  # stopped where generate stopped (eos or limit)


def test_sampling_defaults_come_from_the_model(tmp_path):
    import json

    folder = build_tiny_model(tmp_path / "m", "llama-gqa")
    config_path = folder / "generation_config.json"
    data = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**data, "do_sample": True, "temperature": 0.6, "top_p": 0.9,
                                       "repetition_penalty": 1.05}))
    notices: list[str] = []
    engine = load(str(folder), dtype="float32", chat_template=False, notify=notices.append)
    config = engine.request_config()
    # no top_k named: transformers' generate() samples with its default, 50
    assert (config.temperature, config.top_p, config.top_k, config.min_p) == (0.6, 0.9, 50, 0.0)
    assert notices == [f"{engine.name}'s generation_config.json sets repetition_penalty 1.05, which fafo does not "
                       "apply (transformers' generate() would)"]
    assert config.seed is not None  # sampling: a fresh seed, reported
    assert engine.request_config(temperature=0.0, top_p=0.5).temperature == 0.0  # the user's word wins
    result = engine.complete(PROMPT, max_tokens=5)
    assert result.settings["temperature"] == 0.6 and result.settings["top_p"] == 0.9
    plain = load(str(build_tiny_model(tmp_path / "g", "llama-gqa")), dtype="float32").request_config()
    assert (plain.temperature, plain.top_p, plain.top_k, plain.min_p, plain.seed) == (0.0, 1.0, 0, 0.0, None)


class _PackageRequests:
    """Stands in for compiled steps (the session's protocol): records which package sizes decoders ask for and
    serves none, so every step runs eager."""

    def __init__(self):
        self.asked: list[int] = []

    def __call__(self, step, ids, positions, cache):
        return None

    def serves(self, rows: int) -> bool:
        self.asked.append(rows)
        return False

    def notify_once(self, message: str) -> None:
        pass

    def step_costs(self, sizes, refresh=False):
        return None


@pytest.mark.parametrize("method, compressor, asked", [("vanilla", "stream", [1]), ("fafo", "quest", [])])
def test_prefill_loads_only_the_package_the_decoder_runs_in(tiny, method, compressor, asked):
    """Plain decoding's one-row package is loaded before its prefill; FAFO with a compressor that reads each
    step's queries runs eager, so no package is asked for (under compile: on, one would be built for minutes)."""
    engine = load(str(tiny), dtype="float32", chat_template=False)
    engine.session.compiled = requests = _PackageRequests()
    engine.complete("Once upon a time", max_tokens=6, method=method, compressor=compressor)
    assert requests.asked == asked


@pytest.mark.parametrize("method", ["vanilla", "fafo", "prompt-lookup"])
def test_prefill_progress_is_told_after_each_chunk(tiny, monkeypatch, method):
    monkeypatch.setattr(session_mod, "PREFILL_CHUNK", 16)
    engine = load(str(tiny), dtype="float32", method=method, chat_template=False)
    prompt = PROMPT * 3
    total = len(engine.encode(prompt))
    events = []
    steps = list(engine.stream(prompt, max_tokens=20, on_prefill=events.append))
    assert [e.done for e in events] == [*range(16, total, 16), total] and {e.total for e in events} == {total}
    assert all(a.elapsed_s <= b.elapsed_s for a, b in zip(events, events[1:]))
    assert [t for s in steps for t in s.token_ids] == hf_greedy(tiny, engine.encode(prompt), 20)
    assert steps[-1].stats.peak_memory_mb > 0
    events.clear()  # the next request reuses the cached prompt: only its new tokens are prefilled
    list(engine.stream(prompt + " More.", max_tokens=4, on_prefill=events.append))
    assert events[0].done > 16 * (total // 16) and events[-1].done == events[-1].total


@pytest.mark.parametrize("settings", [dict(method="vanilla"), dict(method="fafo", compressor="snapkv"),
                                      dict(method="triforce")])
def test_prompt_longer_than_the_real_prefill_chunk(tiny, settings):
    engine = load(str(tiny), dtype="float32", chat_template=False, **settings)
    prompt = PROMPT * 12  # byte-level tokens: over 700, two chunks of 512
    ids = engine.encode(prompt)
    assert len(ids) > session_mod.PREFILL_CHUNK
    events = []
    result = engine.stream(prompt, max_tokens=40, on_prefill=events.append)
    assert [t for step in result for t in step.token_ids] == hf_greedy(tiny, ids, 40)
    assert [e.done for e in events] == [session_mod.PREFILL_CHUNK, len(ids)]


def test_a_stream_overtaken_by_another_answer_stops_with_an_error(tiny):
    """An engine runs one answer at a time: a stream resumed after another answer began must not go on with the
    session that answer now holds (it gave wrong tokens), nor undo it; the other answer stays exact."""
    engine = load(str(tiny), dtype="float32", chat_template=False)
    first, second = "one two three four", "the cat sat on"
    expected = {p: engine.complete(p, max_tokens=12).token_ids for p in (first, second)}
    suspended = engine.stream(first, max_tokens=12)
    next(suspended)
    overtaking = engine.stream(second, max_tokens=12)
    ids = list(next(overtaking).token_ids)
    with pytest.raises(FafoError, match="another answer started on this engine"):
        next(suspended)
    ids += [t for step in overtaking for t in step.token_ids]
    assert ids == expected[second]
    assert engine.complete(first, max_tokens=12).token_ids == expected[first]
    suspended = engine.stream(first, max_tokens=12)
    next(suspended)
    engine.reset()  # the cache it was answering from is gone
    with pytest.raises(FafoError, match="another answer started on this engine"):
        next(suspended)
    # a callback of a step asking for an answer or a reset: refused, not run inside the step (the lock is reentrant)
    for inside in (lambda: engine.complete(second, max_tokens=2), engine.reset):
        def on_prefill(progress, inside=inside):
            inside()

        with pytest.raises(FafoError, match="from inside one of its own steps"):
            engine.complete(first * 80, max_tokens=2, on_prefill=on_prefill)
        assert engine.complete(first, max_tokens=12).token_ids == expected[first]
    # a stream whose last step was delivered ends as any: a loop that asks again at that step is no error
    steps = []
    for step in engine.stream(first, max_tokens=12):
        steps.append(step)
        if step.finish_reason:
            assert engine.complete(second, max_tokens=12).token_ids == expected[second]
    assert [t for step in steps for t in step.token_ids] == expected[first]


@pytest.mark.parametrize("prompt, stop, message", [
    (123, (), "a prompt is a string or a list of messages"),
    (["hi"], (), "message 0 of the prompt must be a dict"),
    ([{"role": "user", "content": 5}], (), "message 0 of the prompt must be a dict"),
    ([], (), "the prompt has no messages"),
    ([{"role": "wizard", "content": "hi"}], (), "the role must be one of system, user, assistant"),
    ([{"role": "user", "content": "hi", "name": 5}], (), "message 0 of the prompt must be a dict"),
    ([{"role": "user", "content": "hi", "voice": "bob"}], (), "message 0 of the prompt must be a dict"),
    ("hi", [5], "stop must be a string or a list of strings"),
    ("hi", ["\ud800"], "a stop string is not UTF-8 text"),
    ([{"role": "user", "content": "hi", "name": "b\udcffb"}], (), "a message's name is not UTF-8 text"),
])
def test_malformed_arguments_are_refused_by_name(tiny, prompt, stop, message):
    engine = load(str(tiny), dtype="float32")
    with pytest.raises(FafoError, match=message):
        engine.complete(prompt, max_tokens=2, stop=stop)


def test_an_answer_asked_from_another_thread_mid_step_is_refused(tiny):
    """Two threads on one engine (a web framework's thread pool): the second is refused while the first computes a
    step, rather than rolling the cache back under it; the first answer is untouched."""
    engine = load(str(tiny), dtype="float32", chat_template=False)
    prompt = "one two three " * 30
    expected = engine.complete(prompt, max_tokens=12).token_ids
    engine.reset()
    errors: list[str] = []

    def other_thread() -> None:
        try:
            engine.complete("four five", max_tokens=4)
        except FafoError as e:
            errors.append(str(e))

    def on_prefill(progress) -> None:  # inside the first thread's step
        if not errors:
            thread = threading.Thread(target=other_thread)
            thread.start()
            thread.join()

    assert engine.complete(prompt, max_tokens=12, on_prefill=on_prefill).token_ids == expected
    assert errors and "computing an answer in another thread" in errors[0], errors
    assert engine.complete("four five", max_tokens=4).token_ids  # once it is done, the other thread's turn


def test_reset_from_another_thread_waits_for_the_step_computing(tiny):
    """A GUI's "new chat" on its own thread while a worker computes a step: the cache is emptied after that step,
    not under it; the worker's stream then stops with one FafoError, and the engine answers afresh."""
    engine = load(str(tiny), dtype="float32", chat_template=False)
    order: list[str] = []

    def other_thread() -> None:
        engine.reset()
        order.append("reset")

    thread = threading.Thread(target=other_thread)

    def on_prefill(progress) -> None:  # inside the first step, holding the engine
        if not order:
            thread.start()
            thread.join(0.5)  # it waits for the step
            order.append("step")

    stream = engine.stream("one two three " * 30, max_tokens=12, on_prefill=on_prefill)
    next(stream)
    thread.join()
    assert order == ["step", "reset"]
    with pytest.raises(FafoError, match="another answer started on this engine"):
        next(stream)
    expected = load(str(tiny), dtype="float32", chat_template=False).complete("four five", max_tokens=6).token_ids
    assert engine.complete("four five", max_tokens=6).token_ids == expected


def test_one_stop_string_is_not_split_into_characters(tiny):
    engine = load(str(tiny), dtype="float32", chat_template=False)
    text = engine.complete("one two three", max_tokens=24).text
    assert len(text) > 4
    stop = text[2:4] + "\x00"  # never in the text: with its characters taken one by one, the answer stopped early
    assert engine.complete("one two three", max_tokens=24, stop=stop).text == text


def test_a_model_folder_given_as_dot_or_a_link_has_the_same_compiled_steps(tiny, tmp_path, monkeypatch):
    """`fafo run .` named its steps folder "-<identity>", and the process that builds a package (which loads the
    resolved folder) refused it as another model's: every build failed."""
    (tmp_path / "link").symlink_to(tiny, target_is_directory=True)
    monkeypatch.chdir(tiny)
    folders = {load(spec, dtype="float32", chat_template=False).steps_folder
               for spec in (".", str(tiny), str(tmp_path / "link"))}
    assert len(folders) == 1 and folders.pop().name.startswith(f"{tiny.name}-")


@pytest.mark.parametrize("flags,expected", [
    ("fpu avx2 fma f16c", "float32"),  # Zen 3
    ("avx2 avx512f avx512bw avx512vl", "float32"),  # Skylake: oneDNN says bf16, and emulates it
    ("avx2 avx512f avx512_bf16", "bfloat16"),  # Zen 4, Cooper Lake
    ("avx512f amx_tile amx_bf16", "bfloat16"),  # Sapphire Rapids
    ("fp asimd bf16", "bfloat16"),  # Arm with bf16 products
    ("", "float32"),  # flags not listed (macOS, Windows): oneDNN's yes on any AVX-512 CPU is not taken
])
def test_auto_dtype_on_a_cpu_is_bf16_only_where_it_computes_it(monkeypatch, flags, expected):
    import torch

    from fafo_cli.api import pick_dtype
    from fafo_cli.compiled.kernels import loader

    monkeypatch.setattr(loader, "cpu_flags", lambda: flags)
    assert pick_dtype("auto", torch.device("cpu")) == getattr(torch, expected)
    assert pick_dtype("float16", torch.device("cpu")) == torch.float16  # named: as named


def test_logits_that_are_not_numbers_are_one_line_naming_the_dtype_to_use(tiny, tmp_path, monkeypatch, capsys):
    """float16 overflows in some models (Qwen2's): argmax over NaN logits emitted token 0 on and on, silently."""
    from fafo_cli.cli import entrypoint
    from fafo_cli.errors import ModelOutputError
    from fafo_cli.runtime.model import Model

    forward = Model.forward

    def overflowing(self, *args, **kwargs):
        logits = forward(self, *args, **kwargs)
        engine.session.cache.keys.fill_(float("nan"))  # (what it wrote is no numbers either)
        return logits * float("nan")

    monkeypatch.setattr(Model, "forward", overflowing)
    engine = load(str(tiny), dtype="float32", chat_template=False)
    with pytest.raises(ModelOutputError, match="try --dtype float32"):
        engine.complete("Hello", max_tokens=4)
    assert engine.session.cache.length == 0 and not engine.session.ids  # no cache a later request could reuse
    # nor rows a later answer's steps read under a mask (CUDA graphs read the whole capacity: a masked NaN is NaN)
    assert not engine.session.cache.keys[:, :len(engine.encode("Hello"))].isnan().any()
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Hello")
    assert entrypoint(["run", str(tiny), "--dtype", "float32", "-p", str(prompt), "-n", "4"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not numbers (NaN or infinite) in float32" in err
    assert "bfloat16" in session_mod.non_finite(torch.float16) and "Qwen2" in session_mod.non_finite(torch.float16)


def test_eager_steps_converting_a_compact_cache_let_the_compiled_steps_drop_their_views_first(tiny):
    """A compiled step stores the cache compact (bf16 where eager attention reads float32): the eager pass that
    converts it tells the compiled steps first, whose views of the old tensors would keep both copies alive."""
    engine = load(str(tiny), dtype="float32")
    session = engine.session
    forgotten = []

    class Steps:  # compiled steps that serve no step here
        def __call__(self, *args):
            return None

        def serves(self, rows):
            return False

        def notify_once(self, message):
            pass

        def step_costs(self, sizes, refresh=False):
            return None

        def forget_cache(self):
            forgotten.append(session.cache.dtype)

    session.compiled = Steps()
    session.cache.store_as(torch.bfloat16)  # as a compiled step leaves it
    assert engine.complete("Hello", max_tokens=4, method="vanilla").token_ids
    assert forgotten == [torch.bfloat16] and session.cache.dtype == torch.float32  # once, before the conversion
    session.use_compiled(None)  # as the bench's eager rows set them aside: their views go too
    assert len(forgotten) == 2 and session.compiled is None


def test_a_checkpoint_missing_a_weight_is_refused_not_filled_at_random(tmp_path):
    """A folder whose weights lack a parameter (a head not tied yet not saved, a file cut short): transformers'
    loading fills it with random numbers and says so in a warning; fafo refuses it in one line instead."""
    from safetensors.torch import load_file, save_file

    from .conftest import build_tiny_model

    folder = build_tiny_model(tmp_path / "no-head", "llama-gqa")
    tensors = load_file(folder / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(FafoError, match=r"holds? nothing for 1 of the model's parameters \(such as lm_head.weight\)"):
        load(str(folder), dtype="float32")


class EagerSteps:
    """Compiled steps that serve no step (every step runs eager): each time they are told to let go of the cache,
    its capacity then; a package load that takes `load_s`."""

    def __init__(self, session, load_s: float = 0.0):
        self.session, self.load_s, self.forgotten = session, load_s, []

    def forget_cache(self):
        self.forgotten.append(self.session.cache.capacity)

    def serves(self, rows):
        time.sleep(self.load_s)
        return False

    def __call__(self, *args):
        return None

    def notify_once(self, message):
        pass

    def step_costs(self, sizes, refresh=False):
        return None


@pytest.mark.parametrize("method", ["fafo", "prompt-lookup", "quantspec"])
def test_compiled_steps_let_go_of_the_cache_before_a_step_grows_it(tiny, monkeypatch, method):
    """A decoding step that grows the cache (an answer past the prefill's room): the compiled steps' hold on the old
    storage goes first (a GPU's graphs kept it alive through the copy: old and new cache and every graph's memory)."""
    from fafo_cli.runtime import cache as cache_mod, session as session_mod

    monkeypatch.setattr(session_mod, "RESERVE_AHEAD", 8)  # the prefill's room: the answer grows the cache
    monkeypatch.setattr(cache_mod, "GROW_SLOTS", 16)
    engine = load(str(tiny), dtype="float32", chat_template=False, compile="off")
    engine.session.cache = engine.model.new_cache(initial_slots=16)
    engine.session.compiled = steps = EagerSteps(engine.session)
    forgotten = steps.forgotten
    capacities, before_decoding = [], None
    for _ in engine.stream("one two three one two three", max_tokens=80, method=method):
        before_decoding = len(forgotten) if before_decoding is None else before_decoding
        capacities.append(engine.session.cache.capacity)
    growths = sum(after > before for before, after in zip(capacities, capacities[1:]))
    assert growths and len(forgotten) - before_decoding >= growths


def test_loading_a_compiled_step_is_no_part_of_the_prompts_time(tiny):
    """The prefill loads the decoder's compiled step first (a second or more): the time to the first token counts
    it, the prompt's speed does not."""
    engine = load(str(tiny), dtype="float32", chat_template=False, compile="off", method="vanilla")
    engine.session.compiled = EagerSteps(engine.session, load_s=0.3)  # a package that takes 0.3 s to load
    stats = engine.complete("a short prompt", max_tokens=2).stats
    assert stats.ttft_s >= 0.3 > stats.prefill_s


def test_compiled_steps_let_go_of_the_cache_before_a_prefill_grows_it(tiny):
    """Their views of the cache would keep its old storage alive through a prefill that grows it (a float32 model's
    cache, whose dtype never changes, held twice at a long prompt's peak); a prefill that fits keeps them (a GPU's
    captured graphs are dear to capture again)."""
    engine = load(str(tiny), dtype="float32", chat_template=False, compile="off", method="vanilla")
    engine.session.compiled = steps = EagerSteps(engine.session)
    forgotten = steps.forgotten
    engine.complete("short", max_tokens=2)
    assert forgotten == []  # (the cache's first allocation holds it)
    engine.complete("a prompt longer than the cache's first allocation " * 12, max_tokens=2)
    assert len(forgotten) == 1


def test_load_takes_a_path_and_checks_its_notify(tiny):
    from pathlib import Path

    from fafo_cli import load

    assert load(Path(tiny), dtype="float32").complete("hi", max_tokens=2).token_ids
    with pytest.raises(FafoError, match="^notify must be a function of one notice"):
        load(str(tiny), notify="log")


def test_a_dropped_engine_frees_its_model_without_a_collection(tiny):
    """A notebook that loads one model after another: the engine's compiled steps (compile: auto, on a CPU) held
    it in a reference cycle, so `del engine` kept its model in memory until a garbage collection."""
    import gc
    import weakref

    from fafo_cli import load

    gc.collect()
    gc.disable()
    try:
        engine = load(str(tiny), dtype="float32", compile="auto")
        assert engine.compiled is not None
        model, builder = weakref.ref(engine.model.hf), engine.compiled.builder
        del engine
        assert model() is None
    finally:
        gc.enable()
    from fafo_cli.compiled.build import CompileError

    with pytest.raises(CompileError, match="the engine these steps were built for is gone") as raised:
        builder(1, tiny / "rows1.pt2")  # (steps kept after their engine: nothing recorded as failed)
    assert raised.value.transient
