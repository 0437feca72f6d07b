"""The `long` suite: prompts of a chosen length in tokens, built from the Python standard library on this machine
(or from the user's files: `--documents`).

Three tasks per document, each filling the context but for the answer (`--tokens`):
- `recall`: a long module's source from one of its functions on, then a question about that function (far back);
- `summary`: the documentation (docstrings) of several modules, to summarize;
- `edit`: a long module's source, then the request to rewrite one function from its middle with type hints.
A document is cut at a line break (code) or between paragraphs (documentation) so that the chat-templated prompt
is as long as fits (found by bisection with the model's own tokenizer): the same Python and model give the same
prompts.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import io
from dataclasses import dataclass
from typing import Callable

from ..errors import FafoError
from ..files import user_path

DEFAULT_CONTEXTS = (4096, 8192)  # FAFO's and QuantSpec's papers' shorter long contexts; SmolLM2's whole context
MIN_CONTEXT = 1024
MIN_PROMPT = 768  # --context minus --tokens must leave this much: room for a function far back and one in the middle
RECALLED_LINES = 4  # the recall task's function is at least this long: a signature and a body to explain
EDITED_LINES = (8, 80)  # the edit task's function: long enough to copy, short enough to be rewritten in an answer
CHARS_PER_TOKEN = 5  # more than any tokenizer's, so that the material gathered always covers the target
# Long pure-Python modules (one document per --samples index, the next ones appended while more text is needed),
# those that hold both tasks' functions at short lengths (1K tokens) too first
SOURCE_MODULES = ("logging", "email.message", "pydoc", "tarfile", "http.client", "statistics", "argparse", "difflib",
                  "zipfile", "configparser", "dataclasses", "inspect")
DOC_MODULES = ("argparse", "pathlib", "collections", "functools", "itertools", "inspect", "logging", "difflib",
               "textwrap", "json", "re", "string", "datetime", "os", "shutil", "subprocess", "enum")
TASKS = ("recall", "summary", "edit")

Encode = Callable[[list[dict]], list[int]]  # chat messages -> prompt token ids (Engine.encode)


@dataclass(frozen=True)
class LongPrompt:
    task: str
    context: int
    document: int  # which --samples index it was built from
    messages: tuple[dict, ...]
    tokens: int  # its prompt's length in tokens

    @property
    def id(self) -> str:
        return f"{self.task}-{self.context}" + (f"-{self.document + 1}" if self.document else "")


def check_context(context: int, answer: int, max_context: int | None = None) -> None:
    """`--context` beside `--tokens` (one clear error); against the model's context where known (None: before
    the model loads)."""
    if max_context is not None and max_context < MIN_CONTEXT:
        raise FafoError(f"the long suite needs a context of {MIN_CONTEXT} tokens or more; the model's is {max_context}")
    if context < MIN_CONTEXT or max_context is not None and context > max_context:
        most = "the model's context" + (f", {max_context} tokens" if max_context is not None else "")
        raise FafoError(f"--context {context}: choose from {MIN_CONTEXT} to {most}")
    if context - answer < MIN_PROMPT:
        raise FafoError(f"--context {context} leaves {context - answer} prompt tokens beside --tokens {answer}; "
                        f"the long suite needs at least {MIN_PROMPT}")


def contexts(context: int | None, max_context: int, answer: int,
             notify: Callable[[str], None] = lambda line: None) -> list[int]:
    """The lengths to build: `context` checked against the model (`check_context`), else the defaults that fit the
    model and leave a long prompt beside the answer (the others skipped with a notice, as prompts that do not fit)."""
    if context is not None:
        check_context(context, answer, max_context)
        return [context]
    lengths = [c for c in DEFAULT_CONTEXTS if c <= max_context] or [max_context]
    for length in lengths:
        if length - answer < MIN_PROMPT:
            notify(f"skipping the long suite at {length} tokens: --tokens {answer} leaves {length - answer} prompt "
                   f"tokens, short of {MIN_PROMPT}")
    return [length for length in lengths if length - answer >= MIN_PROMPT]


STANDARD_LIBRARY, USERS = "the standard library's", "your files'"


@dataclass(frozen=True)
class Material:
    """What the documents are cut from: Python sources (recall, edit) and prose (summary), each (name, text)."""
    code: tuple[tuple[str, str], ...]
    prose: tuple[tuple[str, str], ...]
    code_from: str  # whose each kind is, in error messages: "the standard library's", "your files'"
    prose_from: str

    def documents(self, task: str) -> int:
        """How many different documents `task` can be built from (one per file or module)."""
        return len(self.prose if task == "summary" else self.code)


def _module_docs(name: str) -> str:
    """A module's docstring and its public functions' and classes' docstrings."""
    module = importlib.import_module(name)
    parts = [f"{inspect.getdoc(module) or ''}\n"]
    for attribute, value in sorted(vars(module).items()):
        doc = inspect.getdoc(value) if inspect.isfunction(value) or inspect.isclass(value) else None
        if doc and not attribute.startswith("_") and getattr(value, "__module__", None) == name:
            parts.append(f"{name}.{attribute}:\n{doc}\n")
    return "\n".join(parts)


