"""FAFO's step planner: its cost curve, its acceptance statistics and the steps it chooses."""

from __future__ import annotations

import pytest

from fafo_cli.decoders.fafo.planner import EXPLORE_EVERY, Acceptance, Chain, Planner, StepCosts
from fafo_cli.decoders.tree import ROOT

pytestmark = pytest.mark.step_times  # these tests feed StepCosts times (tests/conftest.py)


def test_step_costs_interpolate_eager_and_round_up_to_packages():
    eager = StepCosts({1: 10.0, 9: 18.0})
    assert eager.of(1) == 10.0 and eager.of(5) == 14.0 and eager.of(17) == 26.0  # extrapolated past the ends
    noisy = StepCosts({1: 10.0, 16: 30.0, 24: 28.0})  # a last segment sloping down (noise): flat past its end
    assert noisy.of(20) == 29.0 and noisy.of(24) == noisy.of(200) == 28.0
    assert eager.size(7) == 7
    packages = StepCosts({1: 10.0, 4: 12.0, 20: 30.0}, sizes=[1, 4, 20])
    assert packages.of(2) == 12.0 and packages.of(4) == 12.0 and packages.of(5) == 30.0
    assert packages.size(5) == 20 and packages.of(21) is None  # no package holds 21 rows
    with pytest.raises(ValueError):
        StepCosts({})


def _outcome(acceptance: Acceptance, chain: Chain, agreed: int) -> None:
    """The chain was verified whole and its first `agreed` tokens were accepted."""
    for position in range(min(agreed + 1, len(chain.tokens))):
        acceptance.observe(chain, position, position < agreed)


def test_acceptance_learns_from_outcomes():
    acceptance = Acceptance()
    copy = Chain("text", 8, (1, 2, 3, 4))
    before = acceptance.chances(copy)
    assert before == sorted(before, reverse=True) and 0 < before[-1] < before[0] < 1
    for _ in range(50):
        _outcome(acceptance, copy, 4)
    learned = acceptance.chances(copy)
    assert all(after > prior for after, prior in zip(learned, before))
    for _ in range(50):
        _outcome(acceptance, Chain("window", 1, (7, 8, 9)), 0)  # the first token was wrong
    assert acceptance.chances(Chain("window", 1, (7,)))[0] < 0.05
    assert acceptance.chances(Chain("text", 2, (1,)))[0] != learned[0]  # another match length: another statistic


def test_outcomes_at_one_match_length_calibrate_the_others():
    acceptance = Acceptance()
    unseen_before = acceptance.chances(Chain("text", 24, (1, 2, 3)))
    for _ in range(30):  # copies after 4-token matches keep failing at once
        _outcome(acceptance, Chain("text", 4, (1, 2, 3)), 0)
    unseen_after = acceptance.chances(Chain("text", 24, (1, 2, 3)))
    assert all(after < before / 3 for after, before in zip(unseen_after, unseen_before))
    window = Chain("window", 1, (5,))
    assert acceptance.chances(window) == Acceptance().chances(window)  # another source: untouched


def test_a_frequency_path_is_as_likely_as_its_counts_say_until_outcomes_calibrate_it():
    acceptance = Acceptance()
    path = Chain("text", 3, (1, 2, 3), odds=(0.6, 0.5, 0.9))
    assert acceptance.chances(path) == pytest.approx([0.6, 0.3, 0.27])
    for _ in range(40):  # tokens that followed 6 times in 10 are accepted 9 times in 10 in this text
        for hit in [True] * 9 + [False]:
            acceptance.observe(Chain("text", 3, (1,), odds=(0.6,)), 0, hit)
    assert acceptance.chances(Chain("text", 3, (1,), odds=(0.65,)))[0] == pytest.approx(0.9, abs=0.05)
    assert acceptance.chances(Chain("text", 3, (1,), odds=(0.95,)))[0] == pytest.approx(0.95)  # calibrated, capped
    assert acceptance.chances(Chain("text", 3, (1,))) == Acceptance().chances(Chain("text", 3, (1,)))  # copies apart


