"""Sampling follows the target distribution exactly: the acceptance rules against exact enumeration (and
deliberately wrong rules that these tests catch), keyed draws that make a guessing method sample plain
sampling's very tokens, and the engine against the model's own probabilities."""

from __future__ import annotations

import math

import pytest
import torch

from fafo_cli import load
from fafo_cli.decoders.tree import DraftTree
from fafo_cli.decoders.verify import accept, accept_speculative, accept_tree
from fafo_cli.runtime.sampling import Draws, Sampling, pick, target_probs

# A tiny "model" over 4 tokens: the first token's distribution, and the second's given the first.
FIRST = torch.tensor([0.5, 0.3, 0.15, 0.05])
SECOND = torch.tensor([[0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1], [0.05, 0.05, 0.1, 0.8]])
GUESSES = {(): [(0, 1), (0, 2), (1, 3), (2, 0)], (0,): [(1, 0)], (1,): [(3, 3)], (2,): [(0, 0)], (3,): [(3, 1)]}


def target(prefix):
    return FIRST if not prefix else SECOND[prefix[0]] if len(prefix) == 1 else torch.full((4,), 0.25)


def accept_keyed(tree, rows, draws, position):
    """The rule every one-hot method uses: the tokens plain sampling picks with these draws (`rows[r]`: row r's
    target distribution, given as logits at temperature 1)."""
    return accept(tree, torch.stack(rows).log(), Sampling(1.0), draws, position)


def accept_by_argmax(tree, rows, draws, position):
    """Wrong: treats sampling like greedy decoding."""
    path, emitted = accept(tree, torch.stack(rows).log(), Sampling(), None, position)
    emitted[-1] = pick(rows[path[-1] + 1 if path else 0], draws.uniform(position + len(path)))
    return path, emitted


def accept_one_draw_per_step(tree, rows, draws, position):
    """Wrong: one random number for the whole step rather than one per position (the tokens of a step become
    dependent)."""
    return accept_tree(tree, lambda row: pick(rows[row], draws.uniform(position)))


def sample_pairs(rule, n: int, seed: int = 0, merge: bool = False) -> torch.Tensor:
    """Generate 2-token sequences step by step, as decoding does, with `rule` verifying the guesses (as
    separate chains, FAFO's layout, or merged into a trie, Cacheback's); sequence i has seed `seed * n + i`."""
    counts = torch.zeros(4, 4)
    for i in range(n):
        draws = Draws(seed * n + i)
        out: list[int] = []
        while len(out) < 2:
            tree = DraftTree()
            for guess in GUESSES[tuple(out)]:
                tree.add_chain(guess, merge=merge)
            prefix = tuple(out)
            rows = [target(prefix)] + [target(prefix + tuple(tree.tokens[i] for i in tree.path(node)))
                                       for node in range(len(tree))]
            out += rule(tree, rows, draws, len(out))[1]
        counts[out[0], out[1]] += 1
    return counts


def chi_square(counts: torch.Tensor, probabilities: torch.Tensor) -> float:
    expected = probabilities * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_acceptance_rule_matches_exact_enumeration_and_wrong_rules_fail():
    exact = FIRST[:, None] * SECOND  # the joint distribution of the first two tokens
    critical = 37.7  # chi-square, 15 degrees of freedom, p = 0.001
    assert chi_square(sample_pairs(accept_keyed, 6000), exact) < critical
    assert chi_square(sample_pairs(accept_keyed, 6000, seed=1, merge=True), exact) < critical
    assert chi_square(sample_pairs(accept_by_argmax, 6000), exact) > 10 * critical
    assert chi_square(sample_pairs(accept_one_draw_per_step, 6000), exact) > 3 * critical


