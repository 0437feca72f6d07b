"""Tests of QuantSpec's 4-bit KV cache copy: error bound, exact constant groups, packing, sync/rollback."""

from __future__ import annotations

import pytest
import torch

from fafo_cli.runtime.cache import KVCache
from fafo_cli.decoders.quantiser import QuantizedKV, dequantize_keys, dequantize_values, pack_nibbles, quantize_keys, quantize_values, unpack_nibbles

CPU = torch.device("cpu")


def _data(*shape: int, seed: int = 0) -> torch.Tensor:
    """Normal data with a few large outliers (the case per-group scales exist for)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen)
    flat = x.view(-1)
    picks = torch.randint(0, flat.numel(), (max(1, flat.numel() // 200),), generator=gen)
    flat[picks] *= 30
    return x


def _bound(scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return scale / 2 + 1e-6 * (1 + x.abs())  # half a step, plus float rounding


def test_keys_round_trip_within_half_scale():
    x = _data(96, 3, 16)
    codes, scale, minimum = quantize_keys(x, 32)
    assert codes.shape == (96, 3, 8) and codes.dtype == torch.uint8
    assert scale.shape == minimum.shape == (3, 3, 16) and scale.dtype == torch.float32
    # per channel over 32 tokens: min and range of each group
    torch.testing.assert_close(minimum[1], x[32:64].amin(0), rtol=0, atol=0)
    torch.testing.assert_close(scale[2], (x[64:96].amax(0) - x[64:96].amin(0)) / 15)
    out = dequantize_keys(codes, scale, minimum, 32, torch.float32)
    assert out.shape == x.shape and out.dtype == torch.float32
    error = (out - x).abs()
    assert (error <= _bound(scale.repeat_interleave(32, 0), x)).all()
    assert error.max() > 0.01  # it really is 4-bit
    # each group's min maps to code 0 and its max to code 15
    unpacked = unpack_nibbles(codes).unflatten(0, (3, 32))
    assert (unpacked.amin(1) == 0).all() and (unpacked.amax(1) == 15).all()


@pytest.mark.parametrize("group,channels", [(32, 32), (16, 16), (128, 64)])
def test_values_round_trip_within_half_scale(group, channels):
    x = _data(40, 2, 64, seed=1)
    codes, scale, minimum = quantize_values(x, group)
    assert codes.shape == (40, 2, 32)
    assert scale.shape == minimum.shape == (40, 2, 64 // channels)
    torch.testing.assert_close(minimum[7, 1, 0], x[7, 1, :channels].amin(), rtol=0, atol=0)
    out = dequantize_values(codes, scale, minimum, group, torch.float32)
    error = (out - x).abs()
    assert (error <= _bound(scale.repeat_interleave(channels, -1), x)).all()
    assert error.max() > 0.01


def test_constant_groups_are_exact():
    x = _data(64, 2, 8, seed=2)
    x[32:64, 1, 3] = 2.7182817  # one key channel constant over a whole group
    codes, scale, minimum = quantize_keys(x, 32)
    assert scale[1, 1, 3] == 0
    out = dequantize_keys(codes, scale, minimum, 32, torch.float32)
    assert torch.equal(out[32:64, 1, 3], x[32:64, 1, 3])

    v = _data(5, 2, 8, seed=3)
    v[4, 0, 4:] = -1.3  # one value channel group constant
    v[2] = 0.0  # a whole token zero
    codes, scale, minimum = quantize_values(v, 4)
    assert scale[4, 0, 1] == 0 and (scale[2] == 0).all()
    out = dequantize_values(codes, scale, minimum, 4, torch.float32)
    assert torch.equal(out[4, 0, 4:], v[4, 0, 4:]) and torch.equal(out[2], v[2])
    assert not out.isnan().any()


def test_nibble_packing_on_hand_made_codes():
    codes = torch.tensor([[1, 2, 3, 4], [15, 0, 9, 6]], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x43], [0x0F, 0x69]]  # even index low, odd index high
    assert torch.equal(unpack_nibbles(packed), codes)
    # values [0, 15, 5, 10] in one group: min 0, scale 1, codes are the values themselves
    x = torch.tensor([0.0, 15.0, 5.0, 10.0]).view(1, 1, 4)
    codes, scale, minimum = quantize_values(x, 4)
    assert codes.view(-1).tolist() == [0xF0, 0xA5] and scale.item() == 1 and minimum.item() == 0
    # dequantizing hand-made bytes with scale 2, min -1
    hand = torch.tensor([[[0x3C, 0x0F]]], dtype=torch.uint8)  # codes 12, 3, 15, 0
    out = dequantize_values(hand, torch.full((1, 1, 1), 2.0), torch.full((1, 1, 1), -1.0), 4, torch.float32)
    assert out.view(-1).tolist() == [23.0, 5.0, 29.0, -1.0]


def _fake_cache(n_layers: int = 2, n_kv: int = 2, dim: int = 16, positions: int = 128) -> KVCache:
    cache = KVCache(n_layers, n_kv, dim, max_slots=1024, dtype=torch.float32, device=CPU, initial_slots=8)
    cache.reserve(positions)
    for layer in range(n_layers):
        cache.write(layer, _data(positions, n_kv, dim, seed=10 + layer), _data(positions, n_kv, dim, seed=20 + layer))
    return cache


def _assert_within_bound(quant: QuantizedKV, cache: KVCache, layer: int, start: int, end: int) -> None:
    keys, values = quant.dequantize(layer, torch.float32)
    exact_keys, exact_values = cache.keys[layer, start:end], cache.values[layer, start:end]
    g0, g1 = start // quant.group, end // quant.group
    key_scale = quant.key_scale[layer, g0:g1].repeat_interleave(quant.group, 0)
    value_scale = quant.value_scale[layer, start:end].repeat_interleave(quant.channels, -1)
    assert ((keys[start:end] - exact_keys).abs() <= _bound(key_scale, exact_keys)).all()
    assert ((values[start:end] - exact_values).abs() <= _bound(value_scale, exact_values)).all()


def test_sync_quantizes_only_whole_groups_then_flushes_one_more():
    cache = _fake_cache()
    quant = QuantizedKV(2, 2, 16, group=16, device=CPU)
    cache.commit(45)
    quant.sync(cache.keys, cache.values, cache.length)
    assert quant.length == 32  # positions 32..44 stay in the exact cache (the buffer)
    keys, values = quant.dequantize(1, torch.float32)
    assert keys.shape == values.shape == (32, 2, 16)
    for layer in range(2):
        _assert_within_bound(quant, cache, layer, 0, 32)
    before = [quant.dequantize(layer, torch.float32) for layer in range(2)]

    cache.commit(2)  # 47: still no whole new group
    quant.sync(cache.keys, cache.values, cache.length)
    assert quant.length == 32
    cache.commit(3)  # 50: positions 32..47 are a whole group now
    quant.sync(cache.keys, cache.values, cache.length)
    assert quant.length == 48
    for layer in range(2):
        keys, values = quant.dequantize(layer, torch.float32)
        assert keys.shape == (48, 2, 16)
        assert torch.equal(keys[:32], before[layer][0]) and torch.equal(values[:32], before[layer][1])
        _assert_within_bound(quant, cache, layer, 32, 48)
    # all layers at once gives the same as quantizing the one layer's group alone
    expected = dequantize_keys(*quantize_keys(cache.keys[1, 32:48], 16), 16, torch.float32)
    assert torch.equal(quant.dequantize(1, torch.float32)[0][32:48], expected)


def test_one_token_at_a_time_matches_one_shot_and_grows_by_groups():
    cache = _fake_cache(positions=200)
    step = QuantizedKV(2, 2, 16, group=16, device=CPU)
    capacities = []
    for length in range(1, 201):
        cache.length = length
        step.sync(cache.keys, cache.values, length)
        capacities.append(step.capacity)
    assert step.length == 192
    # nothing allocated before a whole group; then a quarter more at a time, in whole groups
    assert sorted(set(capacities)) == [0, 16, 32, 48, 64, 80, 96, 112, 128, 160, 192]
    whole = QuantizedKV(2, 2, 16, group=16, device=CPU)
    whole.sync(cache.keys, cache.values, 200)
    for layer in range(2):
        for a, b in zip(step.dequantize(layer, torch.float32), whole.dequantize(layer, torch.float32)):
            assert torch.equal(a, b)


def test_the_4bit_copy_grows_a_quarter_at_a_time():
    """As the exact cache grows: doubling held up to twice the positions the answer used (QuantSpec's draft memory
    counted them), and three times while it copied."""
    cache = _fake_cache(positions=512)
    quant = QuantizedKV(2, 2, 16, group=16, device=CPU)
    cache.commit(256)
    quant.sync(cache.keys, cache.values, cache.length)
    assert quant.length == quant.capacity == 256
    cache.commit(20)  # one more whole group
    quant.sync(cache.keys, cache.values, cache.length)
    assert quant.length == 272 and quant.capacity == 256 + 64
    for layer in range(2):
        _assert_within_bound(quant, cache, layer, 0, 272)


def test_sync_quantizes_a_layer_at_a_time(monkeypatch):
    """A long prompt's first sync held float copies of every layer's keys and values at once (several times the
    cache's own memory, out of memory right after a prefill that fit): one layer's at a time, same codes."""
    from fafo_cli.decoders import quantiser

    cache = _fake_cache(positions=200)
    cache.length = 200
    whole = {name: getattr(quantiser, name)((cache.keys if "keys" in name else cache.values)[:, :192], 16)
             for name in ("quantize_keys", "quantize_values")}
    seen = []
    for name in whole:
        real = getattr(quantiser, name)
        monkeypatch.setattr(quantiser, name, lambda x, group, real=real: seen.append(x.shape[0]) or real(x, group))
    quant = QuantizedKV(2, 2, 16, group=16, device=CPU)
    quant.sync(cache.keys, cache.values, 200)
    assert seen == [1, 1, 1, 1]
    key_codes, key_scale, key_min = whole["quantize_keys"]
    value_codes, value_scale, value_min = whole["quantize_values"]
    assert torch.equal(quant.key_codes[:, :192], key_codes) and torch.equal(quant.value_codes[:, :192], value_codes)
    assert torch.equal(quant.key_scale[:, :12], key_scale) and torch.equal(quant.key_min[:, :12], key_min)
    assert torch.equal(quant.value_scale[:, :192], value_scale) and torch.equal(quant.value_min[:, :192], value_min)


def test_rollback_drops_groups_and_requantizes_new_data():
    cache = _fake_cache()
    quant = QuantizedKV(2, 2, 16, group=16, device=CPU)
    cache.commit(70)
    quant.sync(cache.keys, cache.values, 70)
    assert quant.length == 64
    old = quant.dequantize(0, torch.float32)[0][32:48].clone()

    cache.truncate(40)
    quant.sync(cache.keys, cache.values, 40)
    assert quant.length == 32
    assert quant.dequantize(0, torch.float32)[0].shape == (32, 2, 16)
    quant.truncate(20)
    assert quant.length == 16

    # the conversation continues differently: the re-quantized group follows the new tokens
    cache.keys[:, 32:48] = _data(2, 16, 2, 16, seed=99) + 5
    cache.length = 50
    quant.sync(cache.keys, cache.values, 50)
    assert quant.length == 48
    new = quant.dequantize(0, torch.float32)[0][32:48]
    assert (new - old).abs().mean() > 1
    for layer in range(2):
        _assert_within_bound(quant, cache, layer, 0, 48)


def test_dequantize_dtype_and_empty():
    cache = _fake_cache()
    quant = QuantizedKV(2, 2, 16, group=16, device=CPU)
    keys, values = quant.dequantize(0, torch.float32)
    assert keys.shape == values.shape == (0, 2, 16)
    quant.sync(cache.keys.to(torch.bfloat16), cache.values.to(torch.bfloat16), 32)
    keys, values = quant.dequantize(1, torch.bfloat16)
    assert keys.dtype == values.dtype == torch.bfloat16 and keys.shape == (32, 2, 16)
    exact = cache.keys[1, :32].to(torch.bfloat16).float()
    assert (keys.float() - exact).abs().max() < 0.05 * exact.abs().max()


def test_nbytes_is_about_four_bits_per_element():
    n_layers, n_kv, dim, group, positions = 4, 2, 64, 32, 256
    cache = _fake_cache(n_layers, n_kv, dim, positions)
    cache.commit(positions)
    quant = QuantizedKV(n_layers, n_kv, dim, group=group, device=CPU)
    quant.sync(cache.keys, cache.values, positions)
    assert quant.capacity == positions
    codes = 2 * n_layers * positions * n_kv * dim // 2  # keys + values, one byte per two elements
    key_params = 2 * n_layers * (positions // group) * n_kv * dim * 4  # float32 scale + min
    value_params = 2 * n_layers * positions * n_kv * (dim // group) * 4
    assert quant.nbytes() == codes + key_params + value_params == 196608
    exact_bytes = 2 * n_layers * positions * n_kv * dim * 4
    assert quant.nbytes() * 5 < exact_bytes  # 6 bits per element against 32


def test_head_dim_not_divisible_raises():
    with pytest.raises(ValueError):
        QuantizedKV(2, 2, 48, group=32, device=CPU)
    with pytest.raises(ValueError):
        quantize_values(torch.randn(4, 2, 48), 32)
    with pytest.raises(ValueError):
        quantize_keys(torch.randn(40, 2, 16), 32)  # not whole groups of tokens
    with pytest.raises(ValueError):
        QuantizedKV(2, 2, 15, group=32, device=CPU)  # odd head_dim cannot be packed
    QuantizedKV(2, 2, 48, group=16, device=CPU)  # 48 = 3 groups of 16 is fine


@pytest.mark.parametrize("fused", [True, False])
def test_int4_weights_are_group_wise_and_their_product_matches(fused):
    from fafo_cli.decoders.weights4 import Int4Linear

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(37, 192, generator=generator)  # 37 outputs: not a multiple of the kernel's 16
    bias = torch.randn(37, generator=generator)
    layer = Int4Linear(weight, bias, fused=fused)
    assert layer.group == 64  # 128 does not divide 192
    grouped = weight.view(37, 3, 64)
    scale = (grouped.amax(-1, keepdim=True) - grouped.amin(-1, keepdim=True)) / 15
    error = (layer.dequantized(torch.float32).view(37, 3, 64) - grouped).abs()
    assert (error <= scale / 2 * 1.02 + 1e-2).all()  # half a step (scales and zeros kept in bf16 when fused)
    x = torch.randn(5, 192, generator=generator)
    expected = x @ layer.dequantized(torch.float32).t() + bias
    assert torch.allclose(layer(x), expected, rtol=2e-2, atol=0.2)  # bf16 activations in the fused kernel
    assert layer.nbytes() < weight.nbytes / 4  # 4 bits a weight, and a scale and zero per 64
    narrow = Int4Linear(torch.randn(37, 80, generator=generator), None, fused=fused)  # groups of 16
    assert narrow.group == 16 and not narrow.cpu  # the CPU kernel takes groups of 32 or more: dequantized per call
    x = torch.randn(5, 80, generator=generator)
    assert torch.allclose(narrow(x), x @ narrow.dequantized(torch.float32).t(), rtol=1e-5, atol=1e-4)


def test_quantspec_drafts_from_int4_weights_and_keeps_g_to_2g_exact(tiny, monkeypatch):
    from fafo_cli import load
    from fafo_cli.decoders import quantspec

    buffers = []

    class Recorded(quantspec.QuantSpec):
        def _sync(self):
            super()._sync()
            buffers.append(self.cache.length - self.quantized.length)

    monkeypatch.setattr(quantspec, "QuantSpec", Recorded)
    engine = load(str(tiny), dtype="float32", chat_template=False, method="quantspec", quantspec_group=16)
    result = engine.complete("The cat sat on the mat. " * 12, max_tokens=80)
    assert len(buffers) > 10 and all(16 <= n < 32 for n in buffers)  # the double full-precision buffer
    weights = quantspec.int4_weights(engine.model)
    assert set(weights.layers) >= {id(engine.model.lm_head), id(engine.model.layers[0].mlp.down_proj)}
    assert result.stats.draft_memory_mb * 1e6 > weights.nbytes()  # the 4-bit weights count as draft memory


@pytest.mark.parametrize("overrides, group, said", [
    ({}, 6, r"^quantspec_group \(6\) must be at least the model's head dimension \(16\) or divide it$"),
    ({"intermediate_size": 127}, 64, r"^quantspec cannot quantize this model to 4 bits: 127 inputs cannot be split"),
])
def test_a_model_quantspec_cannot_quantize_is_one_line(tmp_path, overrides, group, said):
    """Groups of an even size: a matrix of odd width (or a group that does not fit the head) is refused in one line
    naming it, not a traceback."""
    from fafo_cli import load
    from fafo_cli.errors import FafoError

    from .conftest import build_tiny_model

    folder = build_tiny_model(tmp_path / "m", "llama-gqa", **overrides)
    engine = load(str(folder), dtype="float32", chat_template=False, method="quantspec", quantspec_group=group)
    prefilled = []
    with pytest.raises(FafoError, match=said):
        engine.complete("hello there", max_tokens=4, on_prefill=prefilled.append)
    assert bool(prefilled) == ("intermediate_size" in overrides)  # a group that cannot be is said before the prefill
