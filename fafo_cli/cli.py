"""The `fafo` command: pull, list, run, chat, serve, bench, doctor, compile, config, cacheback. Thin: parse flags,
call the API, render events."""

from __future__ import annotations

import errno
import functools
import gc
import inspect
import json
import math
import os
import re
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from . import __version__
from . import config as config_mod
from . import hub, hub_gguf
from .errors import FafoError, first_line, is_out_of_memory, shortened, unhandled_interrupts
from .files import user_path, write_atomic
from .runtime.memory import release_dropped_models


class _Commands(typer.core.TyperGroup):
    """fafo's commands: a Ctrl-C that no command reported itself is one line (typer makes it a silent exit 130)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            raise typer.Exit(130) from None


def _fold_option_names() -> None:
    """Typer's help table cuts a flag's name that does not fit its column (`--conversations-…` at 80 columns):
    folded onto the next line instead, every flag can be read. (Typer's own highlighters, each wrapped; where a
    version of typer has none by these names, its help is left as it is.)"""
    from typer import rich_utils

    for name in ("highlighter", "negative_highlighter"):
        highlighter = getattr(rich_utils, name, None)
        if highlighter is None:
            continue

        class Folding(type(highlighter)):
            def __call__(self, text):
                text = super().__call__(text)
                text.overflow = "fold"
                return text

        setattr(rich_utils, name, Folding())


_fold_option_names()
app = typer.Typer(cls=_Commands, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Lossless fast decoding for local LLMs (FAFO).")
config_app = typer.Typer(no_args_is_help=True, help="Show or create the YAML configuration file.")
app.add_typer(config_app, name="config")
cacheback_app = typer.Typer(no_args_is_help=True, help="Cacheback's frozen n-gram tables.")
app.add_typer(cacheback_app, name="cacheback")

ConfigOpt = Annotated[Optional[str], typer.Option("--config", "-c", help="YAML config file.", show_default=False)]


def config_options(command: str, help: dict[str, str] | None = None):
    """Give a Typer command one option per config key it offers (declared once, in config.Config), placed where
    its keyword-only `flags` parameter stands; the command receives them as `flags`: key -> value, None where
    not given (the config files' value stands). `help`: key -> the command's own help for a key that does more
    there than the key's help says."""
    offered = config_mod.flags(command)
    unknown = set(help or ()) - {flag.key for flag in offered}
    if unknown:
        raise TypeError(f"help for keys that {command} does not offer: {', '.join(sorted(unknown))}")

    def decorate(function):
        signature = inspect.signature(function, eval_str=True)
        own = list(signature.parameters.values())
        names = [parameter.name for parameter in own]
        clash = {flag.key for flag in offered} & set(names)
        if clash:
            raise TypeError(f"{function.__name__} declares config keys of its own: {', '.join(sorted(clash))}")
        generated = [inspect.Parameter(flag.key, inspect.Parameter.KEYWORD_ONLY, default=None,
                                       annotation=_typer_parameter(flag, (help or {}).get(flag.key)))
                     for flag in offered]
        where = names.index("flags")
        parameters = own[:where] + generated + own[where + 1:]

        @functools.wraps(function)
        def with_config_options(**arguments):
            given = {flag.key: flag.value(arguments.pop(flag.key)) for flag in offered}
            return function(**arguments, flags=given)

        with_config_options.__signature__ = signature.replace(parameters=parameters)
        with_config_options.__annotations__ = {parameter.name: parameter.annotation for parameter in parameters}
        return with_config_options

    return decorate


def _typer_parameter(flag: config_mod.Flag, own_help: str | None = None):
    help = escape(own_help or flag.help)  # "[auto | cpu]" would otherwise be read as Rich markup
    if not flag.declarations:
        return Annotated[Optional[flag.kind], typer.Argument(help=help, show_default=False)]
    return Annotated[Optional[flag.kind], typer.Option(*flag.declarations, help=help, show_default=False,
                                                       rich_help_panel=flag.section)]


def _version(value: bool) -> None:
    if value:
        print(f"fafo-cli {__version__}")
        raise typer.Exit()


@app.callback()
def main(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                               help="Show the version and exit.")] = False) -> None:
    """Lossless fast decoding for local LLMs (FAFO)."""


ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def _unescaped(text: str) -> str:
    """A stop string as typed, its escapes read (a shell passes `\\n` as two characters; llama.cpp reads them too)."""
    return re.sub(r"\\(.)", lambda m: ESCAPES.get(m.group(1), m.group(0)), text)


def _read_prompt(source: str) -> str:
    if source == "-":
        if sys.stdin is None:  # (closed: `fafo run -p - <&-`)
            raise FafoError("cannot read standard input: it is closed")
        try:
            text = sys.stdin.read()
        except UnicodeDecodeError:
            raise FafoError("standard input is not UTF-8 text") from None
        except OSError as e:  # (one a program cannot read: what `nohup` gives a terminal's)
            raise FafoError(f"cannot read standard input: {e.strerror or first_line(e)}") from None
    else:
        if not source.strip():
            raise FafoError("--prompt needs a file name (or - for standard input)")
        shown = shortened(source, 80)
        # llama.cpp's -p and mlx-lm's --prompt take the text itself
        hint = " (--prompt names a file; to give the text itself: echo '...' | fafo run)"
        path = user_path(source)
        try:
            if path.is_dir():
                raise FafoError(f"--prompt {shown} is a folder, not a file")
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise FafoError(f"prompt file not found: {shown}{hint}") from None
        except UnicodeDecodeError:
            raise FafoError(f"prompt file {shown} is not UTF-8 text") from None
        except OSError as e:  # (a text too long to be a file name: ENAMETOOLONG)
            raise FafoError(f"cannot read prompt file {shown}: {e.strerror}"
                            f"{hint if e.errno == errno.ENAMETOOLONG else ''}") from None
    text = text.removeprefix("\ufeff")  # a byte-order mark (Windows editors write one) is no part of the text
    if not text.strip():
        raise FafoError("the prompt is empty")
    return text


