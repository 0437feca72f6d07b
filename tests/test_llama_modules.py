"""Our own modules of the supported architectures (runtime/llama.py) against transformers' own, bit for bit in
float32, and the checkpoints they leave to transformers."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from fafo_cli.runtime import llama
from fafo_cli.runtime.model import max_context

from .conftest import VARIANTS, build_tiny_model

ROPES = {
    "default": None,
    "linear": dict(rope_type="linear", factor=4.0),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64),
}


def _both(folder):
    from transformers import AutoModelForCausalLM

    ours = llama.load(folder, torch.float32, torch.device("cpu"))
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return ours, theirs


def _hidden(theirs, ids):
    """transformers' hidden states before each layer, and its logits."""
    with torch.inference_mode():
        out = theirs(ids, output_hidden_states=True)
    return out.hidden_states, out.logits


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_module_computes_what_transformers_computes(tiny_models, variant):
    ours, theirs = _both(tiny_models[variant])
    assert type(ours) is llama.CausalLM
    assert {n for n, _ in ours.named_parameters()} == {n for n, _ in theirs.named_parameters()} - (
        {"lm_head.weight"} if theirs.config.tie_word_embeddings else set())
    ids = torch.randint(0, ours.config.vocab_size, (1, 12))
    positions = torch.arange(12)[None] + 5
    x = torch.randn(1, 12, ours.config.hidden_size)
    with torch.inference_mode():
        assert torch.equal(ours.model.embed_tokens(ids), theirs.model.embed_tokens(ids))
        for mine, hf in zip(ours.model.rotary_emb(x, positions), theirs.model.rotary_emb(x, positions)):
            assert torch.equal(mine, hf)
        for a, b in zip(ours.model.layers, theirs.model.layers):
            assert torch.equal(a.input_layernorm(x), b.input_layernorm(x))
            assert torch.equal(a.post_attention_layernorm(x), b.post_attention_layernorm(x))
            assert torch.equal(a.mlp(x), b.mlp(x))
            for name in ("q_proj", "k_proj", "v_proj"):
                assert torch.equal(getattr(a.self_attn, name)(x), getattr(b.self_attn, name)(x))
            attended = torch.randn(1, 12, b.self_attn.o_proj.in_features)
            assert torch.equal(a.self_attn.o_proj(attended), b.self_attn.o_proj(attended))
            heads = x.view(1, 12, -1, a.self_attn.head_dim)[..., :ours.config.num_key_value_heads, :]
            for name in ("q_norm", "k_norm"):
                if hasattr(b.self_attn, name):
                    assert torch.equal(getattr(a.self_attn, name)(heads), getattr(b.self_attn, name)(heads))
            assert a.self_attn.scaling == b.self_attn.scaling and a.self_attn.head_dim == b.self_attn.head_dim
        assert torch.equal(ours.lm_head(x), theirs.lm_head(x))
    assert ours.generation_config.eos_token_id == theirs.generation_config.eos_token_id


@pytest.mark.parametrize("rope", list(ROPES))
def test_rotary_factors_equal_transformers_for_each_rope_type(tmp_path, rope):
    folder = build_tiny_model(tmp_path / rope, "llama-gqa", max_positions=4096,
                              **({} if ROPES[rope] is None else {"rope_parameters": {**ROPES[rope], "rope_theta": 5e5}}))
    ours, theirs = _both(folder)
    assert ours.model.rotary_emb.rope_type == rope
    positions = torch.tensor([[0, 1, 7, 63, 64, 500, 4095]])
    x = torch.zeros(1, 7, 8, dtype=torch.bfloat16)
    for mine, hf in zip(ours.model.rotary_emb(x, positions), theirs.model.rotary_emb(x, positions)):
        assert mine.dtype == torch.bfloat16 and torch.equal(mine, hf)


def test_the_older_config_form_reads_as_the_current_one(tmp_path):
    """config.json written by transformers 4 (rope_theta and rope_scaling at the top) reads as rope_parameters."""
    folder = build_tiny_model(tmp_path / "m", "llama-gqa", rope_parameters={**ROPES["llama3"], "rope_theta": 5e5})
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(rope_theta=rope.pop("rope_theta"), rope_scaling={**rope, "type": rope.pop("rope_type")})
    (folder / "config.json").write_text(json.dumps(config))
    assert llama.read_config(folder).rope_parameters == {**ROPES["llama3"], "rope_theta": 5e5}


