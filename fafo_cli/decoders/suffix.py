"""SuffixDecoding: a draft tree from suffix indexes of this request's text and of the session's earlier answers.

Two indexes with occurrence counts (`suffix_index.SuffixIndex`): one over this request's prompt and output,
extended as tokens are accepted, and one over the session's earlier answers (`History`, kept on
`session.learned`). Each step, each index finds the longest ending of the text, at most `suffix_depth` tokens,
that it holds earlier (p tokens), and grows a tree from there best first by empirical probability: how often a
token followed its path's string over how often anything did, multiplied along the path. A token whose
probability falls below `suffix_min_prob` is not drafted, and an index drafts at most α·p tokens
(`suffix_factor`), so a long match earns a long draft and a short one a short draft. Both indexes grow one tree
(a token both propose under the same parent is one row) of at most `suffix_tokens` nodes, most probable first,
which the shared loop (`speculative.py`) verifies in one pass.

Earlier answers change the guesses, never the output: it is plain decoding's whatever is drafted, sampled output
too (the same seed gives the same sample whatever the session answered before).
"""

from __future__ import annotations

import sys
from collections import deque
from typing import Iterator

from ..runtime.events import Step
from ..runtime.session import Emitter, Request, Session
from .suffix_index import SuffixIndex
from .tree import ROOT, DraftTree
from . import speculative
from .speculative import Draft

HISTORY_TOKENS = 1 << 15  # earlier answers' tokens indexed: between this and twice this many (index rebuilds)


class History:
    """The session's earlier answers in one index, each closed by a separator of its own (a negative id, which
    no token has), so no match runs from one answer into the next. Past 2 × `keep` answers, or 2 × HISTORY_TOKENS
    tokens of them, it is rebuilt over the last `keep`, of which only the newest HISTORY_TOKENS tokens' worth are
    kept (the index itself keeps at most 2 × HISTORY_TOKENS tokens: older ones would be indexed to be dropped)."""

    def __init__(self, keep: int, count_depth: int):
        self.keep, self.count_depth = keep, count_depth
        self.answers: deque[list[int]] = deque()
        self._rebuild()

    def _rebuild(self) -> None:
        self.index = SuffixIndex(HISTORY_TOKENS, counts=True, count_depth=self.count_depth)
        self._separator = -1
        tokens = 0
        for kept, answer in enumerate(reversed(self.answers)):
            tokens += len(answer) + 1
            if tokens > HISTORY_TOKENS and kept:
                self.answers = deque(list(self.answers)[-kept:])
                break
        self.tokens = 0  # the kept answers' tokens, separators included
        for answer in self.answers:
            self._index(answer)

    def _index(self, answer: list[int]) -> None:
        self.index.extend(answer + [self._separator])
        self._separator -= 1
        self.tokens += len(answer) + 1

    def configure(self, keep: int, count_depth: int) -> None:
        """This request's settings: deeper counts than the index keeps need a new one (a shallower request reads the
        deeper one alike: requests that take turns rebuilt it each time); fewer answers kept drop the oldest."""
        if count_depth > self.count_depth or len(self.answers) > 2 * keep:
            self.keep, self.count_depth = keep, max(count_depth, self.count_depth)
            while len(self.answers) > keep:
                self.answers.popleft()
            self._rebuild()
        self.keep = keep

    def add(self, answer: list[int]) -> None:
        if not answer or not self.keep:
            return
        self.answers.append(list(answer))
        if len(self.answers) > 2 * self.keep or self.tokens + len(answer) + 1 > 2 * HISTORY_TOKENS:
            while len(self.answers) > self.keep:
                self.answers.popleft()
            self._rebuild()
        else:
            self._index(self.answers[-1])

    def nbytes(self) -> int:
        """Approximate host memory: the index and the answers it is rebuilt from."""
        return self.index.nbytes() + sum(sys.getsizeof(answer) for answer in self.answers)


class Suffix:
    runs_model = False

    def __init__(self, config, history: History | None):
        self.depth, self.factor, self.min_prob = config.suffix_depth, config.suffix_factor, config.suffix_min_prob
        self.max_rows = config.suffix_tokens
        # counts are read down to the deepest draft: the match, then at most suffix_tokens tokens below it
        self.text = SuffixIndex(counts=True, count_depth=count_depth(config))
        self.history = history  # None: drafts from this request's text only

    def start(self, session: Session, request: Request, text: list[int], draws) -> None:
        self.text.extend(text)

    def draft(self, text: list[int], room: int) -> Draft:
        limit = min(self.max_rows, room)
        matches = [(self.text, self.text.match_state(self.depth))]
        if self.history is not None:
            matches.append((self.history.index, self.history.index.find(text[-self.depth:])))
        # each index's likeliest continuations, at most α·p of them; then all of them most probable first (ties:
        # the request's own text first), a token both propose under the same parent one row
        offered = sorted((-node.probability, source, position, node)
                         for source, (index, (state, length)) in enumerate(matches)
                         for position, node in enumerate(index.likeliest(
                             state, length, min(limit, int(self.factor * length + 1e-6)), self.min_prob)))
        tree, placed = DraftTree(), {}
        for _, source, position, node in offered:
            if len(tree) >= limit:
                break
            parent = ROOT if node.parent < 0 else placed[source, node.parent]
            placed[source, position] = tree.add_chain([node.token], parent)
        return Draft(tree)

    def accepted(self, text: list[int], new: int) -> None:
        self.text.extend(text[-new:])

    def nbytes(self) -> int:
        # host memory, estimated: unlike an n-gram table's, the indexes' share of a long text is not small
        return self.text.nbytes() + (self.history.nbytes() if self.history else 0)


def count_depth(config) -> int:
    return config.suffix_depth + config.suffix_tokens


def generate(session: Session, request: Request, emitter: Emitter) -> Iterator[Step]:
    config = request.config
    history = session.learned.get("suffix")
    if config.suffix_outputs:
        if history is None:
            history = session.learned["suffix"] = History(config.suffix_outputs, count_depth(config))
        history.configure(config.suffix_outputs, count_depth(config))
    drafter = Suffix(config, history if config.suffix_outputs else None)
    try:
        yield from speculative.generate(session, request, emitter, drafter)
    finally:  # the answer as emitted (an interrupted one too) joins the history
        if config.suffix_outputs:
            history.add(emitter.token_ids)
