"""FAFO is lossless: float32 token ids identical to transformers' greedy generate, across architectures,
settings (edge ones included) and prompts shorter and longer than the compressed budget."""

from __future__ import annotations

from functools import lru_cache

import pytest

from fafo_cli import load

from .conftest import LONG, SHORT, TOKENS, VARIANTS, hf_greedy

# eager steps attend with our kernel, as the embedded default's do (torch's: test_fafo_over_torchs_attention_...)
pytestmark = [pytest.mark.device, pytest.mark.usefixtures("our_attention")]  # run on --device (tests/conftest.py)

SETTINGS = {
    "default": dict(streams=2, ngram=4, guesses=2, prefix=2, budget=64, sink=4),
    "none": dict(streams=3, ngram=3, guesses=3, prefix=2, compressor="none"),
    "no-guesses": dict(streams=2, ngram=4, guesses=0, copies=0, prefix=2, budget=64, sink=4),
    # the paper's step: every step verifies the window's guesses and runs the window
    "window-guesses-only": dict(streams=2, ngram=4, guesses=2, copies=0, planner=False, budget=64, sink=4),
    "no-window": dict(streams=0, ngram=3, guesses=2, copies=3, planner=False, budget=64),
    "long-drafts": dict(streams=1, ngram=3, guesses=1, copies=4, draft_tokens=64, budget=64),
    "one-stream": dict(streams=1, ngram=5, guesses=2, prefix=1, budget=64, sink=0),
    "budget-covers-all": dict(streams=2, ngram=3, guesses=2, prefix=3, budget=4096, sink=4),
    "wide": dict(streams=5, ngram=6, guesses=5, prefix=3, pool_per_key=2, budget=16, sink=2, draft_tokens=4),
}
# Every architecture with the default setting, every setting on one architecture: the settings exercise the step's
# layout, which does not depend on the architecture.
CASES = [("default", variant) for variant in VARIANTS] + [(setting, "llama-gqa") for setting in SETTINGS
                                                          if setting != "default"]


@lru_cache(maxsize=None)
def engine_for(folder):
    return load(str(folder), dtype="float32", chat_template=False, method="fafo")


@pytest.mark.parametrize("setting,variant", CASES)
def test_fafo_matches_transformers_greedy(tiny_models, variant, setting):
    engine = engine_for(tiny_models[variant])
    accepted = from_window = 0
    for prompt in (SHORT, LONG):
        ids = engine.encode(prompt)
        result = engine.complete(prompt, max_tokens=TOKENS, **SETTINGS[setting])
        assert result.token_ids == hf_greedy(tiny_models[variant], ids, TOKENS), (variant, setting, len(ids))
        stats = result.stats
        assert stats.generated_tokens == TOKENS and stats.steps <= TOKENS
        assert stats.accepted_tokens == TOKENS - stats.steps  # every token beyond one per step was a guess
        accepted += stats.accepted_tokens
        from_window += stats.accepted_from["window"]
        nothing_verified = SETTINGS[setting]["guesses"] == SETTINGS[setting].get("copies", 2) == 0
        if nothing_verified:
            assert stats.drafted_tokens == 0  # the window only feeds the pool
        if SETTINGS[setting]["streams"]:
            # what the last window's fumble rows saw: the whole cache, or the budget once the context exceeds it
            budget = SETTINGS[setting].get("budget", 10**9)
            assert (len(ids) + TOKENS // 2 < stats.fumble_positions < len(ids) + TOKENS
                    or stats.fumble_positions == budget)
        else:
            assert stats.fumble_positions is None and stats.accepted_from["window"] == 0
        assert sum(stats.accepted_from.values()) == stats.accepted_tokens
        assert max(stats.step_rows) <= 1 + SETTINGS[setting].get("draft_tokens", 16) + max(
            0, SETTINGS[setting]["streams"] * SETTINGS[setting]["ngram"] - 1)
    assert accepted > 0 or nothing_verified  # guesses were accepted and committed
    if SETTINGS[setting].get("copies", 2) == 0 and SETTINGS[setting]["guesses"]:
        assert from_window > 0  # the window's own guesses, not the text's copies


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["default", "none"])
def test_fafo_matches_transformers_on_smollm2(smollm2, setting):
    engine = load(str(smollm2), dtype="float32", method="fafo")
    prompts = [
        "Write a short poem about the ocean.",  # chat, shorter than the budget
        "Rewrite the following text, fixing any typos, and keep everything else identical:\n\n"
        + ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
           "How vexingly quick daft zebras jump! The five boxing wizards jump quickly. ") * 6,
    ]
    settings = dict(SETTINGS[setting], budget=128) if setting == "default" else SETTINGS[setting]
    for prompt in prompts:
        ids = engine.encode(prompt)
        result = engine.complete(prompt, max_tokens=TOKENS, **settings)
        assert result.token_ids == hf_greedy(smollm2, ids, TOKENS), (setting, len(ids))
    assert result.stats.tokens_per_step > 1.5  # the copy-heavy prompt is copied in large accepted runs