def _planner(costs: StepCosts, window_rows: int = 0, max_nodes: int = 16) -> Planner:
    return Planner(Acceptance(), costs, window_rows, max_nodes)


def test_a_likely_long_copy_is_verified_whole_when_rows_are_cheap():
    planner = _planner(StepCosts({1: 1.0, 64: 1.1}))
    for _ in range(30):  # copies of this match length have always been right
        _outcome(planner.acceptance, Chain("text", 12, tuple(range(12))), 12)
    plan = planner.plan([Chain("text", 12, tuple(range(12)))], room=100)
    assert plan.tree.tokens == list(range(12)) and plan.tree.parents == [ROOT, *range(11)]
    assert plan.rows == 13 and not plan.window and plan.expected > 8


def test_near_the_contexts_end_a_window_that_cannot_run_leaves_the_copies_verified():
    """Where the window's rows no longer fit the context, a step that would have had to run it (the fixed plan,
    a burst) verifies the copies that fit instead of nothing."""
    planner = Planner(Acceptance(), StepCosts({1: 1.0, 64: 1.0}), 6, 16, fixed=True)
    for _ in range(30):
        _outcome(planner.acceptance, Chain("text", 4, (1, 2, 3)), 3)
    plan = planner.plan([Chain("text", 4, (1, 2, 3))], room=5)
    assert plan.tree.tokens == [1, 2, 3] and not plan.window and plan.rows == 4


def test_nothing_worth_its_rows_is_a_plain_step():
    planner = _planner(StepCosts({1: 1.0, 2: 2.0}))  # every row doubles the step
    for _ in range(30):
        _outcome(planner.acceptance, Chain("window", 1, (5, 6)), 0)
    plan = planner.plan([Chain("window", 1, (5, 6))], room=100)
    assert len(plan.tree) == 0 and plan.rows == 1


def test_candidates_share_their_common_prefix_and_respect_room():
    planner = _planner(StepCosts({1: 1.0, 64: 1.0}))  # rows are free: take everything that fits
    chains = [Chain("text", 6, (1, 2, 3, 4)), Chain("text", 2, (1, 2, 9)), Chain("window", 2, (5, 6, 7))]
    plan = planner.plan(chains, room=100)
    assert len(plan.tree) == 8  # 1 2 3 4, then 9 under 2, then 5 6 7: the shared 1 2 is one pair of rows
    assert plan.sources == ["text"] * 5 + ["window"] * 3
    small = planner.plan(chains, room=4)  # the anchor and 3 guesses
    assert small.rows == 4 and set(small.tree.parents) <= {ROOT, 0, 1}  # prefix-closed: parents come along


def test_copies_that_part_ways_share_one_chance_between_them():
    planner = _planner(StepCosts({1: 1.0, 2: 1.3}))  # a row costs 30% of a step
    for _ in range(30):  # copies of this match length are right 70% of the time
        for agreed in (4, 4, 4, 4, 4, 4, 4, 0, 0, 0):
            _outcome(planner.acceptance, Chain("text", 8, (1, 2, 3, 4)), agreed)
    alone = planner.plan([Chain("text", 8, (1, 2, 3, 4))], room=100)
    both = planner.plan([Chain("text", 8, (1, 2, 3, 4)), Chain("text", 8, (5, 6, 7, 8))], room=100)
    # plain decoding continues with 1 or with 5, not both: the two first tokens' chances (0.7 each alone) sum to at
    # most 1, so both together are worth at most 1 / 0.7 times the one copy's guessed tokens (counted alone: 2×)
    assert alone.expected > 2 and both.expected - 1 < 1.5 * (alone.expected - 1)


