"""QuantSpec's 4-bit copy of the model's weights, which its draft passes read (the full-model verify pass reads the
model's own weights, so the output is unchanged).

Every linear layer of the decoder and the vocabulary projection is quantized group-wise along its input
dimension (asymmetric, codes 0..15, one scale and one zero per group of WEIGHT_GROUP inputs; a smaller power of
two where the width is not a multiple of it), as the paper's W4A16 draft does. On a CPU the product runs in torch's
int4 kernel (`_weight_int4pack_mm_for_cpu`) in bfloat16: reading a quarter of the bytes is where the paper's
speedup at short contexts comes from. Elsewhere each pass dequantizes a layer's weights first (correct, and
without the saving: no fused kernel is wired up for other devices).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from ..runtime.model import Model

WEIGHT_GROUP = 128  # inputs per scale: the group size of the paper's 4-bit weights
LEVELS = 15
OFFSET = 8  # torch's int4 kernel reads a weight as (code - 8) * scale + zero
COMPUTE = torch.bfloat16  # the CPU int4 kernel is many times slower with float32 activations than with bfloat16
ROWS = 16  # the CPU int4 kernel's outputs come in multiples of this: padded with zero rows
FUSED_GROUPS = 32  # the CPU int4 kernel's least group: a matrix of smaller groups is dequantized per call


def group_size(in_features: int) -> int:
    group = WEIGHT_GROUP
    while in_features % group:
        group //= 2
    if group < 2:
        raise ValueError(f"{in_features} inputs cannot be split into groups of 2 or more")
    return group


class Int4Linear:
    """One linear layer's weight [out, in] as 4-bit codes with per-group scales and zeros."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fused: bool | None = None):
        """`fused`: torch's CPU int4 kernel (default: on a CPU, where the groups are large enough for it), else
        dequantize per call."""
        out_features, in_features = weight.shape
        self.group = group_size(in_features)
        grouped = weight.detach().float().view(out_features, in_features // self.group, self.group)
        low = grouped.amin(-1, keepdim=True)
        scale = (grouped.amax(-1, keepdim=True) - low) / LEVELS
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: every code 0 gives low
        codes = ((grouped - low) / scale).round_().clamp_(0, LEVELS).to(torch.int32).view(out_features, in_features)
        zero = low + OFFSET * scale
        self.cpu = (weight.device.type == "cpu" if fused is None else fused) and self.group >= FUSED_GROUPS
        # [groups, out, 2]: scale and zero, as the int4 kernel takes them
        self.scales_and_zeros = torch.stack([scale[..., 0].t(), zero[..., 0].t()], dim=-1).contiguous()
        if self.cpu:
            pad = -out_features % ROWS  # rows of code 8 with scale 1 and zero 0: outputs of 0, cut off
            padded = F.pad(codes, (0, 0, 0, pad), value=OFFSET)
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(padded, 1)
            self.scales_and_zeros = F.pad(self.scales_and_zeros, (0, 0, 0, pad)).to(COMPUTE)
            self.scales_and_zeros[:, out_features:, 0] = 1
        else:  # two codes a byte, low nibble first
            pairs = codes.to(torch.uint8).view(out_features, in_features // 2, 2)
            self.packed = pairs[..., 0] | (pairs[..., 1] << 4)
        self.bias = bias
        self.shape = (out_features, in_features)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] these codes stand for (the non-CPU path, and tests)."""
        out_features, in_features = self.shape
        if self.cpu:
            eye = torch.eye(in_features, dtype=COMPUTE, device=self.packed.device)
            product = torch._weight_int4pack_mm_for_cpu(eye, self.packed, self.group, self.scales_and_zeros)
            return product[:, :out_features].t().to(dtype)
        codes = torch.stack((self.packed & 0x0F, self.packed >> 4), dim=-1).view(out_features, in_features)
        scale, zero = self.scales_and_zeros.float().unbind(-1)  # [groups, out]
        grouped = codes.float().view(out_features, -1, self.group)
        return ((grouped - OFFSET) * scale.t()[..., None] + zero.t()[..., None]).view(self.shape).to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu:
            flat = x.reshape(-1, x.shape[-1]).to(COMPUTE)
            out = torch._weight_int4pack_mm_for_cpu(flat, self.packed, self.group, self.scales_and_zeros)
            out = out[:, :self.shape[0]].reshape(*x.shape[:-1], -1).to(x.dtype)
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes


class Int4Weights:
    """The 4-bit copies of a model's linear layers; `linear(module, x)` is Model.forward's `linear` argument."""

    def __init__(self, model: Model):
        modules = [model.lm_head]
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            modules += [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        # a packed module (compiled/packed.py) rebuilds the dense weight it stands for
        self.layers = {id(module): Int4Linear(*(module.dense() if hasattr(module, "dense") else
                                                 (module.weight, module.bias))) for module in modules}

    def linear(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.layers[id(module)](x)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers.values())


_BUILT: "weakref.WeakKeyDictionary[Model, Int4Weights]" = weakref.WeakKeyDictionary()


def int4_weights(model: Model) -> Int4Weights:
    """The model's 4-bit copy, made once per loaded model (seconds for a large one) and kept while it lives."""
    if model not in _BUILT:
        _BUILT[model] = Int4Weights(model)
    return _BUILT[model]
