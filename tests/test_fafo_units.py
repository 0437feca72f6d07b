"""FAFO's pieces against hand-checked cases and direct references."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fafo_cli import config, load
from fafo_cli.decoders.fafo.attention import CompressedView
from fafo_cli.decoders.fafo.compressors import NoCompressor, StreamCompressor
from fafo_cli.decoders.fafo.pool import NgramPool
from fafo_cli.decoders.fafo.step import FafoSettings, window_streams
from fafo_cli.decoders.fafo.window import LookaheadWindow, window_layout
from fafo_cli.decoders.tree import DraftTree
from fafo_cli.decoders.verify import accept
from fafo_cli.runtime.cache import KVCache
from fafo_cli.runtime.model import causal_attention
from fafo_cli.runtime.rows import draft_step
from fafo_cli.runtime.sampling import Sampling

BF16_CLOSE = dict(atol=1e-2, rtol=2e-2)  # a bf16 result against float32: its rounding (2^-8) and a bf16 cache's sums


def test_window_layout_hand_checked():
    # W=3 streams, 3 levels. Rows: (0,1) (0,2) | (1,0) (1,1) (1,2) | (2,0) (2,1) (2,2)
    layout = window_layout(3, 3)
    rows = layout.rows
    assert rows.offsets == (1, 2, 1, 2, 3, 2, 3, 4)  # level + column
    expected = [  # columns: anchor, then the 8 rows
        [1, 1, 0, 0, 0, 0, 0, 0, 0],  # (0,1): anchor, itself
        [1, 1, 1, 0, 0, 0, 0, 0, 0],  # (0,2): anchor, (0,1), itself
        [1, 0, 0, 1, 0, 0, 0, 0, 0],  # (1,0): anchor, itself
        [1, 1, 0, 0, 1, 0, 0, 0, 0],  # (1,1): anchor, (0,1), itself
        [1, 1, 1, 0, 0, 1, 0, 0, 0],  # (1,2): anchor, (0,1), (0,2), itself
        [1, 0, 0, 1, 0, 0, 1, 0, 0],  # (2,0): anchor, (1,0), itself
        [1, 1, 0, 0, 1, 0, 0, 1, 0],  # (2,1): anchor, (0,1), (1,1), itself
        [1, 1, 1, 0, 0, 1, 0, 0, 1],  # (2,2): anchor, (0,1), (0,2), (1,2), itself
    ]
    assert rows.local.int().tolist() == expected
    assert layout.predictors == (5, 6, 7) and rows.read == (5, 6, 7)
    # The tokens each row sees occupy positions t..t+offset without gaps (the staircase).
    for r, offset in enumerate(rows.offsets):
        seen = [0] + [rows.offsets[c - 1] for c in range(1, 9) if expected[r][c]]
        assert sorted(seen) == list(range(offset + 1))
    # One level filled: the anchor predicts column 0, the level-0 rows the others.
    assert window_layout(3, 1).predictors == (-1, 0, 1)


def test_window_warms_up_then_yields_kgrams_and_shifts():
    window = LookaheadWindow(streams=2, ngram=3, prefix=2, seed_tokens=[7])
    assert window.levels == [[7]]
    assert window.advance(100, [10, 11]) == [] and window.advance(101, [20, 21]) == []  # warm-up: k-1 steps
    assert window.levels == [[7], [10, 11], [20, 21]]
    found = window.advance(102, [30, 31])
    # stream i: its levels 1..k-1 and the new token, keyed by what preceded it (anchor / level-0 token)
    assert found == [([102], (10, 20, 30)), ([7], (11, 21, 31))]
    assert window.levels == [[11], [20, 21], [30, 31]]  # level 1 became level 0 (its column 0 gave way)
    found = window.advance(103, [40, 41])
    assert found == [([102, 103], (20, 30, 40)), ([7, 11], (21, 31, 41))]


def test_pool_keys_lru_and_retrieval_order():
    pool = NgramPool(ngram=2, prefix=2, per_key=2)
    pool.add([1, 2], (3, 4))  # under (2,) and (1, 2)
    assert pool.keys == 2 and pool.ngrams == 2
    pool.add([9, 2], (5, 6))  # under (2,) and (9, 2)
    pool.add([2], (7, 8))  # (2,) now holds (3,4) (5,6) (7,8) -> the oldest (3,4) is dropped
    assert pool.lookup([2], 10) == [((7, 8), 1), ((5, 6), 1)]  # newest first, with the key length
    pool.add([2], (5, 6))  # re-inserting refreshes
    assert pool.lookup([2], 10) == [((5, 6), 1), ((7, 8), 1)]
    # longest key first: (1, 2) knows (3, 4), then the shorter key's n-grams, without duplicates
    assert pool.lookup([0, 1, 2], 10) == [((3, 4), 2), ((5, 6), 1), ((7, 8), 1)]
    assert pool.lookup([0, 1, 2], 2) == [((3, 4), 2), ((5, 6), 1)]
    assert pool.lookup([5], 3) == []
    assert pool.lookup([0, 1, 2], 0) == []


def test_pool_key_bound():
    bounded = NgramPool(ngram=1, prefix=1, per_key=1, max_keys=3)
    for token in range(10):
        bounded.add([token], (0,))
    assert bounded.keys == 3 and bounded.ngrams == 3
    assert bounded.lookup([9], 1) == [((0,), 1)] and bounded.lookup([0], 1) == []


def accept_greedy(tree, argmax):
    """`verify.accept` for greedy decoding over logits whose row r's argmax is `argmax[r]`."""
    logits = torch.nn.functional.one_hot(torch.tensor(argmax), 10).float()
    return accept(tree, logits, Sampling(), None, position=0)


