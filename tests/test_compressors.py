"""Each compressor: its selection against a slow, direct reference; lossless decoding with every one of them
(float32, token for token against transformers' generate), including a multi-turn chat."""

from __future__ import annotations

import math
from dataclasses import replace
from functools import lru_cache

import pytest
import torch

from fafo_cli import load
from fafo_cli.config import COMPRESSORS, MIN_BUDGET, Config
from fafo_cli.runtime.cache import KVCache
from fafo_cli.decoders.fafo.compressors.h2o import H2OCompressor
from fafo_cli.decoders.fafo.compressors.quest import QuestCompressor, page_bounds
from fafo_cli.decoders.fafo.compressors.scores import attention_weights
from fafo_cli.decoders.fafo.compressors.snapkv import SnapKVCompressor
from fafo_cli.decoders.fafo.compressors.stream import StreamCompressor

from .conftest import hf_greedy

# eager steps attend with our kernel, as a .gguf model's do (torch's: test_fafo.py)
pytestmark = pytest.mark.usefixtures("our_attention")

LAYERS, KV, DIM, HEADS = 2, 2, 8, 4


def filled_cache(length: int, seed: int = 0) -> KVCache:
    torch.manual_seed(seed)
    cache = KVCache(LAYERS, KV, DIM, max_slots=512, dtype=torch.float32, device=torch.device("cpu"))
    rows = torch.randn(LAYERS, length, KV, DIM)
    for layer in range(LAYERS):
        cache.write(layer, rows[layer], -rows[layer])
    cache.commit(length)
    return cache


def commit_random(cache: KVCache, compressor, length: int, count: int) -> int:
    """`count` random positions written and committed after `length`, as a step commits them; the new length."""
    rows = torch.randn(LAYERS, count, KV, DIM)
    for layer in range(LAYERS):
        cache.write(layer, rows[layer], -rows[layer])
    cache.commit(count)
    compressor.committed(cache, length, count)
    return length + count


