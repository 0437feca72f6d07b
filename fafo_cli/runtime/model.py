"""Our forward pass over a Llama-family model's modules: ours (llama.py) or, for a checkpoint they do not cover,
transformers' own.

We call the model's embedding, projections, norms, MLP and rotary embedding as built, and own only what decoding
needs to control: which positions each query row sees, and where keys and values are stored. Nothing in
transformers is patched. A step's rows are written after the cache's committed prefix; the caller commits.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .cache import KVCache


# attend(layer, queries [1, heads, rows, dim], keys [1, kv_heads, slots, dim], values) -> [1, heads, rows, dim]
# (4-D with a batch axis: torch's fused CPU attention kernel needs it; 3-D inputs fall back to a slow path)
Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# linear(module, x) -> module's product with x, from weights other than the module's own (QuantSpec's 4-bit draft)
Linear = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]


@contextmanager
def quiet_transformers():
    """Silence transformers' warnings and progress bars while loading, then restore what was there: its logger's own
    level (not the effective one, which would pin a logger left to its parents), its progress bars' switch and
    huggingface_hub's, which transformers' switch flips too."""
    import logging

    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging

    logger = logging.getLogger("transformers")  # (transformers' library root logger)
    level, bars, hub_bars = logger.level, hf_logging.is_progress_bar_enabled(), not are_progress_bars_disabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        logger.setLevel(level)
        if bars:
            hf_logging.enable_progress_bar()
        if hub_bars != (not are_progress_bars_disabled()):
            (enable_progress_bars if hub_bars else disable_progress_bars)()


def max_context(config) -> int:
    """Longest sequence the model handles exactly (transformers' `config`): a sliding window, where transformers
    runs some layer over one, bounds it (within the window a layer sees what full attention sees), as longrope's
    original context does."""
    limit = int(getattr(config, "max_position_embeddings", 0) or 2048)
    window = getattr(config, "sliding_window", None)
    if window and _slides(config):
        limit = min(limit, int(window))
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") == "longrope" and rope.get("original_max_position_embeddings"):
        # transformers rotates a whole call by longrope's long factors once its last position is past the original
        # context: our calls (a prefill in chunks, a step's guessed rows ahead of the text) would switch elsewhere
        limit = min(limit, int(rope["original_max_position_embeddings"]))
    return limit


def _slides(config) -> bool:
    """Whether transformers runs a layer of this model over its sliding window: those its `layer_types` mark so,
    which Qwen2's and Qwen3's configs make from use_sliding_window and max_window_layers (our own config,
    llama.read_config, leaves them to this rule); every layer of a Mistral model; a Llama model's never (its layers
    do not read a `sliding_window` key)."""
    kinds = getattr(config, "layer_types", None)
    if kinds is not None:  # (a Mistral config that gives them is read by transformers as Ministral's, which obeys)
        return "sliding_attention" in kinds
    kind = getattr(config, "model_type", None)
    if kind in ("qwen2", "qwen3"):
        return bool(getattr(config, "use_sliding_window", False)) and \
            getattr(config, "max_window_layers", 28) < config.num_hidden_layers
    return kind == "mistral"


# the most rows a decoding step runs (compiled.steps' largest bucket); a prefill chunk has more
STEP_ROWS = 256


def attention_kernels(device: torch.device, rows: int) -> ContextManager:
    """A decoding step's attention on CUDA runs on flash, memory-efficient or math kernels, never cuDNN's, which
    torch prefers on recent GPUs: cuDNN builds a plan for every new key length, so once per layer in every step
    (on an H200 most of a plain step's host time: docs/gpu.md). A prefill chunk, planned once, keeps torch's
    choice."""
    if device.type != "cuda" or rows > STEP_ROWS:
        return nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _own(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def _columns_linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A float32 CPU linear layer of a step's rows computed as W @ xᵀ. torch's x @ Wᵀ for a few rows (2 to a few
    dozen) runs far below the speed of the one-row product on some CPUs, so that verifying a guess or two cost
    half a plain step more; W @ xᵀ reads W at about the one-row speed (docs/benchmarks.md). One row stays the
    module's own product: bit for bit what plain decoding in transformers computes."""
    # (our packed kernels' modules, and a layer with a product of its own, a quantized checkpoint's: theirs)
    if x.numel() == x.shape[-1] or getattr(type(module), "forward", None) is not torch.nn.Linear.forward:
        return module(x)
    flat = x.reshape(-1, x.shape[-1])
    y = (module.weight @ flat.T).T
    if module.bias is not None:
        y = y + module.bias
    return y.reshape(*x.shape[:-1], -1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Model:
    def __init__(self, hf_model):
        self.hf = hf_model
        self.config = hf_model.config
        inner = hf_model.model
        self.embed, self.layers, self.norm = inner.embed_tokens, inner.layers, inner.norm
        self.rotary, self.lm_head = inner.rotary_emb, hf_model.lm_head
        attn = self.layers[0].self_attn
        self.n_heads = self.config.num_attention_heads
        self.n_kv_heads = self.config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.has_qk_norm = hasattr(attn, "q_norm")
        self.max_context = max_context(self.config)
        self.vocab_size = self.lm_head.out_features
        param = next(hf_model.parameters())
        self.dtype, self.device = param.dtype, self.embed.weight.device  # ids, positions and logits live here
        # a model spread over GPUs (runtime/placement.py): each layer's device, where its cache lives too; the hidden
        # state moves to the next layer's device between layers (one small copy per hop and step)
        self.layer_devices = [next(layer.parameters()).device for layer in self.layers]
        self.devices = tuple(dict.fromkeys([self.device, *self.layer_devices, self.norm.weight.device]))
        # (the embedding alone on the first GPU, every layer on the next, is spread too: the hidden state hops)
        self.spread = len(self.devices) > 1
        # how a decoding step's rows go through the linear layers, where not as the modules compute them
        self.step_linear = _columns_linear if (self.device.type, self.dtype) == ("cpu", torch.float32) else None
        self.packed_matrices = 0  # matrices every step reads as a .gguf file's blocks (compiled/packed.py: install)

    @property
    def eager_mode(self) -> str:
        """The name its eager pass costs are kept under (compiled/timing.py's step costs): over packed blocks a row
        costs another share of a pass than over dense weights, which the same model reads under `compile: off`;
        spread over GPUs, a pass hops between them, which the same model on one GPU does not."""
        return "eager-spread" if self.spread else "eager-packed" if self.packed_matrices else "eager"

    @property
    def attention_dtype(self) -> torch.dtype:
        """The dtype eager attention reads keys and values in, and the cache holds them in. On a CPU, torch's
        attention kernel is several times slower in bf16/fp16 than in fp32 once the context reaches ~1k tokens, so
        there the cache holds fp32 copies of the (exactly representable) half-precision keys and values; a bf16
        model's stay bf16 where our kernel serves and reads them so exactly (`serve_cpu_attention`): half the bytes
        each step streams. Elsewhere the model's dtype."""
        if self.device.type != "cpu":
            return self.dtype
        return torch.bfloat16 if self.dtype == torch.bfloat16 and _cpu_attention_reads_bf16 else torch.float32

    def new_cache(self, initial_slots: int = 256, max_slots: int | None = None) -> KVCache:
        return KVCache(len(self.layers), self.n_kv_heads, self.head_dim, max_slots=max_slots or self.max_context,
                       dtype=self.attention_dtype, device=self.device, initial_slots=initial_slots,
                       layer_devices=self.layer_devices if self.spread else None)

    @torch.inference_mode()
    def shift_positions(self, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """Cached keys ([slots, kv_heads, dim], rotary applied) moved `delta` positions earlier: a rotary
        rotation by -delta composes with the one applied, as StreamingLLM's renumbering within a cache needs."""
        cos, sin = self.rotation(torch.full((1,), -delta, device=keys.device))
        scale = getattr(self.rotary, "attention_scaling", 1.0) or 1.0  # applied once already, not again
        cos, sin = (cos / scale).to(keys.dtype), (sin / scale).to(keys.dtype)
        return keys * cos + _rotate_half(keys) * sin

    def rotation(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary factors cos, sin [rows, 1, dim] (broadcast over heads) of `positions`, by the model's module."""
        cos, sin = self.rotary(torch.empty(0, dtype=self.dtype, device=positions.device), positions[None])
        return cos[0, :, None], sin[0, :, None]

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, attend: Attention,
                logit_rows: torch.Tensor | slice | None = None, *,
                rotation: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
                as_float: bool = True, linear: Linear | None = None) -> torch.Tensor:
        """Run `ids` (1-D) at `positions` against `cache`; return logits [rows, vocab] (float32, or the model's
        dtype if not `as_float`).

        The rows' keys and values are written after the committed prefix but not committed.
        `logit_rows` limits the (large) vocabulary projection to the rows the caller will read.
        `rotation` computes the rotary factors in place of `self.rotation`. `linear` computes every linear layer's
        product (the projections, the MLP's and the vocabulary's) in place of the modules' own weights.
        """
        rows = ids.shape[0]
        linear = linear or (self.step_linear if rows <= STEP_ROWS else None)  # a prefill chunk: torch's GEMM is fine
        lin = linear or _own
        x = self.embed(ids[None])
        cos, sin = (rotation or self.rotation)(positions)
        with attention_kernels(x.device, rows):
            for i, layer in enumerate(self.layers):
                if self.spread and x.device != self.layer_devices[i]:  # the next GPU's layers
                    x, cos, sin = (t.to(self.layer_devices[i]) for t in (x, cos, sin))
                attn = layer.self_attn
                h = layer.input_layernorm(x)[0]
                q = lin(attn.q_proj, h).view(rows, self.n_heads, self.head_dim)
                k = lin(attn.k_proj, h).view(rows, self.n_kv_heads, self.head_dim)
                v = lin(attn.v_proj, h).view(rows, self.n_kv_heads, self.head_dim)
                if self.has_qk_norm:
                    q, k = attn.q_norm(q), attn.k_norm(k)
                q = q * cos + _rotate_half(q) * sin
                k = k * cos + _rotate_half(k) * sin
                keys, values = cache.write(i, k, v)
                out = attend(i, q.to(keys.dtype).transpose(0, 1)[None], keys.transpose(0, 1)[None],
                             values.transpose(0, 1)[None])
                x = x + lin(attn.o_proj, out[0].transpose(0, 1).reshape(1, rows, -1).to(self.dtype))
                h = layer.post_attention_layernorm(x)
                if linear is None:
                    x = x + layer.mlp(h)
                else:  # the gated MLP of every supported architecture, spelled out
                    mlp = layer.mlp
                    x = x + linear(mlp.down_proj, mlp.act_fn(linear(mlp.gate_proj, h)) * linear(mlp.up_proj, h))
        if self.spread:
            x = x.to(self.norm.weight.device)
        x = self.norm(x)[0]
        if logit_rows is not None:
            # (spread: a tensor of rows' indices was made on the embedding's GPU)
            x = x[logit_rows.to(x.device) if torch.is_tensor(logit_rows) else logit_rows]
        if self.spread:
            return self._spread_logits(x, as_float)
        logits = lin(self.lm_head, x)
        return logits.float() if as_float else logits

    def _spread_logits(self, x: torch.Tensor, as_float: bool) -> torch.Tensor:
        """The head's logits of a spread model, back on the first device (where sampling and its generator are)."""
        logits = self.lm_head(x.to(self.lm_head.weight.device)).to(self.device)
        return logits.float() if as_float else logits


# Our CPU attention kernel (fafo::attend, compiled/kernels/attention_op.cpp), once compiled/kernels/loader.py has
# loaded our library into this process (a .gguf model's packed blocks, compiled steps): each row's result then
# depends on that row alone, so an eager step's verifying rows compute bit for bit what plain decoding's single
# row would, where torch's kernel rounds a row differently beside others (bf16 texts parted at near-ties)
_cpu_attention: Callable | None = None
_cpu_attention_reads_bf16 = False
_TRUE = torch.ones(STEP_ROWS, dtype=torch.bool)
_FALSE = torch.zeros(STEP_ROWS, dtype=torch.bool)


def serve_cpu_attention(op: Callable | None, *, reads_bf16: bool = False) -> None:
    """Eager CPU steps attend with `op` (fafo::attend) from now on in this process (None: with torch's kernel).
    `reads_bf16`: its bf16 path gives every row, a draft tree's included, what a one-row step gives it (not where
    AMX tiles serve it), so a bf16 model's cache stays bf16 (`Model.attention_dtype`)."""
    global _cpu_attention, _cpu_attention_reads_bf16
    _cpu_attention, _cpu_attention_reads_bf16 = op, op is not None and reads_bf16


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float, memo: dict | None = None) -> torch.Tensor:
    """Attention of q [1, heads, rows, dim] over k, v [1, kv_heads, keys, dim], each KV head serving heads / kv_heads
    query heads (grouped-query attention). Every row sees the keys before the rows' own (the last `rows` keys);
    `mask` [rows, keys] says which of the rows' own each sees (its earlier columns are all true: every mask a step
    builds is so), None: all of them.

    On a CPU where our library is loaded, a pass of at most STEP_ROWS rows (a decoding step, a prefill's short last
    chunk) runs our kernel (`serve_cpu_attention`); elsewhere on a CPU torch's, through `folded_attention` (`memo`:
    as there)."""
    rows, dim = q.shape[2], q.shape[3]
    if q.device.type != "cpu" and rows > STEP_ROWS and mask is not None and mask.dim() == 2:
        return folded_attention(q, k, v, mask, scale, memo)  # a GPU's prefill chunk: see folded_attention
    if q.device.type != "cpu" or (mask is not None and mask.dim() != 2):  # a GPU's step: see folded_attention
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    ours = _cpu_attention is not None and rows <= STEP_ROWS and dim % 16 == 0
    dtype = q.dtype  # of the result
    if not q.dtype == k.dtype == v.dtype or (q.dtype != torch.float32 and not ours):
        q, k, v = q.float(), k.float(), v.float()  # exact; torch's kernel is slow in bf16 (see attention_dtype)
    if ours:
        cached = k.shape[2] - rows
        local = _TRUE[:1].expand(rows, rows) if mask is None else mask[:, cached:]
        out = _cpu_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), _TRUE[:rows],
                             _FALSE[:rows], _FALSE[:1].expand(cached), local, scale)
        return out.to(dtype).transpose(0, 1)[None]
    return folded_attention(q, k, v, mask, scale, memo).to(dtype)


