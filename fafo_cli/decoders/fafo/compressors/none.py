"""`none`: the fumble rows see the whole cache (Lookahead-style fumbling; the ablation baseline)."""

from __future__ import annotations

from ....runtime.cache import KVCache


class NoCompressor:
    name = "none"

    def rebuild(self, cache: KVCache) -> None:
        pass

    def prepare(self, cache: KVCache) -> None:
        pass

    def committed(self, cache: KVCache, start: int, count: int) -> None:
        pass

    def view(self, layer: int) -> None:
        return None

    def view_size(self, cache: KVCache) -> int:
        return cache.length

    def view_mask(self, cache: KVCache) -> None:
        return None

    def nbytes(self) -> int:
        return 0  # no copy: the fumble rows read the cache itself