def _print_json(value) -> None:
    """One JSON object on stdout: its text as it is where stdout takes UTF-8, escaped where it does not (an ASCII or
    Latin-1 locale), so that it is still one valid object."""
    encoding = (getattr(sys.stdout, "encoding", None) or "").lower().replace("-", "").replace("_", "")
    print(json.dumps(value, ensure_ascii=encoding not in ("utf8", "utf8sig")))


def _finite(value: float | None) -> float | None:
    """A float option's callback: click's range lets inf and nan through (nan compares false with any bound)."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def _given(flags: dict) -> frozenset[str]:
    """The config keys a command line gave a value (an empty one, "", empties its key: nothing asked for)."""
    return frozenset(key for key, value in flags.items() if value not in (None, ""))


def _check_output(flag: str, path: str | None, makes_folders: bool = False) -> None:
    """An output file can be written where `path` says: its folder exists and takes new files (an atomic write
    renames one there), and it is not a folder itself nor a file that is read-only. `makes_folders`: its writer
    creates missing folders (the user's config file), so the nearest existing one must take them."""
    if path is None or path == "-":
        return
    if not path.strip():
        raise FafoError(f"{flag} needs a file name")
    target = user_path(path)
    if target.is_dir():
        raise FafoError(f"{flag} {path} is a folder, not a file")
    if target.is_symlink():  # the link's file is written (files.atomic_path)
        try:
            target = target.resolve()
        except (OSError, RuntimeError) as e:  # (RuntimeError: a loop of links, before Python 3.13)
            raise FafoError(f"{flag} {path}: cannot follow its link ({getattr(e, 'strerror', None) or 'a loop'})") \
                from None
    folder = target.parent
    while makes_folders and not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise FafoError(f"{flag} {path}: no such folder {folder}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise FafoError(f"{flag} {path}: the folder {folder} is not writable")
    if target.exists() and not os.access(target, os.W_OK):
        raise FafoError(f"{flag} {path} is read-only")


def _create_config(config: str | None) -> None:
    """A --config FILE that --tune or --write names is created where it does not exist yet once the measuring is
    done, every key commented out (as `fafo config init` writes it): the next command given it finds it, whatever
    the measurement set. (A command that fails before its measuring is done leaves no file behind.)"""
    path = user_path(config) if config else None
    if path is not None and not path.exists() and not path.is_symlink():
        write_atomic(path, config_mod.default_yaml())


def _check_outputs(outputs: dict[str, str | None], inputs: dict[str, list[str]], binary: tuple[str, ...] = ()) -> None:
    """A command's output files ({flag: path}) can each be written (`_check_output`), none overwrites an input
    ({flag: paths}) or another output, and at most one is standard output (-), which a `binary` one cannot be."""
    def same(a: str, b: str) -> bool:
        if a == "-" or b == "-":
            return False
        try:
            return user_path(a).resolve() == user_path(b).resolve()
        except (OSError, RuntimeError):  # a loop of links: not the same file (its write says what is wrong)
            return False

    given = [(flag, path) for flag, path in outputs.items() if path is not None]
    for i, (flag, path) in enumerate(given):
        _check_output(flag, path)
        if path == "-" and flag in binary:
            raise FafoError(f"{flag} writes a binary file: name one (not - for standard output)")
        for source, paths in inputs.items():
            if any(same(path, p) for p in paths):
                raise FafoError(f"{flag} {path} is also an input ({source}): give the output a file of its own")
        for other, other_path in given[:i]:
            if same(path, other_path) or path == other_path == "-":
                raise FafoError(f"{other} and {flag} both write {path}: give each its own")


# settings of an answer, not of the steps that compute it (what `fafo compile` builds)
ANSWER_ONLY = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "chat_template",
               *config_mod.TEMPLATE_KEYS)


def _check_plot_format(path: str) -> None:
    """A chart file whose suffix matplotlib writes (png, svg, pdf, ...)."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:  # before the run, which may take hours
        raise FafoError("--plot needs matplotlib: pip install 'fafo-cli[bench]'") from None
    suffix = Path(path).suffix.lstrip(".").lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix not in formats:
        raise FafoError(f"--plot {path}: a chart is written as one of {', '.join(sorted(formats))}, by the file's "
                        "suffix")


def _load(config: config_mod.Config, err_console, flags: dict | None = None, load_draft: bool | None = None,
          quiet: bool = False):
    """The engine for `config`; `flags`: the command line's settings, each of which must then have an effect on
    every answer (`config.check_given`); `load_draft`: as Engine.from_config's; `quiet`: no line naming the model."""
    from .api import Engine, pick_device

    explicit = _given(flags or {})
    # before any work (the sampling defaults of the model come later)
    config_mod.check_given(config, explicit, accelerator=pick_device(config.device).type != "cpu")
    if config.method == "cacheback" and config.cacheback_table:
        from .decoders.ngram_table import table_file

        table_file(config.cacheback_table)
    if config.model is None and not quiet and not err_console.is_dumb_terminal and err_console.is_terminal:
        err_console.print(f"[dim]model: {hub.EMBEDDED_NAME} (embedded default)[/]")
    engine = Engine.from_config(config, load_draft=load_draft)
    engine.explicit = explicit
    engine.explicit_variables = config_mod.variables_in((flags or {}).get("chat_template_kwargs"))
    engine.request_config()  # with the model's sampling defaults filled in
    if config.chat_template and not engine.has_chat_template:
        print(f"note: {engine.name} has no chat template; the prompt is continued as plain text", file=sys.stderr)
    return engine


@app.command()
@config_options("run")
def run(
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="Prompt file, or - for standard input "
                                                  "(read without the flag where it is piped in).",
                                                  show_default=False)] = None,
    config: ConfigOpt = None,
    *, flags: dict,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object: text, token_ids, "
                                          "finish_reason, stats, settings.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Only the answer: no panel, no footer.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Stats on stderr even when stdout is not "
                                          "a terminal; on CUDA, host-device syncs per step counted too.")] = False,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", "-r", metavar="TEXT", show_default=False,
                                                      help="End the answer where this text first appears (not "
                                                      "shown; repeatable; \\n, \\t, \\r and \\\\ are read "
                                                      "as escapes).")] = None,
) -> None:
    """Generate one answer, streamed, with live statistics."""
    from .ui import StreamView, consoles, footer, live_display, method_label

    if quiet and verbose:
        raise FafoError("--quiet and --verbose ask for opposite things: give one")
    if quiet and as_json:  # (a flag that would change nothing)
        raise FafoError("--json prints one JSON object and nothing else: --quiet has nothing to leave out")
    if prompt is None:  # a prompt piped in needs no flag (ollama's way)
        if sys.stdin is None or sys.stdin.isatty():
            raise FafoError("no prompt: give --prompt FILE, or pipe the text in (echo '...' | fafo run)")
        prompt = "-"
    text = _read_prompt(prompt)
    stop = [_unescaped(value) for value in stop or ()]
    settings = config_mod.resolve(config, **flags)
    session_only = sorted(_given(flags) & config_mod.SESSION_KEYS)
    if session_only:
        raise FafoError(f"'{session_only[0]}' sets what a session's later answers draft from (fafo chat, fafo serve); "
                        "fafo run makes one answer")
    out, err = consoles()
    engine = _load(settings, err, flags, quiet=quiet)
    engine.count_syncs = verbose
    if as_json:
        result = engine.complete(text, stop=stop)
        _print_json(result.to_dict())
        if verbose:  # the statistics' line on stderr too, as without --json
            print(footer(result.stats, method_label(engine.request_config()), result.finish_reason), file=sys.stderr)
        return
    request = engine.request_config()  # the model's sampling defaults filled in, a fresh seed drawn
    live = live_display(out) and not quiet
    view = StreamView(out, method=method_label(request), live=live, show_footer=not quiet and (live or verbose),
                      stats_console=out if live else err, weights=engine.weights)
    with view:
        view.consume(engine.stream(text, stop=stop, seed=request.seed, on_prefill=view.prefill))


