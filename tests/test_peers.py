"""The peer methods are lossless: float32 token ids identical to transformers' greedy generate, across
architectures and prompts shorter and longer than each method's budget; chat turns, limits, sampling
reproducibility and the draft model's checks; their statistics."""

from __future__ import annotations

from functools import lru_cache

import pytest

from fafo_cli import load
from fafo_cli.cli import entrypoint

from .conftest import LONG, PEERS, SHORT, TOKENS, VARIANTS, build_tiny_model, hf_greedy

# eager steps attend with torch's kernel, as a safetensors model's do (ours: test_fafo.py)
pytestmark = [pytest.mark.device, pytest.mark.usefixtures("torch_attention")]  # run on --device (tests/conftest.py)

DRAFTED_BY_MODEL = {"triforce", "quantspec"}
COPY = "Repeat exactly: The quick brown fox jumps over the lazy dog, and the dog sleeps on by the river bank."


@lru_cache(maxsize=None)
def engine_for(folder, draft=None):
    return load(str(folder), dtype="float32", chat_template=False, method="triforce" if draft else "vanilla",
                draft_model=str(draft) if draft else None)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("peer", list(PEERS))
def test_peer_matches_transformers_greedy(tiny_models, variant, peer):
    engine = engine_for(tiny_models[variant])
    accepted = 0
    for prompt in (SHORT, LONG):
        ids = engine.encode(prompt)
        result = engine.complete(prompt, max_tokens=TOKENS, **PEERS[peer])
        assert result.token_ids == hf_greedy(tiny_models[variant], ids, TOKENS), (variant, peer, len(ids))
        stats = result.stats
        assert stats.generated_tokens == TOKENS and stats.accepted_tokens == TOKENS - stats.steps
        assert (stats.draft_passes is not None) == (PEERS[peer]["method"] in DRAFTED_BY_MODEL)
        accepted += stats.accepted_tokens
    assert accepted > 0  # guesses were accepted and their keys and values committed


@pytest.mark.parametrize("peer", sorted(DRAFTED_BY_MODEL))
def test_a_self_draft_drafts_no_token_past_the_answer_s_end(tiny, peer):
    """A draft model's pass for a guess past max_tokens would be thrown away: none runs (two tokens: the prefill's
    and one step's, which has no room for a guess; QuantSpec's passes, one a guess, are all verified)."""
    engine = engine_for(tiny)
    ids = engine.encode(SHORT)
    for tokens in (2, 5, 9):
        result = engine.complete(SHORT, max_tokens=tokens, **PEERS[peer])
        assert result.token_ids == hf_greedy(tiny, ids, tokens)
        stats = result.stats
        assert stats.draft_passes == stats.drafted_tokens == 0 if tokens == 2 else stats.drafted_tokens > 0
        assert peer != "quantspec" or stats.draft_passes == stats.drafted_tokens


@pytest.fixture(scope="module")
def draft_models(tmp_path_factory):
    """A draft model sharing the tiny models' tokenizer (the tests also use each target as its own draft)."""
    root = tmp_path_factory.mktemp("drafts")
    return {"other": build_tiny_model(root / "other", "llama-mha", seed=7, num_hidden_layers=1)}


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias", "mistral"])
@pytest.mark.parametrize("draft", ["other", "same"])
def test_triforce_with_a_draft_model_matches_transformers(tiny_models, draft_models, variant, draft):
    target = tiny_models[variant]
    engine = engine_for(target, draft_models["other"] if draft == "other" else target)
    for prompt in (SHORT, LONG):
        ids = engine.encode(prompt)
        budget = 64 if prompt is LONG else 320  # SHORT: its answer fits in the retrieval cache too
        result = engine.complete(prompt, max_tokens=TOKENS, method="triforce", triforce_budget=budget,
                                 triforce_gamma1=3, triforce_gamma2=5, triforce_draft_cache=48)
        assert result.token_ids == hf_greedy(target, ids, TOKENS), (variant, draft, len(ids))
        # every middle-level check is one pass; the draft model adds its own
        assert result.stats.draft_passes > result.stats.steps
        if prompt is SHORT:  # within its budget the middle level reads the whole cache: it agrees with the top
            assert result.stats.tokens_per_step > 4


