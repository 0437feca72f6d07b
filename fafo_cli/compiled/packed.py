"""A GGUF model's quantized weights, kept packed for CPU steps (fafo::packed_linear, packed_linear.cpp).

A .gguf model is dequantized once to float32 by gguf's own dequantizer (hub.convert_gguf), so each weight is a
float32 that a few bits of the file determine: d * q + m per block of 32 for Q4_1, d * q for Q8_0 and Q5_0 (q - 16),
(d * sc) * q - dmin * m per 32 for Q4_K, (d * s) * (q - 32) per 16 for Q6_K; a bf16 model holds those rounded to
bf16. A step is bound by reading weights, so its projections and vocabulary head read the file's blocks instead,
repacked into the kernel's entries (64 columns of one row each, about the file's bytes) and rebuilt exactly in the
kernel, in the model's dtype. Packing puts the rows in the loaded model's order (transformers permutes the rows of q
and k for its rotary layout) and keeps a matrix packed only when the kernel's rebuild equals the loaded weight bit
for bit; any other matrix, one of a type not read here (say Q5_1), and every model not from a .gguf file, stays
dense.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from ..runtime.model import STEP_ROWS, Model

# GGUF tensor name (per block) -> the decoder layer's module
LAYER_MODULES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}
HEAD_TENSORS = ("output.weight", "token_embd.weight")  # the vocabulary head's own, else the tied embedding
# a layer's matrices that read the same input: multiplied in one call (fewer calls, one pass over the input)
SHARED_INPUT = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))
TILE, GROUP, BLOCK = 16, 64, 32  # packed_linear.cpp's kTile (weight rows per task) and kGroup; GGUF's block


def supported(model: Model) -> bool:
    """Whether this model's steps use packed weights: a bf16 model on a CPU the kernel's AMX or AVX-512 path was
    built for, a float32 one where its AVX2 path was (our library must be loaded). Its plain path computes the same
    weights everywhere, but multiplies 2.5-4.5x slower than a dense matrix (docs/benchmarks.md): other CPUs keep
    dense weights."""
    return (model.device.type == "cpu" and model.dtype in (torch.bfloat16, torch.float32)
            and torch.ops.fafo.packed_kernel(model.dtype) != "plain")


# the CPU features of packed_linear.cpp's AVX-512 path and of its float32 (AVX2) path as /proc/cpuinfo names them
# (its AMX path's: loader.AMX_FLAGS)
AVX512_PATH_FLAGS = frozenset({"avx512_bf16", "avx512bw", "f16c"})
AVX2_PATH_FLAGS = frozenset({"avx2", "fma", "f16c"})


def worth_preparing(model: Model) -> bool:
    """Whether packing this model's blocks could pay before our library is built to ask it (`supported`): a bf16
    model on a CPU with the features of one of the kernel's bf16 fast paths, or a float32 one with its AVX2 path's,
    and a compiler to build the kernel with."""
    from .kernels import loader

    flags = set(loader.cpu_flags().split())
    if model.dtype == torch.bfloat16:
        fast_path = AVX512_PATH_FLAGS <= flags or loader.AMX_FLAGS <= flags
    else:
        fast_path = model.dtype == torch.float32 and AVX2_PATH_FLAGS <= flags
    return model.device.type == "cpu" and fast_path and loader.compiler_path() is not None


# Past this many rows (a prefill chunk) a matrix is rebuilt in the rows' dtype and multiplied densely: packed_linear
# pays its rebuild per row tile, a dense GEMM once (faster from a few hundred rows on: docs/benchmarks.md).
# No decoding step has more rows (the compiled packages' largest: steps.ROW_BUCKETS), so their graphs never take this
# path.
DENSE_ROWS = STEP_ROWS


def _multiply(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] times a packed weight (packed_linear takes two dimensions): [..., out_features]."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    if flat.shape[0] > DENSE_ROWS:
        weight = torch.ops.fafo.packed_weight(packed, out_features, flat.dtype)
        y = torch.nn.functional.linear(flat, weight, None if bias is None else bias.to(flat.dtype))
    else:
        y = torch.ops.fafo.packed_linear(flat, packed, out_features, bias)
    return y.view(*x.shape[:-1], out_features)


class PackedLinear(torch.nn.Module):
    """Stands in for an nn.Linear of `dtype` (bf16 or float32): same inputs, same outputs."""

    def __init__(self, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.dtype = out_features, dtype
        self.register_buffer("packed", packed)
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _multiply(x, self.packed, self.out_features, self.bias)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight and bias of the nn.Linear this replaced, rebuilt bit for bit (what QuantSpec quantizes)."""
        bias = None if self.bias is None else self.bias.to(self.dtype)
        return torch.ops.fafo.packed_weight(self.packed, self.out_features, self.dtype), bias


