"""Shared fixtures: tiny random models of each supported architecture, and the embedded SmolLM2.

Tiny models get a real byte-level BPE tokenizer (256 byte tokens + specials, no merges) and a chat
template, so every code path (templating, detokenization, stop tokens) runs as it does for a real model.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

import pytest
import torch

# Keep tests offline; no progress bars from the models the fixtures save.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # `-n auto`: one worker per core, so one thread each (more oversubscribe)
    torch.set_num_threads(1)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The prompts of the exactness tests. SHORT: ~40 byte tokens, within every compressed budget the tests use (but
# 16); LONG: ~300 tokens of text with repeats, past those budgets, so guesses from the pool and the prompt get
# accepted (the commit path is exercised).
SHORT = "one two three four five six seven eight"
LONG = ("The cat sat on the mat. The dog sat on the log. " * 3 + "Where did the cat sit? " +
        "A bird sang on a branch while the wind moved the leaves. " * 2)
TOKENS = 256  # generated per exactness comparison: long enough for many accepted runs and pool commits

# The peer methods' settings in the exactness tests. Budgets sit between SHORT and LONG: the retrieval cache
# and the 4-bit groups cover all of a short prompt and part of a long one.
PEERS = {
    "lookahead": dict(method="lookahead", lookahead_streams=2, lookahead_ngram=3, lookahead_guesses=2),
    "prompt-lookup": dict(method="prompt-lookup", lookup_ngram=3, lookup_tokens=6),
    "cacheback": dict(method="cacheback", cacheback_budget=16, cacheback_followers=3),
    "cacheback-ll2": dict(method="cacheback", cacheback_leader=2, cacheback_follower=4, cacheback_budget=9),
    "suffix": dict(method="suffix", suffix_tokens=12, suffix_factor=2.0),
    "triforce": dict(method="triforce", triforce_chunk=8, triforce_budget=64, triforce_gamma2=4),
    "quantspec": dict(method="quantspec", quantspec_gamma=3, quantspec_group=64),
}

VARIANTS = {
    # name: (config class name, extra config)
    "llama-mha": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4)),
    "llama-gqa": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen2-bias": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2)),  # qkv bias
    "qwen3-qknorm": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)),
    "mistral": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=None)),
}


def build_tokenizer(eos: bool = True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    for token in specials:
        vocab[token] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>" if eos else None, pad_token="<|endoftext|>",
                                   additional_special_tokens=specials)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(folder: Path, variant: str, *, seed: int = 0, max_positions: int = 2048,
                     eos: bool = False, chat_template: bool | str = True, **overrides) -> Path:
    """A random-weight model saved as a normal HF folder (safetensors). `eos=False`: no stop token, so
    greedy outputs run to the token limit and comparisons stay long. `chat_template`: False for none, or a
    template of its own."""
    import transformers

    cls_name, extra = VARIANTS[variant]
    tokenizer = build_tokenizer(eos)
    if not chat_template:
        tokenizer.chat_template = None
    elif isinstance(chat_template, str):
        tokenizer.chat_template = chat_template
    settings = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    max_position_embeddings=max_positions, initializer_range=0.2, tie_word_embeddings=False,
                    bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id)
    config = getattr(transformers, cls_name)(**{**settings, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if variant == "qwen2-bias":  # random (not zero) biases, so a forgotten bias would show
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# The device the running test's engines load on: tests marked `device` run on --device (FAFO_TEST_DEVICE), every
# other test on the CPU (a config that names a device keeps it). transformers' oracle (hf_greedy) runs there too.
DEVICE = {"now": "cpu"}


def pytest_addoption(parser):
    parser.addoption("--compile-all", action="store_true",
                     help="run every test with compiled steps (config compile 'on' wherever a test leaves it "
                          "at 'auto'): builds a package per model and row bucket, so it takes much longer")
    parser.addoption("--device", choices=("cpu", "cuda"), default=os.environ.get("FAFO_TEST_DEVICE") or "cpu",
                     help="where the exactness tests (marked `device`) run, against transformers' generate on the "
                          "same device (default: $FAFO_TEST_DEVICE, else cpu); without CUDA, --device cuda skips them")


def _throwaway_cache() -> Path:
    """fafo's cache for this session's tests: their conversions, compiled steps, packed blocks and measured step
    costs go to a throwaway folder, not the user's cache (a cost curve one test's bench measured for a tiny model
    steered another test's plan, and every session's tiny models left folders behind). The user's conversions and
    built kernels are linked in, so the embedded model is not converted again; a test's clean-up cannot remove
    them (a link is not removed as a folder). A killed session's folder is removed by the next session. The user's
    config file is not read either: the folder holds an empty config home."""
    import tempfile

    from fafo_cli import hub
    from fafo_cli.files import remove_abandoned, scratch_dir

    remove_abandoned(Path(tempfile.gettempdir()), "fafo-tests")
    # (xdist's workers inherit the first process's FAFO_CACHE: they read the user's cache from here)
    user = Path(os.environ.setdefault("FAFO_TESTS_USER_CACHE", str(hub.cache_dir())))
    cache = scratch_dir(Path(tempfile.gettempdir()), "fafo-tests")
    for kind, pattern in (("models", "[!.]*"), ("compiled", "fafo-ops-*.so")):
        (cache / kind).mkdir()
        for item in (user / kind).glob(pattern):
            try:
                (cache / kind / item.name).symlink_to(item, target_is_directory=item.is_dir())
            except OSError:  # no links here: that item is made again where a test needs it
                pass
    os.environ["FAFO_CACHE"] = str(cache)
    # torch's compiler cache, shared by the session's builds (each build process otherwise gets one of its own,
    # thrown away after it: the same tiny model's packages, built again by several tests, would compile anew)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
    # nor the user's config file (`fafo config init`, `--tune` or `doctor --write` would change what tests run)
    (cache / "config").mkdir()
    os.environ["XDG_CONFIG_HOME"] = str(cache / "config")
    return cache


def pytest_unconfigure(config):
    import shutil

    if getattr(config, "_fafo_cache", None):
        shutil.rmtree(config._fafo_cache, ignore_errors=True)  # the links only: the user's files stay


def pytest_configure(config):
    from dataclasses import replace

    from fafo_cli import api

    compile_all = config.getoption("--compile-all")
    config._fafo_cache = _throwaway_cache()

    from_config = api.Engine.from_config.__func__

    def on_test_device(cls, settings, notify=None, load_draft=None):
        if settings.device == "auto":
            settings = replace(settings, device=DEVICE["now"])
        if compile_all and settings.compile == "auto":
            settings = replace(settings, compile="on")
            notify = notify or (lambda _: None)
        return from_config(cls, settings, notify=notify, load_draft=load_draft)

    api.Engine.from_config = classmethod(on_test_device)


@pytest.fixture(autouse=True)
def _test_device(request):
    """Engines of a test marked `device` load on --device; every other test's on the CPU."""
    DEVICE["now"] = request.config.getoption("--device") if request.node.get_closest_marker("device") else "cpu"
    yield
    DEVICE["now"] = "cpu"


