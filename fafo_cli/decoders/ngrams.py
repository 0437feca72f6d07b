"""The two-level LRU table behind FAFO's n-gram pool and Cacheback's follower table.

A key (a tuple of tokens) maps to at most `per_key` entries (tuples of tokens), and at most `max_keys` keys
are kept; past either bound the least recently used one goes. Inserting a pair refreshes both its key and
its entry (inserting a known pair only refreshes it). Reading never refreshes entries, so their order
records what the text did most recently; whether it refreshes the key is the caller's rule (Cacheback's
leaders are refreshed by reads, FAFO's pool keys are not). Host memory only.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Iterator

Tokens = tuple[int, ...]


class LruTable:
    def __init__(self, per_key: int, max_keys: int):
        self.per_key, self.max_keys = per_key, max_keys
        # Oldest first at both levels: popitem(last=False) evicts, move_to_end refreshes.
        self._keys: OrderedDict[Tokens, OrderedDict[Tokens, None]] = OrderedDict()
        self.entries = 0  # stored (key, entry) pairs

    def __len__(self) -> int:
        """The number of keys stored."""
        return len(self._keys)

    def __iter__(self) -> Iterator[Tokens]:
        """The keys, least recently used first."""
        return iter(self._keys)

    def insert(self, key: Tokens, entry: Tokens) -> None:
        """Store `entry` under `key`, making both the most recently used."""
        keys = self._keys
        entries = keys.get(key)
        if entries is None:
            entries = keys[key] = OrderedDict()
            if len(keys) > self.max_keys:
                _, evicted = keys.popitem(last=False)
                self.entries -= len(evicted)
        else:
            keys.move_to_end(key)
        if entry in entries:
            entries.move_to_end(entry)
            return
        if len(entries) < self.per_key:
            self.entries += 1
        else:
            entries.popitem(last=False)  # the new entry takes the least recently used one's place
        entries[entry] = None

    def read(self, key: Tokens, refresh: bool = False) -> Iterable[Tokens]:
        """`key`'s entries, most recent first, none for an unknown key; with `refresh` a known key becomes the
        most recently used. What it returns reads the live table: finish with it before the next insert."""
        entries = self._keys.get(key)
        if entries is None:
            return ()
        if refresh:
            self._keys.move_to_end(key)
        return reversed(entries)

    def snapshot(self) -> dict[Tokens, list[Tokens]]:
        """Every key, least recently used first, with its entries most recent first; no LRU effects."""
        return {key: list(reversed(entries)) for key, entries in self._keys.items()}
