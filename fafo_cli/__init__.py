"""fafo-cli: lossless FAFO decoding for local LLMs."""

__version__ = "0.1.0"

from .api import Engine, load  # noqa: E402

__all__ = ["Engine", "load", "__version__"]