def test_window_runs_when_it_pays_and_in_bursts_every_few_steps():
    cheap = _planner(StepCosts({1: 1.0, 64: 1.05}), window_rows=5)
    assert all(cheap.plan([], room=100).window for _ in range(10))  # its worth (the prior) beats 5 nearly free rows
    costly = Planner(Acceptance(), StepCosts({1: 1.0, 64: 64.0}), 5, 16, burst=3)  # each row costs a whole pass
    runs = [costly.plan([], room=100).window for _ in range(2 * EXPLORE_EVERY + 6)]
    # a burst of 3 to warm up, then one every EXPLORE_EVERY steps without it
    assert runs == [True] * 3 + [False] * EXPLORE_EVERY + [True] * 3 + [False] * EXPLORE_EVERY


def test_a_window_that_earns_nothing_is_tried_less_and_less_often():
    # each row costs 12% of a pass: the window's 5 rows cost 0.6 tokens a step, which its one right guess repays
    planner = Planner(Acceptance(), StepCosts({1: 1.0, 64: 1 + 63 * 0.12}), 5, 16, burst=1)
    runs = [planner.plan([], room=100).window for _ in range(1 + 8 + 1 + 16 + 1 + 32 + 1)]
    gaps = [i for i, ran in enumerate(runs) if ran]
    assert gaps == [0, 9, 26, 59]  # idle for EXPLORE_EVERY steps, then twice as long after each fruitless burst
    plan = planner.plan([Chain("window", 1, (5,))], room=100)  # the verified guess was the window's and was right
    planner.observe(plan, [0])
    runs = [planner.plan([], room=100).window for _ in range(64 + 2 + EXPLORE_EVERY)]
    first = runs.index(True)
    assert runs[first + 1:first + 1 + EXPLORE_EVERY] == [False] * EXPLORE_EVERY and runs[first + 1 + EXPLORE_EVERY]


def test_step_costs_learn_from_the_steps_run():
    costs = StepCosts({1: 10.0, 9: 18.0})
    for _ in range(200):
        costs.observe(1, False, 20.0)  # the machine is twice as slow as when measured
        costs.observe(9, False, 72.0)  # and nine rows cost four one-row steps, not 1.8
    assert costs.of(1) == pytest.approx(20.0, rel=0.02) and costs.of(9) == pytest.approx(72.0, rel=0.02)
    assert 12.0 * 2 < costs.of(3) < 12.0 * 4  # not run: as measured, times the ratio over all steps
    costs.observe(1, False, 10_000.0)  # one stall does not move a median
    assert costs.of(1) == pytest.approx(20.0, rel=0.05)
    rare = StepCosts({1: 10.0, 9: 18.0})
    for _ in range(30):
        rare.observe(1, False, 10.0)
    rare.observe(2, False, 11.0)  # a class's first step is not counted
    rare.observe(2, False, 200.0)  # its one counted step a stall: it must not look dearer than 9 rows
    assert rare.of(2) < rare.of(9) * 2
    window = StepCosts({1: 10.0, 9: 18.0})
    for _ in range(300):
        window.observe(6, True, 30.0)  # the window's rows read the compressed view besides
        window.observe(6, False, 15.0)
    assert window.of(6, True) == pytest.approx(2 * window.of(6, False), rel=0.05)
    packages = StepCosts({1: 10.0, 4: 12.0}, sizes=[1, 4])
    packages.observe(2, False, 500.0)  # a class's first step (a package's first call) is not counted
    assert packages.of(3) == pytest.approx(12.0) and packages.of(1) == pytest.approx(10.0)
    for _ in range(100):
        packages.observe(2, False, 24.0)  # padded to the 4-row package
    assert packages.of(3) == pytest.approx(24.0)
    for _ in range(100):  # a long context: each row's attention costs, a padding row's does not
        packages.observe(3, False, 30.0)
        packages.observe(4, False, 36.0)
    assert packages.of(2) < packages.of(3) < packages.of(4)