def brute_bound(q, keys):
    """Quest's bound for one page, literally: sum over heads and dims of max(q*min, q*max)."""
    group = HEADS // KV
    total = 0.0
    for h in range(HEADS):
        kmin, kmax = keys[:, h // group].min(0).values, keys[:, h // group].max(0).values
        total += sum(max(q[h, d] * kmin[d], q[h, d] * kmax[d]) for d in range(DIM))
    return float(total)


def test_quest_selects_the_brute_force_top_pages_and_appends_new_tokens():
    cache = filled_cache(100)
    quest = QuestCompressor(budget=48, page_size=8, refresh=8, tail_rows=4, max_commit=3)
    queries = torch.randn(LAYERS, HEADS, DIM)
    for layer in range(LAYERS):
        quest.observe(layer, queries[layer], cache.keys[layer, :100])
    quest.rebuild(cache)
    pages = math.ceil(100 / 8)
    for layer in range(LAYERS):
        bounds = [brute_bound(queries[layer], cache.keys[layer, p * 8:min(100, (p + 1) * 8)]) for p in range(pages)]
        fast = page_bounds(queries[layer], quest.page_min[layer, :pages], quest.page_max[layer, :pages])
        assert torch.allclose(fast, torch.tensor(bounds), atol=1e-4)
        # 5 pages kept: the budget less room for a refresh's tokens, (48 - 8) // 8 (a step's commit beyond the
        # budget is the view's spare slots')
        top = sorted(sorted(range(pages - 1), key=lambda p: -bounds[p])[:4]) + [pages - 1]
        expected = [pos for p in top for pos in range(p * 8, min(100, (p + 1) * 8))]
        assert quest.selected_positions(cache, layer) == expected
        view_keys = quest.view(layer)[0][:quest.view_size(cache)]
        assert sorted(view_keys[:, 0, 0].tolist()) == sorted(cache.keys[layer, expected, 0, 0].tolist())
    # new tokens are appended until the refresh is due, and page bounds follow them
    extra = torch.randn(LAYERS, 3, KV, DIM)
    for layer in range(LAYERS):
        cache.write(layer, extra[layer], -extra[layer])
    cache.commit(3)
    quest.committed(cache, 100, 3)
    assert quest.selected_positions(cache)[-7:] == list(range(96, 103))
    assert torch.allclose(quest.page_max[0, 12], cache.keys[0, 96:103].amax(0))


def test_quest_keeps_page_bounds_for_the_cache_s_room_not_twice_the_prompt():
    """A long prompt's first new page doubled the bounds (twice the context's, at 32K tokens a gigabyte more):
    they cover the cache's room, which grows by a quarter."""
    torch.manual_seed(0)
    cache = KVCache(LAYERS, KV, DIM, max_slots=512, dtype=torch.float32, device=torch.device("cpu"), initial_slots=128)
    length = commit_random(cache, _NoCompressor(), 0, 120)
    quest = QuestCompressor(budget=48, page_size=8, refresh=8, tail_rows=4, max_commit=9)
    for layer in range(LAYERS):
        quest.observe(layer, torch.randn(HEADS, DIM), cache.keys[layer, :length])
    quest.rebuild(cache)
    commit_random(cache, quest, length, 8)  # a new page
    assert quest.page_min.shape[1] * 8 == cache.capacity == 128
    assert torch.equal(quest.page_max[:, 15], cache.keys[:, 120:128].amax(1))


class _NoCompressor:
    def committed(self, cache, length, count):
        pass


def test_quest_waits_for_its_refresh_and_prepares_nothing_before_it_is_active():
    """Within its budget Quest selects nothing (a prompt shorter than `refresh` crashed the step); once active it
    selects again after `refresh` tokens, not on every step (its selection leaves room for them and a commit)."""
    quest = QuestCompressor(budget=48, page_size=8, refresh=8, tail_rows=4, max_commit=9)
    cache = filled_cache(5)
    quest.rebuild(cache)
    quest.prepare(cache)
    assert not quest.active and quest.slots is None
    cache, selections = filled_cache(100), []
    for layer in range(LAYERS):
        quest.observe(layer, torch.randn(HEADS, DIM), cache.keys[layer, :100])
    quest.rebuild(cache)
    select = quest._select
    quest._select = lambda cache: (selections.append(cache.length), select(cache))
    length = 100
    for _ in range(8):
        rows = torch.randn(LAYERS, 2, KV, DIM)
        for layer in range(LAYERS):
            cache.write(layer, rows[layer], -rows[layer])
        cache.commit(2)
        quest.committed(cache, length, 2)
        length += 2
        quest.prepare(cache)
        assert quest.view_size(cache) <= quest.budget
    assert selections == [108, 116]


def commit_one_by_one(cache: KVCache, compressor, count: int) -> None:
    """`count` generated tokens of random keys (values their negation), committed and told one at a time."""
    for _ in range(count):
        row = torch.randn(LAYERS, 1, KV, DIM)
        for layer in range(LAYERS):
            cache.write(layer, row[layer], -row[layer])
        cache.commit(1)
        compressor.committed(cache, cache.length - 1, 1)


def test_snapkv_keeps_pooled_top_scores_plus_window():
    cache = filled_cache(120)
    snap = SnapKVCompressor(budget=64, window=8, kernel=3, prompt_length=120, scale=0.5, tail_rows=4)
    q = torch.randn(LAYERS, HEADS, 120, DIM)
    for layer in range(LAYERS):  # observed in two prefill chunks, as a chunked prefill would
        snap.observe_prefill(layer, q[layer, :, :100], cache.keys[layer, :100], 0)
        snap.observe_prefill(layer, q[layer, :, 100:], cache.keys[layer, :120], 100)
    snap.rebuild(cache)
    keep = 64 - 16 - 8  # budget - ring for generated tokens - window
    for layer in range(LAYERS):
        scores = torch.zeros(120)
        for row in range(112, 120):  # the last 8 prompt queries, each over the keys up to itself, all heads
            for h in range(HEADS):
                logits = cache.keys[layer, :row + 1, h // 2] @ q[layer, h, row] * 0.5
                scores[:row + 1] += logits.softmax(0)
        pooled = torch.tensor([scores[max(0, i - 1):i + 2].max() for i in range(112)])
        # (pooling repeats a value at neighbours: among equal ones the newest)
        expected = sorted(sorted(range(112), key=lambda i: (-pooled[i], -i))[:keep]) + list(range(112, 120))
        assert snap.selected_positions(cache, layer) == expected
    # generated tokens go into a ring of budget // 4 slots after the prompt selection
    commit_one_by_one(cache, snap, 20)
    assert snap.selected_positions(cache)[-16:] == list(range(124, 140))
    assert snap.view_size(cache) == 64


def test_snapkv_keeps_the_newest_tokens_where_the_answer_outgrows_the_budget():
    """A prompt within the budget selects nothing; once the answer outgrows it, the selection is made from scores
    only the prompt has (its tokens none): the prompt, then the newest of the answer, not an arbitrary few."""
    cache = filled_cache(10)
    snap = SnapKVCompressor(budget=32, window=4, kernel=1, prompt_length=10, scale=0.5, tail_rows=4)
    for layer in range(LAYERS):
        snap.observe_prefill(layer, torch.randn(HEADS, 10, DIM), cache.keys[layer, :10], 0)
    snap.rebuild(cache)
    assert not snap.active
    commit_one_by_one(cache, snap, 30)
    # selected at 33 positions, 32 - 8 (ring) - 4 (window) = 20 by score: the prompt's 10, then the newest 10
    # before the window (19-28); the window 29-32, and the ring since (33-39)
    assert snap.active and sorted(snap.selected_positions(cache, 0)) == [*range(10), *range(19, 40)]


def test_a_view_read_only_as_a_mask_holds_no_copy():
    """Compiled steps read a view's mask alone: its copy of the keys and values is made when first read (a 7B
    model's 80 MB at a 256-token budget were allocated, and counted as the draft's memory, for nothing)."""
    from fafo_cli.decoders.fafo.compressors.view import SlotView

    cache = filled_cache(100)
    view = SlotView(cache, 32, 4)
    view.fill(torch.arange(50, 82))
    assert view.mask(100)[50:82].all() and not view.mask(100)[:50].any()
    held = view.nbytes()
    keys, values = view.layer(1)
    assert torch.equal(keys[:32], cache.keys[1, 50:82]) and torch.equal(values[:32], cache.values[1, 50:82])
    assert view.nbytes() == held + 2 * view.keys.nbytes


def test_h2o_keeps_heavy_hitters_plus_recent():
    cache = filled_cache(90)
    h2o = H2OCompressor(budget=40, recent=10, window=4, prompt_length=90, scale=0.3, tail_rows=4)
    q_prompt = torch.randn(LAYERS, HEADS, 90, DIM)
    q_anchor = torch.randn(LAYERS, HEADS, DIM)
    for layer in range(LAYERS):
        h2o.observe_prefill(layer, q_prompt[layer], cache.keys[layer, :90], 0)
        h2o.observe(layer, q_anchor[layer], cache.keys[layer, :90])
    h2o.prepare(cache)
    for layer in range(LAYERS):
        mass = torch.zeros(90)
        for row in range(86, 90):
            mass[:row + 1] += attention_weights(q_prompt[layer, :, row:row + 1], cache.keys[layer, :row + 1], 0.3)
        mass += attention_weights(q_anchor[layer][:, None], cache.keys[layer, :90], 0.3)
        expected = sorted(torch.topk(mass[:80], 30).indices.tolist()) + list(range(80, 90))
        assert h2o.selected_positions(cache, layer) == expected


def test_h2o_evicts_for_good_and_scores_only_what_it_keeps():
    """As in the paper: once a position leaves the view it is neither scored nor selected again, however much
    attention it would get (scoring the whole cache each step cost as much as the window reading it)."""
    cache = filled_cache(90)
    h2o = H2OCompressor(budget=40, recent=10, window=4, prompt_length=90, scale=0.3, tail_rows=4)
    for layer in range(LAYERS):
        h2o.observe(layer, torch.randn(HEADS, DIM), cache.keys[layer, :90])
    h2o.prepare(cache)
    first = [h2o.selected_positions(cache, layer) for layer in range(LAYERS)]
    evicted = [sorted(set(range(80)) - set(kept)) for kept in first]
    before = [h2o.mass.layer(layer, 90).clone() for layer in range(LAYERS)]
    queries = []
    for layer in range(LAYERS):
        queries.append(50 * cache.keys[layer, evicted[layer][0]].repeat_interleave(HEADS // KV, 0))  # aims at one
        h2o.observe(layer, queries[layer], cache.keys[layer, :90])
    h2o.learn(cache)  # (as a step's commit does: every layer's observed query scored at once)
    for layer in range(LAYERS):
        added = h2o.mass.layer(layer, 90) - before[layer]
        kept = torch.tensor(first[layer])
        assert added[evicted[layer]].abs().max() == 0
        assert torch.allclose(added[kept], attention_weights(queries[layer][:, None], cache.keys[layer, kept], 0.3))
        with torch.inference_mode():  # (as the mass is made and updated)
            h2o.mass.add(layer, torch.zeros(90).index_fill(0, torch.tensor(evicted[layer]), 1e6))  # overwhelming
    h2o.prepare(cache)
    for layer in range(LAYERS):
        assert set(h2o.selected_positions(cache, layer)) <= set(first[layer])


def test_h2o_follows_a_direct_reference_step_by_step():
    """H2O's rule written out with sets: the kept positions older than the recent window compete by accumulated
    mass (an evicted one never again), the recent ones are all kept; the mass comes from each window step's anchor
    over the kept positions alone. Steps without the window (no selection, no scoring) come in between."""
    cache, length = filled_cache(70), 70
    budget, recent = 30, 6
    h2o = H2OCompressor(budget=budget, recent=recent, window=4, prompt_length=70, scale=0.3, tail_rows=4)
    mass = torch.zeros(LAYERS, 512)
    q_prompt = torch.randn(LAYERS, HEADS, 70, DIM)
    for layer in range(LAYERS):
        h2o.observe_prefill(layer, q_prompt[layer], cache.keys[layer, :70], 0)
        for row in range(66, 70):
            mass[layer, :row + 1] += attention_weights(q_prompt[layer, :, row:row + 1], cache.keys[layer, :row + 1],
                                                       0.3)
    kept = [set(range(70)) for _ in range(LAYERS)]

    def select() -> None:
        older = length - recent
        for layer in range(LAYERS):
            old = sorted(p for p in kept[layer] if p < older)
            top = torch.topk(mass[layer, old], budget - recent).indices.tolist()
            kept[layer] = {old[i] for i in top} | set(range(older, length))
            assert h2o.selected_positions(cache, layer) == sorted(kept[layer]), (length, layer)

    h2o.rebuild(cache)
    select()
    for step in range(40):
        length = commit_random(cache, h2o, length, 1 + step % 3)
        # no window this step: now and then, and for a run of more tokens than the 24 heavy slots (every one of them
        # may be evicted at the next selection)
        if step % 3 == 2 or 12 <= step < 29:
            continue
        h2o.prepare(cache)
        select()
        for layer in range(LAYERS):
            q = torch.randn(HEADS, DIM)
            h2o.observe(layer, q, cache.keys[layer, :length])
            seen = torch.tensor(sorted(kept[layer]))
            mass[layer, seen] += attention_weights(q[:, None], cache.keys[layer, seen], 0.3)
    assert h2o.slots.size == budget


@pytest.mark.parametrize("name", ["stream", "snapkv", "quest", "h2o"])
def test_view_reads_and_mask_follow_the_selection(name):
    """The slot view copies keys and values only when read, and keeps its [positions, layers] mask: both agree
    with the selection, through ring wrap-around, refreshes, steps without the window (no selection: quest's
    slots filled up once in such a run) and the cache being reallocated under it."""
    cache = filled_cache(60)
    compressor = {"stream": lambda: StreamCompressor(budget=24, sink=4, tail_rows=4),
                  "snapkv": lambda: SnapKVCompressor(budget=40, window=8, kernel=3, prompt_length=60, scale=0.5,
                                                     tail_rows=4),
                  "quest": lambda: QuestCompressor(budget=32, page_size=8, refresh=4, tail_rows=4, max_commit=3),
                  "h2o": lambda: H2OCompressor(budget=32, recent=8, window=8, prompt_length=60, scale=0.5,
                                               tail_rows=4)}[name]()
    q = torch.randn(LAYERS, HEADS, 60, DIM)
    for layer in range(LAYERS):  # what query-aware compressors learn from
        if hasattr(compressor, "observe_prefill"):
            compressor.observe_prefill(layer, q[layer], cache.keys[layer, :60], 0)
        if name == "quest":
            compressor.observe(layer, q[layer, :, -1], cache.keys[layer, :60])
    compressor.rebuild(cache)
    assert compressor.active
    length = 60
    for step in range(40):
        if step == 20:
            cache.reserve(cache.capacity + 1)  # reallocated: the view must follow the new tensors
        length = commit_random(cache, compressor, length, 1 + step % 3)
        if step % 4 == 3 or 10 <= step < 17:  # a step without the window: nothing reads the view
            continue
        compressor.prepare(cache)
        if name == "h2o":  # the anchor row's attention over what it keeps
            for layer in range(LAYERS):
                compressor.observe(layer, torch.randn(HEADS, DIM), cache.keys[layer, :length])
        if step % 7:  # a compiled step reads only the mask; every 7th step reads the view as well
            continue
        view, mask = compressor.slots, compressor.view_mask(cache)
        assert mask.shape == (length, LAYERS)
        for layer in range(LAYERS):
            assert torch.nonzero(mask[:, layer]).flatten().tolist() == compressor.selected_positions(cache, layer)
            keys, values = compressor.view(layer)
            positions = view.positions[layer, :view.size]
            assert torch.equal(keys[:view.size], cache.keys[layer, positions])
            assert torch.equal(values[:view.size], cache.values[layer, positions])


def test_attention_weights_match_a_direct_softmax():
    keys = torch.randn(12, KV, DIM)
    q = torch.randn(HEADS, 3, DIM)
    positions = torch.tensor([5, 9, 11])
    got = attention_weights(q, keys, 0.7, positions)
    expected = torch.zeros(12)
    for h in range(HEADS):
        for r, pos in enumerate(positions.tolist()):
            expected[:pos + 1] += (keys[:pos + 1, h // 2] @ q[h, r] * 0.7).softmax(0)
    assert torch.allclose(got, expected, atol=1e-5)


SHORT = "one two three"
LONG = "The cat sat on the mat. The dog sat on the log. " * 4 + "Where did the cat sit? " * 2
OPTIONS = dict(streams=2, ngram=3, guesses=2, prefix=2, budget=96, sink=4, page_size=8, refresh=8, window=8,
               kernel=3, recent=16)


@lru_cache(maxsize=None)
def fafo_engine(folder):
    return load(str(folder), dtype="float32", chat_template=False, method="fafo")


@pytest.mark.device
@pytest.mark.parametrize("variant", ["llama-mha", "llama-gqa"])
@pytest.mark.parametrize("compressor", COMPRESSORS)
def test_every_compressor_is_lossless(tiny_models, variant, compressor):
    engine = fafo_engine(tiny_models[variant])
    for prompt in (SHORT, LONG):  # ~15 and ~300 tokens: shorter and longer than the budget of 96
        ids = engine.encode(prompt)
        result = engine.complete(prompt, max_tokens=256, compressor=compressor, **OPTIONS)
        assert result.token_ids == hf_greedy(tiny_models[variant], ids, 256), (compressor, len(ids))
        if compressor != "none":
            assert result.stats.fumble_positions <= 96


@pytest.mark.device
@pytest.mark.parametrize("compressor", ["snapkv", "quest", "h2o"])
def test_three_turn_chat_is_lossless(tiny, compressor):
    engine = load(str(tiny), dtype="float32", method="fafo")
    messages = []
    for turn in ("Tell me about cats. " * 8, "And dogs?", "Compare them. " * 5):
        messages.append({"role": "user", "content": turn})
        result = engine.complete(messages, max_tokens=60, compressor=compressor, **OPTIONS)
        assert result.token_ids == hf_greedy(tiny, engine.encode(messages), 60), (compressor, len(messages))
        messages.append({"role": "assistant", "content": result.text})
    assert result.stats.cached_prompt_tokens > 0  # later turns prefilled only their new tokens


@pytest.mark.parametrize("compressor", ["stream", "quest", "snapkv", "h2o"])
def test_the_least_budget_holds_the_view_through_a_long_answer(tiny, compressor):
    """At the least budget the config admits, the view (its fixed part and the ring of new tokens) stays within
    the budget: snapkv's observation window once took every slot and its ring wrote past them."""
    engine = fafo_engine(tiny)
    least = MIN_BUDGET[compressor](replace(Config(), **OPTIONS))[1]
    result = engine.complete(LONG, max_tokens=40, compressor=compressor, **{**OPTIONS, "budget": least})
    assert result.token_ids == engine.complete(LONG, max_tokens=40, method="vanilla").token_ids
    assert result.stats.fumble_positions <= least


def test_fraction_budget_scales_with_the_prompt(tiny):
    engine = fafo_engine(tiny)
    result = engine.complete(LONG, max_tokens=20, compressor="stream", budget=0.25, sink=4)
    assert result.stats.fumble_positions == math.ceil(0.25 * len(engine.encode(LONG)))


@pytest.mark.device
@pytest.mark.parametrize("compressor", ["stream", "quest", "snapkv", "h2o"])
def test_block_sparse_path_equals_split_path(tiny_models, compressor):
    """One FlexAttention call over [C(kv) leading region | positions] with a per-bucket block mask gives the
    split path's results: same tokens, and the same steps and accepted guesses (so the window rows saw the
    same positions). CPU runs FlexAttention eagerly: slow but exact. The planner is off: it learns from step
    times, so two runs of it may choose different steps; a fixed plan runs the window on every step."""
    engine = fafo_engine(tiny_models["llama-gqa"])
    options = dict(OPTIONS, budget=48, window=4, recent=8, compressor=compressor, max_tokens=48, planner=False)
    split = engine.complete(LONG, attention="split", **options)
    block = engine.complete(LONG, attention="block", **options)
    assert block.token_ids == split.token_ids == hf_greedy(tiny_models["llama-gqa"], engine.encode(LONG), 48)
    assert block.stats.fumble_positions == split.stats.fumble_positions
    if compressor == "h2o":  # re-selects every step from masses the model computes: float32 rounding of the two
        assert abs(block.stats.steps - split.stats.steps) <= 2  # kernels can flip a near-tied heavy hitter
    else:
        assert (block.stats.steps, block.stats.accepted_tokens) == (split.stats.steps, split.stats.accepted_tokens)
    assert engine.session.cache.lead > 0  # the block layout really was used
    engine.complete(SHORT, attention="split", max_tokens=4)
    assert engine.session.cache.lead == 0  # and the split layout drops the leading region


def test_the_block_layout_holds_its_view_before_the_prefill(tiny, monkeypatch):
    """The leading region is as large as the view takes before the prompt is cached: asked for after it, the whole
    cache was copied to make room (twice the cache in memory at a long context)."""
    from fafo_cli.runtime.cache import KVCache

    from fafo_cli.runtime.session import Session

    engine = fafo_engine(tiny)
    allocate, prefill, grown, prefilled = KVCache._allocate, Session.prefill, [], []

    def watched(self, slots: int, lead: int) -> None:
        if prefilled and lead != self.lead:
            grown.append((self.length, self.lead, lead))
        return allocate(self, slots, lead)

    def marked(self, *args, **kwargs):
        result = prefill(self, *args, **kwargs)
        prefilled.append(1)
        return result

    monkeypatch.setattr(KVCache, "_allocate", watched)
    monkeypatch.setattr(Session, "prefill", marked)
    options = dict(OPTIONS, budget=200, compressor="stream", max_tokens=8, planner=False)
    long = LONG * 8  # beyond the budget: the view is made
    result = engine.complete(long, attention="block", **options)
    assert result.stats.fumble_positions == 200 and engine.session.cache.lead >= 200 and grown == []


@pytest.mark.parametrize("compressor", ["snapkv", "h2o"])
def test_a_prompt_asked_again_is_observed_as_a_new_one(tiny, compressor):
    """SnapKV and H2O learn from the prompt's last `window` queries: where the cache already holds the prompt (a
    question asked again, a chat turn of a few tokens) those rows are computed again (they learned from one), so the
    same request plans the same steps."""
    engine = fafo_engine(tiny)
    options = dict(OPTIONS, budget=48, window=8, recent=8, compressor=compressor, max_tokens=32, planner=False)
    first = engine.complete(LONG, **options)
    again = engine.complete(LONG, **options)
    assert again.stats.cached_prompt_tokens == len(engine.encode(LONG)) - 8
    assert (again.token_ids, again.stats.steps, again.stats.accepted_tokens) == (
        first.token_ids, first.stats.steps, first.stats.accepted_tokens)
    # a turn of fewer new tokens than the window still continues the conversation: what FAFO learned is kept
    options.update(window=32, max_tokens=4)
    turn = engine.complete(LONG, **options)
    [learned] = engine.session.carry.values()
    engine.complete(LONG + engine.tokenizer.decode(turn.token_ids) + " ok", **options)
    assert list(engine.session.carry.values()) == [learned]


def test_block_sparse_step_logits_equal_split_step_logits(tiny_models):
    from fafo_cli.decoders.fafo.attention import BlockSparseMasks, CompressedView, flex_attention_kernel
    from fafo_cli.decoders.fafo.compressors import StreamCompressor
    from fafo_cli.decoders.fafo.window import LookaheadWindow
    from fafo_cli.runtime.rows import draft_step

    outputs = []
    for block in (False, True):
        engine = load(str(tiny_models["qwen2-bias"]), dtype="float32", chat_template=False)
        session, model = engine.session, engine.model
        session.cache.use_lead(128 if block else 0)
        prompt = engine.encode(LONG)
        session.prefill(prompt, reserve=64)
        compressor = StreamCompressor(budget=40, sink=4, tail_rows=16)
        compressor.rebuild(session.cache)
        window = LookaheadWindow(streams=3, ngram=3, prefix=2, seed_tokens=prompt)
        window.levels = [[11, 12], [13, 14, 15], [16, 17, 18]]
        view = CompressedView(session.cache, compressor, model.scaling,
                              block_masks=BlockSparseMasks.for_device(model.device) if block else None,
                              flex=flex_attention_kernel(model.device) if block else None)
        step = draft_step(prompt[-1], [5, 6, 7, 8, 9, 10], [-1, 0, 1, -1, 3, 4], model.device,
                          view_tokens=window.tokens(), view_rows=window.layout.rows, view=view)
        start = session.cache.length
        outputs.append(model.forward(torch.tensor(step.ids), start + step.layout.offsets, session.cache,
                                     view.attention(step.layout)))
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-4, rtol=1e-4)


def test_block_path_window_rows_list_only_the_compressed_view_blocks(tiny):
    """The block path's query layout puts verify rows and window rows in different query blocks, so the window
    rows' blocks list only the leading (C(kv)) key blocks and really skip the positions; verify rows' blocks list
    only position blocks."""
    from fafo_cli.decoders.fafo.attention import KV_BLOCK, Q_BLOCK, BlockSparseMasks, block_rows
    from fafo_cli.decoders.fafo.window import LookaheadWindow
    from fafo_cli.runtime.rows import draft_step

    window = LookaheadWindow(streams=3, ngram=3, prefix=2, seed_tokens=list(range(20)))
    window.levels = [[11, 12], [13, 14, 15], [16, 17, 18]]
    step = draft_step(1, [5, 6, 7], [-1, 0, 1], torch.device("cpu"), view_tokens=window.tokens(),
                      view_rows=window.layout.rows, view=object())
    layout = step.layout
    n_verify, n_window = layout.verify_rows, layout.rows - layout.verify_rows
    assert (n_verify, n_window) == (4, 8)
    assert block_rows(n_verify, n_window) == (Q_BLOCK, 2 * Q_BLOCK)
    lead, length = 2 * KV_BLOCK, 700
    mask = BlockSparseMasks(torch.device("cpu")).get(lead=lead, kv_length=lead + 1024, length=length, view_size=40,
                                                     layout=layout)
    counts, indices = mask.kv_num_blocks[0, 0].tolist(), mask.kv_indices[0, 0].tolist()
    verify_blocks, window_blocks = indices[0][:counts[0]], indices[1][:counts[1]]
    assert window_blocks == [0, 1]  # the leading region only
    assert min(verify_blocks) == lead // KV_BLOCK and max(verify_blocks) * KV_BLOCK < lead + length + 256


def test_block_masks_kept_are_bounded(monkeypatch):
    """A mask per length bucket and tree shape: a long chat's would pile up; the least recently used go."""
    from fafo_cli.decoders.fafo import attention
    from fafo_cli.runtime.rows import draft_step

    monkeypatch.setattr(attention, "MOST_MASKS", 2)
    masks = attention.BlockSparseMasks(torch.device("cpu"))
    layouts = [draft_step(1, [5] * n, list(range(-1, n - 1)), torch.device("cpu")).layout for n in (1, 2, 3)]
    for layout in [layouts[0], layouts[1], layouts[0], layouts[2]]:
        masks.get(lead=0, kv_length=512, length=100, view_size=0, layout=layout)
    assert [kept for _, kept in masks._masks.values()] == [layouts[0], layouts[2]]


@pytest.mark.parametrize("compressor", COMPRESSORS)
def test_the_copy_of_ckv_counts_in_draft_memory(tiny, compressor):
    engine = fafo_engine(tiny)
    result = engine.complete(LONG, max_tokens=40, compressor=compressor, **OPTIONS)
    model, cache = engine.model, engine.session.cache
    view = 2 * len(model.layers) * 96 * model.n_kv_heads * model.head_dim * cache.keys.element_size()  # B keys+values
    [conversation] = engine.session.carry.values()
    index = conversation.index.nbytes()  # the text's suffix index, counted as SuffixDecoding's is
    if compressor == "none":  # the window rows read the cache itself
        assert result.stats.draft_memory_mb * 1e6 == pytest.approx(index, rel=0.05)  # (before its last tokens)
    else:  # at least B positions' keys and values in every layer, and less than the whole cache beside it
        assert view <= result.stats.draft_memory_mb * 1e6 - 0.95 * index < cache.nbytes(), compressor
