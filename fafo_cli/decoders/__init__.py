"""Decoding methods behind one interface: generate(session, request, emitter) -> Iterator[Step]."""

from . import vanilla

DECODERS = {
    "vanilla": vanilla.generate,
}
