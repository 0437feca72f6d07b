"""Unit tests of engine pieces: target distribution, KV cache, detokenizer."""

from __future__ import annotations

import sys

import pytest
import torch

from fafo_cli.runtime.cache import KVCache
from fafo_cli.runtime.detok import Detokenizer
from fafo_cli.runtime.model import STEP_ROWS, Model, causal_attention, prefix_causal_mask
from fafo_cli.runtime.sampling import Sampling, next_token, target_probs


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.9),
                                                     (0.6, 20, 0.5), (1.0, 0, 0.05)])
def test_target_probs_match_transformers_warpers(temperature, top_k, top_p):
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(0)
    logits = torch.randn(4, 300) * 3
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)]
                                  + ([TopKLogitsWarper(top_k)] if top_k else [])
                                  + ([TopPLogitsWarper(top_p)] if top_p < 1 else []))
    expected = warpers(None, logits.clone()).softmax(-1)
    got = target_probs(logits, Sampling(temperature, top_p, top_k))
    torch.testing.assert_close(got, expected)


def test_sampling_follows_target_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    sampling = Sampling(temperature=0.8, seed=3)
    draws = sampling.draws()
    counts = torch.zeros(4)
    for position in range(4000):
        counts[next_token(logits, sampling, draws, position)] += 1
    expected = target_probs(logits, sampling) * 4000
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 16.3  # 3 degrees of freedom, p = 0.001


def test_float32_cpu_steps_compute_linear_layers_as_weights_times_rows(tiny):
    """A float32 CPU step of several rows computes each linear layer as W @ xᵀ (torch's x @ Wᵀ is much slower there
    for a few rows); one row and a prefill chunk keep the module's own product, and other dtypes their own."""
    from fafo_cli.runtime import llama

    model = Model(llama.load(tiny, torch.float32, torch.device("cpu")))
    layer, calls = model.layers[0].mlp.up_proj, []
    layer.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[-2]))
    for rows in (1, 3, STEP_ROWS + 1):
        torch.manual_seed(rows)
        x = torch.randn(1, rows, layer.in_features)
        got = model.step_linear(layer, x)
        assert got.shape == (1, rows, layer.out_features) and torch.allclose(got, layer(x), atol=1e-5)
        if rows == 1:
            assert torch.equal(got, layer(x))  # bit for bit what transformers' plain decoding computes
    calls.clear()
    cache = model.new_cache(initial_slots=STEP_ROWS + 1)
    for rows in (1, 3, STEP_ROWS + 1):
        ids = torch.arange(rows) % 50
        model.forward(ids, torch.arange(rows), cache, causal_attention(None, model.scaling))
    assert calls == [1, STEP_ROWS + 1]  # the 3-row step's product was W @ xᵀ, not the module's
    assert Model(llama.load(tiny, torch.bfloat16, torch.device("cpu"))).step_linear is None


def test_a_cache_that_could_not_change_its_dtype_still_says_its_own(monkeypatch):
    """Memory running out as the cache converts to float32 (the eager steps after compiled ones) left it saying
    float32 over bf16 tensors: the next request skipped the conversion, and a compressor's view then failed."""
    cache = KVCache(1, 1, 4, max_slots=64, dtype=torch.bfloat16, device=torch.device("cpu"), initial_slots=8)

    def exhausted(*args):
        raise MemoryError

    monkeypatch.setattr(KVCache, "_allocate", exhausted)
    with pytest.raises(MemoryError):
        cache.attend_in(torch.float32)
    assert cache.dtype == cache.keys.dtype == torch.bfloat16 and cache.read_dtype != torch.float32


def test_cache_grows_without_losing_committed_rows():
    cache = KVCache(2, 1, 4, max_slots=100, dtype=torch.float32, device=torch.device("cpu"), initial_slots=4)
    rows = torch.arange(3 * 4, dtype=torch.float32).view(3, 1, 4)
    for layer in range(2):
        cache.write(layer, rows + layer, -rows)
    cache.commit(3)
    cache.reserve(10)
    assert cache.capacity >= 10
    keys, values = cache.write(1, rows[:1] * 0, rows[:1] * 0)  # a step in flight after the prefix
    assert keys.shape == (4, 1, 4)
    torch.testing.assert_close(keys[:3], rows + 1)
    torch.testing.assert_close(values[:3], -rows)
    cache.truncate(1)
    assert cache.length == 1
    with pytest.raises(ValueError):
        cache.reserve(101)


