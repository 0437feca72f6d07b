"""The suffix index against brute force on random token sequences (small alphabets, so repeats are common), also
across the rebuilds that bound its memory."""

from __future__ import annotations

import random

import pytest

from fafo_cli.decoders.suffix_index import Match, SuffixIndex


def occurrences(text: list[int], pattern: list[int]) -> list[int]:
    """End positions of `pattern` in `text`."""
    n = len(pattern)
    return [i + n - 1 for i in range(len(text) - n + 1) if text[i:i + n] == pattern]


def longest_earlier_ending(text: list[int], cap: int | None = None) -> int:
    """The length of the longest ending of `text` that also ends at an earlier position (at most `cap`)."""
    best = 0
    for length in range(1, min(len(text) - 1, cap or len(text)) + 1):
        if any(end < len(text) - 1 for end in occurrences(text, text[-length:])):
            best = length
        else:
            break
    return best


def random_text(rng: random.Random, n: int, alphabet: int) -> list[int]:
    if rng.random() < 0.3:  # a loop now and then, as models make
        period = rng.randint(1, 4)
        unit = [rng.randrange(alphabet) for _ in range(period)]
        return (unit * n)[:n]
    return [rng.randrange(alphabet) for _ in range(n)]


def check_matches(index: SuffixIndex, limit: int, min_length: int = 1) -> list[Match]:
    held, offset, last = index.tokens, index.offset, len(index) - 1
    found = index.matches(limit, min_length)
    assert len(found) <= limit
    assert [m.length for m in found] == sorted((m.length for m in found), reverse=True)
    assert len({m.end for m in found}) == len(found)
    for length, end in found:
        assert length >= min_length and offset + length - 1 <= end < last  # strictly before the last token
        local = end - offset
        assert held[local - length + 1:local + 1] == held[-length:]  # a real earlier occurrence of the ending
    longest = longest_earlier_ending(held)
    if longest >= min_length and limit:
        assert found and found[0].length == longest
    else:
        assert not found
    return found


@pytest.mark.parametrize("seed", range(6))
def test_matches_and_continuations_are_real_earlier_occurrences(seed):
    rng = random.Random(seed)
    text = random_text(rng, rng.randint(50, 300), rng.choice([2, 3, 5]))
    index = SuffixIndex()
    done = 0
    while done < len(text):
        step = rng.randint(1, 6)
        index.extend(text[done:done + step])
        done = min(done + step, len(text))
        assert len(index) == done and index.tokens == text[:done]
        for length, end in check_matches(index, limit=rng.randint(1, 8), min_length=rng.randint(1, 3)):
            n = rng.randint(1, 10)
            assert index.continuation(end, n) == text[end + 1:min(end + 1 + n, done)]


def test_a_matched_state_points_at_the_most_recent_occurrence_it_was_matched_at():
    index = SuffixIndex()
    index.extend([1, 2, 3, 9, 2, 3])
    assert index.matches(1) == [Match(2, 2)]
    assert index.matches(1) == [Match(2, 2)]  # reading twice before an append reads the same
    index.extend([])
    assert index.matches(1) == [Match(2, 2)]  # appending nothing too
    index.extend([8, 2, 3])
    assert index.matches(1) == [Match(2, 5)]
    assert index.continuation(5, 5) == [8, 2, 3]  # runs into the recent text, not past its end


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("count_depth", [None, 4])
def test_counts_and_continuations_equal_brute_force(seed, count_depth):
    rng = random.Random(seed)
    text = random_text(rng, rng.randint(60, 250), rng.choice([2, 3, 4]))
    index = SuffixIndex(counts=True, count_depth=count_depth)
    cut = rng.randint(1, len(text) - 1)
    index.extend(text[:cut])
    index.extend(text[cut:])
    deepest = count_depth or 8
    for _ in range(60):
        length = rng.randint(1, deepest)
        start = rng.randrange(len(text) - length + 1)
        pattern = text[start:start + length]
        state, matched = index.find(pattern)
        assert matched == length and index.count(state) == len(occurrences(text, pattern))
        following = index.next_counts(state, length)
        if length + 1 > deepest and count_depth:
            assert following == {}
            continue
        expected = {}
        for end in occurrences(text, pattern):
            if end + 1 < len(text):
                expected[text[end + 1]] = expected.get(text[end + 1], 0) + 1
        assert {token: count for token, (count, _) in following.items()} == expected
        for token, (count, child) in following.items():
            assert index.count(child) == count == len(occurrences(text, pattern + [token]))
    for cap in (1, 2, 3, count_depth or 12):
        state, matched = index.match_state(cap)
        assert matched == longest_earlier_ending(text, cap)
        if matched:
            assert index.count(state) == len(occurrences(text, text[-matched:])) >= 2


def test_find_matches_the_longest_ending_of_a_foreign_pattern():
    index = SuffixIndex(counts=True)
    index.extend([5, 6, 7, -1, 6, 7, 8, -2])  # two outputs, each closed by its own separator
    assert index.find([1, 2, 6, 7]) == (index.find([6, 7])[0], 2)
    assert index.find([7, -1, 6])[1] == 3 and index.find([9])[1] == 0
    assert index.find([7, 6])[1] == 1  # "7 6" never occurs: only the last token matches
    state, _ = index.find([6, 7])
    assert {token: count for token, (count, _) in index.next_counts(state, 2).items()} == {-1: 1, 8: 1}


@pytest.mark.parametrize("seed", range(4))
def test_rebuilds_keep_positions_and_answers(seed):
    rng = random.Random(seed)
    text = random_text(rng, 300, 3)
    index = SuffixIndex(max_tokens=20, counts=True, count_depth=5)
    plain = SuffixIndex(max_tokens=20)
    for i in range(0, len(text), 7):
        index.extend(text[i:i + 7])
        plain.extend(text[i:i + 7])
        held = index.tokens
        assert len(index) == min(i + 7, len(text)) and 20 <= len(held) <= 40 or len(index) < 20
        assert held == text[index.offset:len(index)]
        for length, end in check_matches(plain, limit=4):
            assert plain.continuation(end, 3) == text[end + 1:min(end + 4, len(plain))]
        state, matched = index.match_state(5)
        assert matched == longest_earlier_ending(held, 5)
        if matched:
            assert index.count(state) == len(occurrences(held, held[-matched:]))
    assert index.offset > 0
    with pytest.raises(ValueError, match="dropped"):
        index.continuation(index.offset - 2, 3)


def test_memory_estimate_grows_with_the_text():
    index = SuffixIndex()
    small = index.nbytes()
    index.extend(range(1000))
    assert index.nbytes() > small + 1000 * 50