def folded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float, memo: dict | None = None) -> torch.Tensor:
    """torch's attention of q [1, heads, rows, dim] over k, v [1, kv_heads, keys, dim] under `mask` [rows, keys]
    (None: every key), the query heads that share a KV head folded into that head's rows. On a CPU torch's kernel
    then reads each KV head once for all its query heads, where `enable_gqa` took a path several times slower at
    long contexts. The result is enable_gqa's up to rounding (tested). On a GPU a masked `enable_gqa` call takes
    the math path (flash takes no mask, memory-efficient no unequal head counts), which holds every query head's
    scores over the whole cache: a prefill chunk is folded, so that the memory-efficient kernel serves it; a
    decoding step is not, as that kernel splits the work by query rows only and so measured far slower for one row
    over a long cache (docs/gpu.md, scripts/gqa_steps.py). `memo`: a dict that every layer of one pass shares, in
    which the folded mask is kept as the additive mask torch's kernel builds from a boolean one (the same values):
    built once a pass instead of once a layer (a quarter of a long prompt's attention time at 8K tokens)."""
    heads, kv_heads, rows, dim = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
    group = heads // kv_heads
    if mask is not None:
        mask = _folded_mask(mask, group, q.dtype, memo)
    if group == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    folded = q.reshape(q.shape[0], kv_heads, group * rows, dim)
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=scale)
    return out.reshape(q.shape)  # CUDA kernels lay the heads out otherwise: no view