def test_accept_greedy():
    # anchor predicts 5; candidate 0 = (5, 6, 9): after 5 the model says 6, after 6 it says 7 -> accept 2
    chains = DraftTree.chains
    assert accept_greedy(chains([(5, 6, 9), (4, 4, 4)]), [5, 6, 7, 1, 5, 2, 3]) == ([0, 1], [5, 6, 7])
    assert accept_greedy(chains([(4, 4, 4), (5, 2, 3)]), [5, 0, 0, 0, 2, 3, 8]) == ([3, 4, 5], [5, 2, 3, 8])
    assert accept_greedy(chains([(1, 2, 3)]), [5, 0, 0, 0]) == ([], [5])
    assert accept_greedy(chains([]), [5]) == ([], [5])
    # equal depth: the earlier candidate wins
    assert accept_greedy(chains([(5, 1), (5, 2)]), [5, 9, 9, 8, 8]) == ([0], [5, 9])


def test_tree_mask_and_positions_for_a_hand_drawn_tree():
    #  anchor ─ a(7) ─ b(8) ─ c(9)
    #         │      └ d(3)
    #         └ e(4) ─ f(5)
    tree = DraftTree()
    tree.add_chain([7, 8, 9])
    tree.add_chain([7, 3])  # merged: shares a
    tree.add_chain([4, 5])
    assert tree.tokens == [7, 8, 9, 3, 4, 5] and tree.parents == [-1, 0, 1, 0, -1, 4]
    layout = draft_step(0, tree.tokens, tree.parents, torch.device("cpu")).layout
    assert layout.offsets.tolist() == [0, 1, 2, 3, 2, 1, 2]
    expected = torch.tensor([
        # anchor a  b  c  d  e  f
        [1, 0, 0, 0, 0, 0, 0],  # anchor
        [1, 1, 0, 0, 0, 0, 0],  # a
        [1, 1, 1, 0, 0, 0, 0],  # b
        [1, 1, 1, 1, 0, 0, 0],  # c
        [1, 1, 0, 0, 1, 0, 0],  # d
        [1, 0, 0, 0, 0, 1, 0],  # e
        [1, 0, 0, 0, 0, 1, 1],  # f
    ], dtype=torch.bool)
    assert torch.equal(layout.local, expected) and layout.sees_cache is None and layout.logit_rows is None
    # the model says 7 after the anchor, 3 after a, 0 after d: path a-d, bonus 0
    assert accept_greedy(tree, [7, 3, 0, 0, 0, 0, 0]) == ([0, 3], [7, 3, 0])
    assert accept_greedy(tree, [4, 0, 0, 0, 0, 5, 6]) == ([4, 5], [4, 5, 6])


