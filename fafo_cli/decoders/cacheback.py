"""Cacheback: draft a tree from LRU n-gram tables, verify it with tree attention in one pass.

The dynamic table (leader = last `cacheback_leader` tokens -> up to `cacheback_followers` followers of
`cacheback_follower` tokens, both levels LRU; `ngram_table.py`) is seeded with the prompt and learns
the text as it is accepted; an optional frozen table built offline from a corpus is consulted after it.
The tree grows level by level: every node of the frontier is extended by the followers of its path's last
tokens, as whole chunks, merged where they share a prefix. Each level spends at most half of the budget
left (at least one chunk), so deeper levels always keep room.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Iterator

from ..runtime.events import Step
from .ngram_table import FollowerTable, FrozenTable, table_file, tokenizer_fingerprint
from ..runtime.session import Emitter, Request, Session
from .tree import ROOT, DraftTree
from ..errors import FafoError
from . import speculative
from .speculative import Draft


@lru_cache(maxsize=4)
def _frozen_table(path: str, modified_ns: int, fingerprint: str) -> FrozenTable:
    return FrozenTable.load(path, fingerprint)


def load_frozen_table(path: str, tokenizer) -> FrozenTable:
    """The frozen table at `path`, loaded once per file version."""
    path = str(table_file(path))
    try:
        modified = os.stat(path).st_mtime_ns
    except OSError as e:
        raise FafoError(f"cannot read cacheback table {path}: {e.strerror}") from None
    return _frozen_table(path, modified, _fingerprint(tokenizer))


@lru_cache(maxsize=4)
def _fingerprint(tokenizer) -> str:
    return tokenizer_fingerprint(tokenizer)


class Cacheback:
    runs_model = False

    def __init__(self, config, frozen: FrozenTable | None):
        self.dynamic = FollowerTable(config.cacheback_leader, config.cacheback_follower, config.cacheback_followers,
                                     config.cacheback_leaders)
        self.frozen = frozen
        self.budget = self.max_rows = config.cacheback_budget

    def start(self, session: Session, request: Request, text: list[int], draws) -> None:
        self.dynamic.add_text(text)

    def _followers(self, context: list[int]) -> list[tuple[int, ...]]:
        found = self.dynamic.lookup(context[-self.dynamic.leader_length:])
        if self.frozen is not None and len(context) >= self.frozen.leader_length:
            found += [f for f in self.frozen.lookup(context[-self.frozen.leader_length:]) if f not in found]
        return found

    def draft(self, text: list[int], room: int) -> Draft:
        tree = DraftTree()
        chunk = self.dynamic.follower_length
        left = min(self.budget, room)
        frontier = [ROOT]
        tail = text[-max(self.dynamic.leader_length, self.frozen.leader_length if self.frozen else 0):]
        while frontier and left > 0:
            quota = left if left <= chunk else max(chunk, (left + 1) // 2)  # this level's share of what is left
            spent, grown = 0, []
            for node in frontier:
                context = tail + [tree.tokens[i] for i in tree.path(node)]  # leaders read only the end
                for follower in self._followers(context):
                    if spent >= quota:
                        break
                    whole = len(follower) <= quota - spent
                    before = len(tree)
                    end = tree.add_chain(follower[:quota - spent], parent=node)
                    spent += len(tree) - before
                    if whole and end not in grown:
                        grown.append(end)  # only whole chunks are extended at the next level
            if spent == 0:
                break
            left -= spent
            frontier = grown
        return Draft(tree)

    def accepted(self, text: list[int], new: int) -> None:
        self.dynamic.add_text(text, new=new)

    def nbytes(self) -> int:
        return 0  # host-memory tables: inside the process's peak memory, not a second cache


def generate(session: Session, request: Request, emitter: Emitter) -> Iterator[Step]:
    config = request.config
    table = config.cacheback_table
    frozen = load_frozen_table(table, session.tokenizer) if table else None
    yield from speculative.generate(session, request, emitter, Cacheback(config, frozen))