@app.command()
@config_options("chat")
def chat(config: ConfigOpt = None, *, flags: dict) -> None:
    """Multi-turn chat with the same live panel. /help lists the commands."""
    from .chat import Repl
    from .ui import consoles

    settings = config_mod.resolve(config, **flags)
    out, err = consoles()
    engine = _load(settings, err, flags)
    engine.explicit = frozenset()  # checked at launch; from here on /set may change any of them (and is checked)
    raise typer.Exit(Repl(engine, out, err).run())


SERVE_HELP = {"max_tokens": "most tokens generated for a request that gives no limit of its own (without this flag "
                           "or the key in the config file: as OpenAI's API, a chat's answer may fill the context "
                           "left after its prompt, a completion's has 16 tokens)"}


@app.command()
@config_options("serve", help=SERVE_HELP)
def serve(
    config: ConfigOpt = None,
    *, flags: dict,
    host: Annotated[str, typer.Option(help="Address to listen on. Beyond this machine (e.g. 0.0.0.0), set an API "
                                      "key.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free one).", min=0, max=65535)] = 8000,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="FAFO_API_KEY", show_default=False,
                                                   help="Require 'Authorization: Bearer KEY' on every request "
                                                   "but /health.")] = None,
    cors: Annotated[Optional[list[str]], typer.Option("--cors", metavar="ORIGIN", show_default=False,
                                                      help="Let web pages from this origin call the server "
                                                      "(repeat for more; off by default).")] = None,
    queue: Annotated[int, typer.Option(help="Requests that may wait while one runs; beyond, 503.", min=0)] = 32,
    conversations: Annotated[int, typer.Option(help="Earlier conversations whose KV caches are kept, so clients "
                                               "taking turns prefill only their new tokens.", min=0)] = 4,
    conversations_mb: Annotated[Optional[float], typer.Option(help="Most memory those caches take, in MB "
                                                              "(default: 1024).", min=0, callback=_finite,
                                                              show_default=False)] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log each request's settings and every HTTP "
                                          "request too.")] = False,
) -> None:
    """An OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions, /v1/models, /health."""
    from .serve import server

    if conversations == 0 and conversations_mb is not None:
        raise FafoError("--conversations-mb bounds the kept conversations' caches, and --conversations 0 keeps none")
    if api_key and (api_key != api_key.strip() or not (api_key.isascii() and api_key.isprintable())):
        raise FafoError("the API key (--api-key or FAFO_API_KEY) must be printable ASCII without spaces at its ends: "
                        "clients send it in an HTTP header, where no other key could ever match")
    settings = config_mod.resolve(config, **flags)
    if settings.cacheback_table:  # any request may ask for cacheback: a table it cannot read is said now
        from .decoders.ngram_table import table_file

        table_file(settings.cacheback_table)
    options = server.Options(api_key or None, tuple(cors or ()), queue, conversations,
                             1024 if conversations_mb is None else conversations_mb,
                             server.default_max_tokens(settings, config, flags))
    sock = server.bind(host, port)  # before the model loads: a taken port fails at once
    try:
        if options.api_key is None and not server.is_loopback(sock):
            print(f"warning: listening on {host} without an API key: anyone who can reach this machine can use the "
                  "model (set --api-key or FAFO_API_KEY)", file=sys.stderr)
        from .ui import consoles

        with server.request_log(verbose):
            with server.loading(sock, options.cors):
                # a request may ask for TriForce, which reads the draft model: loaded at start where one is configured
                engine = _load(settings, consoles()[1], load_draft=settings.draft_model is not None)
                if settings.cacheback_table:  # (and whether it was built with this model's tokenizer)
                    from .decoders.cacheback import load_frozen_table

                    load_frozen_table(settings.cacheback_table, engine.tokenizer)
                # the command line's settings are the requests' defaults; these no request could use
                engine.check_given(engine.request_config(),
                                   _given(flags) & {"chat_template", *config_mod.TEMPLATE_KEYS})
                if settings.compile == "on" and engine.compiled is not None:
                    from .compiled.ahead import build_ahead

                    # built now, not by the first request that meets a step size: inside the engine's thread every
                    # client would wait minutes for it
                    for _ in build_ahead(engine, [settings.method]):
                        pass
                    # and no later: a request whose settings (another method, a longer draft) meet a size not built
                    # runs that step eager rather than hold every client for a build in the engine's thread
                    engine.compiled.builds = False
            server.serve(engine, sock, options)
    finally:
        sock.close()


