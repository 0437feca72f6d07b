"""QuantSpec's 4-bit copy of the KV cache: the draft reads it, the exact cache still verifies.

Quantization is asymmetric (code = round((x - min) / scale), codes 0..15, scale = (max - min) / 15):
- keys per channel, over groups of `group` consecutive tokens (key outliers live in channels);
- values per token, over groups of min(group, head_dim) consecutive channels.
Codes are packed two per uint8 along the last dimension (low nibble = even index, high nibble = odd).

Scales and mins are kept in float32, not float16: it costs about one extra bit per element but keeps the
error bound exact (|x - dequant| <= scale / 2 up to float rounding) with no overflow or underflow cases.
A group whose max equals its min stores scale 0 and dequantizes exactly to its min.

Only whole groups of `group` tokens are quantized. The newest, not yet whole group is not copied: the
caller reads positions [quantized.length, cache.length) from the exact cache.
"""

from __future__ import annotations

import torch

LEVELS = 15  # largest 4-bit code


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [..., n] (n even) -> [..., n / 2], even index in the low nibble."""
    pairs = codes.unflatten(-1, (codes.shape[-1] // 2, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_nibbles: [..., n / 2] uint8 -> [..., n] codes."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def _quantize(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize float32 `x` with one min/scale per slice along `dim`; returns unpacked codes, scale, min."""
    minimum = x.amin(dim=dim, keepdim=True)
    scale = (x.amax(dim=dim, keepdim=True) - minimum) / LEVELS
    # constant groups: divide by 1 instead of 0; every x - min is 0 there, so every code is 0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((x - minimum) / safe).round_().clamp_(0, LEVELS).to(torch.uint8)
    return codes, scale.squeeze(dim), minimum.squeeze(dim)


def _check_even(dim: int) -> None:
    if dim % 2:
        raise ValueError(f"head_dim {dim} must be even to pack two 4-bit codes per byte")


def value_channel_group(group: int, head_dim: int) -> int:
    """Channels per value group; raises ValueError when head_dim is not a multiple of it."""
    channels = min(group, head_dim)
    if group < 1 or head_dim % channels:
        raise ValueError(f"head_dim {head_dim} is not divisible by the value channel group {channels}")
    return channels