@pytest.fixture(autouse=True)
def _fixed_step_costs(request, monkeypatch):
    """FAFO's planner corrects its cost curve with the times of the steps it runs, so on a loaded machine it
    guesses differently. Output never depends on that, but a test that looks at the steps (which ran several
    rows, what was accepted) must see the same steps on every machine: tests plan from the curve alone, except
    those marked `step_times` (the planner's own tests, which feed it times)."""
    if not request.node.get_closest_marker("step_times"):
        from fafo_cli.decoders.fafo.planner import StepCosts

        monkeypatch.setattr(StepCosts, "observe", lambda self, rows, window, ms: None)


@pytest.fixture(autouse=True)
def _no_kept_cost_curves(request, monkeypatch):
    """Engines load without the pass-cost curves kept beside a model's packages: the tests share one cache, and a
    curve one test's bench measured for a tiny model (host jitter) steered a later test's plan (a steep one left the
    sampling test no depth-2 guess). Tests marked `kept_costs` read what is kept, as a user's later run does."""
    if not request.node.get_closest_marker("kept_costs"):
        from fafo_cli import api

        monkeypatch.setattr(api, "read_step_costs", lambda folder: {})


@pytest.fixture(autouse=True)
def _undisturbed_cost_curves(monkeypatch):
    """A tiny model's passes take a millisecond or so, their cost curve is host jitter: in tests it is never
    judged disturbed (test_bench checks that judgement on curves of its own)."""
    from fafo_cli.bench import tune

    monkeypatch.setattr(tune, "CURVE_SLACK", float("inf"))


COMPILED_FIXTURES = {"compiled_folder", "compiled_cache", "compiled_engine"}
# The files that build packages, minutes each: first, so that a parallel run (`-n auto --dist loadfile`, which hands
# out files in this order: pyproject's --no-loadscope-reorder) starts them at once and gives the other files to
# whichever worker is free
LONGEST_FIRST = ("test_packed_packages.py", "test_compiled.py", "test_packed.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: LONGEST_FIRST.index(item.path.name) if item.path.name in LONGEST_FIRST else
               len(LONGEST_FIRST))  # (stable: each file's own order is kept)
    cuda = config.getoption("--device") == "cuda"
    for item in items:  # a test that may build packages or our kernels is marked so, whichever way it asks
        if COMPILED_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.compiled)
        if cuda and item.get_closest_marker("device"):
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="--device cuda: CUDA is not available here"))
            elif item.get_closest_marker("compiled"):  # compiled steps and our kernels are CPU code
                item.add_marker(pytest.mark.skip(reason="--device cuda: compiled steps are tested on the CPU"))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {name: build_tiny_model(root / name, name) for name in VARIANTS}