def test_stream_selection_is_sink_plus_recent():
    cache = KVCache(2, 1, 2, max_slots=64, dtype=torch.float32, device=torch.device("cpu"))
    compressor = StreamCompressor(budget=8, sink=3, tail_rows=4)
    positions = torch.arange(20, dtype=torch.float32)
    for start in range(0, 20, 3):  # commit in uneven pieces, as accepted runs do
        count = min(3, 20 - start)
        rows = positions[start:start + count].view(count, 1, 1).expand(count, 1, 2)
        for layer in range(2):
            cache.write(layer, rows, -rows)
        cache.commit(count)
        if start == 0:
            compressor.rebuild(cache)
        else:
            compressor.committed(cache, start, count)
        expected = sorted(set(range(min(3, cache.length))) | set(range(max(0, cache.length - 5), cache.length)))
        assert compressor.selected_positions(cache) == expected
        view = compressor.view(1)
        if cache.length <= 8:
            assert view is None and compressor.view_size(cache) == cache.length
        else:
            keys = sorted(int(k) for k in view[0][:8, 0, 0])
            assert keys == expected and compressor.view_size(cache) == 8
            assert sorted(int(-v) for v in view[1][:8, 0, 0]) == expected


@pytest.mark.parametrize("compressor_name", ["stream", "none"])
def test_fumble_rows_equal_a_forward_over_the_gathered_cache(tiny_models, compressor_name):
    """The window rows' logits from FAFO's attention equal those of a plain forward pass whose cache holds
    only C(kv) (physically gathered, original positions) plus the anchor."""
    engine = load(str(tiny_models["qwen2-bias"]), dtype="float32", chat_template=False)
    model, session = engine.model, engine.session
    prompt = engine.encode("The cat sat on the mat. " * 6)
    session.prefill(prompt[:-1] + [prompt[-1]], reserve=64)
    anchor = prompt[-1]
    cache, start = session.cache, session.cache.length
    compressor = StreamCompressor(budget=24, sink=4, tail_rows=32) if compressor_name == "stream" else NoCompressor()
    compressor.rebuild(cache)
    candidates = [(5, 6, 7), (8, 9, 10)]
    window = LookaheadWindow(streams=3, ngram=3, prefix=2, seed_tokens=prompt)
    window.levels = [[11, 12], [13, 14, 15], [16, 17, 18]]
    tree = DraftTree.chains(candidates)
    step = draft_step(anchor, tree.tokens, tree.parents, model.device, view_tokens=window.tokens(),
                      view_rows=window.layout.rows, view=CompressedView(cache, compressor, model.scaling))
    layout = step.layout
    logits = model.forward(torch.tensor(step.ids), start + layout.offsets, cache, step.view.attention(layout))
    fafo_verify, fafo_window = logits[:layout.verify_rows], logits[layout.verify_rows:]
    if compressor_name == "stream":
        # The verify rows see the whole cache, the window rows only C(kv): with the cached positions outside C(kv)
        # changed, the same step's first layer gives the window rows the same attention output and the verify
        # rows another one (later layers' window rows see the anchor's keys, which saw the whole cache).
        outside = sorted(set(range(start)) - set(_stream_positions(start, 24, 4)))

        def first_layer() -> torch.Tensor:
            outputs = []
            step_attention = step.view.attention(layout)

            def recorded(layer, q, k, v):
                outputs.append(step_attention(layer, q, k, v))
                return outputs[-1]

            model.forward(torch.tensor(step.ids), start + layout.offsets, cache, recorded)
            return outputs[0][0].transpose(0, 1)  # [rows, heads, dim]

        before = first_layer()
        saved = cache.keys[:, outside].clone(), cache.values[:, outside].clone()
        cache.keys[:, outside] += 1.0
        cache.values[:, outside] -= 1.0
        after = first_layer()
        cache.keys[:, outside], cache.values[:, outside] = saved
        verify = layout.verify_rows
        assert torch.equal(after[verify:], before[verify:])
        assert (after[:verify] - before[:verify]).abs().flatten(1).amax(1).min() > 1e-3  # each verify row

    # The verify rows saw the whole cache: they equal the same rows run with plain tree attention over it.
    verify_mask = torch.cat([torch.ones(layout.verify_rows, start, dtype=torch.bool), layout.verify_local], dim=1)
    verify_ids = torch.tensor(step.ids[:layout.verify_rows])
    whole = model.forward(verify_ids, start + layout.offsets[:layout.verify_rows], cache,
                          causal_attention(verify_mask, model.scaling))
    torch.testing.assert_close(fafo_verify, whole, atol=2e-4, rtol=1e-4)

    # Reference for the window rows: the anchor committed by a plain step, then C(kv) + anchor gathered into a
    # fresh cache.
    session.step(anchor)
    selected = list(range(start)) if compressor_name == "none" else _stream_positions(start, 24, 4)
    keep = torch.tensor(selected + [start])
    gathered = model.new_cache(initial_slots=len(keep) + len(step.ids))
    gathered.keys[:, :len(keep)] = cache.keys[:, keep]
    gathered.values[:, :len(keep)] = cache.values[:, keep]
    gathered.commit(len(keep))
    local = layout.view_local[:, 1:]
    mask = torch.cat([torch.ones(local.shape[0], len(keep), dtype=torch.bool), local], dim=1)
    window_offsets = layout.offsets[layout.verify_rows:]
    expected = model.forward(torch.tensor(window.tokens()), start + window_offsets, gathered,
                             causal_attention(mask, model.scaling))
    torch.testing.assert_close(fafo_window, expected, atol=2e-4, rtol=1e-4)