@pytest.mark.slow
@pytest.mark.parametrize("peer", ["lookahead", "prompt-lookup", "cacheback", "suffix", "triforce", "quantspec"])
def test_peer_matches_transformers_on_smollm2(smollm2, peer):
    engine = engine_for(smollm2)
    prompts = [
        "Write a short poem about the ocean.",  # chat: shorter than every budget
        "Rewrite the following text, fixing any typos, and keep everything else identical:\n\n"
        + ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
           "How vexingly quick daft zebras jump! The five boxing wizards jump quickly. ") * 6,  # ~290 tokens
    ]
    settings = dict(method=peer, triforce_budget=128, quantspec_group=64, chat_template=True)
    tokens = TOKENS // 2  # past every budget with the copy-heavy prompt; the tiny models' tests run TOKENS
    for prompt in prompts:
        ids = engine.encode(prompt, engine.request_config(chat_template=True))
        result = engine.complete(prompt, max_tokens=tokens, **settings)
        assert result.token_ids == hf_greedy(smollm2, ids, tokens), (peer, len(ids))
    # the copy-heavy prompt is copied in accepted runs (lookahead's pool holds only its window's guesses)
    assert result.stats.tokens_per_step > (1.2 if peer == "lookahead" else 1.5)


@pytest.mark.parametrize("peer", list(PEERS))
def test_peer_chat_turns_equal_generate_on_each_turns_history(tiny, peer):
    engine = load(str(tiny), dtype="float32", **PEERS[peer])
    messages = [{"role": "system", "content": "You are terse."}]
    for turn in ("Name a fruit. " * 4, "Another one?", "Why that one? " * 3):
        messages.append({"role": "user", "content": turn})
        result = engine.complete(messages, max_tokens=50)
        assert result.token_ids == hf_greedy(tiny, engine.encode(messages), 50), (peer, len(messages))
        messages.append({"role": "assistant", "content": result.text})
    assert result.stats.cached_prompt_tokens > 0.5 * result.stats.prompt_tokens


@pytest.mark.parametrize("budget", [128, 1_000_000])  # rebuilds keep more than the first allocation; beyond any context
def test_triforce_retrieval_cache_grows_as_it_fills(tiny, monkeypatch, budget):
    from fafo_cli.decoders import triforce

    monkeypatch.setattr(triforce, "RETRIEVAL_SLOTS", 16)  # far less than a rebuild keeps
    engine = load(str(tiny), dtype="float32", chat_template=False)
    ids = engine.encode(LONG)
    result = engine.complete(LONG, max_tokens=TOKENS, method="triforce", triforce_budget=budget)
    assert result.token_ids == hf_greedy(tiny, ids, TOKENS)
    assert result.stats.draft_memory_mb < 8  # the cache the budget asks for was never allocated whole


def test_triforce_draft_model_follows_the_chat(tiny, draft_models):
    engine = load(str(tiny), dtype="float32", method="triforce", draft_model=str(draft_models["other"]),
                  triforce_budget=32, triforce_recent=8, triforce_draft_cache=24)
    messages = []
    for turn in ("Name a fruit. " * 4, "Another one?", "Why that one? " * 3):
        messages.append({"role": "user", "content": turn})
        result = engine.complete(messages, max_tokens=40)
        assert result.token_ids == hf_greedy(tiny, engine.encode(messages), 40)
        messages.append({"role": "assistant", "content": result.text})


