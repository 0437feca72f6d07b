"""A GGUF model's quantized weights, kept packed for compiled CPU steps (fafo::packed_linear, packed_linear.cpp).

A .gguf model is dequantized once to float32 (hub.convert_gguf) and loaded in bf16, so each weight of a Q4_1
tensor is bf16(d * q + m) and each of a Q8_0 tensor bf16(d * q): 16 bits that 6 or 9 determine. A compiled
step is bound by reading weights, so its projections and vocabulary head read the file's blocks instead,
rebuilt exactly in the kernel. Packing reads the blocks again, puts the rows in the loaded model's order
(transformers permutes the rows of q and k for its rotary layout) and keeps a matrix packed only when the
kernel's rebuild equals the loaded weight bit for bit; any other matrix, and every model not from a .gguf
file, stays dense.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from ..runtime.model import Model

# GGUF tensor name (per block) -> the decoder layer's module
LAYER_MODULES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}
HEAD_TENSORS = ("output.weight", "token_embd.weight")  # the vocabulary head's own, else the tied embedding
# a layer's matrices that read the same input: multiplied in one call (fewer calls, one pass over the input)
SHARED_INPUT = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))
TILE, GROUP, BLOCK = 16, 64, 32  # packed_linear.cpp's kTile (weight rows per task) and kGroup; GGUF's block


def supported(model: Model) -> bool:
    """Whether this model's steps can use packed weights: a bf16 model on a CPU the kernel was built for
    (our library must be loaded)."""
    return model.device.type == "cpu" and model.dtype == torch.bfloat16 and torch.ops.fafo.packed_supported()


def _multiply(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] times a packed weight (packed_linear takes two dimensions): [..., out_features]."""
    y = torch.ops.fafo.packed_linear(x.reshape(-1, x.shape[-1]).contiguous(), packed, out_features, bias)
    return y.view(*x.shape[:-1], out_features)