# what --compile does in a bench: not the steps of every row, as elsewhere, but a compiled twin of each row
BENCH_HELP = {"compile": "--compile: each row runs twice, eager and compiled (its +compiled twin, checked against "
                         "vanilla+compiled), compiled steps built where missing (minutes each on a CPU); --no-compile: "
                         "eager steps only, over dense weights; neither: the config's compile (auto: each row runs the "
                         "compiled steps built before that measured faster than eager)"}


@app.command()
@config_options("bench", help=BENCH_HELP)
def bench(
    config: ConfigOpt = None,
    suites: Annotated[Optional[str], typer.Option(help="Comma-separated: chat, math, code, summarize, edit, long "
                                                  "(default: all but long); custom: the --prompts file alone "
                                                  "(else it is added to the suites).",
                                                  show_default=False)] = None,
    context: Annotated[Optional[int], typer.Option(help="The long suite's prompts at this many tokens, the answer "
                                                   "included (default: 4096 and 8192, where the model's context "
                                                   "allows).", show_default=False)] = None,
    documents: Annotated[Optional[list[str]], typer.Option(help="The long suite's text from these files instead of "
                                                           "the standard library: .py files for the recall and edit "
                                                           "tasks, any other text for the summary (repeatable).",
                                                           show_default=False)] = None,
    methods: Annotated[Optional[str], typer.Option(help="Comma-separated methods (default: fafo, prompt-lookup, "
                                                   "suffix; --full: all). vanilla always runs: it is the reference.",
                                                   show_default=False)] = None,
    compressors: Annotated[Optional[str], typer.Option(help="FAFO rows, one per compressor named (auto among "
                                                       "them: as configured; default: the config's; a named one "
                                                       "runs the window).",
                                                       show_default=False)] = None,
    tokens: Annotated[Optional[int], typer.Option(help="New tokens per answer (default: 512).", min=1,
                                                  show_default=False)] = None,
    repeats: Annotated[Optional[int], typer.Option(help="Repetitions per prompt, medians reported (default: 1; "
                                                   "--full: 3).", min=1, show_default=False)] = None,
    warmup: Annotated[Optional[int], typer.Option(help="Untimed runs of every row first (default: 1).", min=0,
                                                  show_default=False)] = None,
    samples: Annotated[Optional[int], typer.Option(help="Prompts per suite (default: 1; --full: 3; a --prompts "
                                                        "file runs whole).", min=1, show_default=False)] = None,
    prompts: Annotated[Optional[str], typer.Option(help="Your own prompts, as one more suite "
                                                   "(`custom`): a JSONL file, {\"prompt\": ...} or "
                                                   "{\"messages\": [...]} per line.", show_default=False)] = None,
    temperature: Annotated[Optional[float], typer.Option(help="0 = greedy (exactness checked; the default); "
                                                         "above 0 samples.", min=0.0, max=100.0, callback=_finite,
                                                         show_default=False)] = None,
    *, flags: dict,
    external: Annotated[Optional[bool], typer.Option("--external/--no-external", help="Time transformers' "
                                                     "generate and its prompt lookup too (default: with --full).",
                                                     show_default=False)] = None,
    full: Annotated[bool, typer.Option("--full", help="The whole matrix: every method, transformers too, 3 prompts "
                                       "per suite, 3 repetitions (hours on a small CPU; the default answers in "
                                       "minutes).")] = False,
    verify: Annotated[bool, typer.Option("--verify", help="Re-run the greedy rows in float32 and require "
                                         "identical tokens.")] = False,
    json_file: Annotated[Optional[str], typer.Option("--json", help="Write one record per method × suite (- for "
                                                     "standard output).", show_default=False)] = None,
    csv_file: Annotated[Optional[str], typer.Option("--csv", help="Write the records as CSV (- for standard output).",
                                                    show_default=False)] = None,
    markdown_file: Annotated[Optional[str], typer.Option("--markdown", help="Write a markdown table (- for "
                                                         "standard output).", show_default=False)] = None,
    plot_file: Annotated[Optional[str], typer.Option("--plot", help="Speedup chart (PNG; needs matplotlib).",
                                                     show_default=False)] = None,
    tune: Annotated[bool, typer.Option("--tune", help="Measure this machine and write the best FAFO settings "
                                       "into the user config (or the --config file, created where missing).")] = False,
) -> None:
    """FAFO against plain decoding, the peer methods and transformers, side by side."""
    from .bench import command, long
    from .bench.suites import CUSTOM, check_installed, check_prompts, parse_suites
    from .ui import consoles

    if tune:  # it measures with prompts and settings of its own
        ignored = [flag for flag, given in (
            ("--suites", suites), ("--context", context), ("--documents", documents), ("--methods", methods),
            ("--compressors", compressors), ("--tokens", tokens is not None), ("--repeats", repeats),
            ("--warmup", warmup is not None), ("--samples", samples), ("--prompts", prompts),
            ("--temperature", temperature is not None),
            ("--external/--no-external", external is not None), ("--full", full), ("--verify", verify),
            ("--json", json_file), ("--csv", csv_file), ("--markdown", markdown_file), ("--plot", plot_file)) if given]
        if ignored:
            raise FafoError(f"--tune measures with its own prompts and settings: drop {', '.join(ignored)}")
    temperature = temperature or 0.0
    if verify and temperature > 0:
        raise FafoError("--verify checks greedy rows for identical tokens: drop it, or use --temperature 0")
    settings = config_mod.resolve(config, written=tune, **flags)
    matrix = command.FULL if full else command.QUICK
    chosen = parse_suites(suites, notify=lambda line: print(f"note: {line}", file=sys.stderr))
    if context is not None and "long" not in chosen:
        raise FafoError("--context sets the long suite's prompt length: add long to --suites")
    if documents and "long" not in chosen:
        raise FafoError("--documents gives the long suite its text: add long to --suites")
    options = command.BenchOptions(
        suites=chosen,
        methods=command.parse_list("--methods", methods, config_mod.METHODS, list(matrix.methods)),
        compressors=command.parse_list("--compressors", compressors, ("auto",) + config_mod.COMPRESSORS,
                                       [settings.compressor]),
        tokens=512 if tokens is None else tokens, repeats=matrix.repeats if repeats is None else repeats,
        warmup=1 if warmup is None else warmup,
        samples=matrix.samples if samples is None else samples, prompts=prompts, temperature=temperature,
        external=matrix.external if external is None else external, verify=verify, json_path=json_file,
        csv_path=csv_file, markdown_path=markdown_file, plot_path=plot_file, context=context,
        documents=tuple(documents or ()))
    if compressors is not None and "fafo" not in options.methods:
        raise FafoError("--compressors names FAFO rows: add fafo to --methods")
    if compressors is not None and settings.streams == 0 and set(options.compressors) - {"auto"}:
        raise FafoError("--compressors compares the window's compressors, and the config's streams: 0 runs no "
                        "window: set streams in the config file (or give another with --config)")
    outputs = {"--json": json_file, "--csv": csv_file, "--markdown": markdown_file, "--plot": plot_file}
    _check_outputs(outputs, {"--prompts": [prompts] if prompts else [], "--documents": list(documents or ()),
                             "--config": [config] if config else [],
                             "MODEL": [settings.model] if settings.model else []}, binary=("--plot",))  # (hours)
    if plot_file is not None:
        _check_plot_format(plot_file)
    if not tune:  # before the model loads
        check_installed(chosen)
        check_prompts(chosen, prompts)
        if samples is not None and chosen == [CUSTOM]:  # (a --prompts file runs whole)
            raise FafoError("--samples sets how many prompts of each built-in suite run, and --suites custom runs "
                            "the --prompts file whole: drop --samples")
        if context is not None:
            long.check_context(context, options.tokens)  # (against the model's context once it loads)
        if documents:
            long.user_files(list(documents))
        if "cacheback" in options.methods and settings.cacheback_table:  # (read by that row, after others ran)
            from .decoders.ngram_table import table_file

            table_file(settings.cacheback_table)
        if settings.gpus > 1:  # a model spread over GPUs runs only some rows (api.check_spread says which)
            from .api import check_spread
            from .bench.runner import plan_rows

            for row in plan_rows(options.methods, options.compressors, external=False):
                check_spread(replace(settings, method=row.method, **dict(row.overrides)))
    out, err = consoles()
    if tune:
        from .bench import tune as tune_mod

        written = user_path(config) if config else None
        _check_output("config file", str(written or config_mod.user_config_path()), makes_folders=not written)
        code = tune_mod.run(_load(settings, err), settings, out, err, written)
        _create_config(config)
        raise typer.Exit(code)
    tables = err if "-" in outputs.values() else out  # standard output carries that file alone
    # (loaded by the bench, not here: --verify frees it before its float32 copy loads; TriForce's rows read the draft)
    raise typer.Exit(command.run(lambda: _load(settings, err, load_draft="triforce" in options.methods),
                                 settings, options, tables, err))