def _inside_runs(steps) -> list[int]:
    """Positions of the answer whose token is neither the first nor the last of its step."""
    positions, start = [], 0
    for step in steps:
        positions += range(start + 1, start + len(step.token_ids) - 1)
        start += len(step.token_ids)
    return positions


def test_stop_token_inside_an_accepted_run(tiny):
    """A stop token, or the token limit, that falls inside a step's accepted run cuts the step there."""
    # the window runs every step (no planner): the steps are the same on every machine; its guesses alone (no
    # copies of the text, whose tokens were all emitted before) can hold a token the answer has not had yet
    engine = load(str(tiny), dtype="float32", chat_template=False, method="fafo", compressor="stream", budget=64,
                  planner=False, copies=0, streams=3, ngram=4)
    full = engine.complete(SHORT, max_tokens=120)
    steps = list(engine.stream(SHORT, max_tokens=120))
    assert [token for step in steps for token in step.token_ids] == full.token_ids
    inside = _inside_runs(steps)
    first = next((i for i in inside if full.token_ids.index(full.token_ids[i]) == i), None)
    assert first is not None, "no token is first emitted inside a step's run here: pick other settings"
    engine.stop_ids = frozenset({full.token_ids[first]})
    result = engine.complete(SHORT, max_tokens=120)
    assert result.token_ids == full.token_ids[:first + 1] and result.finish_reason == "stop"
    engine.stop_ids = frozenset()
    for limit in (1, 2, inside[0] + 1, inside[-1] + 1, 50):  # the token limit cuts inside accepted runs too
        limited = engine.complete(SHORT, max_tokens=limit)
        assert limited.token_ids == full.token_ids[:limit] and limited.finish_reason == "length"


def test_context_end_falls_back_to_plain_steps(tmp_path):
    from .conftest import build_tiny_model

    folder = build_tiny_model(tmp_path / "m", "llama-gqa", max_positions=96)
    engine = load(str(folder), dtype="float32", chat_template=False, method="fafo", streams=3, ngram=5,
                  guesses=3, budget=32)
    ids = engine.encode("abc abc abc abc abc")
    result = engine.complete("abc abc abc abc abc", max_tokens=500)
    assert result.finish_reason == "context" and len(ids) + len(result.token_ids) == 96
    assert result.token_ids == hf_greedy(folder, ids, 96 - len(ids))


def test_fafo_chat_turns_reuse_the_cache(tiny):
    engine = load(str(tiny), dtype="float32", method="fafo", compressor="stream", budget=32)
    messages = [{"role": "user", "content": "hello " * 20}]
    first = engine.complete(messages, max_tokens=60)
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "again"}]
    second = engine.complete(messages, max_tokens=60)
    assert second.stats.cached_prompt_tokens > 0
    assert second.token_ids == hf_greedy(tiny, engine.encode(messages), 60)


@pytest.mark.parametrize("planner", [False, pytest.param(True, marks=pytest.mark.step_times)])
def test_fafo_sampling_is_plain_samplings_tokens(tiny, planner):
    """Sampled FAFO emits the very tokens plain sampling emits with the same seed, whatever it guessed: with the
    planner on, its guesses depend on measured step times, its output must not."""
    engine = load(str(tiny), dtype="float32", chat_template=False, method="fafo", compressor="stream", budget=64,
                  planner=planner)
    settings = dict(max_tokens=120, temperature=0.8, top_p=0.95, min_p=0.02)
    a = engine.complete(LONG, seed=3, **settings)
    c = engine.complete(LONG, seed=4, **settings)
    assert a.token_ids == engine.complete(LONG, seed=3, method="vanilla", **settings).token_ids
    assert c.token_ids == engine.complete(LONG, seed=4, method="vanilla", **settings).token_ids != a.token_ids
    assert a.stats.drafted_tokens > 0  # guesses were verified (on a random model, sampled, the planner's mostly fail)
    if not planner:  # the window runs every step: some guesses are accepted
        assert a.stats.accepted_tokens > 0 and a.stats.steps < 120