def _stream_positions(length: int, budget: int, sink: int) -> list[int]:
    return list(range(sink)) + list(range(length - (budget - sink), length))


class _Compiled:
    """Stands in for CompiledSteps: which step sizes run compiled."""

    def __init__(self, sizes: set[int]):
        self.sizes = sizes

    def serves(self, rows: int) -> bool:
        return rows in self.sizes


def test_auto_streams_run_no_window_on_a_cpu_unless_a_compressor_is_named():
    unnamed = FafoSettings.from_config(config.build(streams="auto"))
    assert (unnamed.compressor, unnamed.compressor_named) == ("stream", False)  # what a window would see
    assert window_streams(unnamed, None) == window_streams(unnamed, _Compiled({3})) == 0
    assert window_streams(unnamed, None, packed=True) == 0
    assert window_streams(unnamed, None, accelerator=True) > 0  # a GPU's rows are nearly free: the widest window
    assert window_streams(replace(unnamed, streams=2), None) == 2  # a configured W is kept
    named = FafoSettings.from_config(config.build(streams="auto", compressor="stream"))
    assert named.compressor_named and window_streams(named, None) == 2


def test_compiled_step_sizes_are_few_and_cover_plain_short_medium_and_long_steps():
    sizes = lambda **keys: FafoSettings.from_config(config.build(**keys)).step_sizes
    # plain, one guess, an n-gram's or short copy's 3, a copy's 8, its 16 guesses
    assert sizes(streams=0) == (1, 2, 4, 9, 17) == sizes(streams=0, guesses=3, ngram=5)  # G, k: the window's
    assert sizes(streams=1) == (1, 2, 3, 6, 11, 19)  # the window's 2 rows with the guesses, and the window alone
    assert sizes(streams=2, guesses=2, draft_tokens=6) == (1, 2, 6, 12)  # G·k = D: no medium size


def test_auto_streams_follow_whether_the_step_runs_compiled():
    settings = FafoSettings.from_config(config.build(streams="auto", ngram=3, draft_tokens=8, compressor="quest"))
    assert window_streams(settings, None) == 2  # eager: rows cost little, W=2
    # W=1 where its window's step, 1 + (3 - 1) = 3 rows, runs compiled (larger steps need not: they bound the draft)
    assert window_streams(settings, _Compiled({3})) == 1
    assert window_streams(replace(settings, ngram=4), _Compiled({3})) == 2  # a 4-row window step: eager, W=2
    assert window_streams(replace(settings, streams=3), _Compiled({3})) == 3  # a configured W is kept
    assert window_streams(settings, None, packed=True) == 1  # eager over packed blocks: rows cost arithmetic too