@app.command()
@config_options("doctor")
def doctor(
    config: ConfigOpt = None,
    *, flags: dict,
    write: Annotated[bool, typer.Option("--write", help="Keep the measured cost curve, from which `streams: auto` "
                                        "derives the recommended width for this model and device, and set `streams: "
                                        "auto` in the config (or the --config file, created where missing).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the report.")] = False,
    gpu_report: Annotated[Optional[str], typer.Option("--gpu-report", metavar="FILE", show_default=False,
                                                      help="Also measure a 7B-shaped random-weight Llama's steps "
                                                      "(rows 1-256, eager and CUDA graphs, bf16) against the "
                                                      "memory-bandwidth bound; write them to FILE (JSON). CUDA "
                                                      "only.")] = None,
    gpu_shape: Annotated[Optional[str], typer.Option("--gpu-shape", help="The report's model shape: "
                                                     "7b (default), 8b (Llama-3-8B's, grouped-query attention), 135m "
                                                     "(SmolLM2-135M's) or tiny (tests; runs on a CPU too).")] = None,
) -> None:
    """Check this machine: device and kernels, FAFO's exactness in float32, one pass's cost, recommended settings."""
    from .api import pick_device
    from .bench import doctor as doctor_mod
    from .bench import gpu_report as gpu_mod
    from .ui import consoles

    if gpu_shape is not None and gpu_report is None:
        raise FafoError("--gpu-shape sets the shape of --gpu-report's model: add --gpu-report FILE")
    gpu_shape = gpu_shape or "7b"
    settings = config_mod.resolve(config, written=write, **flags)
    device = pick_device(settings.device)
    report_path = None
    if gpu_report is not None:  # refused before minutes of measuring
        if gpu_report == "-":
            raise FafoError("--gpu-report writes a file: name one (--json prints the rest of the report)")
        _check_outputs({"--gpu-report": gpu_report}, {"the config file": [str(doctor_mod.default_config_path(config))],
                                                      "MODEL": [settings.model] if settings.model else []})
        report_path = user_path(gpu_report)
        gpu_mod.check(device, gpu_shape)
    if write:  # before a minute of measuring
        _check_output("config file", str(doctor_mod.default_config_path(config)), makes_folders=not config)
    # the model found (or converted) before the first progress line: a missing one is one line
    hub.resolve(settings.model, allow_pickle=settings.allow_pickle, trust_remote_code=settings.trust_remote_code)
    out, err = consoles()
    progress = (lambda line: None) if as_json else (lambda line: err.print(f"[dim]{line}[/]"))
    report = doctor_mod.run(settings, lambda chosen: _load(chosen, err), progress=progress,
                            write_to=doctor_mod.default_config_path(config) if write else None)
    if write:
        _create_config(config)
    gpu = gpu_failed = None
    if report_path is not None:  # (the configured model released first: the 7B shape needs the memory)
        release_dropped_models()
        progress(f"measuring the {gpu_shape}-shaped model's steps (--gpu-report)")
        try:
            gpu = gpu_mod.run(device, gpu_shape, notify=lambda line: print(f"note: {line}", file=sys.stderr))
        except (FafoError, MemoryError, RuntimeError) as e:  # the report above stands: said, then this one line
            if not isinstance(e, FafoError) and not is_out_of_memory(e):
                raise
            gpu_failed = str(e) if isinstance(e, FafoError) else (
                f"--gpu-report: the {gpu_shape}-shaped model's steps ran out of this GPU's memory; nothing written")
            report["gpu_report"] = {"error": gpu_failed}
    if gpu is not None:
        write_atomic(report_path, json.dumps(gpu, indent=1) + "\n")
        report["gpu_report"] = {"file": str(report_path), "bound_share_one_row": gpu["rows"][1]["bound_share"],
                                "vs_one_row_64": gpu["rows"][64]["vs_one_row"] if 64 in gpu["rows"] else None}
    if as_json:
        _print_json(report)
    else:
        doctor_mod.render(report, out)
        if gpu is not None:
            out.print(f"GPU report ({gpu_shape} shape, {gpu['dtype']}, {gpu['device']}): a one-row step runs at "
                      f"{gpu['rows'][1]['bound_share']:.0%} of the bandwidth bound ({gpu['bound_ms']:.2f} ms); "
                      f"written to {report_path}")
    if doctor_mod.failed(report):
        raise FafoError("FAFO differed from plain decoding in float32 on this machine (see above): please report it")
    if gpu_failed:
        raise FafoError(gpu_failed)


