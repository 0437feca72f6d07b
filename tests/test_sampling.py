"""FAFO sampling follows the target distribution exactly: the acceptance rule against exact enumeration (and
two deliberately wrong rules that this test catches), and the engine against the model's own probabilities."""

from __future__ import annotations

import pytest
import torch

from fafo_cli import load
from fafo_cli.runtime.sampling import Sampling, target_probs
from fafo_cli.decoders.tree import ROOT, DraftTree
from fafo_cli.decoders.verify import accept_greedy, accept_sampling, accept_speculative

# A tiny "model" over 4 tokens: the first token's distribution, and the second's given the first.
FIRST = torch.tensor([0.5, 0.3, 0.15, 0.05])
SECOND = torch.tensor([[0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1], [0.05, 0.05, 0.1, 0.8]])
GUESSES = {(): [(0, 1), (0, 2), (1, 3), (2, 0)], (0,): [(1, 0)], (1,): [(3, 3)], (2,): [(0, 0)], (3,): [(3, 1)]}


def target(prefix):
    return FIRST if not prefix else SECOND[prefix[0]] if len(prefix) == 1 else torch.full((4,), 0.25)


def accept_by_argmax(tree, target_at, generator):
    """Wrong: treats sampling like greedy decoding."""
    path, emitted = accept_greedy(tree, [int(target_at(row).argmax()) for row in range(len(tree) + 1)])
    emitted[-1] = int(torch.multinomial(target_at(path[-1] + 1 if path else 0), 1, generator=generator))
    return path, emitted


def accept_without_renormalising(tree, target_at, generator):
    """Wrong: rejected guesses are not removed from the distribution the fallback samples from."""
    emitted, alive, p = [], [ROOT], target_at(0)
    while children := tree.children(alive):
        accepted = None
        for x in dict.fromkeys(tree.tokens[c] for c in children):
            if torch.rand((), generator=generator) < p[x]:
                accepted = x
                break
        if accepted is None:
            break
        emitted.append(accepted)
        alive = [c for c in children if tree.tokens[c] == accepted]
        p = target_at(alive[0] + 1)
    emitted.append(int(torch.multinomial(p, 1, generator=generator)))
    return tree.path(alive[0]), emitted


def sample_pairs(rule, n: int, seed: int = 0, merge: bool = False) -> torch.Tensor:
    """Generate 2-token sequences step by step, as decoding does, with `rule` verifying the guesses (as
    separate chains, FAFO's layout, or merged into a trie, Cacheback's)."""
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(4, 4)
    for _ in range(n):
        out: list[int] = []
        while len(out) < 2:
            tree = DraftTree()
            for guess in GUESSES[tuple(out)]:
                tree.add_chain(guess, merge=merge)
            prefix = tuple(out)
            rows = [()] + [tuple(tree.tokens[i] for i in tree.path(node)) for node in range(len(tree))]
            _, emitted = rule(tree, lambda row: target(prefix + rows[row]), generator)
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
    assert chi_square(sample_pairs(accept_sampling, 6000, seed=1, merge=True), exact) < critical
    assert chi_square(sample_pairs(accept_by_argmax, 6000), exact) > 10 * critical
    assert chi_square(sample_pairs(accept_without_renormalising, 6000), exact) > 3 * critical


# The draft model of a self-speculative method: close to the target, not equal to it.
DRAFT_FIRST = torch.tensor([0.4, 0.4, 0.1, 0.1])
DRAFT_SECOND = (SECOND + 0.3) / (SECOND + 0.3).sum(-1, keepdim=True)


def draft(prefix):
    return DRAFT_FIRST if not prefix else DRAFT_SECOND[prefix[0]] if len(prefix) == 1 else torch.full((4,), 0.25)


def accept_one_hot(tokens, target_at, drafts, generator):
    """Wrong: accepts x with p(x) and, on rejection, resamples from p itself (x keeps its mass twice)."""
    emitted = []
    for j, x in enumerate(tokens):
        if torch.rand((), generator=generator) < target_at(j)[x]:
            emitted.append(x)
            continue
        emitted.append(int(torch.multinomial(target_at(j), 1, generator=generator)))
        return emitted
    return emitted + [int(torch.multinomial(target_at(len(tokens)), 1, generator=generator))]


