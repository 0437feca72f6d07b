"""Decoding methods behind one interface: generate(session, request, emitter) -> Iterator[Step]."""

from ..engine import fafo
from . import vanilla

DECODERS = {
    "vanilla": vanilla.generate,
    "fafo": fafo.generate,
}
