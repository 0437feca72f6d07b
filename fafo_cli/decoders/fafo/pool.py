"""The n-gram pool: guesses keyed by the tokens that preceded them, retrieved longest key first.

The pool holds what the lookahead window found (copies from the text come from the suffix index instead). Keys
are tuples of 1..P tokens. An n-gram is stored under every suffix of its preceding tokens, each key holding at
most `per_key` n-grams in LRU order (re-inserting refreshes). The number of keys is bounded too (least recently
used key evicted), so a long chat cannot grow the pool without limit. A lookup leaves the LRU order as it is.
Host memory only; the two-level LRU table is Cacheback's too (`decoders/ngrams.py`).
"""

from __future__ import annotations

from typing import Sequence

from ..ngrams import LruTable, Tokens

NGram = Tokens


class NgramPool:
    def __init__(self, ngram: int, prefix: int, per_key: int, max_keys: int = 200_000):
        self.ngram, self.prefix = ngram, prefix
        self._table = LruTable(per_key, max_keys)

    @property
    def keys(self) -> int:
        return len(self._table)

    @property
    def ngrams(self) -> int:
        """Stored (key, n-gram) entries."""
        return self._table.entries

    def add(self, before: Sequence[int], ngram: NGram) -> None:
        """Store `ngram` under every suffix (length 1..P) of the tokens `before` it."""
        before = tuple(before[-self.prefix:])
        insert = self._table.insert
        for length in range(1, len(before) + 1):
            insert(before[-length:], ngram)

    def lookup(self, text: Sequence[int], limit: int) -> list[tuple[NGram, int]]:
        """Up to `limit` distinct n-grams to follow `text`, each with the length of the key it was found under:
        longest matching key first, newest first."""
        found: dict[NGram, int] = {}  # a dict keeps the first place of an n-gram met again
        if limit <= 0:
            return []
        read = self._table.read
        tail = tuple(text[-self.prefix:])
        for length in range(len(tail), 0, -1):
            for ngram in read(tail[-length:]):
                found.setdefault(ngram, length)
                if len(found) >= limit:
                    return list(found.items())
        return list(found.items())
