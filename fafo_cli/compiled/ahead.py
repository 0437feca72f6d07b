"""`fafo compile`: build a method's compiled steps before its first use.

Each method runs once on a short prompt with compilation on, so exactly the packages its decoding loads are
built (FAFO's planner sizes, a peer's padded draft size, plain decoding's one row), by the same code that builds
them on first use; nothing here knows a method's sizes.
"""

from __future__ import annotations

from typing import Iterator

PROMPT = "Name three colours of the sea, one per line."
TOKENS = 8  # enough for every method's first steps, which load or build all its packages


def build_ahead(engine, methods: list[str], retry_failed: bool = False) -> Iterator[tuple[str, list[int]]]:
    """For each method, the package sizes (rows) its steps run in, built now where missing; with `retry_failed`,
    those whose build failed here before too (`fafo compile`)."""
    compiled = engine.compiled
    compiled.retry_failed = retry_failed
    for method in methods:
        loaded, calls = set(compiled.built()), dict(compiled.calls_by_size)
        engine.reset()
        engine.complete(PROMPT, method=method, max_tokens=TOKENS, temperature=0.0)
        called = {size for size, n in compiled.calls_by_size.items() if n > calls.get(size, 0)}
        yield method, sorted(set(compiled.built()) - loaded | called)
    engine.reset()
