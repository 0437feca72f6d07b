"""A model spread over GPUs (`gpus`): the layer -> GPU map, each layer's cache on its layer's device, and decoding
through a spread cache. No second GPU here: "meta" and "cpu:0" (another device name for the same memory) stand in
for the other GPUs."""

from __future__ import annotations

import pytest
import torch

from fafo_cli import load
from fafo_cli.runtime import placement
from fafo_cli.runtime.cache import KVCache, LayerStack
from fafo_cli.runtime.placement import DoesNotFit, Sizes, device_map, spread

from .conftest import LONG, hf_greedy

CPU, OTHER = torch.device("cpu"), torch.device("cpu", 0)  # two names, two groups, one memory


def test_layers_fill_gpus_in_order_and_the_head_follows_the_last_layer():
    sizes = Sizes(embedding=10, layer=20, head=15, n_layers=5)
    assert spread(sizes, [55, 100]) == ([0, 0, 1, 1, 1], 1)  # 10 + 2·20 on GPU 0; 3·20 + 15 on GPU 1
    assert spread(sizes, [55, 60, 100]) == ([0, 0, 1, 1, 1], 2)  # the head does not fit beside the last layer
    assert spread(sizes, [1000]) == ([0] * 5, 0)
    with pytest.raises(DoesNotFit, match="layer 4 of 5 does not fit"):
        spread(sizes, [55, 50])
    with pytest.raises(DoesNotFit, match="vocabulary projection"):
        spread(sizes, [55, 60])
    with pytest.raises(DoesNotFit, match="embedding alone"):
        spread(sizes, [5, 100])
    assert device_map([0, 1], 1) == {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0,
                                     "model.layers.1": 1, "model.norm": 1, "lm_head": 1}
    # the first layer beside the embedding would overflow GPU 0: the embedding stays where it was counted
    first_apart = Sizes(embedding=10, layer=50, head=5, n_layers=2)
    assert spread(first_apart, [55, 200]) == ([1, 1], 1)
    assert device_map(*spread(first_apart, [55, 200]))["model.embed_tokens"] == 0


def test_plan_counts_a_meta_models_parts_with_their_caches():
    from accelerate import init_empty_weights
    from transformers import LlamaConfig, LlamaForCausalLM

    for tied in (False, True):
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512,
                             tie_word_embeddings=tied)
        with init_empty_weights():
            model = LlamaForCausalLM(config)
        sizes = placement.sizes_of(model, 2, 512)
        layer_weights = sum(p.numel() for p in model.model.layers[0].parameters()) * 2
        assert sizes.layer == layer_weights + 2 * 512 * 2 * 16 * 2  # keys and values of 512 positions, 2 heads × 16
        assert sizes.embedding == 1000 * 64 * 2 and sizes.head == 64 * 2 + (0 if tied else 1000 * 64 * 2)
        free = [int((sizes.embedding + 2 * sizes.layer) / placement.HEADROOM) + 1, 10**9]
        mapping = placement.plan(model, 2, 512, free)
        assert [mapping[f"model.layers.{i}"] for i in range(4)] == [0, 0, 1, 1]
        assert mapping["lm_head"] == (0 if tied else 1)  # a tied head is the embedding


def test_cache_keeps_each_layer_on_its_device():
    cache = KVCache(4, 2, 8, max_slots=64, dtype=torch.float32, device=CPU, initial_slots=4,
                    layer_devices=[CPU, CPU, torch.device("meta"), torch.device("meta")])
    assert cache.spread and isinstance(cache.keys, LayerStack)
    assert [cache.keys[layer].device.type for layer in range(4)] == ["cpu", "cpu", "meta", "meta"]
    # the whole context from the start, as placement budgets it: growing would hold two caches at once
    assert cache.capacity == 64
    cache.reserve(20)
    assert cache.capacity == 64 and cache.values[3].device.type == "meta" and cache.keys[1].device.type == "cpu"
    with pytest.raises(ValueError, match="block-sparse"):
        cache.use_lead(128)