def test_keyed_draws_give_plain_samplings_tokens_whatever_was_guessed():
    """The same draws: the same tokens with no guesses, with the likeliest guesses, with unlikely ones."""
    for seed in range(200):
        draws, outputs = Draws(seed), []
        for guesses in ([], GUESSES[()], [(3, 3), (3, 0)]):
            tree = DraftTree.chains(guesses)
            rows = [FIRST] + [target(tuple(tree.tokens[i] for i in tree.path(node))) for node in range(len(tree))]
            _, emitted = accept_keyed(tree, rows, draws, 0)
            if len(emitted) < 2:  # the second token from its own step, as plain decoding samples it
                emitted.append(pick(SECOND[emitted[0]], draws.uniform(1)))
            outputs.append(emitted[:2])
        assert outputs[0] == outputs[1] == outputs[2]


def test_draws_are_keyed_by_position_and_uniform():
    draws = Draws(5)
    assert [draws.uniform(p) for p in (9, 3, 9)] == [draws.uniform(9), draws.uniform(3), draws.uniform(9)]
    assert len({draws.uniform(3), draws.uniform(3, stream=1), draws.below().uniform(3)}) == 3
    u = torch.tensor([Draws(seed).uniform(position) for seed in range(40) for position in range(100)])
    assert 0 <= float(u.min()) and float(u.max()) < 1
    counts = torch.histc(u, bins=10, min=0, max=1)
    assert chi_square(counts, torch.full((10,), 0.1)) < 27.9  # 9 dof, p = 0.001


# The draft model of a self-speculative method: close to the target, not equal to it.
DRAFT_FIRST = torch.tensor([0.4, 0.4, 0.1, 0.1])
DRAFT_SECOND = (SECOND + 0.3) / (SECOND + 0.3).sum(-1, keepdim=True)


def draft(prefix):
    return DRAFT_FIRST if not prefix else DRAFT_SECOND[prefix[0]] if len(prefix) == 1 else torch.full((4,), 0.25)


def accept_one_hot(tokens, target_at, drafts, draws, position):
    """Wrong: accepts x with p(x) and, on rejection, resamples from p itself (x keeps its mass twice)."""
    emitted = []
    for j, x in enumerate(tokens):
        if draws.uniform(position + j, stream=1) < target_at(j)[x]:
            emitted.append(x)
            continue
        emitted.append(pick(target_at(j), draws.uniform(position + j, stream=2)))
        return emitted
    return emitted + [pick(target_at(len(tokens)), draws.uniform(position + len(tokens)))]


def sample_speculative_pairs(rule, n: int, seed: int = 0) -> torch.Tensor:
    counts = torch.zeros(4, 4)
    for i in range(n):
        draws = Draws(seed * n + i)
        out: list[int] = []
        while len(out) < 2:
            tokens, drafts = [], []
            for _ in range(2):  # a 2-token chain sampled from the draft model, with the level below's draws
                q = draft(tuple(out + tokens))
                drafts.append(q)
                tokens.append(pick(q, draws.below().uniform(len(out) + len(tokens))))
            prefix = tuple(out)
            out += rule(tokens, lambda j: target(prefix + tuple(tokens[:j])), drafts, draws, len(out))
        counts[out[0], out[1]] += 1
    return counts


def test_speculative_rule_matches_exact_enumeration_and_a_one_hot_rule_fails():
    exact = FIRST[:, None] * SECOND
    critical = 37.7
    assert chi_square(sample_speculative_pairs(accept_speculative, 6000), exact) < critical
    assert chi_square(sample_speculative_pairs(accept_one_hot, 6000), exact) > 3 * critical


def test_min_p_matches_transformers():
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper

    logits = torch.randn(3, 50) * 3
    expected = MinPLogitsWarper(0.1)(None, TemperatureLogitsWarper(0.8)(None, logits.clone())).softmax(-1)
    torch.testing.assert_close(target_probs(logits, Sampling(0.8, min_p=0.1)), expected)


@pytest.mark.parametrize("temperature", [1e-40, 1e-46, 1e-300])  # (1e-46 is 0 in float32: 0 / 0 before)
def test_a_temperature_near_zero_samples_the_likeliest(temperature):
    """Past float32's range logits / T was inf, the probabilities NaN, and the token drawn a fixed wrong one."""
    logits = torch.tensor([[1.0, 5.0, -3.0, 4.0], [2.0, 2.0, 0.0, -1.0]])
    probs = target_probs(logits, Sampling(temperature))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]]))  # a tie splits evenly