@pytest.fixture(scope="session")
def tiny(tiny_models) -> Path:
    return tiny_models["llama-gqa"]


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The embedded default, converted once into fafo's cache (the user's cache: conversion is shared)."""
    from fafo_cli import hub

    return hub.resolve(None)


@pytest.fixture(scope="session")
def compiled_folder(tmp_path_factory) -> Path:
    """fafo's cache for the compiled tests (packages and our kernel library), one per session: each package and the
    kernels are built once, however many tests use them."""
    return tmp_path_factory.mktemp("fafo-cache")


@pytest.fixture
def compiled_cache(compiled_folder, monkeypatch) -> Iterator[Path]:
    """The session's compiled cache as fafo's cache (FAFO_CACHE) for this test only: the other tests' engines
    (compile "auto") never find a package that a compiled test built."""
    monkeypatch.setenv("FAFO_CACHE", str(compiled_folder))
    yield compiled_folder
    for failed in compiled_folder.glob("compiled/*/rows*.failed"):  # a build a test made fail is not the others'
        failed.unlink()


@pytest.fixture
def our_attention(request, compiled_folder) -> bool:
    """Eager steps attend with our kernel, as a .gguf model's do (the embedded default's), where this machine can
    build it (then loaded for the rest of the process, as in a run); else with torch's. Which one a file's tests use
    must not depend on which tests ran before them in their worker. True where ours serves. (Not built for a run on
    --device cuda, whose engines attend on the GPU.)"""
    from fafo_cli.compiled.kernels import loader
    from fafo_cli.runtime import model

    if request.config.getoption("--device") != "cpu":
        return False
    try:
        loader.load(compiled_folder / "compiled")
    except loader.BuildError:  # (no C++ compiler here: torch's, as a run would)
        pass
    return model._cpu_attention is not None


@pytest.fixture
def torch_attention(monkeypatch) -> None:
    """Eager steps attend with torch's kernel, as a safetensors model's do in a run that loaded no .gguf model."""
    from fafo_cli.runtime import model

    monkeypatch.setattr(model, "_cpu_attention", None)
    monkeypatch.setattr(model, "_cpu_attention_reads_bf16", False)


@pytest.fixture(scope="session")
def compiled_engine(compiled_folder, tiny):
    """The tiny model in float32 with compiled steps (packages built on first need), its notices in `.notices`."""
    from fafo_cli import load

    notices: list[str] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FAFO_CACHE", str(compiled_folder))  # read at load: where the engine's packages live
        engine = load(str(tiny), dtype="float32", chat_template=False, compile="on", notify=notices.append)
    engine.notices = notices
    return engine


def first_row_logits(model, runners: dict, context: int, recent: int, generator) -> dict[int, torch.Tensor]:
    """{rows: the first row's logits} for token 0 at position `context`, after a cache of random keys and values, in
    each compiled package of `runners` ({rows: runner}); the rows after the first ask the same, those from the third
    on as a window's rows, which see the cache's first 4 positions and its last `recent` (StreamingLLM's view)."""
    from fafo_cli.compiled.build import stored_dtype

    cache = model.new_cache(context + max(runners), context + max(runners))
    for part in (cache.keys, cache.values):
        part.copy_(torch.randn(part.shape, generator=generator))
    cache.commit(context)
    cache.store_as(stored_dtype(model))
    visible = torch.zeros(context, len(model.layers), dtype=torch.bool)
    visible[:4] = visible[-recent:] = True
    logits = {}
    for rows, runner in runners.items():
        sees_all = torch.arange(rows) < 2
        logits[rows] = runner(torch.zeros(rows, dtype=torch.long), torch.arange(context, context + rows),
                              torch.ones(rows, rows, dtype=torch.bool).tril(), sees_all, ~sees_all, visible,
                              list(cache.keys.unbind(0)), list(cache.values.unbind(0)))[0]
    return logits


def hf_greedy(folder: Path, prompt_ids: list[int], new_tokens: int, dtype=torch.float32) -> list[int]:
    """The external oracle: transformers' own greedy generate on the test's device (each answer computed once per
    session)."""
    return list(_greedy(folder, tuple(prompt_ids), new_tokens, dtype, DEVICE["now"]))


@lru_cache(maxsize=None)
def _greedy(folder: Path, prompt_ids: tuple[int, ...], new_tokens: int, dtype, device: str) -> tuple[int, ...]:
    ids = torch.tensor([prompt_ids], device=device)
    with torch.inference_mode():
        out = _hf_model(folder, dtype, device).generate(ids, attention_mask=torch.ones_like(ids),
                                                        max_new_tokens=new_tokens, do_sample=False, min_new_tokens=0)
    return tuple(out[0, len(prompt_ids):].tolist())


def forget_hf_models() -> None:
    """Free the oracle's models (a module of large ones ends: the others' tests need the memory)."""
    _hf_model.cache_clear()


@lru_cache(maxsize=4)
def _hf_model(folder: Path, dtype, device: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