def test_steps_slower_than_measured_cost_sizes_not_run_as_the_recent_steps_fit():
    grown = StepCosts({1: 10.0, 9: 18.0, 17: 26.0})
    for _ in range(50):  # a long cache: every step 30 ms slower than measured
        grown.observe(1, False, 40.0)
        grown.observe(9, False, 48.0)
    assert grown.of(17) == pytest.approx(56.0)  # 30 ms added, not the measured 26 times the ratio seen
    busy = StepCosts({1: 10.0, 9: 18.0, 17: 26.0})
    for _ in range(50):  # a machine twice as fast as when measured
        busy.observe(1, False, 5.0)
        busy.observe(9, False, 9.0)
    assert busy.of(17) == pytest.approx(13.0)  # half, not 5 ms less
    long = StepCosts({1: 10.0, 4: 10.5, 9: 12.0})  # measured at a short context, where a few rows cost alike
    for _ in range(50):  # at 8K every row's attention reads the whole cache: 4-row steps run 23 ms slower
        long.observe(4, False, 33.5)
    assert long.of(1) == pytest.approx(10.0 + 23.0 / 4) and long.of(1) < long.of(4)  # a smaller step is worth trying...
    for _ in range(50):
        long.observe(1, False, 25.0)
        long.observe(4, False, 33.5)
    assert long.of(1) == pytest.approx(25.0, abs=1.5)  # ...and, once run, costs what it took
    # 1 and 4 rows run: each row adds (33.5 - 25) / 3 ms there, and an 8-row step is priced so (not as the 4-row
    # step's milliseconds added to the short context's curve, which made long steps look cheap at 8K)
    assert long.of(8) == pytest.approx(25.0 + 7 * 8.5 / 3, rel=0.03)


def test_observe_credits_accepted_tokens_to_their_source():
    planner = _planner(StepCosts({1: 1.0, 64: 1.0}), window_rows=2)
    plan = planner.plan([Chain("text", 4, (1, 2)), Chain("window", 1, (3, 4))], room=100)
    text_node = plan.tree.tokens.index(1)
    assert planner.observe(plan, [text_node, text_node + 1]) == ["text", "text"]
    window_node = plan.tree.tokens.index(3)
    assert planner.observe(plan, [window_node]) == ["window"]


def _copies(chains: list[Chain]) -> list[Chain]:
    return [chain for chain in chains if not chain.odds]


def test_a_copy_runs_at_most_as_long_as_its_match():
    from fafo_cli.decoders.fafo.step import text_chains
    from fafo_cli.decoders.suffix_index import SuffixIndex

    index = SuffixIndex(counts=True)
    index.extend([5, 6, 7, 8, 9, 10, 11, 12, 13, 1, 5])  # the ending [5] occurred once before: a 1-token match
    assert _copies(text_chains(index, copies=2, draft_tokens=16)) == [Chain("text", 1, (6,))]
    index.extend([6, 7])  # now [5, 6, 7]: three tokens
    assert _copies(text_chains(index, copies=1, draft_tokens=16)) == [Chain("text", 3, (8, 9, 10))]
    assert _copies(text_chains(index, copies=1, draft_tokens=2)) == [Chain("text", 3, (8, 9))]


def test_the_text_also_offers_what_most_often_followed_its_ending():
    from fafo_cli.decoders.fafo.step import text_chains
    from fafo_cli.decoders.suffix_index import SuffixIndex

    index = SuffixIndex(counts=True)
    index.extend([9, 1, 2, 9, 1, 2, 9, 1, 3, 9, 1])  # the ending [9, 1] was followed twice by 2, once by 3
    paths = {chain.tokens: chain.odds for chain in text_chains(index, copies=1, draft_tokens=4) if chain.odds}
    # best first by how often each token followed, each count over its total plus one (one occurrence: 1/2)
    assert paths == {(2, 9, 1): pytest.approx((2 / 4, 2 / 3, 2 / 3)), (3,): pytest.approx((1 / 4,))}
    planner = _planner(StepCosts({1: 1.0, 2: 1.3}))  # one guess is worth its row where it is likely enough
    latest = Chain("text", 1, (3, 9))  # a copy of the latest occurrence, after a short match
    chains = [latest] + [Chain("text", 2, tokens, odds) for tokens, odds in paths.items()]
    assert planner.plan(chains, room=100).tree.tokens == [2]  # the likelier first token, not the latest