def sample_speculative_pairs(rule, n: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(4, 4)
    for _ in range(n):
        out: list[int] = []
        while len(out) < 2:
            tokens, drafts = [], []
            for _ in range(2):  # a 2-token chain sampled from the draft model
                q = draft(tuple(out + tokens))
                drafts.append(q)
                tokens.append(int(torch.multinomial(q, 1, generator=generator)))
            prefix = tuple(out)
            out += rule(tokens, lambda j: target(prefix + tuple(tokens[:j])), drafts, generator)
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


def _exact_first_two(engine, prompt_ids, sampling):
    """The model's own distribution of the first two tokens, by enumeration over the allowed first tokens."""
    model = engine.hf_model  # transformers' own class: the oracle
    with torch.inference_mode():
        first = target_probs(model(torch.tensor([prompt_ids])).logits[0, -1], sampling)
        support = first.nonzero().flatten().tolist()
        pairs = {}
        for x in support:
            second = target_probs(model(torch.tensor([prompt_ids + [x]])).logits[0, -1], sampling)
            for y in second.nonzero().flatten().tolist():
                pairs[(x, y)] = float(first[x] * second[y])
    return pairs


def _offer(monkeypatch, method: str, likely: dict[int, list[int]]) -> None:
    """Make the method's drafter offer, after each possible first token, the model's own likely second tokens,
    so every sample goes through the acceptance rule with guesses it often accepts (and sometimes rejects)."""
    from fafo_cli.decoders.cacheback import Cacheback
    from fafo_cli.decoders.prompt_lookup import PromptLookup
    from fafo_cli.decoders.suffix import Suffix
    from fafo_cli.decoders.speculative import Draft
    from fafo_cli.decoders.fafo.pool import NgramPool
    from fafo_cli.decoders.tree import DraftTree

    def tree(text, chains):
        tree = DraftTree()
        for chain in chains:
            tree.add_chain(chain)
        return Draft(tree)

    if method in ("fafo", "lookahead"):  # candidates as separate chains
        monkeypatch.setattr(NgramPool, "lookup",
                            lambda self, text, limit: [((x, x), 1) for x in likely.get(text[-1], [])][:limit])
    elif method == "prompt-lookup":  # one chain
        monkeypatch.setattr(PromptLookup, "draft",
                            lambda self, text, room: tree(text, [[x, x] for x in likely.get(text[-1], [])][:1]))
    elif method in ("cacheback", "suffix"):  # a tree: every likely token a child of the anchor, merged where equal
        monkeypatch.setattr(Cacheback if method == "cacheback" else Suffix, "draft",
                            lambda self, text, room: tree(text, [[x, x] for x in likely.get(text[-1], [])]))
    # triforce and quantspec draft with the model itself (sampled drafts, speculative sampling)


# TriForce's middle level reads the whole (short) prompt, so its q equals p; with the draft model its own
# checks of the draft model's q != p are exercised. QuantSpec's 4-bit copy gives q != p at the top level.
PEER_SETTINGS = dict(streams=2, ngram=2, guesses=3, prefix=1, lookahead_streams=2, lookahead_ngram=2,
                     lookahead_guesses=3, triforce_budget=64, triforce_chunk=4, triforce_gamma1=2,
                     quantspec_group=8, quantspec_gamma=2)


@pytest.mark.parametrize("method", ["vanilla", "fafo", "lookahead", "prompt-lookup", "cacheback", "suffix",
                                    "triforce", "triforce+draft", "quantspec"])
def test_engine_sampling_matches_the_model_distribution(tiny, method, monkeypatch, tmp_path):
    from .conftest import build_tiny_model

    draft = str(build_tiny_model(tmp_path / "draft", "llama-mha", seed=3)) if method == "triforce+draft" else None
    method = method.removesuffix("+draft")
    engine = load(str(tiny), dtype="float32", chat_template=False, method=method, draft_model=draft,
                  **PEER_SETTINGS)
    prompt = "The cat sat on the mat."
    settings = dict(temperature=1.0, top_k=3, max_tokens=3)  # the first step may keep an accepted guess
    exact = _exact_first_two(engine, engine.encode(prompt), Sampling(1.0, top_k=3))
    likely: dict[int, list[int]] = {}
    for first, second in exact:
        likely.setdefault(first, []).append(second)
    _offer(monkeypatch, method, likely)
    counts = dict.fromkeys(exact, 0)
    accepted = 0
    for seed in range(1500):
        result = engine.complete(prompt, seed=seed, **settings)
        counts[tuple(result.token_ids[:2])] += 1
        accepted += result.stats.accepted_tokens
    observed = torch.tensor([counts[k] for k in exact], dtype=torch.float)
    assert chi_square(observed, torch.tensor(list(exact.values()))) < 26.1  # 8 dof, p = 0.001
    if method != "vanilla":
        assert accepted > 100  # the guesses were really verified (and often accepted), not bypassed
