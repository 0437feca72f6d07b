"""FAFO sampling follows the target distribution exactly: the acceptance rule against exact enumeration (and
two deliberately wrong rules that this test catches), and the engine against the model's own probabilities."""

from __future__ import annotations

import itertools

import pytest
import torch

from fafo_cli import load
from fafo_cli.engine.sampling import Sampling, target_probs
from fafo_cli.engine.verify import accept_sampling

# A tiny "model" over 4 tokens: the first token's distribution, and the second's given the first.
FIRST = torch.tensor([0.5, 0.3, 0.15, 0.05])
SECOND = torch.tensor([[0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1], [0.05, 0.05, 0.1, 0.8]])
GUESSES = {(): [(0, 1), (0, 2), (1, 3), (2, 0)], (0,): [(1, 0)], (1,): [(3, 3)], (2,): [(0, 0)], (3,): [(3, 1)]}


def target(prefix):
    return FIRST if not prefix else SECOND[prefix[0]] if len(prefix) == 1 else torch.full((4,), 0.25)


def accept_by_argmax(target_at, candidates, generator):
    """Wrong: treats sampling like greedy decoding."""
    emitted, alive, p = [], list(range(len(candidates))), target_at(0, 0)
    for j in range(len(candidates[0])):
        x = int(p.argmax())
        if not any(candidates[c][j] == x for c in alive):
            break
        emitted.append(x)
        alive = [c for c in alive if candidates[c][j] == x]
        p = target_at(alive[0], j + 1)
    emitted.append(int(torch.multinomial(p, 1, generator=generator)))
    return alive[0], emitted


def accept_without_renormalising(target_at, candidates, generator):
    """Wrong: rejected guesses are not removed from the distribution the fallback samples from."""
    emitted, alive, p = [], list(range(len(candidates))), target_at(0, 0)
    for j in range(len(candidates[0])):
        accepted = None
        for x in dict.fromkeys(candidates[c][j] for c in alive):
            if torch.rand((), generator=generator) < p[x]:
                accepted = x
                break
        if accepted is None:
            break
        emitted.append(accepted)
        alive = [c for c in alive if candidates[c][j] == accepted]
        p = target_at(alive[0], j + 1)
    emitted.append(int(torch.multinomial(p, 1, generator=generator)))
    return alive[0], emitted


def sample_pairs(rule, n: int, seed: int = 0) -> torch.Tensor:
    """Generate 2-token sequences step by step, as decoding does, with `rule` verifying the guesses."""
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(4, 4)
    for _ in range(n):
        out: list[int] = []
        while len(out) < 2:
            guesses = GUESSES[tuple(out)]
            prefix = tuple(out)
            _, emitted = rule(lambda c, j: target(prefix + tuple(guesses[c][:j])), guesses, generator)
            out += emitted
        counts[out[0], out[1]] += 1
    return counts


def chi_square(counts: torch.Tensor, probabilities: torch.Tensor) -> float:
    expected = probabilities * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_acceptance_rule_matches_exact_enumeration_and_wrong_rules_fail():
    exact = FIRST[:, None] * SECOND  # the joint distribution of the first two tokens
    critical = 37.7  # chi-square, 15 degrees of freedom, p = 0.001
    assert chi_square(sample_pairs(accept_sampling, 6000), exact) < critical
    assert chi_square(sample_pairs(accept_by_argmax, 6000), exact) > 10 * critical
    assert chi_square(sample_pairs(accept_without_renormalising, 6000), exact) > 3 * critical


def test_min_p_matches_transformers():
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper

    logits = torch.randn(3, 50) * 3
    expected = MinPLogitsWarper(0.1)(None, TemperatureLogitsWarper(0.8)(None, logits.clone())).softmax(-1)
    torch.testing.assert_close(target_probs(logits, Sampling(0.8, min_p=0.1)), expected)


def _exact_first_two(engine, prompt_ids, sampling):
    """The model's own distribution of the first two tokens, by enumeration over the allowed first tokens."""
    model = engine.model.hf
    with torch.inference_mode():
        first = target_probs(model(torch.tensor([prompt_ids])).logits[0, -1], sampling)
        support = first.nonzero().flatten().tolist()
        pairs = {}
        for x in support:
            second = target_probs(model(torch.tensor([prompt_ids + [x]])).logits[0, -1], sampling)
            for y in second.nonzero().flatten().tolist():
                pairs[(x, y)] = float(first[x] * second[y])
    return pairs


@pytest.mark.parametrize("method", ["fafo", "vanilla"])
def test_engine_sampling_matches_the_model_distribution(tiny, method, monkeypatch):
    from fafo_cli.engine.pool import NgramPool

    engine = load(str(tiny), dtype="float32", chat_template=False, method=method, streams=2, ngram=2, guesses=3,
                  prefix=1)
    prompt = "The cat sat on the mat."
    settings = dict(temperature=1.0, top_k=3, max_tokens=3)  # the first step may keep an accepted guess
    exact = _exact_first_two(engine, engine.encode(prompt), Sampling(1.0, top_k=3))
    # The pool offers, after each possible first token, the model's own likely second tokens, so every sample
    # goes through the acceptance rule with guesses it often accepts (and sometimes rejects).
    likely = {}
    for first, second in exact:
        likely.setdefault(first, []).append((second, second))
    monkeypatch.setattr(NgramPool, "lookup", lambda self, text, limit: likely.get(text[-1], [])[:limit])
    counts = dict.fromkeys(exact, 0)
    accepted = 0
    for seed in range(1500):
        result = engine.complete(prompt, seed=seed, **settings)
        counts[tuple(result.token_ids[:2])] += 1
        accepted += result.stats.accepted_tokens
    observed = torch.tensor([counts[k] for k in exact], dtype=torch.float)
    assert chi_square(observed, torch.tensor(list(exact.values()))) < 26.1  # 8 dof, p = 0.001
    if method == "fafo":
        assert accepted > 100  # the guesses were really verified (and often accepted), not bypassed