@pytest.mark.parametrize("peer", list(PEERS))
def test_peer_limits_cut_inside_accepted_runs(tiny, peer):
    """A token limit that falls inside a step's accepted run cuts the step there: transformers' tokens, that many."""
    from .test_fafo import _inside_runs

    engine = load(str(tiny), dtype="float32", chat_template=False, **PEERS[peer])
    prompt = "abc abc abc abc abc abc abc abc"  # (the tiny model's answer to it repeats: every peer guesses runs)
    full = hf_greedy(tiny, engine.encode(prompt), 120)
    inside = _inside_runs(list(engine.stream(prompt, max_tokens=120)))
    assert inside, "no step accepted two guesses or more: no limit falls inside a run"
    for limit in (1, 2, 7, 50, inside[0] + 1, inside[len(inside) // 2] + 1):  # (a limit of n ends at position n - 1)
        limited = engine.complete(prompt, max_tokens=limit)
        assert limited.token_ids == full[:limit] and limited.finish_reason == "length", limit


@pytest.mark.parametrize("method", ["fafo", "prompt-lookup", "suffix"])
def test_a_stop_inside_an_accepted_run_ends_the_answer_as_plain_decoding_would(smollm2, method):
    """A stop string completed by a guess in the middle of a step's accepted run: the tokens after it are no part
    of the answer, of its statistics, or of what the session keeps for the next turn (as after plain decoding)."""
    # (SuffixDecoding without its tree of earlier answers: the second answer then drafts as the first did)
    engine = load(str(smollm2), dtype="float32", method=method, suffix_outputs=0)
    steps = list(engine.stream(COPY, max_tokens=120))
    tokens = [t for step in steps for t in step.token_ids]
    step_at = next(i for i, step in enumerate(steps) if i > 0 and step.accepted >= 3)
    cut = sum(len(step.token_ids) for step in steps[:step_at]) + 2  # the step's second guess completes the stop
    decode = engine.tokenizer.decode
    text = decode(tokens[:cut])
    stop = next(text[-m:] for m in range(1, len(text)) if text.find(text[-m:]) == len(text) - m
                and decode(tokens[:cut - 1]).find(text[-m:]) < 0)
    result = engine.complete(COPY, max_tokens=120, stop=[stop])
    assert result.finish_reason == "stop" and result.token_ids == tokens[:cut]
    assert result.stats.accepted_tokens == sum(step.accepted for step in steps[:step_at]) + 2
    kept = list(engine.session.ids)
    plain = engine.complete(COPY, max_tokens=120, stop=[stop], method="vanilla")
    assert plain.token_ids == result.token_ids and kept == list(engine.session.ids)


@pytest.mark.parametrize("method", ["fafo", "prompt-lookup", "suffix"])
def test_no_step_guesses_past_the_answers_limit(tiny, method, monkeypatch):
    from fafo_cli.decoders import speculative
    from fafo_cli.decoders.fafo import step as fafo_step

    depths = []  # each step's longest path of guesses

    def recording(draft_step):
        def recorded(anchor, tokens, parents, *args, **kwargs):
            depth = {-1: 0}
            for node, parent in enumerate(parents):
                depth[node] = depth[parent] + 1
            depths.append(max(depth.values()))
            return draft_step(anchor, tokens, parents, *args, **kwargs)
        return recorded

    for module in (speculative, fafo_step):
        monkeypatch.setattr(module, "draft_step", recording(module.draft_step))
    engine = load(str(tiny), dtype="float32", chat_template=False, method=method)
    for limit in (2, 9, 40):
        depths.clear()
        steps = list(engine.stream(LONG, max_tokens=limit))
        emitted = [sum(len(step.token_ids) for step in steps[:i]) for i in range(1, len(steps))]
        assert len(depths) == len(emitted) and sum(map(len, (s.token_ids for s in steps))) == limit
        assert all(depth <= limit - before - 1 for depth, before in zip(depths, emitted)), (depths, emitted)


def test_the_prefill_time_leaves_out_the_drafters_set_up(tiny, monkeypatch):
    import time

    from fafo_cli.decoders.suffix import Suffix

    start = Suffix.start
    monkeypatch.setattr(Suffix, "start", lambda *args: (time.sleep(0.5), start(*args))[1])
    stats = load(str(tiny), dtype="float32", chat_template=False, method="suffix").complete(LONG, max_tokens=4).stats
    assert stats.ttft_s - stats.prefill_s >= 0.5  # the set-up's half second after the prefill, not in it
    # FAFO's compressor selects its view after the prefill too (it was counted in the prefill's speed)
    from fafo_cli.decoders.fafo.compressors import StreamCompressor

    rebuild = StreamCompressor.rebuild
    monkeypatch.setattr(StreamCompressor, "rebuild", lambda *args: (time.sleep(0.5), rebuild(*args))[1])
    engine = load(str(tiny), dtype="float32", chat_template=False, method="fafo", compressor="stream", streams=2)
    stats = engine.complete(LONG, max_tokens=4).stats
    assert stats.ttft_s - stats.prefill_s >= 0.5  # the set-up's half second after the prefill, not in it


@pytest.mark.parametrize("settings", [dict(method="vanilla"), *PEERS.values()] + [
    dict(method="fafo", compressor=name, budget=80, streams=2) for name in ("none", "stream", "quest", "snapkv",
                                                                              "h2o")])
def test_the_cache_grows_as_the_answer_does(tiny, monkeypatch, settings):
    """Only part of an answer's cache is reserved at its start; growing it under a running decoder (compressed
    views, retrieval caches, drafts) changes nothing."""
    from fafo_cli.runtime import session

    monkeypatch.setattr(session, "RESERVE_AHEAD", 3)
    engine = load(str(tiny), dtype="float32", chat_template=False)
    reserved = []
    grow = type(engine.session.cache).reserve
    monkeypatch.setattr(type(engine.session.cache), "reserve",
                        lambda cache, slots: (reserved.append(cache.capacity), grow(cache, slots))[1])
    result = engine.complete(LONG, max_tokens=TOKENS, **settings)
    assert result.token_ids == hf_greedy(tiny, engine.encode(LONG), TOKENS)
    assert min(reserved) < len(engine.encode(LONG)) + TOKENS // 2 < max(reserved)


@pytest.mark.parametrize("peer", list(PEERS))
def test_peer_context_end(tmp_path, peer):
    folder = build_tiny_model(tmp_path / "m", "llama-gqa", max_positions=96)
    engine = load(str(folder), dtype="float32", chat_template=False, **PEERS[peer])
    ids = engine.encode("abc abc abc abc abc")
    result = engine.complete("abc abc abc abc abc", max_tokens=500)
    assert result.finish_reason == "context" and len(ids) + len(result.token_ids) == 96
    assert result.token_ids == hf_greedy(folder, ids, 96 - len(ids))


@pytest.mark.parametrize("peer", list(PEERS))
def test_peer_sampling_is_reproducible(tiny, peer):
    """The same seed, the same sample; a method that verifies one-hot guesses samples plain decoding's very tokens.
    A self-draft samples the same distribution (tests/test_sampling.py), with tokens of its own."""
    engine = load(str(tiny), dtype="float32", chat_template=False, **PEERS[peer])
    # (a 2-token leader seldom recurs in a random model's text sampled at 0.8: cooler, it does, and is drafted)
    settings = dict(max_tokens=100, temperature=0.3 if peer == "cacheback-ll2" else 0.8, top_p=0.95)
    a = engine.complete(LONG, seed=3, **settings)
    b = engine.complete(LONG, seed=3, **settings)
    c = engine.complete(LONG, seed=4, **settings)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids
    assert a.stats.drafted_tokens > 0  # its guesses were verified (one-hot ones would otherwise match trivially)
    plain = engine.complete(LONG, seed=3, method="vanilla", **settings)
    assert (a.token_ids == plain.token_ids) == (PEERS[peer]["method"] not in DRAFTED_BY_MODEL)


@pytest.mark.parametrize("method", ["suffix", "fafo", "cacheback"])
def test_a_later_chat_turn_samples_plain_samplings_tokens(tiny, method):
    """What a method carries from turn to turn (SuffixDecoding's earlier answers, FAFO's pool and index, Cacheback's
    table) changes its guesses only: a sampled second turn is plain sampling's with that seed, as a first is."""
    engine, plain = load(str(tiny), dtype="float32", method=method), load(str(tiny), dtype="float32")
    settings = dict(max_tokens=60, temperature=0.8, top_p=0.95)
    messages = [{"role": "user", "content": COPY}]
    first = engine.complete(messages, seed=5, **settings)
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": COPY + " Again."}]
    second = engine.complete(messages, seed=6, **settings)
    assert second.stats.drafted_tokens > 0 and second.stats.cached_prompt_tokens > 0  # a turn that follows on
    assert second.token_ids == plain.complete(messages, seed=6, method="vanilla", **settings).token_ids


def test_second_caches_are_reported(tiny, draft_models):
    quantspec = engine_for(tiny).complete(LONG, max_tokens=64, **PEERS["quantspec"]).stats
    triforce = engine_for(tiny).complete(LONG, max_tokens=64, **PEERS["triforce"]).stats
    with_draft = engine_for(tiny, draft_models["other"]).complete(LONG, max_tokens=64, **PEERS["triforce"]).stats
    assert 0 < quantspec.draft_memory_mb and 0 < triforce.draft_memory_mb < with_draft.draft_memory_mb
    assert engine_for(tiny).complete(LONG, max_tokens=8, **PEERS["prompt-lookup"]).stats.draft_memory_mb == 0
    # Lookahead drafts nothing from the text, and indexes none of it
    assert engine_for(tiny).complete(LONG, max_tokens=8, **PEERS["lookahead"]).stats.draft_memory_mb == 0


def test_draft_model_must_share_the_tokenizer(tmp_path, tiny, capsys):
    from .conftest import build_tokenizer

    other = build_tiny_model(tmp_path / "other", "llama-gqa")
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(other)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hello")
    code = entrypoint(["run", str(tiny), "-p", str(prompt), "--method", "triforce", "--draft-model", str(other)])
    err = capsys.readouterr().err
    assert code == 1 and err.strip().count("\n") == 0
    assert "does not share the tokenizer" in err
    code = entrypoint(["run", str(tiny), "-p", str(prompt), "--method", "fafo", "--draft-model", str(tiny)])
    assert code == 1 and "'draft_model' is a setting of method triforce" in capsys.readouterr().err


def test_cacheback_frozen_table_built_by_the_cli_is_used(tmp_path, tiny, capsys):
    engine = load(str(tiny), dtype="float32", chat_template=False, method="cacheback")
    expected = engine.complete(SHORT, max_tokens=120)
    # a corpus holding the answer: a frozen table built from it drafts the answer, the dynamic one cannot
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(expected.text, encoding="utf-8")
    table = tmp_path / "table.bin"
    code = entrypoint(["cacheback", "build-table", str(corpus), "--out", str(table), "--model", str(tiny)])
    assert code == 0 and table.exists() and "leaders" in capsys.readouterr().out
    with_table = engine.complete(SHORT, max_tokens=120, cacheback_table=str(table))
    assert with_table.token_ids == expected.token_ids == hf_greedy(tiny, engine.encode(SHORT), 120)
    assert with_table.stats.accepted_tokens > expected.stats.accepted_tokens + 20


def test_cacheback_table_from_another_tokenizer_is_refused(tmp_path, tiny, capsys, monkeypatch):
    from fafo_cli.decoders.ngram_table import build_table

    build_table([[1, 2, 3, 4]], 1, 3, 4).save(tmp_path / "table.bin", "0123456789abcdef")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hello")
    code = entrypoint(["run", str(tiny), "-p", str(prompt), "--method", "cacheback", "--cacheback-table",
                       str(tmp_path / "table.bin")])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "different tokenizer" in err
    from fafo_cli import api

    monkeypatch.setattr(api.Engine, "from_config", lambda *a, **k: pytest.fail("loaded the model first"))
    code = entrypoint(["run", str(tiny), "-p", str(prompt), "--method", "cacheback", "--cacheback-table",
                       str(tmp_path / "missing.bin")])
    assert code == 1 and "cacheback table not found" in capsys.readouterr().err


def test_suffix_drafts_from_earlier_answers_until_reset(tiny):
    engine = load(str(tiny), dtype="float32", chat_template=False, **PEERS["suffix"])
    first = engine.complete(SHORT, max_tokens=64)
    again = engine.complete(SHORT, max_tokens=64)  # the first answer is in the session's history now
    assert again.token_ids == first.token_ids == hf_greedy(tiny, engine.encode(SHORT), 64)
    assert again.stats.steps < first.stats.steps
    assert engine.complete(SHORT, max_tokens=64, suffix_outputs=0).stats.steps == first.stats.steps  # not read
    assert engine.complete(SHORT, max_tokens=64).stats.steps < first.stats.steps  # nor forgotten
    engine.reset()  # forgets the history too
    assert engine.complete(SHORT, max_tokens=64).stats.steps == first.stats.steps


def test_triforce_retrieval_cache_stays_its_size_and_is_rebuilt(tiny, monkeypatch):
    from fafo_cli.decoders import triforce

    made = []

    class Recorded(triforce.TriForce):
        def __init__(self, *args):
            super().__init__(*args)
            made.append(self)

    monkeypatch.setattr(triforce, "TriForce", Recorded)
    engine = load(str(tiny), dtype="float32", chat_template=False)
    settings = dict(PEERS["triforce"], triforce_recent=16)  # budget 64: 40 chosen, 8 recent, room for 8 new tokens
    ids = engine.encode(LONG)
    memory = []
    for tokens in (40, 400):
        result = engine.complete(LONG, max_tokens=tokens, **settings)
        assert result.token_ids == hf_greedy(tiny, ids, tokens)
        memory.append(result.stats.draft_memory_mb)
        drafter = made[-1]
        # the budget and a round's rows (γ2 + γ1 + 1), never more
        assert drafter.retrieval.length <= 64 and drafter.retrieval.capacity == 64 + 4 + 2 + 1
    assert memory[0] == memory[1]  # bounded: ten times the answer, the same memory
    engine.complete("Hi there", max_tokens=4, **settings)  # a prompt shorter than the budget: what it holds
    assert made[-1].retrieval.capacity <= len(engine.encode("Hi there")) + 4 + 8 + 7 < 64 + 7
    assert drafter.rebuilds >= 400 // 8  # every 8 accepted tokens at least (after the prefill's first)
    # acceptance halving since the last rebuild rebuilds before the room is full; holding up does not
    for accepted, rebuilt in ((1, True), (7, False)):
        drafter.synced = drafter.rebuilt_at = drafter.main.length
        drafter.before, drafter.period, drafter.rounds = 0.9, [8, accepted], drafter.MIN_ROUNDS
        before = drafter.rebuilds
        drafter.accepted([], 1)  # a round that emitted only the model's own token
        assert drafter.rebuilds == before + rebuilt, accepted