@pytest.mark.parametrize("changes", [
    dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}, rope_scaling={"type": "linear", "factor": 2.0}),
    dict(rope_parameters={**ROPES["llama3"], "rope_theta": 5e5}, original_max_position_embeddings=32),
    dict(rope_parameters={k: v for k, v in ROPES["llama3"].items() if k != "original_max_position_embeddings"}),
    dict(num_key_value_heads=None),
    dict(model_type="mistral", sliding_window=None, head_dim=None),
])
def test_config_forms_read_as_transformers_reads_them(tmp_path, changes):
    """Legacy rope_scaling beside rope_parameters, a top-level original context, a missing one, null kv heads."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    folder = build_tiny_model(tmp_path / "m", "llama-gqa")
    config = {**json.loads((folder / "config.json").read_text()), **changes}
    (folder / "config.json").write_text(json.dumps(config))
    ours, theirs = llama.read_config(folder), AutoConfig.from_pretrained(folder)
    assert ours.num_key_value_heads == theirs.num_key_value_heads and ours.head_dim == theirs.head_dim
    assert max_context(ours) == max_context(theirs)  # a null window is none
    assert torch.equal(llama.inverse_frequencies(ours), LlamaRotaryEmbedding(theirs).inv_freq)


@pytest.mark.parametrize("changes, context", [
    (dict(sliding_window=16), 4096),  # Llama's layers do not read the key
    (dict(model_type="mistral", sliding_window=16), 16),
    # (transformers reads a Mistral config with layer_types as Ministral's, whose layers follow them)
    (dict(model_type="mistral", sliding_window=16, layer_types=["full_attention"] * 2), 4096),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1), 16),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=2), 4096),  # no layer
    (dict(model_type="qwen2", use_sliding_window=False, sliding_window=16), 4096),
])
def test_a_sliding_window_bounds_the_context_where_transformers_slides(tmp_path, changes, context):
    """Within its sliding window a layer attends to what full attention does: the context is bounded by the window
    where transformers runs some layer over it (and only there: a key no layer reads cost a Llama model its context)."""
    from transformers import AutoConfig

    folder = build_tiny_model(tmp_path / "m", "llama-gqa", max_positions=4096)  # (2 layers)
    (folder / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()), **changes}))
    assert max_context(llama.read_config(folder)) == max_context(AutoConfig.from_pretrained(folder)) == context


def test_longrope_runs_within_its_original_context(tmp_path):
    """transformers picks longrope's short or long factors for a whole call by its last position: within the
    original context every call of ours (a chunk of a prefill, a step with guessed rows) picks the short ones, as
    transformers' own decoding does."""
    from transformers import AutoConfig

    half = 8  # (the tiny model's head size is 16)
    folder = build_tiny_model(tmp_path / "m", "llama-gqa", max_positions=4096, rope_parameters=dict(
        rope_type="longrope", rope_theta=1e4, original_max_position_embeddings=1024, short_factor=[1.0] * half,
        long_factor=[4.0] * half))
    assert llama.read_config(folder) is None  # (transformers' own modules run it)
    assert max_context(AutoConfig.from_pretrained(folder)) == 1024


def test_a_linear_layer_of_its_own_kind_computes_its_own_product():
    """A step's rows go through a float32 linear layer as W @ xᵀ (model._columns_linear), but a subclass's own
    product (a quantized checkpoint's layers, which transformers builds) is its own: not the plain product of its
    weight."""
    from fafo_cli.runtime.model import _columns_linear

    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    x = torch.randn(3, 8)
    for module in (torch.nn.Linear(8, 4), Scaled(8, 4)):
        assert torch.allclose(_columns_linear(module, x), module(x), atol=1e-6)