def test_auto_streams_widen_with_the_measured_cost_of_eager_rows():
    """On eager steps `auto` is the widest window costing at most 25% more than a plain step by the cost curve: a
    GPU's nearly free rows give a wide window (the paper's W 10-40), a CPU's dear ones the measured floor W=2."""
    from fafo_cli.decoders.fafo.planner import StepCosts
    from fafo_cli.decoders.fafo.step import MOST_AUTO_STREAMS, widest_window

    settings = FafoSettings.from_config(config.build(streams="auto", ngram=4, compressor="stream"))
    default = StepCosts.default(accelerator=True)  # each row 0.5% of a one-row step
    assert window_streams(settings, None, default) == 12  # 1 + 47 · 0.005 ≤ 1.25 < 1 + 51 · 0.005
    assert window_streams(replace(settings, ngram=3), None, default) == 17  # 51 rows, then 54
    assert widest_window(StepCosts({1: 1.0, 64: 1.0}), 3) == MOST_AUTO_STREAMS  # free rows: the widest
    flat = StepCosts({1: 10.0, 64: 12.0, 256: 17.0})  # a memory-bound GPU: 64 rows 20% dearer than one
    assert widest_window(flat, 4) == 20  # 80 rows cost 12 + 16·5/192 = 12.42 ms, 84 rows 12.52 (> 1.25 × 10 ms)
    assert window_streams(settings, None, flat) == 20
    steep = StepCosts({1: 30.0, 9: 45.0})  # a CPU: each row ~6% of a plain step
    assert widest_window(steep, 4) == 1 and window_streams(settings, None, steep) == 2
    assert window_streams(settings, _Compiled({4}), flat) == 1  # compiled window steps keep W=1
    assert window_streams(replace(settings, streams=5), None, flat) == 5
    noisy = StepCosts({1: 10.0, 8: 20.0, 16: 10.5, 64: 11.0})  # a busy machine's outlier at 8 rows
    assert widest_window(noisy, 4) == 1  # the 8-row window already costs too much: no wider one is trusted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5])
def test_grouped_attention_folds_query_heads_into_rows(dtype, rows, monkeypatch):
    """The CPU path without our library (query heads folded into their KV head's rows) against torch's own
    grouped-query attention, over keys laid out as the cache holds them, with the step's own rows causal."""
    from fafo_cli.runtime import model
    from fafo_cli.runtime.model import grouped_attention

    monkeypatch.setattr(model, "_cpu_attention", None)
    torch.manual_seed(0)
    keys = 700
    cached_k, cached_v = torch.randn(keys + 8, 3, 64, dtype=dtype), torch.randn(keys + 8, 3, 64, dtype=dtype)
    k, v = cached_k[:keys].transpose(0, 1)[None], cached_v[:keys].transpose(0, 1)[None]
    q = torch.randn(rows, 9, 64, dtype=dtype).transpose(0, 1)[None]
    mask = torch.ones(rows, keys, dtype=torch.bool)
    mask[:, keys - rows:] = torch.ones(rows, rows, dtype=torch.bool).tril()
    for given in (mask, None):
        folded = grouped_attention(q, k, v, given, 0.125)
        # computed in float32 (torch's CPU kernel is slow in bf16), the result in the queries' dtype
        reference = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=given,
                                                                     scale=0.125, enable_gqa=True).to(dtype)
        assert folded.shape == reference.shape and folded.dtype == dtype
        torch.testing.assert_close(folded, reference)