class FusedPackedLinear(torch.nn.Module):
    """Packed matrices that read the same input, stacked: one packed_linear call computes all their outputs.
    Each part stands in for its own module (`part(i)`); calls with the same input tensor, as a layer makes them
    for q, k and v, share the latest call. Every output row's sums are those its own matrix gives alone (the
    kernel works tile by tile of 16 weight rows), so this changes no bit, only the number of calls. The outputs are
    let go once every part has taken its own: kept until the next call, a long prompt's last prefill chunk left
    its q, k, v and gate, up products alive in every layer (0.8 GB for Qwen2.5-Coder-0.5B at 1,450 tokens)."""

    def __init__(self, packed: torch.Tensor, sizes: list[int], bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.sizes, self.dtype = list(sizes), dtype
        self.out_features = sum(self.sizes)
        self.register_buffer("packed", packed)
        self.register_buffer("bias", bias)
        self._latest: tuple[torch.Tensor, tuple[torch.Tensor, ...], set[int]] | None = None  # input, outputs, taken

    @classmethod
    def stacked(cls, parts: list[PackedLinear]) -> "FusedPackedLinear":
        biases = [p.bias for p in parts]
        return cls(torch.cat([p.packed for p in parts]), [p.out_features for p in parts],
                   None if biases[0] is None else torch.cat(biases), parts[0].dtype)

    @staticmethod
    def fits(parts: list[PackedLinear | None]) -> bool:
        """Whether these can be stacked: all packed alike, none padded (every size a whole number of tiles,
        so no padding rows sit between two parts), all with a bias or none."""
        return (all(p is not None for p in parts) and len({(p.packed.shape[1:], p.dtype) for p in parts}) == 1
                and all(p.out_features % TILE == 0 for p in parts) and len({p.bias is None for p in parts}) == 1)

    def part(self, index: int) -> "FusedPart":
        return FusedPart(self, index)

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Part `index`'s product with `x`: the parts' call with this input, made now unless it was made for it."""
        if self._latest is None or self._latest[0] is not x:
            self._latest = (x, _multiply(x, self.packed, self.out_features, self.bias).split(self.sizes, dim=-1), set())
        _, outputs, taken = self._latest
        taken.add(index)
        if len(taken) == len(self.sizes):
            self._latest = None
        return outputs[index]

    def forget(self) -> None:
        self._latest = None  # holds traced tensors: dropped once the trace is done


class FusedPart(torch.nn.Module):
    """One matrix of a FusedPackedLinear, in its module's place."""

    def __init__(self, fused: FusedPackedLinear, index: int):
        super().__init__()
        self.fused, self.index = fused, index
        self.out_features = fused.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.output(x, self.index)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        start = sum(self.fused.sizes[:self.index])
        rows = slice(start, start + self.out_features)
        dtype = self.fused.dtype
        weight = torch.ops.fafo.packed_weight(self.fused.packed, self.fused.out_features, dtype)[rows]
        return weight, None if self.fused.bias is None else self.fused.bias[rows].to(dtype)


def _halves(raw: np.ndarray, at: int) -> np.ndarray:
    """Little-endian float16 bytes at `at` of each block, as float32 (as gguf reads them)."""
    return raw[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(codes: np.ndarray) -> np.ndarray:
    """[..., 64] codes -> 32 bytes: byte i = (code i & 15) | (code 32 + i & 15) << 4 (blocks A and B)."""
    return (codes[..., :32] & 15) | ((codes[..., 32:] & 15) << 4)


def _plane(codes: np.ndarray, bit: int) -> np.ndarray:
    """[..., 64] codes -> 8 bytes: `bit` of A's 32 codes as a little-endian uint32 (bit i: code i), then B's."""
    bits = ((codes >> bit) & 1).astype(np.uint8).reshape(*codes.shape[:-1], 2, 32)
    return np.packbits(bits, axis=-1, bitorder="little").reshape(*codes.shape[:-1], 8)


def _q4_1(raw: np.ndarray) -> np.ndarray:  # blocks: d, m (float16), 16 bytes: code j low nibble, j + 16 high
    pairs = raw.reshape(*raw.shape[:-2], -1, 2, 20)
    codes = np.concatenate([pairs[..., 4:] & 15, pairs[..., 4:] >> 4], axis=-1).reshape(*pairs.shape[:-2], 64)
    scales = np.stack([_halves(pairs, 0), _halves(pairs, 2)], axis=-1).reshape(*pairs.shape[:-2], 4)
    return np.concatenate([_nibbles(codes), scales.view(np.uint8)], axis=-1)


def _q8_0(raw: np.ndarray) -> np.ndarray:  # blocks: d (float16), 32 int8: A's codes, B's, dA, dB
    pairs = raw.reshape(*raw.shape[:-2], -1, 2, 34)
    flat = lambda part: part.reshape(*pairs.shape[:-2], -1)  # noqa: E731
    return np.concatenate([flat(pairs[..., 2:]), flat(pairs[..., :2])], axis=-1)


def _q5_0(raw: np.ndarray) -> np.ndarray:  # blocks: d (float16), the fifth bits (uint32), 16 bytes as Q4_1's
    pairs = raw.reshape(*raw.shape[:-2], -1, 2, 22)
    flat = lambda part: part.reshape(*pairs.shape[:-2], -1)  # noqa: E731
    low = np.concatenate([pairs[..., 6:] & 15, pairs[..., 6:] >> 4], axis=-1)
    return np.concatenate([_nibbles(flat(low)), flat(pairs[..., 2:6]), flat(pairs[..., :2])], axis=-1)


def _q5_0_bytes(raw: np.ndarray) -> np.ndarray:
    """Q5_0 for float32 rows: Q8_0's entries, each code less 16 as a signed byte (A's, B's), then dA, dB as the
    file's."""
    pairs = raw.reshape(*raw.shape[:-2], -1, 2, 22)
    low = np.concatenate([pairs[..., 6:] & 15, pairs[..., 6:] >> 4], axis=-1)
    fifth = np.unpackbits(pairs[..., 2:6], axis=-1, bitorder="little")  # bit j of the little-endian word: code j's
    codes = (low | (fifth << 4)).astype(np.int8) - np.int8(16)
    flat = lambda part: part.reshape(*pairs.shape[:-2], -1)  # noqa: E731
    return np.concatenate([flat(codes.view(np.uint8)), flat(pairs[..., :2])], axis=-1)


def _q4_k(raw: np.ndarray) -> np.ndarray:
    """Super-blocks of 256: d, dmin (float16), 12 bytes of 6-bit scales and minimums, 128 bytes of codes whose
    32-byte run k holds sub-block 2k in its low nibbles and 2k + 1 in its high ones: one entry's codes as they are."""
    from gguf.quants import Q4_K

    rows, supers = raw.shape[:-1]
    sc, m = Q4_K.get_scale_min(raw[..., 4:16].reshape(-1, 12))  # gguf's own unpacking, [blocks, 8] each
    scales = np.stack([sc, m], axis=-1).reshape(rows, supers, 4, 4)  # per entry: scA, mA, scB, mB
    codes = raw[..., 16:].reshape(rows, supers, 4, 32)
    head = np.broadcast_to(raw[..., None, :4], (rows, supers, 4, 4))
    return np.concatenate([codes, scales.astype(np.uint8), head], axis=-1).reshape(rows, supers * 4, 40)


def _q4_k_as_q4_1(raw: np.ndarray) -> np.ndarray:
    """Q4_K for float32 rows: Q4_1's entries, each sub-block's D = d * sc and M = -(dmin * m) as float32 (exact
    products; D * q + M rounds once, as gguf's D * q - dmin * m does)."""
    from gguf.quants import Q4_K

    rows, supers = raw.shape[:-1]
    sc, m = Q4_K.get_scale_min(raw[..., 4:16].reshape(-1, 12))  # [blocks, 8] each
    d, dmin = _halves(raw, 0).reshape(-1, 1), _halves(raw, 2).reshape(-1, 1)
    scale, least = d * sc.astype(np.float32), -(dmin * m.astype(np.float32))
    scales = np.stack([scale, least], axis=-1).astype(np.float32).reshape(rows, supers * 4, 4)  # dA, mA, dB, mB
    return np.concatenate([raw[..., 16:].reshape(rows, supers * 4, 32), scales.view(np.uint8)], axis=-1)


def _q6_k_codes(raw: np.ndarray) -> np.ndarray:
    """Super-blocks of 256: ql (128 bytes), qh (64), 16 int8 scales, d (float16) -> the codes [rows, entries, 64],
    unpacked as gguf does."""
    rows, supers = raw.shape[:-1]
    blocks = raw.reshape(-1, 210)
    ql = blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return ((ql & 15).reshape(-1, 256) | ((qh & 3).reshape(-1, 256) << 4)).reshape(rows, supers * 4, 64)


def _q6_k_bytes(raw: np.ndarray) -> np.ndarray:
    """Q6_K for float32 rows: each code less 32 as a signed byte, then D = d * s of the entry's four 16-weight
    sub-blocks as float32 (exact products: gguf's values)."""
    rows, supers = raw.shape[:-1]
    codes = _q6_k_codes(raw).astype(np.int8) - np.int8(32)
    scales = raw[..., 192:208].copy().view(np.int8).astype(np.float32)
    d = (_halves(raw, 208)[..., None] * scales).astype(np.float32).reshape(rows, supers * 4, 4)
    return np.concatenate([codes.view(np.uint8), d.view(np.uint8)], axis=-1)


def _q6_k(raw: np.ndarray) -> np.ndarray:
    """The codes as nibbles and two bit planes, the entry's four int8 scales and the super-block's d."""
    rows, supers = raw.shape[:-1]
    codes = _q6_k_codes(raw)
    scales = raw[..., 192:208].reshape(rows, supers * 4, 4)
    d = np.broadcast_to(raw[..., None, 208:210], (rows, supers, 4, 2)).reshape(rows, supers * 4, 2)
    return np.concatenate([_nibbles(codes), _plane(codes, 4), _plane(codes, 5), scales, d,
                           np.zeros((rows, supers * 4, 2), np.uint8)], axis=-1)


# GGUF type -> its entries (packed_linear.cpp's formats) from the blocks [rows, blocks per row, bytes per block]
FORMATS = {"Q4_1": _q4_1, "Q8_0": _q8_0, "Q5_0": _q5_0, "Q4_K": _q4_k, "Q6_K": _q6_k}
# bytes per 64 weights of each format (the file's: 40, 68, 44, 36, 52.5)
ENTRY_BYTES = {"Q4_1": 48, "Q8_0": 68, "Q5_0": 44, "Q4_K": 40, "Q6_K": 56}
# For float32 rows (the AVX2 path, bound by its instructions, not by memory) every type is read as nibbles or signed
# bytes and float32 or float16 scales: nothing is assembled per weight or per entry (packed_linear.cpp, B6)
WIDE_FORMATS = {**FORMATS, "Q4_K": _q4_k_as_q4_1, "Q5_0": _q5_0_bytes, "Q6_K": _q6_k_bytes}
WIDE_ENTRY_BYTES = {**ENTRY_BYTES, "Q4_K": 48, "Q5_0": 68, "Q6_K": 80}


CHECK_ROWS = 4096  # rows repacked, dequantized and compared at once: a vocabulary matrix whole would take GBs


def _blocks(tensor) -> np.ndarray:
    """A GGUF matrix's bytes, one row of blocks per output row: [out, bytes per row]."""
    return np.asarray(tensor.data).reshape(int(tensor.shape[1]), -1)


def entries(tensor, wide: bool = False) -> np.ndarray | None:
    """A GGUF matrix [out, in] as packed_linear's entries [out, in / 64, entry bytes], for float32 rows where `wide`;
    None for a type we do not read (or a shape whose blocks do not fit whole entries)."""
    from gguf import GGML_QUANT_SIZES

    kind, formats = tensor.tensor_type.name, WIDE_FORMATS if wide else FORMATS
    out_features, in_features = int(tensor.shape[1]), int(tensor.shape[0])
    if kind not in formats or in_features % GROUP:
        return None
    block, size = GGML_QUANT_SIZES[tensor.tensor_type]
    raw = _blocks(tensor)
    parts = [formats[kind](raw[start:start + CHECK_ROWS].reshape(-1, in_features // block, size))
             for start in range(0, out_features, CHECK_ROWS)]
    return np.ascontiguousarray(np.concatenate(parts)) if len(parts) > 1 else np.ascontiguousarray(parts[0])


def reference(tensor, start: int = 0, stop: int | None = None, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """gguf's own dequantization of a matrix's rows `start:stop` (all by default), in `dtype` as the model was
    loaded (bf16: rounded)."""
    from gguf import quants

    values = quants.dequantize(_blocks(tensor)[start:stop], tensor.tensor_type)
    return torch.from_numpy(values.reshape(values.shape[0], int(tensor.shape[0]))).to(dtype)


def _bits(weight: torch.Tensor) -> torch.Tensor:
    return weight.view(torch.int16 if weight.element_size() == 2 else torch.int32)  # compared as bits: -0 is not 0


def _row_order(tensor, target: torch.Tensor) -> slice | list[int] | None:
    """The file's rows that equal target's, bit for bit, in target's order: all in order (a slice), checked a slice
    of rows at a time; where the order differs (transformers permutes the rows of q and k for its rotary layout),
    matched row by row over the whole matrix; None when some row has no match."""
    for start in range(0, target.shape[0], CHECK_ROWS):
        stop = start + CHECK_ROWS
        if not torch.equal(_bits(reference(tensor, start, stop, target.dtype)), _bits(target[start:stop])):
            break
    else:
        return slice(None)
    where = {row.numpy().tobytes(): i for i, row in enumerate(_bits(reference(tensor, dtype=target.dtype)))}
    order = [where.get(row.numpy().tobytes()) for row in _bits(target)]
    return None if None in order else order


def _rebuilds(weight: torch.Tensor, target: torch.Tensor) -> bool:
    """Whether the kernel rebuilds `target` from the tiled `weight` bit for bit (a slice of tiles at a time)."""
    tiles = CHECK_ROWS // TILE
    for first in range(0, weight.shape[0], tiles):
        start = first * TILE
        rows = min(target.shape[0] - start, tiles * TILE)
        rebuilt = torch.ops.fafo.packed_weight(weight[first:first + tiles], rows, target.dtype)
        if not torch.equal(_bits(rebuilt), _bits(target[start:start + rows])):
            return False
    return True


def tiled(rows: np.ndarray) -> torch.Tensor:
    """Entries [out, in / 64, entry] -> packed_linear's layout [out / TILE, in / 64, TILE, entry] (out padded
    with zero rows)."""
    out_features, groups, size = rows.shape
    pad = -out_features % TILE
    if pad:
        rows = np.concatenate([rows, np.zeros((pad, groups, size), np.uint8)])
    tiles = rows.reshape(-1, TILE, groups, size).transpose(0, 2, 1, 3)
    return torch.from_numpy(np.ascontiguousarray(tiles))


def packed_linear(tensor, linear: torch.nn.Linear) -> PackedLinear | None:
    """`linear` as packed `tensor`'s blocks, when they rebuild its weight exactly."""
    rows = None if tensor is None else entries(tensor, wide=linear.weight.dtype == torch.float32)
    if rows is None or rows.shape[0] != linear.out_features or rows.shape[1] * GROUP != linear.in_features:
        return None
    order = _row_order(tensor, linear.weight.data)
    if order is None:
        return None
    weight = tiled(rows[order])
    if not _rebuilds(weight, linear.weight.data):
        return None  # the kernel would multiply other values than the model's: keep this one dense
    return PackedLinear(weight, linear.out_features, linear.bias, linear.weight.dtype)


def pack_model(model: Model, gguf: Path, notify=None) -> dict[str, torch.nn.Module]:
    """The projections and the vocabulary head that can be packed exactly, by their module's name in the
    transformers model ("model.layers.3.mlp.up_proj", "lm_head"): PackedLinear, or FusedPart where a layer's
    matrices that read the same input could be stacked. Matrices of a type we do not read stay dense: `notify`
    hears of them in one line."""
    from ..gguf_header import read_tensors

    tensors = {t.name: t for t in read_tensors(gguf)}
    wanted = {f"model.layers.{i}.{module}": [tensors.get(f"blk.{i}.{name}.weight")]
              for i in range(len(model.layers)) for name, module in LAYER_MODULES.items()}
    wanted["lm_head"] = [tensors[name] for name in HEAD_TENSORS if name in tensors]
    packed, unread = {}, {}
    for name, candidates in wanted.items():
        linear = model.hf.get_submodule(name)
        # the head's own matrix, else the embedding it is tied to: the first whose blocks rebuild its weight
        packed[name] = next(filter(None, (packed_linear(t, linear) for t in candidates if t is not None)), None)
        for tensor in candidates:
            if tensor is not None and tensor.tensor_type.name not in FORMATS and packed[name] is None:
                unread.setdefault(tensor.tensor_type.name, 0)
                unread[tensor.tensor_type.name] += 1
    if unread and notify is not None:
        kinds = ", ".join(f"{kind} ({count})" for kind, count in sorted(unread.items()))
        dtype = str(model.dtype).removeprefix("torch.").replace("bfloat16", "bf16")
        notify(f"{gguf.name}: the matrices of type {kinds} stay dense {dtype} in its steps (packed blocks are "
               f"read for {', '.join(FORMATS)})")
    for i in range(len(model.layers)):
        for group in SHARED_INPUT:
            names = [f"model.layers.{i}.{module}" for module in group]
            if FusedPackedLinear.fits([packed[name] for name in names]):
                fused = FusedPackedLinear.stacked([packed[name] for name in names])
                packed.update((name, fused.part(index)) for index, name in enumerate(names))
    return {name: module for name, module in packed.items() if module is not None}


def save(modules: dict[str, torch.nn.Module], path: Path) -> None:
    """Write pack_model's modules to a safetensors file (atomically), so later processes read them in a moment
    instead of reading and checking the .gguf file's blocks again (seconds)."""
    from ..files import whole, write_safetensors

    tensors, layout, fused_names = [], {}, {}
    for name, module in modules.items():
        if isinstance(module, FusedPart):
            key = fused_names.setdefault(id(module.fused), name)  # the first part's name keys the stack
            layout[name] = {"fused": key, "index": module.index}
            module = module.fused
            if key != name:
                continue
            layout[key]["sizes"] = module.sizes
        else:
            layout[name] = {"out_features": module.out_features}
        tensors.append(whole(f"{name}.packed", module.packed))
        if module.bias is not None:
            tensors.append(whole(f"{name}.bias", module.bias))
    dtype = next((str(m.dtype).removeprefix("torch.") for m in kernels(modules)), "")  # one model: one dtype
    write_safetensors(path, tensors, metadata={"layout": json.dumps(layout), "dtype": dtype})


def load(path: Path) -> dict[str, torch.nn.Module]:
    """The modules `save` wrote."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as file:
        layout = json.loads(file.metadata()["layout"])
        dtype = getattr(torch, file.metadata().get("dtype") or "bfloat16")  # (none packed: no dtype)
        tensors = {key: file.get_tensor(key) for key in file.keys()}
    modules, stacks = {}, {}
    for name, entry in layout.items():  # the stacks' first parts come first (save's order)
        if "fused" not in entry:
            modules[name] = PackedLinear(tensors[f"{name}.packed"], entry["out_features"], tensors.get(f"{name}.bias"),
                                         dtype)
            continue
        key = entry["fused"]
        if key not in stacks:
            stacks[key] = FusedPackedLinear(tensors[f"{key}.packed"], layout[key]["sizes"], tensors.get(f"{key}.bias"),
                                            dtype)
        modules[name] = stacks[key].part(entry["index"])
    return modules


def kernels(modules: dict[str, torch.nn.Module]) -> list[PackedLinear | FusedPackedLinear]:
    """The distinct packed_linear calls behind `modules` (a FusedPackedLinear once for all its parts)."""
    distinct = {}
    for module in modules.values():
        module = module.fused if isinstance(module, FusedPart) else module
        distinct[id(module)] = module
    return list(distinct.values())


def install(model: Model, modules: dict[str, torch.nn.Module]) -> None:
    """`modules` in place of the model's own for good: eager steps multiply with the packed blocks as compiled
    ones do, and the dense bf16 matrices they replace are freed (the resident model is about the file's size)."""
    for name, module in modules.items():
        model.hf.set_submodule(name, module)
    model.lm_head = modules.get("lm_head", model.lm_head)
    model.packed_matrices = len(modules)


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