class PackedLinear(torch.nn.Module):
    """Stands in for an nn.Linear while a step is traced: same inputs, same outputs."""

    def __init__(self, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.out_features = out_features
        self.register_buffer("packed", packed)
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _multiply(x, self.packed, self.out_features, self.bias)


class FusedPackedLinear(torch.nn.Module):
    """Packed matrices that read the same input, stacked: one packed_linear call computes all their outputs.
    Each part stands in for its own module (`part(i)`); calls with the same input tensor, as a layer makes them
    for q, k and v, share the latest call. Every output row's sums are those its own matrix gives alone (the
    kernel works tile by tile of 16 weight rows), so this changes no bit, only the number of calls."""

    def __init__(self, parts: list[PackedLinear]):
        super().__init__()
        self.sizes = [p.out_features for p in parts]
        self.out_features = sum(self.sizes)
        self.register_buffer("packed", torch.cat([p.packed for p in parts]))
        biases = [p.bias for p in parts]
        self.register_buffer("bias", None if biases[0] is None else torch.cat(biases))
        self._latest: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None  # (input, outputs)

    @staticmethod
    def fits(parts: list[PackedLinear | None]) -> bool:
        """Whether these can be stacked: all packed alike, none padded (every size a whole number of tiles,
        so no padding rows sit between two parts), all with a bias or none."""
        return (all(p is not None for p in parts) and len({p.packed.shape[1:] for p in parts}) == 1
                and all(p.out_features % TILE == 0 for p in parts) and len({p.bias is None for p in parts}) == 1)

    def part(self, index: int) -> "FusedPart":
        return FusedPart(self, index)

    def outputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self._latest is None or self._latest[0] is not x:
            self._latest = (x, _multiply(x, self.packed, self.out_features, self.bias).split(self.sizes, dim=-1))
        return self._latest[1]

    def forget(self) -> None:
        self._latest = None  # holds traced tensors: dropped once the trace is done


class FusedPart(torch.nn.Module):
    """One matrix of a FusedPackedLinear, in its module's place."""

    def __init__(self, fused: FusedPackedLinear, index: int):
        super().__init__()
        self.fused, self.index = fused, index
        self.out_features = fused.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.outputs(x)[self.index]


def q4_1_blocks(tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
    """A Q4_1 or Q8_0 tensor [out, in] as codes [out, in / 32, 32], d and m [out, in / 32] (float32; m None
    for Q8_0); None for other types."""
    from gguf import GGMLQuantizationType as Type

    out_features, in_features = int(tensor.shape[1]), int(tensor.shape[0])
    if tensor.tensor_type == Type.Q4_1:  # d, m (float16), 16 bytes: weight j in the low nibble, j + 16 high
        raw = np.asarray(tensor.data).reshape(out_features, in_features // BLOCK, 20)
        m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        codes = np.concatenate([raw[..., 4:] & 15, raw[..., 4:] >> 4], axis=-1)
        return codes, raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32), m
    if tensor.tensor_type == Type.Q8_0:  # d (float16), 32 int8
        raw = np.asarray(tensor.data).reshape(out_features, in_features // BLOCK, 34)
        return raw[..., 2:].copy().view(np.int8), raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32), None
    return None


def dequantized(codes: np.ndarray, d: np.ndarray, m: np.ndarray | None) -> torch.Tensor:
    """What GGUF's dequantizer computes in float32 (d * q [+ m]), rounded to bf16 as the model was loaded."""
    values = d[..., None] * codes.astype(np.float32)
    if m is not None:
        values = values + m[..., None]
    return torch.from_numpy(values.reshape(codes.shape[0], -1)).to(torch.bfloat16)


def _row_order(source: torch.Tensor, target: torch.Tensor) -> list[int] | None:
    """Indices i such that source[i] == target row by row, bit for bit; None when some row has no match."""
    if torch.equal(source, target):
        return list(range(source.shape[0]))
    where = {row.view(torch.int16).numpy().tobytes(): i for i, row in enumerate(source)}
    order = [where.get(row.view(torch.int16).numpy().tobytes()) for row in target]
    return None if None in order else order


def pack(codes: np.ndarray, d: np.ndarray, m: np.ndarray | None) -> torch.Tensor:
    """Blocks -> packed_linear's layout [out / TILE, in / GROUP, TILE, entry] (out padded with zero rows).
    An entry holds two blocks, A and B: Q4_1 (m given): byte i = A's code i | B's code i << 4, then dA, mA, dB,
    mB; Q8_0: A's codes, B's codes, dA, dB (scales as float32)."""
    rows, blocks, _ = codes.shape
    pad = -rows % TILE
    d, m = d.astype(np.float32), None if m is None else m.astype(np.float32)
    if pad:
        codes = np.concatenate([codes, np.zeros((pad, blocks, BLOCK), codes.dtype)])
        d = np.concatenate([d, np.zeros((pad, blocks), np.float32)])
        m = None if m is None else np.concatenate([m, np.zeros((pad, blocks), np.float32)])
    rows, groups = rows + pad, blocks // 2
    pairs = codes.view(np.uint8).reshape(rows, groups, 2, BLOCK)
    if m is None:
        code_bytes, scales = pairs.reshape(rows, groups, 2 * BLOCK), d.reshape(rows, groups, 2)
    else:
        code_bytes = pairs[:, :, 0] | (pairs[:, :, 1] << 4)
        scales = np.stack([d.reshape(rows, groups, 2), m.reshape(rows, groups, 2)], axis=-1).reshape(rows, groups, 4)
    entries = np.concatenate([code_bytes, np.ascontiguousarray(scales).view(np.uint8)], axis=-1)
    tiled = entries.reshape(rows // TILE, TILE, groups, entries.shape[-1]).transpose(0, 2, 1, 3)
    return torch.from_numpy(np.ascontiguousarray(tiled))


def packed_linear(tensor, linear: torch.nn.Linear) -> PackedLinear | None:
    """`linear` as packed `tensor`'s blocks, when they rebuild its weight exactly."""
    blocks = None if tensor is None or linear.in_features % GROUP else q4_1_blocks(tensor)
    if blocks is None:
        return None
    codes, d, m = blocks
    if codes.shape[0] != linear.out_features or codes.shape[1] * BLOCK != linear.in_features:
        return None
    order = _row_order(dequantized(codes, d, m), linear.weight.data)
    if order is None:
        return None
    weight = pack(codes[order], d[order], None if m is None else m[order])
    if not torch.equal(torch.ops.fafo.packed_weight(weight, linear.out_features), linear.weight.data):
        return None  # the kernel would multiply other values than the model's: keep this one dense
    return PackedLinear(weight, linear.out_features, linear.bias)


def pack_model(model: Model, gguf: Path) -> dict[str, torch.nn.Module]:
    """The projections and the vocabulary head that can be packed exactly, by their module's name in the
    transformers model ("model.layers.3.mlp.up_proj", "lm_head"): PackedLinear, or FusedPart where a layer's
    matrices that read the same input could be stacked."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(gguf).tensors}
    wanted = {f"model.layers.{i}.{module}": tensors.get(f"blk.{i}.{name}.weight")
              for i in range(len(model.layers)) for name, module in LAYER_MODULES.items()}
    wanted["lm_head"] = next((tensors[name] for name in HEAD_TENSORS if name in tensors), None)
    packed = {name: packed_linear(tensor, model.hf.get_submodule(name)) for name, tensor in wanted.items()}
    for i in range(len(model.layers)):
        for group in SHARED_INPUT:
            names = [f"model.layers.{i}.{module}" for module in group]
            if FusedPackedLinear.fits([packed[name] for name in names]):
                fused = FusedPackedLinear([packed[name] for name in names])
                packed.update((name, fused.part(index)) for index, name in enumerate(names))
    return {name: module for name, module in packed.items() if module is not None}


def kernels(modules: dict[str, torch.nn.Module]) -> list[PackedLinear | FusedPackedLinear]:
    """The distinct packed_linear calls behind `modules` (a FusedPackedLinear once for all its parts)."""
    distinct = {}
    for module in modules.values():
        module = module.fused if isinstance(module, FusedPart) else module
        distinct[id(module)] = module
    return list(distinct.values())


@contextmanager
def swapped_in(model: Model, modules: dict[str, torch.nn.Module]):
    """The transformers model's modules replaced by `modules` (for tracing), then put back. Model.forward
    holds the vocabulary head itself, so it is swapped there too."""
    originals = {name: model.hf.get_submodule(name) for name in modules}
    head = model.lm_head
    try:
        for name, module in modules.items():
            model.hf.set_submodule(name, module)
        model.lm_head = modules.get("lm_head", head)
        yield
    finally:
        for name, module in originals.items():
            model.hf.set_submodule(name, module)
        model.lm_head = head
        for module in modules.values():
            if isinstance(module, FusedPart):
                module.fused.forget()