def test_pool_follows_the_conversation_and_reset_clears_it(tiny, monkeypatch):
    from fafo_cli.decoders.fafo.pool import NgramPool

    engine = load(str(tiny), dtype="float32", method="fafo", compressor="stream", budget=32, planner=False)  # the window runs every step
    messages = [{"role": "user", "content": "tell me about cats " * 6}]
    first = engine.complete(messages, max_tokens=40)
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "more"}]
    second = engine.complete(messages, max_tokens=40)
    assert second.stats.pool_ngrams > first.stats.pool_ngrams  # the first turn's n-grams are still there
    assert second.token_ids == hf_greedy(tiny, engine.encode(messages), 40)
    with monkeypatch.context() as patched:  # a turn without the window offers none of the pool's n-grams
        patched.setattr(NgramPool, "lookup", lambda *_: pytest.fail("the pool was read without a window"))
        turn = messages + [{"role": "assistant", "content": second.text}, {"role": "user", "content": "dogs?"}]
        assert engine.complete(turn, max_tokens=20, streams=0).token_ids == hf_greedy(tiny, engine.encode(turn), 20)
    engine.reset()
    fresh = engine.complete([{"role": "user", "content": "more"}], max_tokens=40)
    assert fresh.stats.pool_ngrams < second.stats.pool_ngrams  # the earlier turns' n-grams are gone


def test_four_turn_chat_equals_generate_on_each_turns_history(tiny):
    engine = load(str(tiny), dtype="float32", method="fafo", compressor="stream", budget=48)
    messages = [{"role": "system", "content": "You are terse."}]
    for turn in ("Name a fruit. " * 4, "Another one?", "Why that one? " * 3, "Thanks."):
        messages.append({"role": "user", "content": turn})
        result = engine.complete(messages, max_tokens=50)
        assert result.token_ids == hf_greedy(tiny, engine.encode(messages), 50), len(messages)
        messages.append({"role": "assistant", "content": result.text})
    # the earlier turns were not prefilled again (a random model's bytes do not all survive re-tokenization)
    assert result.stats.cached_prompt_tokens > 0.5 * result.stats.prompt_tokens


@pytest.mark.parametrize("method", ["vanilla", "fafo"])
def test_min_p_reaches_the_sampler(tiny, method):
    """min_p = 1 keeps only the likeliest token: sampling then equals greedy decoding."""
    engine = load(str(tiny), dtype="float32", chat_template=False, method=method)
    greedy = engine.complete(LONG, max_tokens=40, temperature=0.0).token_ids
    assert engine.complete(LONG, max_tokens=40, temperature=1.0, min_p=1.0, seed=5).token_ids == greedy
    assert engine.complete(LONG, max_tokens=40, temperature=1.0, seed=5).token_ids != greedy


def test_no_window_on_a_cpu_unless_a_compressor_is_named(tiny, tmp_path, monkeypatch):
    # an empty cache: a cost curve another test's bench measured for this model would widen `auto`'s window
    monkeypatch.setenv("FAFO_CACHE", str(tmp_path))
    engine = load(str(tiny), dtype="float32", chat_template=False, method="fafo", device="cpu")
    plain = engine.complete(LONG, max_tokens=60).stats  # streams: auto, compressor: auto
    assert plain.streams == 0 and plain.fumble_positions is None
    assert plain.accepted_from["window"] == 0 and plain.accepted_tokens > 0  # copies from the text still pay
    named = engine.complete(LONG, max_tokens=60, compressor="stream", budget=32).stats
    assert named.streams == 2 and named.fumble_positions == 32
    # the text's suffix index (as SuffixDecoding's is counted), and with a window its copy of C(kv) besides
    assert 0 < plain.draft_memory_mb < named.draft_memory_mb


def test_copies_auto_offers_more_copies_when_sampling(tiny, monkeypatch):
    from fafo_cli.decoders.fafo import step

    asked = []

    class Recording(step.TextGuesses):
        def __init__(self, index, copies, draft_tokens):
            asked.append(copies)
            super().__init__(index, copies, draft_tokens)

    monkeypatch.setattr(step, "TextGuesses", Recording)
    engine = load(str(tiny), dtype="float32", chat_template=False, method="fafo")
    for settings, copies in ((dict(), 2), (dict(temperature=0.8, seed=1), 4), (dict(temperature=0.8, copies=3), 3)):
        asked.clear()
        engine.complete(LONG, max_tokens=8, **settings)
        assert asked and set(asked) == {copies}, settings  # auto: 2 greedy, 4 sampled; a configured count is kept