@app.command("compile")
@config_options("compile")
def compile_steps(
    config: ConfigOpt = None,
    methods: Annotated[Optional[str], typer.Option(help="Comma-separated methods to build for (default: the "
                                                   "config's method).", show_default=False)] = None,
    *, flags: dict,
) -> None:
    """Build the compiled steps a method runs in, ahead of its first `--compile` run (minutes each on a CPU)."""
    from .bench.command import parse_list
    from .compiled.ahead import build_ahead
    from .ui import consoles

    settings = config_mod.resolve(config, **flags)
    if settings.compile == "off":
        raise FafoError("fafo compile builds compiled steps; --no-compile (or compile: off) contradicts it")
    chosen = parse_list("--methods", methods, config_mod.METHODS, [settings.method])
    given = _given(flags)
    if methods is not None and "method" in given:
        raise FafoError("--methods names the methods to build for: drop --method")
    unused = sorted(given & (set(ANSWER_ONLY) | config_mod.GUESS_ONLY_KEYS))  # the packages' shapes do not use these
    unused += sorted(given & ({"draft_model"} | config_mod.DRAFT_MODEL_KEYS))  # (TriForce's draft model runs eager)
    unused += sorted(key for key in given if config_mod.method_of(config_mod.SPECS[key]) not in (None, *chosen))
    if unused:
        raise FafoError(f"fafo compile builds the steps of {', '.join(chosen)}; '{unused[0]}' does not change them")
    if settings.gpus > 1:  # one device's graph cannot hold a spread model's step
        raise FafoError(f"--gpus {settings.gpus}: a model spread over GPUs runs eager steps; fafo compile has "
                        "nothing to build for it")
    if "cuda_graphs" in given:  # (captured by each run as it needs them)
        raise FafoError("fafo compile builds compiled packages; CUDA graphs are captured at run time: drop "
                        "--cuda-graphs")
    from .api import pick_device

    device = pick_device(settings.device)
    if device.type != "cpu":  # (before the model loads)
        raise FafoError(f"fafo compile builds compiled steps for a CPU, not for {device.type}"
                        + (": a GPU's steps run as CUDA graphs, captured as they run" if device.type == "cuda" else ""))
    for method in chosen:  # each of its settings must change that method's steps, as `fafo run` checks them
        config_mod.check_given(replace(settings, method=method), {key for key in given if config_mod.method_of(
            config_mod.SPECS[key]) in (None, method)}, accelerator=False)
    _, err = consoles()
    engine = _load(replace(settings, compile="on"), err)
    for method, sizes in build_ahead(engine, chosen, retry_failed=True):  # (asked for: failed ones again)
        listed = ", ".join(map(str, sizes)) if sizes else "none (it runs eager)"
        print(f"{method}: compiled steps of {listed} rows, in {engine.steps_folder}")
    failed = engine.compiled.failed()
    if failed:
        raise FafoError(f"the compiled step{'s' if len(failed) > 1 else ''} of {', '.join(map(str, failed))} rows "
                        "could not be built (the notes above say why); those steps run eager")