def quantize_keys(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys [..., tokens, kv_head, dim] (tokens a multiple of group) -> codes [..., tokens, kv_head, dim / 2]
    uint8, scale and min [..., tokens / group, kv_head, dim] float32."""
    tokens, dim = x.shape[-3], x.shape[-1]
    if group < 1 or tokens % group:
        raise ValueError(f"{tokens} tokens are not whole groups of {group}")
    _check_even(dim)
    grouped = x.float().unflatten(-3, (tokens // group, group))  # [..., groups, group, kv, dim]
    codes, scale, minimum = _quantize(grouped, dim=-3)
    return pack_nibbles(codes.flatten(-4, -3)), scale, minimum


def dequantize_keys(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """Inverse of quantize_keys: [..., tokens, kv_head, dim] in dtype."""
    unpacked = unpack_nibbles(codes).to(dtype)
    grouped = unpacked.unflatten(-3, (unpacked.shape[-3] // group, group))
    return (grouped * scale.to(dtype).unsqueeze(-3) + minimum.to(dtype).unsqueeze(-3)).flatten(-4, -3)


def quantize_values(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values [..., tokens, kv_head, dim] -> codes [..., tokens, kv_head, dim / 2] uint8, scale and min
    [..., tokens, kv_head, dim / channels] float32 (channels = min(group, dim))."""
    dim = x.shape[-1]
    channels = value_channel_group(group, dim)
    _check_even(dim)
    codes, scale, minimum = _quantize(x.float().unflatten(-1, (dim // channels, channels)), dim=-1)
    return pack_nibbles(codes.flatten(-2)), scale, minimum


def dequantize_values(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """Inverse of quantize_values: [..., tokens, kv_head, dim] in dtype."""
    unpacked = unpack_nibbles(codes).to(dtype)
    channels = value_channel_group(group, unpacked.shape[-1])
    grouped = unpacked.unflatten(-1, (unpacked.shape[-1] // channels, channels))
    return (grouped * scale.to(dtype).unsqueeze(-1) + minimum.to(dtype).unsqueeze(-1)).flatten(-2)


class QuantizedKV:
    """A 4-bit copy of the whole groups of a KV cache, all layers in one set of tensors.

    Storage is [layer, slot, ...] like KVCache; it grows geometrically so appending a group is cheap.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, group: int, device: torch.device):
        _check_even(head_dim)
        self.channels = value_channel_group(group, head_dim)
        self.shape = (n_layers, n_kv_heads, head_dim)
        self.group, self.device = group, device
        self.length = 0  # quantized positions, always a multiple of group
        self._allocate(0)

    def _allocate(self, slots: int) -> None:
        n_layers, n_kv, dim = self.shape

        def new(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.zeros(n_layers, *shape, dtype=dtype, device=self.device)

        groups = slots // self.group
        key_codes = new(slots, n_kv, dim // 2, dtype=torch.uint8)
        value_codes = new(slots, n_kv, dim // 2, dtype=torch.uint8)
        key_scale, key_min = new(groups, n_kv, dim), new(groups, n_kv, dim)
        value_scale, value_min = new(slots, n_kv, dim // self.channels), new(slots, n_kv, dim // self.channels)
        if self.length:  # growth keeps what is already quantized
            n, g = self.length, self.length // self.group
            key_codes[:, :n], value_codes[:, :n] = self.key_codes[:, :n], self.value_codes[:, :n]
            key_scale[:, :g], key_min[:, :g] = self.key_scale[:, :g], self.key_min[:, :g]
            value_scale[:, :n], value_min[:, :n] = self.value_scale[:, :n], self.value_min[:, :n]
        self.key_codes, self.key_scale, self.key_min = key_codes, key_scale, key_min
        self.value_codes, self.value_scale, self.value_min = value_codes, value_scale, value_min

    @property
    def capacity(self) -> int:
        return self.key_codes.shape[1]

    def _reserve(self, slots: int) -> None:
        """Room for `slots` positions: a quarter more at a time, as the exact cache grows (doubling held up to twice
        what the answer used, and counted it as the draft's memory)."""
        if slots > self.capacity:
            grown = self.capacity + max(self.group, self.capacity // 4 // self.group * self.group)
            self._allocate(max(slots, grown))  # both multiples of group

    def sync(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Quantize the whole groups of the exact cache's first `length` positions not yet held
        (after dropping any beyond `length`, when the conversation was rolled back)."""
        if length < self.length:
            self.truncate(length)
        start, end = self.length, length // self.group * self.group
        if end <= start:
            return
        self._reserve(end)
        g0, g1 = start // self.group, end // self.group
        # a layer at a time: float copies of a long prompt's every layer at once took several times the cache's memory
        for layer in range(self.shape[0]):
            at = slice(layer, layer + 1)
            key_codes, key_scale, key_min = quantize_keys(keys[at, start:end], self.group)
            value_codes, value_scale, value_min = quantize_values(values[at, start:end], self.group)
            self.key_codes[at, start:end], self.value_codes[at, start:end] = key_codes, value_codes
            self.key_scale[at, g0:g1], self.key_min[at, g0:g1] = key_scale, key_min
            self.value_scale[at, start:end], self.value_min[at, start:end] = value_scale, value_min
        self.length = end

    def dequantize(self, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [0, length) of `layer`, each [length, kv_head, dim] in dtype."""
        n, g = self.length, self.length // self.group
        keys = dequantize_keys(self.key_codes[layer, :n], self.key_scale[layer, :g], self.key_min[layer, :g],
                               self.group, dtype)
        values = dequantize_values(self.value_codes[layer, :n], self.value_scale[layer, :n],
                                   self.value_min[layer, :n], self.group, dtype)
        return keys, values

    def truncate(self, length: int) -> None:
        """Keep only the whole groups below `length` (storage is kept for reuse)."""
        self.length = min(self.length, length // self.group * self.group)

    def nbytes(self) -> int:
        tensors = (self.key_codes, self.key_scale, self.key_min, self.value_codes, self.value_scale, self.value_min)
        return sum(t.numel() * t.element_size() for t in tensors)
