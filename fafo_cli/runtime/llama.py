"""The supported architectures (architectures.py) as plain torch modules, loaded from a safetensors checkpoint
without transformers' model classes.

Importing those classes costs a command about two seconds before its first token (they pull in torch's compiler
and sympy) and `from_pretrained` another half second; decoding uses none of it. These modules carry
transformers' names (`model.layers.0.self_attn.q_proj`, ...) and compute what transformers' modules compute,
operation for operation: float32 logits equal transformers' bit for bit (tested on every architecture and rope
type here). `load` answers None for a checkpoint they do not cover exactly (another rope scaling or activation,
a tensor they do not expect), which then loads through transformers.
"""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import FafoError
from .architectures import SUPPORTED

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}
ROPE_TYPES = {"default": (), "linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# transformers' defaults for the keys a checkpoint's config.json may leave out (its config classes' own)
DEFAULTS = {
    "llama": dict(max_position_embeddings=2048),
    "mistral": dict(max_position_embeddings=4096 * 32, sliding_window=4096, num_key_value_heads=8),
    "qwen2": dict(max_position_embeddings=32768, sliding_window=4096, use_sliding_window=False, num_key_value_heads=32),
    "qwen3": dict(max_position_embeddings=32768, sliding_window=4096, use_sliding_window=False, num_key_value_heads=32,
                  head_dim=128),
}
# what decoding reads (and the penalty it does not apply: said at load)
GENERATION_KEYS = ("do_sample", "temperature", "top_p", "top_k", "min_p", "eos_token_id", "repetition_penalty")
COMMON = dict(rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu", attention_bias=False, mlp_bias=False)


class Config(SimpleNamespace):
    """config.json's settings with transformers' defaults filled in, as attributes (what Model reads)."""

    def to_json_string(self) -> str:
        return json.dumps(vars(self), sort_keys=True)


def read_config(folder: Path) -> Config | None:
    """The model's settings; None where these modules do not compute it exactly."""
    raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    kind = raw.get("model_type")
    if kind not in SUPPORTED or kind not in DEFAULTS:
        return None
    # what transformers computes otherwise, or refuses: quantization on load, sliding-window layers, partial rotary
    if (raw.get("quantization_config") or "sliding_attention" in (raw.get("layer_types") or ())
            or raw.get("partial_rotary_factor", 1.0) != 1.0):
        return None
    settings = {**COMMON, **DEFAULTS[kind], **raw}  # a null stays null (`sliding_window: null`: no window)
    missing = [key for key in REQUIRED if settings.get(key) is None]
    if missing:  # (transformers' classes would fill in their own defaults, of another model's shape)
        raise FafoError(f"{folder / 'config.json'} does not give {', '.join(missing)}")
    if settings.get("num_key_value_heads") is None:  # absent or null: as many as the query heads
        settings["num_key_value_heads"] = settings["num_attention_heads"]
    if settings.get("head_dim") is None:
        settings["head_dim"] = settings["hidden_size"] // settings["num_attention_heads"]
    # the older form (rope_scaling beside rope_theta) wins over the current one where both are given, as in transformers
    rope = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    if any(isinstance(value, dict) for value in rope.values()):  # per layer type: not a form these modules run
        return None
    rope.setdefault("rope_theta", raw.get("rope_theta", 10_000.0))
    rope["rope_type"] = rope.get("rope_type", rope.pop("type", "default"))
    if rope["rope_type"] == "llama3":  # the config's own value wins, as transformers standardizes it
        rope["original_max_position_embeddings"] = raw.get("original_max_position_embeddings") or rope.get(
            "original_max_position_embeddings") or settings["max_position_embeddings"]
    settings["rope_parameters"] = rope
    if rope["rope_type"] in ROPE_TYPES and any(rope.get(key) is None for key in ROPE_TYPES[rope["rope_type"]]):
        raise FafoError(f"{folder / 'config.json'}: its {rope['rope_type']} rope scaling does not give "
                        + ", ".join(key for key in ROPE_TYPES[rope["rope_type"]] if rope.get(key) is None))
    if (rope["rope_type"] not in ROPE_TYPES or rope.get("partial_rotary_factor", 1.0) != 1.0
            or settings["hidden_act"] not in ACTIVATIONS):
        return None
    return Config(**settings)


def inverse_frequencies(config: Config) -> torch.Tensor:
    """The rotary inverse frequencies of the config's rope type, computed as transformers computes them."""
    rope = config.rope_parameters
    dim = config.head_dim
    steps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu")  # not on meta, where the model is built
    inv_freq = 1.0 / (rope["rope_theta"] ** (steps.to(dtype=torch.float) / dim))
    if rope["rope_type"] == "linear":
        inv_freq /= rope["factor"]
    elif rope["rope_type"] == "llama3":  # Llama 3.1's: long wavelengths divided by the factor, a smooth band between
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old_context = rope["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_context / low, old_context / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class Linear(nn.Linear):
    def reset_parameters(self) -> None:  # every weight is loaded: no random initialisation (on meta, it imports dynamo)
        pass


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass


_bf16_rms_norm: Callable | None = None  # fafo::rms_norm, where our kernel library is loaded


def serve_bf16_rms_norm(op: Callable | None) -> None:
    """bf16 RMSNorms on a CPU run `op` (fafo::rms_norm) from now on in this process: one order of a row's sum for
    eager steps and compiled packages, whose own reductions part in the last bits (rms_norm.cpp says why)."""
    global _bf16_rms_norm
    _bf16_rms_norm = op


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _bf16_rms_norm is not None and x.dtype == self.weight.dtype == torch.bfloat16 and x.device.type == "cpu":
            return _bf16_rms_norm(x, self.weight, self.variance_epsilon)
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """cos, sin [1, rows, dim] of the positions [1, rows], in the dtype of `x`."""

    def __init__(self, config: Config):
        super().__init__()
        self.rope_type = config.rope_parameters["rope_type"]
        self.attention_scaling = 1.0  # the types above scale no attention
        self.register_buffer("inv_freq", inverse_frequencies(config), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        angles = torch.cat((freqs, freqs), dim=-1)
        return ((angles.cos() * self.attention_scaling).to(dtype=x.dtype),
                (angles.sin() * self.attention_scaling).to(dtype=x.dtype))


class Attention(nn.Module):
    """The projections (Model.forward computes attention itself); Qwen2 biases q, k and v, Qwen3 norms q and k."""

    def __init__(self, config: Config):
        super().__init__()
        self.head_dim = config.head_dim
        self.scaling = self.head_dim ** -0.5
        heads, kv, hidden = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
        qkv_bias = config.model_type == "qwen2" or (config.model_type in ("llama", "qwen3") and config.attention_bias)
        o_bias = config.model_type in ("llama", "qwen3") and config.attention_bias
        self.q_proj = Linear(hidden, heads * self.head_dim, bias=qkv_bias)
        self.k_proj = Linear(hidden, kv * self.head_dim, bias=qkv_bias)
        self.v_proj = Linear(hidden, kv * self.head_dim, bias=qkv_bias)
        self.o_proj = Linear(heads * self.head_dim, hidden, bias=o_bias)
        if config.model_type == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)


class MLP(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        bias = config.model_type == "llama" and config.mlp_bias
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Decoder(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = Rotary(config)


class CausalLM(nn.Module):
    """The modules Model.forward runs, under transformers' names; `generation_config` as transformers reads it."""

    def __init__(self, config: Config, generation_config):
        super().__init__()
        self.config, self.generation_config = config, generation_config
        self.model = Decoder(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)


def load(folder: Path, dtype: torch.dtype, device: torch.device) -> CausalLM | None:
    """The checkpoint in `folder` (config.json, *.safetensors) on `device` in `dtype`; None where these modules do
    not compute it exactly (transformers loads it instead)."""
    from safetensors import safe_open

    config = read_config(folder)
    files = checkpoint_files(folder)
    if config is None or not files:
        return None
    with torch.device("meta"):
        model = CausalLM(config, _generation_config(folder, config))
    shapes = {name: p.shape for name, p in model.named_parameters()}  # what the checkpoint must hold, exactly
    if config.tie_word_embeddings:
        del shapes["lm_head.weight"]
    stored_shapes = {}
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as stored:
            for name in stored.keys():
                if not name.endswith("rotary_emb.inv_freq"):  # older checkpoints keep the buffer; it is computed
                    stored_shapes[name] = torch.Size(stored.get_slice(name).get_shape())
    if stored_shapes != shapes:
        return None  # a tensor these modules lack or shape otherwise, or one they need that is not there
    # each tensor read, converted and moved on its own: the whole model in host memory at once, and in two dtypes
    # while converting, was up to three times its size before it reached a GPU
    tensors = {}
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as stored:
            for name in stored.keys():
                if name in shapes:
                    tensors[name] = stored.get_tensor(name).to(device=device, dtype=dtype)
    model.load_state_dict(tensors, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device).eval()


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of the checkpoint: its index's, or the one `model.safetensors` (a folder may hold other
    files, such as Mistral's consolidated copy of the same weights)."""
    index = folder / "model.safetensors.index.json"
    if (folder / "model.safetensors").is_file():  # transformers' first choice too
        return [folder / "model.safetensors"]
    if index.is_file():
        shards = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values()
        return [folder / name for name in sorted(set(shards))]
    return []


def _generation_config(folder: Path, config: Config) -> SimpleNamespace:
    """What decoding reads of generation_config.json (sampling defaults, stop ids), or of the model's config where
    there is none, as transformers derives one; a key left out is None, as transformers' default."""
    path = folder / "generation_config.json"
    given = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else vars(config)
    if not isinstance(given, dict):
        raise ValueError(f"{path.name} does not hold a JSON object")
    return SimpleNamespace(**{key: given.get(key) for key in GENERATION_KEYS})
