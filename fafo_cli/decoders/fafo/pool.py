"""The n-gram pool: guesses keyed by the tokens that preceded them, retrieved longest key first.

Keys are tuples of 1..P tokens. An n-gram is stored under every suffix of its preceding tokens, each key
holding at most `per_key` n-grams in LRU order (re-inserting refreshes). The number of keys is bounded
too (least recently used key evicted), so a long chat cannot grow the pool without limit. Host memory only.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

NGram = tuple[int, ...]


class NgramPool:
    def __init__(self, ngram: int, prefix: int, per_key: int, max_keys: int = 200_000):
        self.ngram, self.prefix, self.per_key, self.max_keys = ngram, prefix, per_key, max_keys
        self._table: OrderedDict[NGram, OrderedDict[NGram, None]] = OrderedDict()
        self.ngrams = 0  # stored (key, n-gram) entries

    @property
    def keys(self) -> int:
        return len(self._table)

    def add(self, before: Sequence[int], ngram: NGram) -> None:
        """Store `ngram` under every suffix (length 1..P) of the tokens `before` it."""
        for length in range(1, min(self.prefix, len(before)) + 1):
            key = tuple(before[-length:])
            entries = self._table.get(key)
            if entries is None:
                entries = self._table[key] = OrderedDict()
                if len(self._table) > self.max_keys:
                    _, evicted = self._table.popitem(last=False)
                    self.ngrams -= len(evicted)
            else:
                self._table.move_to_end(key)
            if ngram in entries:
                entries.move_to_end(ngram)
                continue
            entries[ngram] = None
            self.ngrams += 1
            if len(entries) > self.per_key:
                entries.popitem(last=False)
                self.ngrams -= 1

    def add_text(self, tokens: Sequence[int], new: int | None = None) -> None:
        """Seed with the n-grams of `tokens`; with `new`, only those ending in its last `new` tokens."""
        n = self.ngram
        first = 1 if new is None else max(1, len(tokens) - new - n + 1)  # only the tail is read
        for start in range(first, len(tokens) - n + 1):
            self.add(tokens[max(0, start - self.prefix):start], tuple(tokens[start:start + n]))

    def lookup(self, text: Sequence[int], limit: int) -> list[NGram]:
        """Up to `limit` distinct n-grams to follow `text`: longest matching key first, newest first."""
        found: dict[NGram, None] = {}
        if limit <= 0:
            return []
        for length in range(min(self.prefix, len(text)), 0, -1):
            entries = self._table.get(tuple(text[-length:]))
            if not entries:
                continue
            for ngram in reversed(entries):
                found.setdefault(ngram, None)
                if len(found) >= limit:
                    return list(found)
        return list(found)