def test_a_full_cache_grows_by_a_quarter_up_to_what_the_request_can_use():
    """Doubling held three times the cache while it copied and left up to half of it unused: at a long context the
    difference between an answer that fits and one out of memory."""
    from fafo_cli.runtime.cache import GROW_SLOTS

    cache = KVCache(1, 1, 4, max_slots=100_000, dtype=torch.float32, device=torch.device("cpu"), initial_slots=16_000)
    cache.reserve(16_001)
    assert cache.capacity == 20_000  # a quarter more
    cache.limit = 21_000
    cache.reserve(20_001)
    assert cache.capacity == 21_000  # what the request can use, no more
    cache.reserve(21_500)
    assert cache.capacity == 26_250  # a padded step past it: grown as usual (not reallocated step by step)
    near = KVCache(1, 1, 4, max_slots=100_000, dtype=torch.float32, device=torch.device("cpu"), initial_slots=16_000)
    near.limit = 21_000
    near.reserve(16_001)  # (a long prompt's room: 20,000 and then 21,000 held 41,000 slots while the last copied)
    assert near.capacity == 21_000  # the limit at once, where a quarter more would leave less than a quarter
    near.reserve(21_010)  # a padded step past the limit: a quarter more, not the whole of max_slots
    assert near.capacity == 26_250
    small = KVCache(1, 1, 4, max_slots=100_000, dtype=torch.float32, device=torch.device("cpu"), initial_slots=8)
    small.reserve(9)
    assert small.capacity == 8 + GROW_SLOTS  # (small caches: at least GROW_SLOTS at once)


def test_the_prefill_bounds_the_cache_by_what_the_request_can_use(tiny):
    from fafo_cli import load

    engine = load(str(tiny), dtype="float32", chat_template=False)
    engine.complete("The list of colours:", max_tokens=20, method="vanilla")
    assert engine.session.cache.limit == len(engine.encode("The list of colours:")) + 20


def test_cache_slots_never_written_hold_finite_values():
    """Attention over whole blocks multiplies masked slots' values by 0: they must never be NaN."""
    cache = KVCache(2, 1, 4, max_slots=4096, dtype=torch.float32, device=torch.device("cpu"), initial_slots=8)
    cache.use_lead(5)
    cache.reserve(3000)
    assert torch.isfinite(cache.storage_keys).all() and torch.isfinite(cache.storage_values).all()
    assert cache.lead == 128  # rounded to whole attention blocks


def test_prefix_causal_mask():
    mask = prefix_causal_mask(2, 3, torch.device("cpu"))
    assert mask.int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


def test_detokenizer_deltas_add_up_even_inside_multibyte_characters():
    from .conftest import build_tokenizer

    tokenizer = build_tokenizer()  # byte-level: "é" and "🦊" span several tokens
    text = "Voilà, le renard 🦊 saute: naïve café — done."
    ids = tokenizer(text)["input_ids"]
    detok = Detokenizer(tokenizer)
    deltas = [detok.add([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == text
    assert detok.text == text


class SentencePieceLike:
    """A `tokenizers` backend decoding as the detokenizer calls a tokenizer (a Llama-2 or Mistral one's)."""

    def __init__(self, backend):
        self.backend = backend

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=False):
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)


def test_a_continuation_keeps_the_space_a_sentencepiece_decoder_drops_at_the_start():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"▁The": 0, "▁capital": 1, "▁is": 2, "▁Paris": 3, "[UNK]": 4}, "[UNK]"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()  # Llama-2, Mistral

    prompt = backend.encode("The capital is").ids
    alone = Detokenizer(SentencePieceLike(backend))  # a message's answer: decoded alone, as transformers decodes it
    assert alone.add([3]) == "Paris"
    detok = Detokenizer(SentencePieceLike(backend), prompt[-2:])  # a continuation: after the prompt's last tokens
    assert detok.add([3]) + detok.add([2]) == " Paris is" and detok.text == " Paris is"
    assert "The capital is" + detok.text == backend.decode(prompt + [3, 2])