@pytest.mark.parametrize("top_p, top_k", [(0.8, 0), (0.3, 0), (1.0, 5), (0.9, 7)])
def test_top_p_and_top_k_match_transformers(top_p, top_k):
    """The nucleus and the k likeliest as transformers' warpers keep them, in its order: temperature, top-k, top-p;
    every token tied at the k-th kept. (Which of tokens tied at the nucleus' edge stays is the sort's choice, in
    transformers too: every method reads our own sampler, which exactness is judged against.)"""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(4, 50) * 3
    logits[0] = torch.cat([torch.tensor([9.0, 8.0]), torch.full((6,), 2.0), torch.randn(42).clamp(max=1.5)])
    assert top_k == 0 or sorted(logits[0].tolist(), reverse=True)[top_k - 1] == 2.0  # a tie across the k-th
    warped = TemperatureLogitsWarper(0.7)(None, logits.clone())
    if top_k:
        warped = TopKLogitsWarper(top_k)(None, warped)
    if top_p < 1:
        warped = TopPLogitsWarper(top_p)(None, warped)
    torch.testing.assert_close(target_probs(logits, Sampling(0.7, top_p=top_p, top_k=top_k)), warped.softmax(-1))


def _exact_first(engine, prompt_ids, sampling, length: int) -> dict[tuple[int, ...], float]:
    """The model's own distribution of the first `length` tokens, by enumeration over the allowed ones."""
    model = engine.hf_model  # transformers' own class: the oracle
    joint = {(): 1.0}
    with torch.inference_mode():
        for _ in range(length):
            longer = {}
            for prefix, mass in joint.items():
                probs = target_probs(model(torch.tensor([prompt_ids + list(prefix)])).logits[0, -1], sampling)
                for token in probs.nonzero().flatten().tolist():
                    longer[prefix + (token,)] = mass * float(probs[token])
            joint = longer
    return joint


def pooled_chi_square(counts: dict, exact: dict, least: float = 5.0) -> tuple[float, float]:
    """Chi-square of `counts` against the probabilities `exact` over the cells expected at least `least` times,
    the others pooled into one, and its critical value at p = 0.001 (Wilson-Hilferty's approximation)."""
    total = sum(counts.values())
    cells = sorted(exact, key=exact.get, reverse=True)
    kept = [cell for cell in cells if exact[cell] * total >= least]
    rest = [cell for cell in cells if cell not in kept]
    observed = [counts[cell] for cell in kept] + ([sum(counts[cell] for cell in rest)] if rest else [])
    expected = [exact[cell] * total for cell in kept] + ([sum(exact[cell] for cell in rest) * total] if rest else [])
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    freedom = len(observed) - 1
    critical = freedom * (1 - 2 / (9 * freedom) + 3.0902 * math.sqrt(2 / (9 * freedom))) ** 3
    return statistic, critical


def _offer(monkeypatch, method: str, likely: dict[int, list[int]]) -> None:
    """Make the method's drafter offer, after each token, two-token guesses of the model's own likely next tokens
    (each one's likeliest follower second), so every sample goes through the acceptance rule at depth 1 and 2 with
    guesses it often accepts (and sometimes rejects)."""
    from fafo_cli.decoders.cacheback import Cacheback
    from fafo_cli.decoders.prompt_lookup import PromptLookup
    from fafo_cli.decoders.suffix import Suffix
    from fafo_cli.decoders.speculative import Draft
    from fafo_cli.decoders.fafo.pool import NgramPool
    from fafo_cli.decoders.tree import DraftTree

    def guesses(token: int) -> list[list[int]]:
        return [[x, *likely.get(x, [])[:1]] for x in likely.get(token, [])]

    def tree(text, chains):
        tree = DraftTree()
        for chain in chains:
            tree.add_chain(chain)
        return Draft(tree)

    if method in ("fafo", "lookahead"):  # candidates as separate chains
        monkeypatch.setattr(NgramPool, "lookup",
                            lambda self, text, limit: [(tuple(g), 1) for g in guesses(text[-1]) if len(g) == 2][:limit])
    elif method == "prompt-lookup":  # one chain
        monkeypatch.setattr(PromptLookup, "draft",
                            lambda self, text, room: tree(text, guesses(text[-1])[:1]))
    elif method in ("cacheback", "suffix"):  # a tree: every likely token a child of the anchor, merged where equal
        monkeypatch.setattr(Cacheback if method == "cacheback" else Suffix, "draft",
                            lambda self, text, room: tree(text, guesses(text[-1])))
    # triforce and quantspec draft with the model itself (sampled drafts, speculative sampling)