def test_spread_cache_writes_commits_snapshots_and_loads_like_one_tensor():
    plain = KVCache(3, 1, 2, max_slots=64, dtype=torch.float32, device=CPU, initial_slots=2)
    split = KVCache(3, 1, 2, max_slots=64, dtype=torch.float32, device=CPU, initial_slots=2,
                    layer_devices=[CPU, OTHER, OTHER])
    assert split.spread and [count for _, count in split.groups] == [1, 2]
    for cache in (plain, split):
        for step in range(3):
            cache.reserve(cache.length + 4)
            for layer in range(3):
                rows = torch.arange(4 * 2, dtype=torch.float32).view(4, 1, 2) + 100 * layer + 10 * step
                cache.write(layer, rows, -rows)
            cache.commit_rows([0, 2, 3])  # row 1 rejected: later rows move down
    assert plain.length == split.length == 9
    for a, b in zip(plain.snapshot(torch.float32), split.snapshot(torch.float32)):
        assert torch.equal(a, b)
    keys, values = plain.snapshot(torch.float32)
    for layer in range(3):  # each step's rows 0, 2 and 3, in order, the rejected row 1 gone
        kept = torch.cat([(torch.arange(4 * 2, dtype=torch.float32).view(4, 1, 2) + 100 * layer + 10 * step)[[0, 2, 3]]
                          for step in range(3)])
        assert torch.equal(keys[layer], kept) and torch.equal(values[layer], -kept)
    for cache in (plain, split):  # rows dropped as no numbers: zeroed on every device
        cache.forget(4)
        assert cache.length == 4 and not any(cache.keys[layer, 4:9].any() for layer in range(3))
        assert torch.equal(cache.values[1, :4], values[1, :4])
    split.truncate(0)
    split.load(keys[:, :5], values[:, :5])
    assert split.length == 5 and torch.equal(split.keys[2, :5], keys[2, :5])
    assert split.nbytes() == plain.nbytes() * split.capacity // plain.capacity


def test_layers_all_on_a_device_apart_from_the_embedding_keep_their_cache_there():
    """`spread` may put the embedding alone on GPU 0 and every layer on GPU 1: their keys and values go to GPU 1."""
    cache = KVCache(3, 1, 2, max_slots=16, dtype=torch.float32, device=CPU, layer_devices=[OTHER] * 3)
    assert not cache.spread and cache.device == OTHER


@pytest.mark.parametrize("method", ["vanilla", "fafo", "prompt-lookup"])
def test_decoding_through_a_spread_cache_equals_generate(tiny, method):
    """The model's layers named as on two devices (cpu, cpu:0): the cache is a LayerStack, the hidden state hops,
    and FAFO (without a compressed view) and the peers still equal transformers' greedy output."""
    engine = load(str(tiny), dtype="float32", chat_template=False, compile="off")
    model = engine.model
    model.layer_devices, model.spread = [CPU, OTHER], True
    engine.session.cache = model.new_cache()
    assert engine.session.cache.spread
    result = engine.complete(LONG, method=method, compressor="none", max_tokens=48, temperature=0.0)
    assert result.token_ids == hf_greedy(tiny, engine.encode(LONG), 48)
    if method != "vanilla":
        assert result.stats.accepted_tokens > 0  # multi-row steps committed some rows and rejected others


def test_spread_models_refuse_what_keeps_a_second_cache(tiny):
    from fafo_cli.errors import FafoError

    from fafo_cli.bench import doctor
    from fafo_cli.config import Config

    engine = load(str(tiny), dtype="float32", chat_template=False, compile="off")
    engine.model.spread = True
    # its passes hop between GPUs: their cost curve is not the same model's on one GPU
    assert engine.model.eager_mode == "eager-spread"
    # `fafo doctor --gpus 2` checks the window every step without a compressor where none is configured
    assert doctor.windowed(Config(), engine.model.spread)[1]["compressor"] == "none"
    assert doctor.windowed(Config(compressor="quest"), engine.model.spread)[1]["compressor"] == "quest"
    with pytest.raises(FafoError, match="use --compressor none"):
        engine.complete("hi", method="fafo", compressor="stream", max_tokens=2)
    # the default (auto) runs the window without a compressor there: `fafo run --gpus 2` was refused as it is
    assert engine.complete("hi", method="fafo", streams=2, max_tokens=2).stats.steps > 0
    engine.explicit = frozenset({"budget"})  # a compressor's setting given there would change nothing
    with pytest.raises(FafoError, match="'budget' is a setting of the .* compressor, which the window does not use"):
        engine.complete("hi", method="fafo", streams=2, budget=64, max_tokens=2)
    engine.explicit = frozenset()
    with pytest.raises(FafoError, match="use --attention split"):
        engine.complete("hi", method="fafo", compressor="none", attention="block", max_tokens=2)
    with pytest.raises(FafoError, match="method triforce keeps a second cache"):
        engine.complete("hi", method="triforce", max_tokens=2)


def test_gpus_needs_cuda_gpus(tiny, tmp_path, capsys):
    from fafo_cli.cli import entrypoint

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hello")
    assert entrypoint(["run", str(tiny), "--gpus", "2", "--prompt", str(prompt)]) == 1
    assert capsys.readouterr().err.strip() == ("error: --gpus 2 spreads the model over CUDA GPUs; the device here "
                                               "is cpu")


def test_a_mask_goes_to_a_later_gpu_once_a_pass():
    """A spread model's later GPUs read the step's mask in each of their layers: copied there once a pass."""
    from fafo_cli.runtime.model import on_device

    mask, copies = torch.ones(3, 5, dtype=torch.bool), {}
    moved = on_device(mask, OTHER, copies)
    assert moved is not mask and torch.equal(moved, mask) and on_device(mask, OTHER, copies) is moved
    assert on_device(mask, CPU, copies) is mask and on_device(None, OTHER, copies) is None and len(copies) == 1