def test_a_gpus_prefill_chunk_folds_its_query_heads_and_its_steps_do_not(monkeypatch):
    """Off the CPU (meta tensors stand in for a GPU's: shapes only), a masked prefill chunk of a grouped-query model
    is folded into equal head counts, which torch's memory-efficient kernel serves (`enable_gqa` with a mask takes
    the math path, every query head's scores over the whole cache at once); a decoding step keeps `enable_gqa`."""
    from fafo_cli.runtime import model

    calls = []

    def sdpa(q, k, v, attn_mask=None, scale=None, enable_gqa=False):
        calls.append((q.shape[1], k.shape[1], enable_gqa))
        return torch.empty(q.shape[:-1] + v.shape[-1:], device=q.device, dtype=q.dtype)

    monkeypatch.setattr(model.F, "scaled_dot_product_attention", sdpa)
    keys = 4096
    k = v = torch.empty(1, 2, keys, 64, device="meta")
    for rows, expected in ((512, (2, 2, False)), (model.STEP_ROWS, (14, 2, True)), (4, (14, 2, True))):
        q = torch.empty(1, 14, rows, 64, device="meta")
        out = model.grouped_attention(q, k, v, torch.ones(rows, keys, dtype=torch.bool, device="meta"), 0.125, {})
        assert calls[-1] == expected and out.shape == q.shape, rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5])
def test_grouped_attention_is_our_kernel_where_our_library_is_loaded(compiled_folder, rows, dtype):
    """Once our library is loaded on a CPU with AVX2 or AVX-512, a CPU step attends with our kernel: torch's float32
    result up to rounding (in float32 or from a bf16 cache, as eager steps attend), and each row's bits the same
    alone as beside the step's other rows. Elsewhere torch's kernel stays."""
    from fafo_cli.compiled.kernels import loader
    from fafo_cli.runtime import model
    from fafo_cli.runtime.model import grouped_attention

    loader.load(compiled_folder / "compiled")
    if not loader.attends():
        assert model._cpu_attention is None
        pytest.skip("this CPU has neither AVX2 nor AVX-512: eager steps attend with torch's kernel")
    assert model._cpu_attention is not None
    torch.manual_seed(0)
    keys, cached = 700, 700 - rows
    k, v = (torch.randn(keys, 3, 64, dtype=dtype).transpose(0, 1)[None] for _ in range(2))
    q = torch.randn(rows, 9, 64, dtype=dtype).transpose(0, 1)[None]
    mask = torch.ones(rows, keys, dtype=torch.bool)
    mask[:, cached:] = torch.ones(rows, rows, dtype=torch.bool).tril()
    for given in (mask, None):
        ours = grouped_attention(q, k, v, given, 0.125)
        reference = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=given,
                                                                     scale=0.125, enable_gqa=True)
        assert ours.dtype == dtype
        torch.testing.assert_close(ours.float(), reference, **({} if dtype == torch.float32 else BF16_CLOSE))
    stepped = grouped_attention(q, k, v, mask, 0.125)
    for first in range(1, rows + 1):
        alone = grouped_attention(q[:, :, :first], k[:, :, :cached + first], v[:, :, :cached + first],
                                  mask[:first, :cached + first], 0.125)
        assert torch.equal(alone, stepped[:, :, :first])


def test_one_stream_s_first_window_step_runs_no_window_rows(tiny, monkeypatch):
    """With W=1 the window's first step after a prefill has no rows (its anchor alone predicts the next level):
    that pass reads no C(kv) (no selection, no zero-row attention call), and the answer is plain decoding's."""
    from fafo_cli.decoders.fafo import step as fafo_step

    from .conftest import LONG, hf_greedy

    calls = []

    def recorded(*args, **kwargs):
        calls.append((kwargs.get("view_tokens"), kwargs.get("view") is not None))
        return draft_step(*args, **kwargs)

    monkeypatch.setattr(fafo_step, "draft_step", recorded)
    engine = load(str(tiny), dtype="float32", chat_template=False, method="fafo", streams=1, compressor="stream",
                  budget=32, planner=False)
    result = engine.complete(LONG, max_tokens=24)
    assert result.token_ids == hf_greedy(tiny, engine.encode(LONG), 24)
    assert calls[0] == (None, False) and all(tokens is None or len(tokens) > 0 for tokens, _ in calls)
    assert any(tokens and reads for tokens, reads in calls)  # (the window's later steps read the view)