def test_checkpoints_the_modules_do_not_cover_load_through_transformers(tmp_path, tiny):
    from fafo_cli import load

    yarn = build_tiny_model(tmp_path / "yarn", "llama-gqa", rope_parameters=dict(
        rope_type="yarn", factor=2.0, rope_theta=1e4, original_max_position_embeddings=1024))
    assert llama.load(yarn, torch.float32, torch.device("cpu")) is None
    engine = load(str(yarn), dtype="float32")
    assert type(engine.model.hf).__name__ == "LlamaForCausalLM"
    assert len(engine.complete("hello", max_tokens=4).token_ids) == 4

    extra = tmp_path / "extra"  # a tensor our modules have no place for: never dropped silently
    shutil.copytree(tiny, extra)
    from safetensors.torch import load_file, save_file

    tensors = load_file(extra / "model.safetensors")
    save_file({**tensors, "model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}, extra / "model.safetensors",
              metadata={"format": "pt"})
    assert llama.load(extra, torch.float32, torch.device("cpu")) is None
    shaped = {**tensors, "model.norm.weight": torch.ones(32)}  # a shape the config does not give: not loaded
    save_file(shaped, extra / "model.safetensors", metadata={"format": "pt"})
    assert llama.load(extra, torch.float32, torch.device("cpu")) is None


def test_loading_the_embedded_model_imports_neither_transformers_nor_the_compiler_nor_sympy():
    """What a `fafo run` start costs: transformers' model classes pull in torch._dynamo and sympy (seconds), its
    package and tokenizer classes half a second."""
    code = ("import sys; from fafo_cli import load; e = load(); e.complete('Hi', max_tokens=2); "
            "print(type(e.model.hf).__name__, type(e.tokenizer).__name__, "
            "*(m in sys.modules for m in ('transformers', 'torch._dynamo', 'sympy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["CausalLM", "Tokenizer", "False", "False", "False"]


SAMPLING = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "eos_token_id": 2}


@pytest.mark.parametrize("given", [None, {"eos_token_id": [2, 3]}, SAMPLING])
def test_generation_settings_read_as_transformers_reads_them(tmp_path, given):
    from transformers import GenerationConfig

    folder = build_tiny_model(tmp_path / "m", "llama-gqa")
    path = folder / "generation_config.json"
    if given is None:
        path.unlink()
        theirs = GenerationConfig.from_model_config(json.loads((folder / "config.json").read_text()))
    else:
        path.write_text(json.dumps(given))
        theirs = GenerationConfig.from_pretrained(folder)
    ours = llama.load(folder, torch.float32, torch.device("cpu")).generation_config
    assert {key: getattr(ours, key) for key in llama.GENERATION_KEYS} == {
        key: getattr(theirs, key) for key in llama.GENERATION_KEYS}


def test_loading_gives_transformers_and_the_hub_their_logging_and_progress_bars_back(monkeypatch):
    """Both switches as they were (transformers' flips the hub's too), and the logger's own level, not its
    effective one (which would pin a logger left to its parents)."""
    import importlib
    import logging

    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging

    from fafo_cli.runtime.model import quiet_transformers

    # (the tests' environment turns the hub's bars off for good: HF_HUB_DISABLE_PROGRESS_BARS, read at import)
    monkeypatch.setattr(importlib.import_module("huggingface_hub.utils.tqdm"), "HF_HUB_DISABLE_PROGRESS_BARS", None)
    logger = logging.getLogger("transformers")
    kept = logger.level, hf_logging.is_progress_bar_enabled(), are_progress_bars_disabled()
    try:
        for transformers_bars, hub_bars in ((True, False), (False, True), (True, True)):
            (hf_logging.enable_progress_bar if transformers_bars else hf_logging.disable_progress_bar)()
            (enable_progress_bars if hub_bars else disable_progress_bars)()
            logger.setLevel(logging.NOTSET)
            with quiet_transformers():
                assert logger.level == logging.ERROR and are_progress_bars_disabled()
            assert logger.level == logging.NOTSET
            assert hf_logging.is_progress_bar_enabled() == transformers_bars
            assert are_progress_bars_disabled() != hub_bars
    finally:
        logger.setLevel(kept[0])
        (hf_logging.enable_progress_bar if kept[1] else hf_logging.disable_progress_bar)()
        (disable_progress_bars if kept[2] else enable_progress_bars)()