def test_compiled_plain_steps_are_measured_before_stale_package_costs_are_trusted():
    """Each compiled package is timed at its own build: a 4-row package timed cheaper than the 1-row one would have
    every step verify guesses that do not pay. The planner runs plain steps where less than a guess is expected
    until their cost has counted, and then plans with what both sizes really take."""
    costs = StepCosts({1: 9.6, 4: 8.7}, sizes=(1, 4))
    planner = _planner(costs)
    weak = [Chain("window", 1, (7, 8, 9))]  # a window n-gram: seldom right
    rows = []
    for _ in range(16):
        plan = planner.plan(weak, room=100)
        rows.append(plan.rows)
        planner.observe(plan, [])
        costs.observe(plan.rows, plan.window, 6.5 if plan.rows == 1 else 9.5)  # what the steps really take
    assert rows[:4] == [1, 1, 1, 1]  # the first one warms up, then FIT_LEAST count
    assert rows[-4:] == [1, 1, 1, 1] and costs.of(1) < costs.of(2)
    eager = _planner(StepCosts({1: 9.6, 4: 8.7}))  # eager costs are measured side by side: trusted
    assert eager.plan(weak, room=100).rows > 1


def test_candidates_that_cannot_pay_are_never_built_and_the_plans_stay_the_same():
    """The bound from the candidates' first tokens (`firsts`) decides a plain step without growing the text's
    frequency tree; wherever it cannot, the plan is the one the built candidates give."""
    from fafo_cli.decoders.fafo.step import TextGuesses, text_index
    from fafo_cli.decoders.verify import accept_tree

    text = [5, 6, 7, 8, 1, 2, 3, 5, 6, 7, 9, 4, 1, 2, 3, 5, 6, 7, 8] * 3 + list(range(20, 60))
    runs = {}
    for bounded in (False, True):
        index, planner, built, steps, at = text_index(), _planner(StepCosts({1: 1.0, 2: 1.15, 17: 2.0})), [], [], 10
        index.extend(text[:at])
        while at < len(text):
            guesses = TextGuesses(index, 2, 16)

            def chains(guesses=guesses):
                built.append(True)
                return guesses.chains()

            plan = planner.plan(chains, 100, guesses.firsts()) if bounded else planner.plan(chains(), 100)
            tree = plan.tree
            path, emitted = accept_tree(tree, lambda row: text[min(at + (tree.depths[row - 1] if row else 0),
                                                                   len(text) - 1)])
            planner.observe(plan, path)
            emitted = emitted[:len(text) - at]
            index.extend(emitted)
            at += len(emitted)
            steps.append((plan.rows, tree.tokens, path))
        runs[bounded] = steps, len(built)
    (full, every), (bounded, some) = runs[False], runs[True]
    assert bounded == full and any(rows > 1 for rows, _, _ in full)
    assert 0 < some < every == len(full)  # plain steps in the new text skipped building; the copies were built


def test_a_copy_whose_chances_underflow_deep_down_is_planned_not_a_crash():
    """A copy of a hundred tokens whose per-token chances collapsed: its deep nodes' chances reach 0.0, and the
    chance of a node given its parent divided by 0 (a ZeroDivisionError ended the answer)."""
    from types import SimpleNamespace

    from fafo_cli.decoders.fafo.planner import _merge

    chain = Chain("text", 100, tuple(range(100)))
    chances = [1e-4 ** (depth + 1) for depth in range(100)]  # 0.0 from about the 81st token on
    assert chances[-1] == 0.0
    tree, chance, sources, nodes = _merge([chain], SimpleNamespace(chances=lambda c: chances))
    assert len(nodes[0]) == 100 and chance[-1] == 0.0 and chance[0] == pytest.approx(1e-4)
