"""fafo-cli: lossless FAFO decoding for local LLMs."""

__version__ = "0.1.0"

__all__ = ["Engine", "FafoError", "load", "__version__"]

from .errors import FafoError  # what every refusal raises (light: no torch)


def __getattr__(name: str):
    # The API pulls in torch and transformers (seconds); `fafo list`, `pull`, `config` and `--help` need neither.
    if name in ("Engine", "load"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'fafo_cli' has no attribute '{name}'")
