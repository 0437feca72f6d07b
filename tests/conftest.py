"""Shared fixtures: tiny random models of each supported architecture, and the embedded SmolLM2.

Tiny models get a real byte-level BPE tokenizer (256 byte tokens + specials, no merges) and a chat
template, so every code path (templating, detokenization, stop tokens) runs as it does for a real model.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Keep tests offline; no progress bars from the models the fixtures save.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

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
                     eos: bool = False, chat_template: bool = True, **overrides) -> Path:
    """A random-weight model saved as a normal HF folder (safetensors). `eos=False`: no stop token, so
    greedy outputs run to the token limit and comparisons stay long."""
    import transformers

    cls_name, extra = VARIANTS[variant]
    tokenizer = build_tokenizer(eos)
    if not chat_template:
        tokenizer.chat_template = None
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


def pytest_addoption(parser):
    parser.addoption("--compile-all", action="store_true",
                     help="run every test with compiled steps (config compile 'on' wherever a test leaves it "
                          "at 'auto'): builds a package per model and row bucket, so it takes much longer")


def pytest_configure(config):
    if config.getoption("--compile-all"):
        import tempfile
        from dataclasses import replace

        from fafo_cli import api

        # packages of the tests' throwaway models go to a throwaway cache, not the user's
        os.environ["FAFO_CACHE"] = tempfile.mkdtemp(prefix="fafo-compile-all-")

        from_config = api.Engine.from_config.__func__

        def compiled(cls, settings, notify=None):
            if settings.compile == "auto":
                settings = replace(settings, compile="on")
            return from_config(cls, settings, notify=notify or (lambda _: None))

        api.Engine.from_config = classmethod(compiled)


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


def hf_greedy(folder: Path, prompt_ids: list[int], new_tokens: int, dtype=torch.float32) -> list[int]:
    """The external oracle: transformers' own greedy generate."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             min_new_tokens=0)
    return out[0, len(prompt_ids):].tolist()
