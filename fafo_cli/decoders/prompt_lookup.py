"""Prompt lookup: copy what followed the last earlier occurrence of the text's ending.

The last `lookup_ngram` tokens (then fewer, down to one) are looked up among the earlier text, prompt and
output alike; the `lookup_tokens` tokens that followed the most recent earlier occurrence are the draft, one
chain verified in one pass. An index of every n-gram's latest end position is kept up to date as the text
grows, so a lookup costs the same at any context length.
"""

from __future__ import annotations

from typing import Iterator

from ..runtime.events import Step
from ..runtime.session import Emitter, Request, Session
from .tree import DraftTree
from . import speculative
from .speculative import Draft


class PromptLookup:
    runs_model = False

    def __init__(self, longest: int, tokens: int):
        self.longest, self.tokens = longest, tokens
        self.max_rows = tokens
        self._last_end: dict[tuple[int, ...], int] = {}  # n-gram -> index of its last token, latest occurrence
        self._indexed = 0  # n-grams ending before this index are in the index

    def start(self, session: Session, request: Request, text: list[int], draws) -> None:
        pass

    def _index(self, text: list[int], end: int) -> None:
        for i in range(self._indexed, end):
            for n in range(1, min(self.longest, i + 1) + 1):
                self._last_end[tuple(text[i - n + 1:i + 1])] = i
        self._indexed = max(self._indexed, end)

    def draft(self, text: list[int], room: int) -> Draft:
        # index every n-gram ending before the anchor: the anchor's own suffix must find an earlier occurrence
        self._index(text, len(text) - 1)
        tree = DraftTree()
        limit = min(self.tokens, room)
        for n in range(min(self.longest, len(text)), 0, -1):
            end = self._last_end.get(tuple(text[-n:]))
            if end is not None and limit > 0:
                tree.add_chain(text[end + 1:end + 1 + limit])
                break
        return Draft(tree)

    def accepted(self, text: list[int], new: int) -> None:
        pass

    def nbytes(self) -> int:
        return 0  # the index is host memory, a few dict entries per token (inside the process's peak memory)


def generate(session: Session, request: Request, emitter: Emitter) -> Iterator[Step]:
    config = request.config
    yield from speculative.generate(session, request, emitter, PromptLookup(config.lookup_ngram, config.lookup_tokens))
