"""The peer methods' parts against hand-made cases and brute-force references: TriForce's chunk scoring and
selection, its draft model's StreamingLLM eviction, prompt lookup's index, Cacheback's and SuffixDecoding's tree
drafting."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from fafo_cli.decoders.cacheback import Cacheback
from fafo_cli.decoders.prompt_lookup import PromptLookup
from fafo_cli.decoders.retrieval import chunk_scores, gather_positions, select_positions
from fafo_cli.decoders.suffix import History, Suffix


def test_chunk_scores_equal_a_brute_force_reference():
    torch.manual_seed(0)
    keys = torch.randn(37, 2, 8)  # 4 whole chunks of 8 and a partial one
    query = torch.randn(6, 8)  # 6 query heads: 3 per KV head
    scores = chunk_scores(keys, query, 8)
    assert scores.shape == (2, 4)
    for head in range(2):
        for chunk in range(4):
            mean = sum(keys[chunk * 8 + i, head] for i in range(8)) / 8
            expected = sum(float(query[head * 3 + g] @ mean) for g in range(3))
            assert abs(float(scores[head, chunk]) - expected) < 1e-4


def test_selection_keeps_first_chunk_top_chunks_and_the_tail():
    torch.manual_seed(1)
    keys = torch.randn(37, 2, 8)
    query = torch.randn(2, 8)  # one query head per KV head
    positions = select_positions(keys, query, chunk=8, budget=29)  # tail of 5 + 3 whole chunks
    scores = chunk_scores(keys, query, 8)
    for head in range(2):
        best = sorted(range(1, 4), key=lambda c: -float(scores[head, c]))[:2]  # chunk 0 is always kept
        expected = [p for c in sorted([0] + best) for p in range(c * 8, c * 8 + 8)] + list(range(32, 37))
        assert positions[head].tolist() == expected
    gathered = gather_positions(keys, positions)
    assert gathered.shape == (29, 2, 8)
    assert torch.equal(gathered[:, 1], keys[positions[1], 1])
    # within the budget: everything, in order
    assert select_positions(keys, query, chunk=8, budget=64).tolist() == [list(range(37))] * 2


def test_streaming_draft_model_keeps_sink_and_recent_positions_renumbered(tiny):
    from fafo_cli import load
    from fafo_cli.decoders.triforce import SINK, StreamingDraftModel
    from fafo_cli.runtime.model import causal_attention, prefix_causal_mask

    engine = load(str(tiny), dtype="float32", chat_template=False)
    draft = StreamingDraftModel(engine.model, size=24, target_vocab=engine.model.vocab_size)
    text = list(range(40, 140))
    draft.begin(text)
    length = draft.cache.length
    assert length <= 24 + 20 // 4 and draft.ids == text
    # Layer 0's keys depend only on the token and its position. StreamingLLM numbers positions within the
    # cache, so the kept slots must hold the sink tokens and the most recent ones at positions 0..length-1.
    kept = text[:SINK] + text[len(text) - (length - SINK):]
    fresh = engine.model.new_cache()
    ids = torch.tensor(kept)
    engine.model.forward(ids, torch.arange(length), fresh,
                         causal_attention(prefix_causal_mask(0, length, ids.device), engine.model.scaling))
    assert torch.allclose(draft.cache.keys[0, :length], fresh.keys[0, :length], atol=1e-4)
    # a round's tentative tokens are cut back, and the logits after the text are those it proposes from again
    logits = draft.logits
    draft.extend([7, 8, 9])
    draft.end()
    assert draft.cache.length == length and draft.ids == text and draft.logits is logits
    # a branch (a different text) starts over
    draft.begin([1, 2, 3])
    assert draft.ids == [1, 2, 3] and draft.cache.length == 3
    # a smaller vocabulary than the target's: its logits are padded, the missing ids never proposed
    small = StreamingDraftModel(engine.model, size=24, target_vocab=engine.model.vocab_size + 5)
    small.begin([1, 2, 3])
    assert small.logits.shape[-1] == engine.model.vocab_size + 5 and torch.isinf(small.logits[-5:]).all()


def test_prompt_lookup_copies_after_the_most_recent_earlier_occurrence():
    lookup = PromptLookup(longest=2, tokens=3)
    text = [1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3]
    # "2 3" occurred at 1-2 (followed by 4 9 2) and at 5-6 (followed by 5 6 7): the later one wins
    assert lookup.draft(text, room=10).tree.tokens == [5, 6, 7]
    assert lookup.draft(text, room=2).tree.tokens == [5, 6]  # never more than the room left
    # neither "3 8" nor "8" occurred before
    assert lookup.draft(text + [8], room=10).tree.tokens == []
    # the one-token fallback: "7 3" never occurred, "3" did (last at 6, followed by 5 6 7)
    assert PromptLookup(longest=2, tokens=3).draft(text[:10] + [3], room=10).tree.tokens == [5, 6, 7]


def _cacheback(**overrides):
    config = SimpleNamespace(cacheback_leader=1, cacheback_follower=2, cacheback_followers=4,
                             cacheback_leaders=100, cacheback_budget=8)
    for key, value in overrides.items():
        setattr(config, key, value)
    return Cacheback(config, frozen=None)


def test_cacheback_grows_the_tree_level_by_level_within_the_budget():
    drafter = _cacheback()
    # seeded with the prompt: after 1 came (2 3) and later (4 5); after 3 came (6 7); after 5 came (8 9)
    drafter.start(None, None, [1, 2, 3, 6, 7, 0, 1, 4, 5, 8, 9, 0, 1], None)
    tree = drafter.draft([0, 1], room=100).tree
    # level 1 (at most half of 8 = 4 tokens): (4 5) most recent first, then (2 3)
    # level 2 (half of the 4 left = 2): after 5 -> (8 9); level 3 (2 left): after 9 -> (0 1)
    assert [tree.tokens[i] for i in tree.path(len(tree) - 1)] == [4, 5, 8, 9, 0, 1]
    assert tree.tokens[:4] == [4, 5, 2, 3] and tree.parents[:4] == [-1, 0, -1, 2]
    assert len(tree) == 8
    assert len(drafter.draft([0, 1], room=3).tree) == 3  # the room left in the context bounds it too


def test_cacheback_merges_shared_prefixes_and_learns_accepted_text():
    drafter = _cacheback(cacheback_budget=8)
    drafter.start(None, None, [1, 2, 3, 1, 2, 4], None)
    tree = drafter.draft([1], room=100).tree
    assert tree.tokens[:3] == [2, 4, 3] and tree.parents[:3] == [-1, 0, 0]  # (2 4) and (2 3) share the 2
    drafter.accepted([1, 2, 3, 1, 2, 4, 9, 1, 7, 7], new=4)
    assert drafter.dynamic.lookup((1,))[0] == (7, 7)  # the newest text's follower comes first


def _suffix(history=None, **overrides):
    config = SimpleNamespace(suffix_depth=24, suffix_factor=1.0, suffix_min_prob=0.1, suffix_tokens=8)
    for key, value in overrides.items():
        setattr(config, key, value)
    history = history or History(keep=4, count_depth=32)
    return Suffix(config, history)


def _draft(drafter, text, room=100):
    drafter.text = type(drafter.text)(counts=True, count_depth=32)
    drafter.start(None, None, text, None)
    tree = drafter.draft(text, room).tree
    return tree.tokens, tree.parents


def test_suffix_grows_the_most_probable_tokens_first_within_alpha_times_the_match():
    # the text ends with "1 2", which occurred 3 times before: followed by 3, 3 and 4
    text = [1, 2, 3, 1, 2, 3, 1, 2, 4, 9, 1, 2]
    # 3 (2/3), then "1 2 3" -> 1 (2/3), "1 2 3 1" -> 2 (2/3); then the first 4 (1/3) before the deeper 3 and 4 (1/3)
    assert _draft(_suffix(suffix_factor=2.0), text) == ([3, 1, 2, 4], [-1, 0, 1, -1])
    assert _draft(_suffix(suffix_factor=1.0), text) == ([3, 1], [-1, 0])  # a match of 2: at most 2 tokens
    assert _draft(_suffix(suffix_factor=2.0, suffix_min_prob=0.5), text) == ([3, 1, 2], [-1, 0, 1])
    assert _draft(_suffix(suffix_factor=2.0, suffix_tokens=2), text) == ([3, 1], [-1, 0])
    assert _draft(_suffix(suffix_factor=2.0), text, room=1) == ([3], [-1])  # the room left in the context
    assert _draft(_suffix(), text + [7]) == ([], [])  # 7 never occurred before


def test_suffix_drafts_from_earlier_answers_merged_with_the_text_and_never_across_two_answers():
    history = History(keep=4, count_depth=32)
    history.add([5, 6, 7])
    history.add([6, 7, 8])
    # "6 7" is in both answers: at the end of the first (nothing follows), then followed by 8: 8 at 1/2
    assert _draft(_suffix(history), [0, 6, 7]) == ([8], [-1])
    # "7 6" never occurred (the first answer's end and the second's start are not one text), "6" did: then 7, twice
    assert _draft(_suffix(history), [0, 7, 6]) == ([7], [-1])
    # the text's own "6 7 -> 8 0" and the answers' "6 7 -> 8" share the row of 8
    assert _draft(_suffix(history), [6, 7, 8, 0, 6, 7]) == ([8, 0], [-1, 0])
    drafter = _suffix(history)
    drafter.history = None  # a request that reads only its own text
    assert _draft(drafter, [0, 6, 7]) == ([], [])


def test_suffix_history_keeps_the_last_answers():
    history = History(keep=2, count_depth=32)
    for answer in ([1, 1], [2, 2], [3, 3], [4, 4]):
        history.add(answer)
    assert history.index.find([1])[1] == 1 and len(history.answers) == 4  # up to twice `keep`
    history.add([5, 5])  # past it: rebuilt over the last two
    assert [history.index.find([t])[1] for t in (1, 2, 3, 4, 5)] == [0, 0, 0, 1, 1]
    history.configure(keep=0, count_depth=32)
    assert not history.answers and history.index.find([5])[1] == 0
    history.add([6])
    assert not history.answers


def test_suffix_history_rebuilds_over_no_more_answers_than_its_index_keeps(monkeypatch):
    from fafo_cli.decoders import suffix

    monkeypatch.setattr(suffix, "HISTORY_TOKENS", 8)
    history = History(keep=2, count_depth=32)
    for answer in ([1, 1, 1], [2, 2, 2], [3, 3, 3], [4, 4, 4], [5] * 9):
        history.add(answer)
    assert list(history.answers) == [[5] * 9]  # the newest alone is beyond 8 tokens: kept, the others not
    assert [history.index.find([t])[1] for t in (4, 5)] == [0, 1]
    history.add([6, 6])
    index = history.index
    history.configure(keep=2, count_depth=16)  # shallower counts: the deeper index serves them (requests that take
    assert history.index is index and history.count_depth == 32  # turns rebuilt it each time)
    history.configure(keep=2, count_depth=64)  # rebuilt for deeper counts: 3 + 10 tokens are beyond 8
    assert list(history.answers) == [[6, 6]] and history.count_depth == 64
    assert history.index.likeliest(*history.index.match_state(4), limit=0, min_prob=0.0) == []


def test_suffix_history_holds_a_bounded_number_of_tokens_whatever_the_answers(monkeypatch):
    from fafo_cli.decoders import suffix

    monkeypatch.setattr(suffix, "HISTORY_TOKENS", 8)
    history = History(keep=256, count_depth=32)  # (far more answers kept than 8 tokens hold)
    for answer in range(20):
        history.add([answer] * 5)
        assert history.tokens == sum(len(kept) + 1 for kept in history.answers) <= 2 * 8
    assert list(history.answers) == [[18] * 5, [19] * 5] and history.nbytes() > history.index.nbytes()


def test_lookahead_keeps_its_own_pool_whatever_fafo_s_pool_per_key(tiny, monkeypatch):
    """FAFO's `pool_per_key` (a config file's, say) never reaches lookahead's pool: a peer's row of the bench stays
    the method it names."""
    from fafo_cli import load
    from fafo_cli.decoders import lookahead
    from fafo_cli.decoders.fafo import step

    made, pool = [], step.NgramPool
    monkeypatch.setattr(step, "NgramPool", lambda *args: made.append(args) or pool(*args))
    engine = load(str(tiny), dtype="float32", chat_template=False, pool_per_key=1)
    engine.complete("the cat sat on the mat, the cat sat on the", max_tokens=6, method="lookahead")
    assert made and all(args[2] == lookahead.POOL_PER_KEY != 1 for args in made)