def test_pool_and_guess_settings_take_effect(tiny):
    engine = load(str(tiny), dtype="float32", chat_template=False, method="fafo", compressor="stream", budget=64, copies=0, planner=False)
    steps = list(engine.stream(LONG, max_tokens=80, pool_per_key=1, guesses=2, ngram=4))
    one = steps[-1].stats
    assert one.pool_ngrams == one.pool_keys  # one n-gram per key
    assert one.drafted_tokens <= 2 * 4 * one.steps  # G candidates of k tokens
    emitted = 0
    for before, step in zip(steps, steps[1:]):
        emitted += len(before.token_ids)
        if 80 - emitted > 2 * 4:  # whole candidates, but where fewer tokens are left than they hold
            assert (step.stats.drafted_tokens - before.stats.drafted_tokens) % 4 == 0
    many = engine.complete(LONG, max_tokens=80, pool_per_key=8, guesses=2, ngram=4).stats
    assert many.pool_ngrams > many.pool_keys


def test_step_rows_count_the_rows_that_ran(tiny, monkeypatch):
    """A window warming up (its first k - 1 steps of a request) runs fewer rows than it will: the step's rows in
    the statistics, and the step time the planner learns from, are the rows that ran."""
    from collections import Counter

    from fafo_cli.decoders.fafo.planner import StepCosts
    from fafo_cli.runtime.session import Session

    ran, observed, run = [], [], Session.run

    def counted(self, rows, *args, **kwargs):
        ran.append(len(rows.ids))
        return run(self, rows, *args, **kwargs)

    monkeypatch.setattr(Session, "run", counted)
    monkeypatch.setattr(StepCosts, "observe", lambda self, rows, window, ms: observed.append(rows))
    engine = load(str(tiny), dtype="float32", chat_template=False, method="fafo", device="cpu")
    stats = engine.complete(LONG, max_tokens=24, streams=2, ngram=3, guesses=1, planner=False, compressor="stream",
                            budget=32).stats
    assert Counter(ran) == Counter(stats.step_rows) and ran == observed
    assert ran[0] < ran[2]  # the window's first levels (1 + 2 of 5 rows) before all of them


def test_eager_costs_are_kept_apart_for_packed_and_dense_weights(tiny, tmp_path, monkeypatch):
    """A .gguf model's eager steps read its packed blocks, or (`compile: off`) its dense weights, where a row costs
    another share of a pass: the planner reads the curve measured for the weights that run, and `bench --tune` or
    `doctor --write` keep each under its own name."""
    from fafo_cli.bench.tune import keep_eager_costs
    from fafo_cli.compiled.timing import read_step_costs
    from fafo_cli.decoders.fafo.step import eager_costs

    monkeypatch.setenv("FAFO_CACHE", str(tmp_path))
    engine = load(str(tiny), dtype="float32", chat_template=False)
    session = engine.session
    session.step_costs = {"eager": {1: 10.0, 8: 80.0}, "eager-packed": {1: 10.0, 8: 12.0}}
    assert eager_costs(session).of(8) == 80.0
    session.model.packed_matrices = 7
    assert eager_costs(session).of(8) == 12.0
    keep_eager_costs(engine, {1: 9.0, 8: 11.0})
    assert read_step_costs(engine.steps_folder) == {"eager-packed": {1: 9.0, 8: 11.0}}


@pytest.mark.parametrize("compressor", ["none", "stream", "snapkv"])
def test_fafo_over_torchs_attention_decodes_transformers_tokens(tiny, monkeypatch, compressor):
    """Where our kernel does not serve (no AVX2, `compile: off` before any library loaded), FAFO's steps attend with
    torch's kernel, each mask folded once a pass for all layers: transformers' tokens, window rows and all."""
    from fafo_cli.runtime import model

    monkeypatch.setattr(model, "_cpu_attention", None)
    engine = load(str(tiny), dtype="float32", chat_template=False, compile="off")
    result = engine.complete(LONG, method="fafo", compressor=compressor, streams=2, budget=64, max_tokens=TOKENS,
                             temperature=0.0)
    assert result.token_ids == hf_greedy(tiny, engine.encode(LONG), TOKENS)