def test_a_continuation_after_byte_fallback_tokens_keeps_its_characters():
    """Llama-2's and Mistral's decoders turn a run of byte tokens that is not UTF-8 as a whole into U+FFFD, every
    byte: a context of the prompt's last tokens that starts inside a character must not join the answer's run."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for piece in ("▁", "C", "r", "a", "b", "s", ":", "▁is"):
        vocab[piece] = len(vocab)
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])  # Llama-2's

    prompt, whole = backend.encode("Crabs: 🦀🦀").ids, backend.encode("Crabs: 🦀🦀🦀 is").ids
    assert whole[:len(prompt)] == prompt and prompt[-5] == vocab["<0x80>"]  # the context starts inside a crab
    detok = Detokenizer(SentencePieceLike(backend), prompt[-5:])
    assert "".join(detok.add([i]) for i in whole[len(prompt):]) + detok.flush() == "🦀 is" == detok.text


def test_stats_say_how_the_decoding_steps_ran():
    from fafo_cli.runtime.events import Stats

    assert [Stats(steps=9, compiled_steps=n).steps_ran for n in (0, 3, 8)] == ["eager", "compiled 3/8", "compiled"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's peak resident size: Linux")
def test_peak_memory_counts_what_was_freed_between_samples():
    """A prefill chunk's temporaries are freed before the chunk returns, where the peak was sampled: the kernel's
    high-water mark, restarted per request, holds them (a process's earlier peak, say a conversion's, does not
    count)."""
    import gc

    from fafo_cli.runtime.memory import PeakMemory, _rss_bytes

    # the worker's earlier tests' garbage (engines of hundreds of MB) freed now, not by a collection that an
    # allocation below sets off: the resident size would shrink under the measurement (a suite run saw 120 MB)
    gc.collect()
    gc.disable()
    try:
        torch.empty(400 * 2**20, dtype=torch.uint8).fill_(1)  # an earlier peak, gone before the request
        before = _rss_bytes() / 1e6  # (fafo's MB)
        memory = PeakMemory([torch.device("cpu")])
        assert memory.sample() < before + 100
        # (the resident size just before: the worker's other memory may have shrunk since `before`, a suite run saw
        # 40 MB; and this kernel's resident counts are approximate, off by tens of MB in a suite run: a quarter's
        # margin)
        just_before = _rss_bytes() / 1e6
        torch.empty(200 * 2**20, dtype=torch.uint8).fill_(1)  # freed at once (glibc returns blocks this large)
        assert memory.sample() >= just_before + 200 * 2**20 / 1e6 * 0.75
    finally:
        gc.enable()


@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (4, 4)])
def test_a_pass_shares_its_additive_mask_across_layers_bit_for_bit(heads, kv_heads, monkeypatch):
    """A long prompt's chunk attends with torch's kernel, which made an additive mask of the boolean one on every
    layer's call: built once a pass now, with the same results."""
    from fafo_cli.runtime import model as model_mod

    torch.manual_seed(0)
    rows, keys, dim = 300, 700, 16
    q, k, v = torch.randn(1, heads, rows, dim), torch.randn(1, kv_heads, keys, dim), torch.randn(1, kv_heads, keys, dim)
    mask = prefix_causal_mask(keys - rows, rows, torch.device("cpu"))
    expected = model_mod.folded_attention(q, k, v, mask, 0.25)  # a boolean mask, as torch's kernel takes it
    masks = []
    real = model_mod.F.scaled_dot_product_attention
    monkeypatch.setattr(model_mod.F, "scaled_dot_product_attention",
                        lambda *a, attn_mask=None, **kw: masks.append(attn_mask) or real(*a, attn_mask=attn_mask, **kw))
    attend = model_mod.causal_attention(mask, 0.25)
    for layer in range(3):
        assert torch.equal(attend(layer, q, k, v), expected)
    assert masks[0].dtype == torch.float32 and all(m is masks[0] for m in masks)
    assert masks[0].shape == (heads // kv_heads * rows, keys)