@app.command()
@config_options("pull")
def pull(
    model: Annotated[str, typer.Argument(help="Hub id, e.g. Qwen/Qwen2.5-0.5B-Instruct; a repo of GGUF files with "
                                         "a quantization, as llama.cpp's -hf and ollama's hf.co/ name them, e.g. "
                                         "bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M.", show_default=False)],
    revision: Annotated[Optional[str], typer.Option(help="Branch, tag or commit.", show_default=False)] = None,
    config: ConfigOpt = None,
    *, flags: dict,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar; print only the path.")] = False,
) -> None:
    """Download a model's config, tokenizer and safetensors into the Hugging Face cache, or a GGUF file, which is
    converted once; print its path."""
    allow_pickle = config_mod.resolve(config, **flags).allow_pickle  # the config file's, unless the flag says
    repo_id, quant = hub_gguf.parse(model) or (model, None)
    if model == repo_id and hub.looks_like_path(model):
        raise FafoError(f"{model} names a file or folder: `fafo run {model}` runs it as it is; `fafo pull` downloads "
                        "models from the Hugging Face hub by id (org/name)")
    if "/" not in model and (converted := hub.converted_named(model)) is not None:  # nothing to download
        print(f"note: {model} is a .gguf model converted here (`fafo list` shows it); nothing to pull",
              file=sys.stderr)
        print(converted)
        return
    folder = hub.pull(repo_id, quant=quant, gguf=model != repo_id, revision=revision or None,  # ("": main)
                      allow_pickle=allow_pickle, quiet=quiet)
    hub.check_folder(folder, allow_pickle=allow_pickle, trust_remote_code=True)
    print(folder)


@app.command("list")
def list_models(
    as_json: Annotated[bool, typer.Option("--json", help="One JSON array.")] = False,
) -> None:
    """Models available offline, with their quantization: the Hugging Face cache and converted .gguf models (and
    pulls cut off before they held a whole model)."""
    models = hub.cached_models()
    if as_json:
        print(json.dumps([m.to_dict() for m in models], indent=2))
        return
    from rich.table import Table

    from .ui import consoles

    out, _ = consoles()
    if not models:
        out.print("No cached models. `fafo pull ORG/NAME` downloads one; `fafo run` prepares the embedded default.")
        return
    # "on disk": with its compiled steps; a converted .gguf is held dequantized (float32, and the dtypes run),
    # several times the file
    table = Table("name", "quantization", "on disk", "modified", box=None, header_style="bold")
    table.add_column("path", overflow="fold")
    for m in models:
        name = escape(m.name)  # (a name or path with brackets is text, not Rich markup)
        table.add_row(name if m.complete else f"{name} [yellow](incomplete: pull it again, or rm it)[/]",
                      m.quantization or "—", _megabytes(m.size_bytes), m.modified.strftime("%Y-%m-%d %H:%M"),
                      escape(str(m.path)))
    out.print(table)


def _megabytes(size: int) -> str:
    from .runtime.memory import MB

    return f"{size / MB:,.0f} MB" if size >= MB / 2 else "<1 MB"


@app.command("rm")
def remove_models(
    models: Annotated[list[str], typer.Argument(
        help="Names as `fafo list` shows them, hub ids, or .gguf files (their conversion is removed, not the file).",
        show_default=False, metavar="MODEL")],
) -> None:
    """Remove models from the caches with their compiled steps: converted .gguf models, hub downloads."""
    found = [hub.removable(spec) for spec in models]  # every name checked before anything is removed
    for model in dict.fromkeys(m for copies in found for m in copies):  # (a model named twice: removed once)
        download = hub.hub_download_of(model.path) if model.source == "gguf" else None
        hub.remove(model)
        print(f"removed {model.name} ({_megabytes(model.size_bytes)}): {model.path}")
        if download is not None and download.exists():
            print(f"note: its GGUF file stays in the Hugging Face cache, which other tools share: {download}",
                  file=sys.stderr)


@config_app.command("show")
def config_show(
    config: ConfigOpt = None,
    markdown: Annotated[bool, typer.Option("--markdown", help="Print the reference of every key instead "
                                           "(docs/configuration.md).")] = False,
) -> None:
    """Print the configuration the commands use, checked: the keys your config file (or --config's) gives, and
    every other key commented out at its default, each with its description (with no file: what `init` writes)."""
    if markdown:
        print(config_mod.reference_markdown(), end="")
        return
    settings = config_mod.resolve(config)
    print(config_mod.default_yaml(settings, config_mod.config_source(config)), end="")


@config_app.command("path")
def config_path() -> None:
    """Print where the user configuration file is read from."""
    print(config_mod.user_config_path())


@config_app.command("init")
def config_init(force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False) -> None:
    """Write the documented default configuration to the user config path, every key commented out."""
    path = config_mod.user_config_path()
    if path.exists() and not force:
        raise FafoError(f"{path} already exists (use --force to overwrite)")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, config_mod.default_yaml())
    print(path)


