"""Where did the text's ending occur before, and what followed: one online suffix automaton over token ids.

`SuffixIndex` is the single index of that question: SuffixDecoding's drafter reads it (with occurrence counts, to
score continuations by how often they followed), and long copy drafts read it (without counts, most recent
occurrence first). Tokens are appended as they are committed; each costs O(1) amortised (the standard online
construction: states with `len`, `link`, `next`, kept in parallel lists, which CPython reads faster than objects).

A state stands for a set of substrings that end at the same positions (its endpos); the strings of the state
reached from the last state by suffix links are exactly the text's endings, longest first. So the longest ending
that occurred before is the last state's link, and shorter ones follow by links.

Positions are indices into the full appended sequence, whatever was dropped: past 2 × `max_tokens` held tokens
the index is rebuilt over the last `max_tokens` (amortised O(1) per token, bounded memory for long chats);
`offset` is the position of the first token still held, `len(index)` the number of tokens ever appended.

Recency (`matches`): each state keeps one end position, set when it is created (a clone copies its original's),
and every state a match is read from records the end at which it was matched, applied at the next `extend`
(so reading twice between appends reads the same). Next time that state is matched it points at the most recent
occurrence at which it was matched before, so copies follow what the text did last. Every stored end is in its
state's endpos (the recorded one too: the state held the text's ending then), so a match is always a real
earlier occurrence.

Counts (`counts=True`): each state's |endpos|, exact online: every new token adds one to each state on the
suffix-link chain of the text's new ending, which costs O(length of the longest repeated ending) per token, and
a model caught in a loop makes that long; `count_depth` bounds it: counts are then exact for the states whose shortest string
has at most `count_depth` tokens (the walk starts at the state of the ending of that length, tracked as tokens
arrive), enough for a caller that never matches or drafts deeper.
"""

from __future__ import annotations

import heapq
import itertools
import sys
from typing import Iterable, NamedTuple, Sequence


class Continuation(NamedTuple):
    parent: int  # the node this token follows (its index in the list; -1: the text's ending itself)
    token: int
    probability: float  # of the whole path from the text's ending: the product of `given` along it
    given: float  # how often this token followed its parent's string, of how often anything did


class Match(NamedTuple):
    length: int  # tokens of the text's ending that occurred before
    end: int  # position of the last token of that earlier occurrence (before the text's last token)