def _folded_mask(mask: torch.Tensor, group: int, dtype: torch.dtype, memo: dict | None) -> torch.Tensor:
    """`mask` [rows, keys] for `group` query heads folded into each KV head's rows ([group * rows, keys]); with
    `memo`, as an additive mask of `dtype`, kept there."""
    key = (group, dtype, mask.device)
    if memo is not None and key in memo:
        return memo[key]
    folded = mask.repeat(group, 1) if group > 1 else mask
    if memo is None:
        return folded
    memo[key] = torch.zeros(folded.shape, dtype=dtype, device=folded.device).masked_fill_(~folded, float("-inf"))
    return memo[key]


def on_device(mask: torch.Tensor | None, device: torch.device, copies: dict) -> torch.Tensor | None:
    """`mask` on `device`: a spread model's later GPUs read it in each of their layers, copied there once a pass
    (`copies`, the pass's own), not once a layer."""
    if mask is None or mask.device == device:
        return mask
    if device not in copies:
        copies[device] = mask.to(device)
    return copies[device]


def causal_attention(mask: torch.Tensor | None, scaling: float) -> Attention:
    """Plain attention: every row sees the cache plus `mask` (None: a single row that sees everything). Its layers
    share one `memo` (folded_attention's)."""
    memo: dict = {}
    copies: dict = {}

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return grouped_attention(q, k, v, on_device(mask, q.device, copies), scaling, memo)

    return attend


def prefix_causal_mask(cached: int, rows: int, device: torch.device) -> torch.Tensor:
    """Boolean mask for `rows` new tokens after `cached` committed ones: row r sees slots 0..cached+r."""
    slots = torch.arange(cached + rows, device=device)
    return slots[None, :] <= (cached + torch.arange(rows, device=device))[:, None]
