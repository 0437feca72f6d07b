"""Conversations kept besides the live one, so that several clients taking turns each prefill only their new tokens.

The session's cache holds one conversation. When a request would cut it (another client's conversation comes
in), a copy of its keys, values and decoder state (`Session.carry`) is kept here; a later request that shares more
of its tokens with a kept conversation than with the live one gets it copied back before its prefill. Copying a
conversation's keys and values costs far less than computing them again.

Bounded twice: by count, least recently used dropped first, and by bytes, so long contexts cannot grow the
server's memory without limit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences have in common."""
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length


@dataclass
class KeptConversation:
    ids: list[int]  # the tokens whose keys and values are kept
    keys: torch.Tensor  # [layer, position, kv_head, dim], in the model's dtype
    values: torch.Tensor
    carry: dict  # the decoders' state that follows this conversation

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


class KeptConversations:
    def __init__(self, count: int, max_bytes: int):
        self.count, self.max_bytes = count, max_bytes
        self.entries: list[KeptConversation] = []  # least recently used first

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self.entries)

    def best(self, ids: list[int]) -> tuple[KeptConversation | None, int]:
        """The kept conversation sharing the longest prefix with `ids`, and that length (None, 0: none shares any)."""
        found, longest = None, 0
        for entry in self.entries:
            length = shared_prefix(entry.ids, ids)
            if length > longest:
                found, longest = entry, length
        return found, longest

    def take(self, entry: KeptConversation) -> KeptConversation:
        """Remove an entry to make it live again."""
        self.entries.remove(entry)
        return entry

    def takes(self, nbytes: int) -> bool:
        """Whether a conversation of `nbytes` could be kept at all."""
        return self.count > 0 and nbytes <= self.max_bytes

    def keep(self, entry: KeptConversation) -> None:
        """Keep a conversation as the most recent one (`make_room` first)."""
        if not self.takes(entry.nbytes):
            return
        self.make_room(entry.ids, entry.nbytes)
        self.entries.append(entry)

    def make_room(self, ids: list[int], nbytes: int) -> None:
        """Drop what keeping a conversation of `ids` and `nbytes` drops: kept ones that are a prefix of it (it serves
        whatever they would), then the least recently used until both bounds hold with it. Called before its copy is
        made too, so that the kept copies stay within the bound while it is (a conversation taken back to be the live
        one is the live cache's, not counted)."""
        self.entries = [kept for kept in self.entries if shared_prefix(kept.ids, ids) < len(kept.ids)]
        while self.entries and (len(self.entries) >= self.count or self.nbytes + nbytes > self.max_bytes):
            self.entries.pop(0)

    def clear(self) -> None:
        self.entries.clear()