@cacheback_app.command("build-table")
@config_options("cacheback build-table")
def cacheback_build_table(
    files: Annotated[list[str], typer.Argument(help="Text files to learn from.", show_default=False)],
    out: Annotated[str, typer.Option("--out", "-o", help="Table file to write (e.g. table.bin).",
                                     show_default=False)],
    model: Annotated[Optional[str], typer.Option(help="Model whose tokenizer encodes the text (default: the "
                                                 "config's model, else the embedded SmolLM2).",
                                                 show_default=False)] = None,
    config: ConfigOpt = None,
    *, flags: dict,
) -> None:
    """Build a frozen Cacheback table from text files, for --cacheback-table."""
    from .decoders.ngram_table import build_from_files, check_corpus, tokenizer_fingerprint

    settings = config_mod.resolve(config, model=model, **flags)
    _check_outputs({"--out": out}, {"a text file to learn from": list(files)}, binary=("--out",))
    paths = check_corpus(files)  # every file checked before the tokenizer loads
    # only its tokenizer is read: pickle weights, never loaded here, are no reason to refuse it
    folder = hub.resolve(settings.model, allow_pickle=True, trust_remote_code=settings.trust_remote_code)
    from .api import load_tokenizer

    tokenizer = load_tokenizer(folder, settings)
    table, tokens = build_from_files(paths, lambda text: tokenizer(text, add_special_tokens=False)["input_ids"],
                                     settings.cacheback_leader, settings.cacheback_follower,
                                     settings.cacheback_followers, settings.cacheback_leaders)
    table.save(out, tokenizer_fingerprint(tokenizer))
    print(f"{out}: {table.leaders:,} leaders, {table.entries:,} followers from {tokens:,} tokens in {len(paths)} "
          "file(s)")


# what a path the user chose or set up can be that makes it unusable (anything else is ours to fix: a traceback)
UNUSABLE_PATH = {errno.ENOTDIR, errno.EISDIR, errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC,
                 errno.EDQUOT, errno.EFBIG, errno.EEXIST, errno.ENAMETOOLONG, errno.ELOOP, errno.EXDEV,
                 errno.ENOTEMPTY}


class Terminated(BaseException):
    """SIGTERM, raised where the process is (not an Exception: it unwinds every `with` and `finally`, the live
    panel's that shows the cursor again included; not a KeyboardInterrupt, which `fafo chat` takes as "stop this
    answer")."""


def _terminate(signum, frame) -> None:
    raise Terminated


def _interrupt(signum, frame) -> None:
    """Python's own SIGINT handler (a KeyboardInterrupt), remembering that it ran (`unhandled_interrupts`)."""
    unhandled_interrupts.append(signum)
    raise KeyboardInterrupt


def _after_interrupt() -> int:
    print("interrupted", file=sys.stderr)
    return 130


def tolerant_streams() -> None:
    """The process's own streams: a character the locale cannot write, or a file name's stray bytes (kept by Python as
    lone surrogates, which not even UTF-8 writes), is replaced, not a traceback. A stream that writes those bytes
    back as they were (surrogateescape: Python's own under the C locale or UTF-8 mode) is left so."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None and getattr(stream, "errors", "strict") == "strict":
            getattr(stream, "reconfigure", lambda **_: None)(errors="replace")


def entrypoint(argv: list[str] | None = None) -> int:
    """Run the CLI; every failure becomes one line on stderr and a non-zero exit code."""
    command = typer.main.get_command(app)
    unhandled_interrupts.clear()
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # (not where a caller set its own)
        signal.signal(signal.SIGINT, _interrupt)
    # (`fafo serve` has uvicorn's own while it serves; it gives this one back after. Only the main thread may set
    # one: an in-process caller's thread leaves SIGTERM as it is)
    terminate = None
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        terminate = signal.signal(signal.SIGTERM, _terminate)
    if argv is None:
        tolerant_streams()
    try:
        return _run(command, argv)
    except Terminated:
        print("terminated", file=sys.stderr)
        return 143
    except Exception:  # after an interrupt, whatever it left half done (a module half imported)
        if unhandled_interrupts:
            return _after_interrupt()
        raise
    finally:
        if terminate is not None:
            signal.signal(signal.SIGTERM, terminate)
        # the interpreter's last collection walks every object torch and the model created (0.3-0.5 s of an exit);
        # it skips frozen ones. Only as the process's command: an in-process caller goes on, and frozen garbage (a
        # finished engine's cycles) would never be freed
        if argv is None:
            gc.freeze()


def _run(command, argv: list[str] | None) -> int:
    """The command's exit code; each failure that a user can act on as one line on stderr."""
    try:
        result = command.main(args=argv, prog_name="fafo", standalone_mode=False)
        return result if isinstance(result, int) else 0
    except FafoError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except typer.Exit as e:
        return e.exit_code
    except typer.Abort:
        return _after_interrupt()
    except typer.TyperException as e:  # bad usage: unknown option, wrong type, missing argument
        ctx = getattr(e, "ctx", None)
        if type(e).__name__ == "NoArgsIsHelpError":  # bare `fafo` or `fafo config`: the help (rich help printed
            help = e.format_message()                   # it already, and its message is empty)
            if help.strip():
                print(help)
            return 0
        words = sys.argv[1:] if argv is None else [str(word) for word in argv]
        path = ctx.command_path if ctx is not None else (  # (an option missing its value has no context yet)
            f"fafo {words[0]}" if words and words[0] in getattr(command, "commands", {}) else None)
        hint = f" (see `{path} --help`)" if path else ""
        print(f"error: {first_line(e.format_message()) or 'invalid usage'}{hint}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return _after_interrupt()
    except (MemoryError, RuntimeError, OSError) as e:  # torch's out-of-memory errors are RuntimeErrors; ENOMEM
        if not is_out_of_memory(e):
            if isinstance(e, OSError):
                return _unusable(e)
            raise
        print("error: out of memory; try fewer tokens, a shorter prompt, --dtype bfloat16 or a smaller model",
              file=sys.stderr)
        return 1


def _unusable(e: OSError) -> int:
    """A path we were given or pointed at (a cache, the config's folder, an output) is unusable: one line (any
    other OSError is raised again)."""
    path = e.filename2 or e.filename  # a rename's target, not its temporary source
    if e.errno in (errno.ENOSPC, errno.EDQUOT) and not path:  # a write whose file the error does not name
        print(f"error: {e.strerror} (a cache, a conversion or an output could not be written)", file=sys.stderr)
        return 1
    if e.errno not in UNUSABLE_PATH or not path:
        raise e
    print(f"error: cannot use {path}: {e.strerror}", file=sys.stderr)
    return 1

