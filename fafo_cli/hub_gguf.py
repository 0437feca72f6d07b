"""GGUF files of hub repos, named as llama.cpp (`-hf org/name:QUANT`) and ollama (`hf.co/org/name:QUANT`) name them.

A repo such as bartowski/Llama-3.2-1B-Instruct-GGUF holds one file per quantization. `org/name:Q8_0` names the file
of that quantization; without one (or ollama's `:latest`), Q4_K_M's as both tools choose, else the first of
PREFERRED the repo has, or its only file (not the first by name: that is often its largest, BF16 or F16). The file is
downloaded into the Hugging Face cache like any hub file, then converted as a local .gguf file is (hub.py).
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

from .errors import FafoError

DEFAULT_QUANT = "Q4_K_M"
PREFERRED = (DEFAULT_QUANT, "Q4_K_S", "Q4_0", "Q5_K_M", "Q5_K_S", "Q5_0", "Q6_K", "Q8_0")  # (without a name)
# what a user may paste before the repo id: ollama's `hf.co/`, the hub's address
_PREFIX = re.compile(r"^(?:https?://)?(?:hf\.co|huggingface\.co)/", re.IGNORECASE)
_NAMED = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*?)(?::(?P<quant>[\w.-]+))?/?$")  # (not ./x)
_SPLIT = re.compile(r"-\d{5}-of-\d{5}$")  # llama.cpp's gguf-split parts: name-00001-of-00003.gguf


def parse(spec: str) -> tuple[str, str | None] | None:
    """(repo id, quantization or None) where `spec` names a hub repo's GGUF file: `org/name:QUANT`, or anything
    after `hf.co/` or the hub's address; None for anything else (a plain `org/name` may be either kind of repo)."""
    prefixed = _PREFIX.match(spec)
    match = _NAMED.match(spec[prefixed.end():] if prefixed else spec)
    if match is None or not (prefixed or match["quant"]):
        return None
    quant = (match["quant"] or "").upper()
    return match["repo"], quant if quant not in ("", "LATEST") else None


def quant_of(file: str, quant: str) -> bool:
    """Whether a file's name states quantization `quant` (Q4_K_M: ...-Q4_K_M.gguf, ...q4_k_m.gguf, Q4_K_M/x.gguf; not
    ...-Q4_K_S.gguf, nor Q4_K in ...-Q4_K_M.gguf)."""
    return re.search(rf"(?:^|[-._/]){re.escape(quant)}(?=$|[-./])", file.removesuffix(".gguf"), re.IGNORECASE) \
        is not None


def choose(repo_id: str, files: list[str], quant: str | None) -> tuple[str, str]:
    """The repo's file for `quant` (None: the default) and the quantization to name it by. One clear line where
    there is none: the quantizations the repo has, or a split model's parts (which we do not read)."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf") and "mmproj" not in PurePosixPath(f).name.lower())
    single = [f for f in ggufs if not _SPLIT.search(f.removesuffix(".gguf"))]
    # without a name: the first of PREFERRED the repo has, whole or split (a split one is said so, not passed over)
    wanted = quant or next((q for q in PREFERRED if any(quant_of(f, q) for f in ggufs)), DEFAULT_QUANT)
    found = [f for f in single if quant_of(f, wanted)]
    if found:  # (a file at the top level before one in a folder)
        return min(found, key=lambda f: (f.count("/"), len(f), f)), wanted
    if any(quant_of(f, wanted) for f in ggufs):
        raise FafoError(f"{repo_id}'s {wanted} model is split in parts, which fafo does not read: download them and "
                        "merge them into one file (llama.cpp: llama-gguf-split --merge FIRST-PART MERGED.gguf)")
    if not ggufs:
        raise FafoError(f"{repo_id} holds no GGUF file")
    if quant is None and len(single) == 1 == len(ggufs):  # one model, whatever its name: nothing to choose
        return single[0], _label(single[0]) or PurePosixPath(single[0]).stem
    known = sorted({label for f in ggufs if (label := _label(f))})
    has = f" (it has: {', '.join(known)})" if known else ""
    if quant is None:
        raise FafoError(f"{repo_id} has none of the quantizations fafo picks without a name ({', '.join(PREFERRED)})"
                        f"{has}: name one, {repo_id}:QUANT")
    raise FafoError(f"{repo_id} has no {wanted} GGUF file{has}")


def _label(file: str) -> str | None:
    """The quantization a file's name ends with (Llama-3.2-1B-Instruct-Q4_K_M.gguf: Q4_K_M), if it looks like one."""
    stem = _SPLIT.sub("", PurePosixPath(file).name.removesuffix(".gguf"))
    match = re.search(r"[-.]((?:I?Q\d\w*|BF16|FP?16|FP?32))$", stem, re.IGNORECASE)
    return match[1].upper().replace("FP", "F") if match else None