# TriForce's middle level reads a retrieval cache of triforce_budget tokens of a longer prompt, so its q is not p;
# with the draft model its own checks of the draft model's q != p run too. QuantSpec's 4-bit copy gives q != p.
PEER_SETTINGS = dict(streams=2, ngram=2, guesses=3, prefix=1, lookahead_streams=2, lookahead_ngram=2,
                     lookahead_guesses=3, triforce_budget=64, triforce_chunk=4, triforce_gamma1=2,
                     quantspec_group=8, quantspec_gamma=2)


@pytest.mark.parametrize("method", ["vanilla", "fafo", "lookahead", "prompt-lookup", "cacheback", "suffix",
                                    "triforce", "triforce+draft", "quantspec", "quantspec+wrong-rule"])
def test_engine_sampling_matches_the_model_distribution(tiny, method, monkeypatch, tmp_path):
    """The first four tokens' joint distribution against the model's own, enumerated: the second to fourth are
    guessed in one step (depth 1 and 2 of a draft, and the token after an accepted one), at a temperature other than
    1, so that a draft's distribution warped otherwise than the target's would show. A wrong acceptance rule must
    fail the same check."""
    from fafo_cli.decoders import speculative

    from .conftest import build_tiny_model

    wrong = method.endswith("+wrong-rule")
    if wrong:  # accepts x with p(x), whatever q(x) was
        monkeypatch.setattr(speculative, "accept_speculative", accept_one_hot)
    draft = str(build_tiny_model(tmp_path / "draft", "llama-mha", seed=3)) if method == "triforce+draft" else None
    method = method.removesuffix("+draft").removesuffix("+wrong-rule")
    engine = load(str(tiny), dtype="float32", chat_template=False, method=method, draft_model=draft,
                  **PEER_SETTINGS)
    engine.stop_ids = frozenset()  # every answer four tokens long, as the enumeration
    # TriForce's: longer than its retrieval budget, so that its middle level's q is not the target's p
    prompt = "The cat sat on the mat. " * (4 if method == "triforce" else 1)
    settings = dict(temperature=0.7, top_k=3, max_tokens=4)
    exact = _exact_first(engine, engine.encode(prompt), Sampling(0.7, top_k=3), 4)
    likely: dict[int, list[int]] = {}
    for tokens in exact:
        for before, after in zip(tokens, tokens[1:]):
            if after not in likely.setdefault(before, []):
                likely[before].append(after)
    _offer(monkeypatch, method, likely)
    counts = dict.fromkeys(exact, 0)
    accepted = drafted = deep = 0
    for seed in range(1500):
        result = engine.complete(prompt, seed=seed, **settings)
        counts[tuple(result.token_ids)] += 1
        accepted += result.stats.accepted_tokens
        drafted += result.stats.drafted_tokens
        deep += result.stats.accepted_tokens >= 2  # (in four tokens: a guess accepted at depth 2)
        if seed < 100 and method not in ("vanilla", "triforce", "quantspec"):  # one-hot guesses: plain's tokens
            assert result.token_ids == engine.complete(prompt, seed=seed, method="vanilla", **settings).token_ids
    statistic, critical = pooled_chi_square(counts, exact)
    if wrong:
        assert statistic > critical, (statistic, critical)
        return
    assert statistic < critical, (statistic, critical)
    if method != "vanilla":
        assert accepted > 100 and drafted - accepted > 50  # guesses verified, often accepted and sometimes not
        assert deep > 20, deep