@functools.lru_cache(maxsize=1)
def standard_library() -> Material:
    """The standard library's sources and documentation on this machine (read once per process); a Python installed
    without its .py sources is one FafoError."""
    try:
        sources = tuple((f"{name.replace('.', '/')}.py", inspect.getsource(importlib.import_module(name)))
                        for name in SOURCE_MODULES)
    except (OSError, TypeError) as e:
        raise FafoError(f"the long suite reads this Python's standard library sources, which are not here ({e}): give "
                        "your own with --documents FILE.py ...") from None
    return Material(sources,
                    tuple((f"Module {name}", _module_docs(name)) for name in DOC_MODULES),
                    STANDARD_LIBRARY, STANDARD_LIBRARY)


def user_files(paths: list[str]) -> Material:
    """The user's files: Python sources (.py) for the recall and edit tasks, any other text for the summary; a kind
    not given comes from the standard library."""
    code, prose, functions = [], [], []  # functions: (first line, last line, name) of each file's, as kept
    for given in paths:
        path = user_path(given)
        try:
            text = path.read_text(encoding="utf-8-sig")  # (Python runs a file with a byte-order mark; ast not)
        except FileNotFoundError:
            raise FafoError(f"--documents: file not found: {given}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise FafoError(f"--documents: cannot read {given}: {getattr(e, 'strerror', None) or e}") from None
        if not text.strip():  # (a kind not given at all comes from the standard library; an empty file is a mistake)
            raise FafoError(f"--documents: {given} has no text")
        if path.suffix == ".py":
            try:
                functions += _kept_functions(ast.parse(text))[1]
            except SyntaxError as e:
                raise FafoError(f"--documents: {given} is not valid Python (line {e.lineno})") from None
            except ValueError:  # a NUL byte (before Python 3.12, which says SyntaxError)
                raise FafoError(f"--documents: {given} is not valid Python (it holds a NUL byte)") from None
            code.append((path.name, text))
        else:
            prose.append((path.name, text))
    if code:  # (said before the model loads, not after)
        for task, least, most in (("recall", RECALLED_LINES, None), ("edit", *EDITED_LINES)):
            if not _asked_about(functions, least, most):
                raise FafoError(f"--documents: your Python files hold no function of {least}"
                                f"{f' to {most}' if most else ' or more'} lines with a name of its own, for the long "
                                f"suite's {task} task")
    fallback = standard_library()
    return Material(tuple(code) or fallback.code, tuple(prose) or fallback.prose,
                    USERS if code else STANDARD_LIBRARY, USERS if prose else STANDARD_LIBRARY)


def _lines(text: str) -> list[str]:
    """`text`'s lines as Python counts them (at \n, \r\n, \r: not at a form feed or U+2028, as splitlines does)."""
    return io.StringIO(text, newline=None).readlines()


def _kept_functions(tree: ast.Module) -> tuple[int, list[tuple[int, int, str]]]:
    """Where a file's document starts (its first definition's line, 1-based: a docstring and imports would push the
    recall task's function away from the document's beginning), and its functions from there on as (first line,
    last line, name), 1-based, in order: not one inside an `if` or `try` above the first definition."""
    tops = [min([node.lineno, *(d.lineno for d in node.decorator_list)]) for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
    top = min(tops, default=1)
    return top, sorted((node.lineno, node.end_lineno, node.name) for node in ast.walk(tree)
                       if isinstance(node, ast.FunctionDef) and node.lineno >= top)


def _asked_about(functions, least: int, most: int | None = None) -> list[tuple[int, int, str]]:
    """The functions of `least` to `most` lines (None: no most) whose name is defined once among `functions`."""
    names = [name for _, _, name in functions]
    return [f for f in functions if least <= f[1] - f[0] + 1 <= (most or f[1] - f[0] + 1) and names.count(f[2]) == 1]


def _sources(first: int, chars: int, material: Material) -> tuple[list[str], list[tuple[int, int, str]]]:
    """Lines of the sources from the `first`-th on (round the list), at least `chars` long, and their functions as
    (first line, last line, name), 0-based, in order. Each file from its first definition on: a docstring and
    imports would push the recall task's function away from the document's beginning."""
    lines: list[str] = []
    functions: list[tuple[int, int, str]] = []
    for offset in range(len(material.code)):
        name, source = material.code[(first + offset) % len(material.code)]
        top, kept = _kept_functions(ast.parse(source))
        start = len(lines) + 1 - (top - 1)  # where the file's line 1 would be, after the file header line
        lines += [f"# file: {name}\n", *_lines(source)[top - 1:], "\n"]
        functions += [(start + first - 1, start + last - 1, function) for first, last, function in kept]
        if sum(map(len, lines)) >= chars:
            break
    return lines, functions


def _documentation(first: int, chars: int, material: Material) -> list[str]:
    parts: list[str] = []
    for offset in range(len(material.prose)):
        title, text = material.prose[(first + offset) % len(material.prose)]
        parts.append(f"{title}\n\n{text}")
        if sum(map(len, parts)) >= chars:
            break
    return "\n".join(parts).splitlines(keepends=True)


def _code(lines: list[str]) -> str:
    return "```python\n" + "".join(lines).rstrip("\n") + "\n```"


def _recall_start(functions, material: Material) -> int:
    """Where the recall task's document starts: at the first function of four lines or more whose name is defined
    once, so that it is the document's very first lines, however long the document."""
    first = next((start for start, _, _ in _asked_about(functions, RECALLED_LINES)), None)
    if first is None:
        raise FafoError(f"{material.code_from} Python sources hold no function of {RECALLED_LINES} lines or more with "
                        "a name of its own, for the long suite's recall task")
    return first


def _recall(lines, first: tuple[int, int, str], kept: int) -> list[dict] | None:
    """Ask about `first` (the document's first function) once the document holds all of it."""
    if kept <= first[1]:
        return None
    return [{"role": "user", "content": f"{_code(lines[:kept])}\n\nIn the code above, near its beginning, a function "
             f"named `{first[2]}` is defined. Quote its signature exactly, then explain in a few sentences what it "
             "does and what it returns."}]


def _edit(lines, functions, kept: int) -> list[dict] | None:
    """Rewrite the function of EDITED_LINES, of a name defined once, that lies nearest the middle of the kept lines."""
    fitting = _asked_about([f for f in functions if f[1] < kept], *EDITED_LINES)
    if not fitting:
        return None
    _, _, name = min(fitting, key=lambda f: (abs((f[0] + f[1]) / 2 - kept / 2), f[0]))
    return [{"role": "user", "content": f"{_code(lines[:kept])}\n\nRewrite the function `{name}` from the code above "
             "with type hints added to its signature. Keep everything else in it exactly as it is, including its "
             "docstring and comments, and output only that function's code."}]


def _summary(lines, kept: int) -> list[dict]:
    return [{"role": "user", "content": "Summarize the following documents in a few paragraphs, one per "
             "document:\n\n" + "".join(lines[:kept])}]


def _longest(task: str, build: Callable[[int], list[dict] | None], cuts: list[int], limit: int, encode: Encode,
             where: str) -> tuple[list[dict], int]:
    """The prompt of the most lines, cut at one of `cuts` (line counts, increasing; found by bisection), whose
    tokens are at most `limit`, and its length. All of the text fitting means it is too short to fill the context."""
    low, high, best = 0, len(cuts) - 1, None
    while low <= high:
        middle = (low + high) // 2
        messages = build(cuts[middle])
        length = len(encode(messages)) if messages is not None else None
        if length is not None and length <= limit:
            if middle == len(cuts) - 1:
                raise FafoError(f"{where} text gives the long suite's {task} prompt only {length} tokens, short of "
                                f"{limit}: add documents or choose a smaller --context")
            best, low = (messages, length), middle + 1
        elif messages is None:
            low = middle + 1  # too few lines to hold the task's function: more lines
        else:
            high = middle - 1
    if best is None and task == "edit" and build(cuts[-1]) is None:  # no cut holds a function to edit
        raise FafoError(f"{where} Python sources hold no function of {EDITED_LINES[0]} to {EDITED_LINES[1]} lines "
                        "with a name of its own, for the long suite's edit task")
    if best is None:
        raise FafoError(f"cannot build the long suite's {task} prompt in {limit} tokens from {where} text: a "
                        "larger --context (or fewer --tokens) leaves it more room, as do longer documents")
    if best[1] < limit // 2:  # the next place to end the text is past the limit: a line or paragraph too long
        raise FafoError(f"{where} text has no place to end the long suite's {task} prompt between {best[1]} and "
                        f"{limit} tokens: its lines or paragraphs are too long to cut")
    return best


PARAGRAPH_LINES, PARAGRAPH_CHARS = 20, 2000  # the summary's text ends between paragraphs, or anywhere in a longer one


def paragraph_cuts(lines: list[str]) -> list[int]:
    """Where a text of `lines` may end (line counts, increasing): after a blank line, and after any line of a
    paragraph longer than PARAGRAPH_LINES or PARAGRAPH_CHARS (a text without blank lines: a log, a CSV file, prose
    with single line breaks)."""
    cuts, start = [], 0
    for end in [i for i, line in enumerate(lines) if not line.strip()] + [len(lines)]:
        if end - start > PARAGRAPH_LINES or sum(map(len, lines[start:end])) > PARAGRAPH_CHARS:
            cuts += range(start + 1, end + 1)
        if end < len(lines):
            cuts.append(end + 1)
        start = end + 1
    return cuts


def build(context: int, document: int, answer: int, encode: Encode, tasks: tuple[str, ...] = TASKS,
          material: Material | None = None) -> list[LongPrompt]:
    """The `tasks` at `context` tokens (prompt plus an `answer` of that many tokens) from document `document` of
    `material` (default: the standard library)."""
    material = material or standard_library()
    limit = context - answer
    chars = limit * CHARS_PER_TOKEN
    lines, functions = _sources(document, chars, material)
    docs = _documentation(document, chars, material)
    # at any line: a long function without blank lines would leave a gap of hundreds of tokens (the tasks' own
    # functions are whole: the builders check)
    code_cuts = list(range(1, len(lines) + 1))
    doc_cuts = paragraph_cuts(docs)
    skip = _recall_start(functions, material)
    first = next((start - skip, end - skip, name) for start, end, name in functions if start == skip)
    builders = {"recall": (lambda k: _recall(lines[skip:], first, k), [c - skip for c in code_cuts if c > skip]),
                "summary": (lambda k: _summary(docs, k), doc_cuts),
                "edit": (lambda k: _edit(lines, functions, k), code_cuts)}
    prompts = []
    for task in tasks:
        make, cuts = builders[task]
        messages, length = _longest(task, make, cuts, limit, encode,
                                    material.prose_from if task == "summary" else material.code_from)
        prompts.append(LongPrompt(task, context, document, tuple(messages), length))
    return prompts
