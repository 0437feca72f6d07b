"""Decoding methods behind one interface: generate(session, request, emitter) -> Iterator[Step]."""

from .fafo import step as fafo
from . import cacheback, lookahead, prompt_lookup, quantspec, suffix, triforce, vanilla

DECODERS = {
    "vanilla": vanilla.generate,
    "fafo": fafo.generate,
    "lookahead": lookahead.generate,
    "prompt-lookup": prompt_lookup.generate,
    "cacheback": cacheback.generate,
    "suffix": suffix.generate,
    "triforce": triforce.generate,
    "quantspec": quantspec.generate,
}