class SuffixIndex:
    def __init__(self, max_tokens: int = 1 << 16, counts: bool = False, count_depth: int | None = None):
        if max_tokens < 1 or count_depth is not None and count_depth < 1:
            raise ValueError("max_tokens and count_depth must be at least 1")
        self.max_tokens, self.counts, self.count_depth = max_tokens, counts, count_depth if counts else None
        self.offset = 0  # position of tokens[0] in the full appended sequence
        self._reset([])

    def _reset(self, tokens: list[int]) -> None:
        self.tokens: list[int] = []  # the tokens held (the last ones appended)
        self._len = [0]  # the longest string of each state; state 0 is the root (the empty string)
        self._link = [-1]  # suffix link: the state of the longest suffix with a different endpos
        self._next: list[dict[int, int]] = [{}]  # transitions: token -> state
        self._end = [-1]  # one position of the state's endpos (see Recency above)
        self._count = [0]  # |endpos| (with counts; see Counts above)
        self._last = 0  # the state of the whole text
        self._edges = 0  # transitions stored (for nbytes)
        self._pending: list[int] = []  # states matched since the last extend: they record that end
        self._deep, self._deep_length = 0, 0  # the state of the text's ending of min(count_depth, n) tokens
        self.extend(tokens)

    def __len__(self) -> int:
        """Tokens appended so far (the position after the last one)."""
        return self.offset + len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append committed tokens."""
        tokens = list(tokens)
        if not tokens:
            return
        if self._pending:
            now = len(self) - 1
            for state in self._pending:
                self._end[state] = now
            self._pending = []
        done = 0
        while done < len(tokens):
            room = 2 * self.max_tokens - len(self.tokens)
            if room <= 0:
                self._rebuild()
                continue
            self._append(tokens[done:done + room])
            done += room

    def _rebuild(self) -> None:
        keep = self.tokens[-self.max_tokens:]
        self.offset += len(self.tokens) - len(keep)
        self._reset(keep)

    def _append(self, tokens: Sequence[int]) -> None:
        length, link, nexts, ends, count = self._len, self._link, self._next, self._end, self._count
        counts, depth = self.counts, self.count_depth
        last, edges = self._last, self._edges
        deep, deep_length = self._deep, self._deep_length
        position = len(self)
        for token in tokens:
            cur = len(length)
            length.append(length[last] + 1)
            link.append(0)
            nexts.append({})
            ends.append(position)
            count.append(0)
            p = last
            while p != -1 and token not in nexts[p]:
                nexts[p][token] = cur
                edges += 1
                p = link[p]
            if p != -1:
                q = nexts[p][token]
                if length[p] + 1 == length[q]:
                    link[cur] = q
                else:  # split q: its strings up to length[p] + 1 also end here now
                    clone = len(length)
                    length.append(length[p] + 1)
                    link.append(link[q])
                    nexts.append(nexts[q].copy())
                    edges += len(nexts[q])
                    ends.append(ends[q])
                    count.append(count[q])
                    while p != -1 and nexts[p].get(token) == q:
                        nexts[p][token] = clone
                        p = link[p]
                    link[q] = link[cur] = clone
            last = cur
            position += 1
            if counts:
                if depth is None:
                    state = cur
                else:  # the ending of min(depth, n) tokens: one token longer than before, then trimmed
                    if deep and length[link[deep]] >= deep_length:  # a split moved that string to a clone
                        deep = link[deep]
                    deep = nexts[deep][token]
                    deep_length += 1
                    if deep_length > depth:
                        deep_length = depth
                        if length[link[deep]] >= depth:
                            deep = link[deep]
                    state = deep
                while state > 0:
                    count[state] += 1
                    state = link[state]
        self.tokens.extend(tokens)
        self._last, self._edges, self._deep, self._deep_length = last, edges, deep, deep_length

    # --- most recent earlier occurrences (copy drafts) ---

    def matches(self, limit: int, min_length: int = 1) -> list[Match]:
        """Earlier occurrences of the text's ending, longest first, each end position once: the longest ending
        that occurred before, then shorter ones by suffix links; at most `limit`, none shorter than
        `min_length`. Each is the most recent occurrence at which that state was last matched (module doc)."""
        found: list[Match] = []
        seen: set[int] = set()
        length, link, ends = self._len, self._link, self._end
        state = link[self._last] if self._last else 0
        while state > 0 and len(found) < limit and length[state] >= min_length:
            end = ends[state]
            if end not in seen:
                seen.add(end)
                found.append(Match(length[state], end))
            self._pending.append(state)
            state = link[state]
        return found

    def continuation(self, end: int, n: int) -> list[int]:
        """The up-to-`n` tokens after position `end` (may run into the recent text, never past its end)."""
        start = end + 1 - self.offset
        if start < 0:
            raise ValueError(f"position {end} was dropped (the index holds positions from {self.offset})")
        return self.tokens[start:start + n]

    # --- continuations with their frequencies (counts=True) ---

    def match_state(self, max_length: int | None = None) -> tuple[int, int]:
        """(state, length): the longest ending of the text, of at most `max_length` tokens, that occurred before,
        and the state holding it; (0, 0) when none did (state 0 is the root)."""
        length, link = self._len, self._link
        if self.count_depth is not None:
            state, matched = self._deep, self._deep_length
        else:
            state, matched = self._last, length[self._last]
        if max_length is not None and max_length < 1:
            return 0, 0
        if max_length is not None and matched > max_length:
            while length[link[state]] >= max_length:
                state = link[state]
            matched = max_length
        if state == self._last and state:  # that ending occurs only at the end: the longest earlier one is shorter
            state = link[state]
            matched = length[state]
        return state, matched

    def find(self, pattern: Sequence[int]) -> tuple[int, int]:
        """(state, length): the longest ending of `pattern` that occurs anywhere in the indexed text, and the state
        holding it; (0, 0) when none does. O(len(pattern)) amortised."""
        length, link, nexts = self._len, self._link, self._next
        state, matched = 0, 0
        for token in pattern:
            while state and token not in nexts[state]:
                state = link[state]
                matched = length[state]
            state = nexts[state].get(token, 0)
            matched = matched + 1 if state else 0
        return state, matched

    def next_counts(self, state: int, length: int) -> dict[int, tuple[int, int]]:
        """For `state` holding a string of `length` tokens: each token that followed it, with (how many times,
        the state of the string one token longer). The count of that state is the count of the string + token:
        all strings of a state share their endpos, even when the state holds longer ones. Empty past
        `count_depth` (counts are not kept there) or without counts."""
        count = self._count
        return {token: (count[child], child) for token, child in self._followers(state, length).items()}

    def _followers(self, state: int, length: int) -> dict[int, int]:
        """`state`'s transitions (token -> state) where the counts of their states are kept, else none."""
        if not self.counts or self.count_depth is not None and length + 1 > self.count_depth:
            return {}
        return self._next[state]

    def given(self, state: int, length: int, smoothing: int = 0) -> list[float]:
        """How often each token (no separator) that followed the string of `state` followed it, as `likeliest`
        gives its first tokens."""
        following, count = self._followers(state, length), self._count
        total = sum(count[child] for child in following.values()) + smoothing
        return [count[child] / total for token, child in following.items() if token >= 0]

    def likeliest(self, state: int, length: int, limit: int, min_prob: float, smoothing: int = 0) -> list[Continuation]:
        """Up to `limit` continuations of the string of `state` (`length` tokens), grown best first by probability:
        a token's `given` is how often it followed its parent's string over how often anything did (plus
        `smoothing` in the denominator: one occurrence then says 1/2, not certainty); none below `min_prob`.
        Parents come before their children. Separators (negative ids) end a path."""
        nodes: list[Continuation] = []
        if limit <= 0:  # (no match, or no room: nothing to scan the root's followers for)
            return nodes
        heap: list = []  # (-probability, order, token, state, length, parent, given)
        order = itertools.count()  # ties: earlier offered first

        count = self._count

        def offer(state: int, length: int, probability: float, parent: int) -> None:
            # next_counts' answer read in place: this runs for every node of every step's tree
            following = self._followers(state, length)
            total = sum(count[child] for child in following.values()) + smoothing
            for token, child in following.items():
                given = count[child] / total
                if token >= 0 and probability * given >= min_prob:
                    heapq.heappush(heap, (-probability * given, next(order), token, child, length + 1, parent, given))

        offer(state, length, 1.0, -1)
        while heap and len(nodes) < limit:
            probability, _, token, child, depth, parent, given = heapq.heappop(heap)
            nodes.append(Continuation(parent, token, -probability, given))
            offer(child, depth, -probability, len(nodes) - 1)
        return nodes

    def count(self, state: int) -> int:
        """How many times the strings of `state` occur in the held text (with counts)."""
        return self._count[state]

    def nbytes(self) -> int:
        """Approximate host memory (CPython sizes): the lists, a small transition dict and two int objects per
        state (its length and end), and the entries of the dicts past one each."""
        states = len(self._len)
        lists = sum(sys.getsizeof(values) for values in (self._len, self._link, self._next, self._end, self._count,
                                                          self.tokens))
        return lists + states * (_SMALL_DICT + 2 * _INT) + max(0, self._edges - states) * _EDGE


_INT = sys.getsizeof(1 << 20)  # an int beyond the small-int cache
_SMALL_DICT = sys.getsizeof({0: 0})  # most states have one or two transitions
_EDGE = (sys.getsizeof(dict.fromkeys(range(11))) - _SMALL_DICT) // 10  # each further entry, amortised
