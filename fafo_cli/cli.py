"""The `fafo` command: pull, list, run, chat, config. Thin: parse flags, call the API, render events."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from . import __version__
from . import config as config_mod
from . import hub
from .errors import FafoError
from .files import write_atomic

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Lossless fast decoding for local LLMs (FAFO).")
config_app = typer.Typer(no_args_is_help=True, help="Show or create the YAML configuration file.")
app.add_typer(config_app, name="config")
cacheback_app = typer.Typer(no_args_is_help=True, help="Cacheback's frozen n-gram tables.")
app.add_typer(cacheback_app, name="cacheback")

# Options shared by `run` and `chat`. None means "not given": the config file's value stands.
ModelArg = Annotated[Optional[str], typer.Argument(
    help="Hub id (org/name), local folder or .gguf file. Default: the embedded SmolLM2-135M-Instruct.",
    show_default=False)]
ConfigOpt = Annotated[Optional[str], typer.Option("--config", "-c", help="YAML config file.", show_default=False)]
MaxTokens = Annotated[Optional[int], typer.Option("--max-tokens", "-n", help="Most tokens to generate.",
                                                  show_default=False)]
Temperature = Annotated[Optional[float], typer.Option(help="0 = greedy; above 0 samples.", show_default=False)]
TopP = Annotated[Optional[float], typer.Option("--top-p", help="Nucleus sampling mass.", show_default=False)]
TopK = Annotated[Optional[int], typer.Option("--top-k", help="Sample among the k likeliest (0 = off).",
                                             show_default=False)]
MinP = Annotated[Optional[float], typer.Option("--min-p", help="Drop tokens below min_p × the likeliest (0 = off).",
                                               show_default=False)]
Seed = Annotated[Optional[int], typer.Option(help="Random seed for sampling.", show_default=False)]
Dtype = Annotated[Optional[str], typer.Option(help="auto | float32 | bfloat16 | float16", show_default=False)]
Device = Annotated[Optional[str], typer.Option(help="auto | cpu | cuda | mps", show_default=False)]
Compile = Annotated[Optional[bool], typer.Option("--compile/--no-compile", help="Compiled decoding steps: built "
                                                 "once per model (minutes on a CPU), then loaded from disk. "
                                                 "Default (config 'auto'): those already built and faster.",
                                                 show_default=False)]
Method = Annotated[Optional[str], typer.Option(help=f"Decoding method: {' | '.join(config_mod.METHODS)}",
                                               show_default=False)]
System = Annotated[Optional[str], typer.Option(help="System prompt.", show_default=False)]
ChatTemplate = Annotated[Optional[bool], typer.Option("--chat-template/--no-chat-template",
                                                      help="Wrap the prompt in the model's chat template.",
                                                      show_default=False)]
TrustRemoteCode = Annotated[Optional[bool], typer.Option("--trust-remote-code", help="Allow a model repo's own "
                                                         "Python code to run.", show_default=False)]
AllowPickle = Annotated[Optional[bool], typer.Option("--allow-pickle", help="Allow pickle (.bin) weights, "
                                                     "which can run code when loaded.", show_default=False)]
Streams = Annotated[Optional[str], typer.Option("--streams", "-W", help="fafo: lookahead streams W, or auto "
                                                "(1 where steps run compiled, else 2).",
                                                show_default=False, rich_help_panel="FAFO")]
Ngram = Annotated[Optional[int], typer.Option("--ngram", "-k", help="fafo: guess length k.", show_default=False,
                                              rich_help_panel="FAFO")]
Guesses = Annotated[Optional[int], typer.Option("--guesses", "-G", help="fafo: candidates verified per step G.",
                                                show_default=False, rich_help_panel="FAFO")]
Prefix = Annotated[Optional[int], typer.Option("--prefix", "-P", help="fafo: longest pool key P.",
                                               show_default=False, rich_help_panel="FAFO")]
PoolPerKey = Annotated[Optional[int], typer.Option("--pool-per-key", help="fafo: n-grams kept per pool key.",
                                                   show_default=False, rich_help_panel="FAFO")]
Compressor = Annotated[Optional[str], typer.Option(help=f"fafo: {' | '.join(config_mod.COMPRESSORS)}",
                                                   show_default=False, rich_help_panel="FAFO")]
Budget = Annotated[Optional[float], typer.Option("--budget", "-B", help="fafo: compressed budget B: tokens, or a "
                                                 "fraction of the prompt (0.1).", show_default=False,
                                                 rich_help_panel="FAFO")]
Sink = Annotated[Optional[int], typer.Option(help="stream: first positions always kept.", show_default=False,
                                             rich_help_panel="FAFO")]
PageSize = Annotated[Optional[int], typer.Option(help="quest: tokens per page.", show_default=False,
                                                 rich_help_panel="FAFO")]
Refresh = Annotated[Optional[int], typer.Option(help="quest: re-select pages every N new tokens.",
                                                show_default=False, rich_help_panel="FAFO")]
Window = Annotated[Optional[int], typer.Option(help="snapkv/h2o: prompt queries observed at prefill.",
                                               show_default=False, rich_help_panel="FAFO")]
Kernel = Annotated[Optional[int], typer.Option(help="snapkv: score smoothing width (odd).", show_default=False,
                                               rich_help_panel="FAFO")]
Attention = Annotated[Optional[str], typer.Option(help="fafo: split | block (FlexAttention) | auto.",
                                                  show_default=False, rich_help_panel="FAFO")]
Recent = Annotated[Optional[int], typer.Option(help="h2o: recent positions always kept.", show_default=False,
                                               rich_help_panel="FAFO")]



def _peer(flag: str, kind: type, help: str, panel: str):
    return Annotated[Optional[kind], typer.Option(flag, help=help, show_default=False, rich_help_panel=panel)]


LookaheadStreams = _peer("--lookahead-streams", int, "Window streams W.", "Lookahead")
LookaheadNgram = _peer("--lookahead-ngram", int, "Guess length (N - 1).", "Lookahead")
LookaheadGuesses = _peer("--lookahead-guesses", int, "Candidates verified per step G.", "Lookahead")
LookupNgram = _peer("--lookup-ngram", int, "Longest text ending looked up in the context.", "Prompt lookup")
LookupTokens = _peer("--lookup-tokens", int, "Tokens drafted after a match.", "Prompt lookup")
CachebackLeader = _peer("--cacheback-leader", int, "Leader length LL.", "Cacheback")
CachebackFollower = _peer("--cacheback-follower", int, "Follower length FL.", "Cacheback")
CachebackFollowers = _peer("--cacheback-followers", int, "Followers kept per leader FC.", "Cacheback")
CachebackLeaders = _peer("--cacheback-leaders", int, "Leaders kept in the dynamic table.", "Cacheback")
CachebackBudget = _peer("--cacheback-budget", int, "Draft tokens per step (tree nodes).", "Cacheback")
CachebackTable = _peer("--cacheback-table", str, "Frozen table file (fafo cacheback build-table).", "Cacheback")
TriforceChunk = _peer("--triforce-chunk", int, "Tokens per retrieval chunk.", "TriForce")
TriforceBudget = _peer("--triforce-budget", int, "Retrieval cache size in tokens.", "TriForce")
TriforceGamma1 = _peer("--triforce-gamma1", int, "Draft model tokens per middle-level check.", "TriForce")
TriforceGamma2 = _peer("--triforce-gamma2", int, "Middle-level tokens per full-model check.", "TriForce")
TriforceDraftCache = _peer("--triforce-draft-cache", int, "Draft model's StreamingLLM cache size.", "TriForce")
DraftModel = _peer("--draft-model", str, "Tiny draft model sharing the tokenizer.", "TriForce")
QuantspecGamma = _peer("--quantspec-gamma", int, "Tokens drafted per step.", "QuantSpec")
QuantspecGroup = _peer("--quantspec-group", int, "Quantisation group size.", "QuantSpec")

def _version(value: bool) -> None:
    if value:
        print(f"fafo-cli {__version__}")
        raise typer.Exit()


@app.callback()
def main(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                               help="Show the version and exit.")] = False) -> None:
    """Lossless fast decoding for local LLMs (FAFO)."""


def _config_flags(arguments: dict) -> dict:
    """The command's arguments that are config keys (None: not given, the file's value stands)."""
    keys = config_mod.Config().to_dict()
    flags = {k: v for k, v in arguments.items() if k in keys}
    if isinstance(flags.get("compile"), bool):  # --compile / --no-compile
        flags["compile"] = "on" if flags["compile"] else "off"
    return flags


def _read_prompt(source: str) -> str:
    if source == "-":
        text = sys.stdin.read()
    else:
        path = Path(source).expanduser()
        if path.is_dir():
            raise FafoError(f"--prompt {source} is a folder, not a file")
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise FafoError(f"prompt file not found: {source}") from None
        except UnicodeDecodeError:
            raise FafoError(f"prompt file {source} is not UTF-8 text") from None
        except OSError as e:
            raise FafoError(f"cannot read prompt file {source}: {e.strerror}") from None
    if not text.strip():
        raise FafoError("the prompt is empty")
    return text


def _load(config: config_mod.Config, err_console):
    from .api import Engine

    if config.model is None and not err_console.is_dumb_terminal and err_console.is_terminal:
        err_console.print(f"[dim]model: {hub.EMBEDDED_NAME} (embedded default)[/]")
    engine = Engine.from_config(config)
    if config.chat_template and not engine.has_chat_template:
        print(f"note: {engine.name} has no chat template; the prompt is continued as plain text", file=sys.stderr)
    return engine


@app.command()
def run(
    model: ModelArg = None,
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="Prompt file, or - for standard input.",
                                        show_default=False)] = ...,
    config: ConfigOpt = None, method: Method = None, max_tokens: MaxTokens = None,
    temperature: Temperature = None, top_p: TopP = None, top_k: TopK = None, min_p: MinP = None,
    seed: Seed = None,
    dtype: Dtype = None, device: Device = None, compile: Compile = None, system: System = None,
    chat_template: ChatTemplate = None,
    trust_remote_code: TrustRemoteCode = None, allow_pickle: AllowPickle = None,
    streams: Streams = None, ngram: Ngram = None, guesses: Guesses = None, prefix: Prefix = None,
    pool_per_key: PoolPerKey = None, compressor: Compressor = None, budget: Budget = None, sink: Sink = None,
    page_size: PageSize = None, refresh: Refresh = None, window: Window = None, kernel: Kernel = None,
    recent: Recent = None, attention: Attention = None,
    lookahead_streams: LookaheadStreams = None, lookahead_ngram: LookaheadNgram = None,
    lookahead_guesses: LookaheadGuesses = None, lookup_ngram: LookupNgram = None, lookup_tokens: LookupTokens = None,
    cacheback_leader: CachebackLeader = None, cacheback_follower: CachebackFollower = None,
    cacheback_followers: CachebackFollowers = None, cacheback_leaders: CachebackLeaders = None,
    cacheback_budget: CachebackBudget = None, cacheback_table: CachebackTable = None,
    triforce_chunk: TriforceChunk = None, triforce_budget: TriforceBudget = None,
    triforce_gamma1: TriforceGamma1 = None, triforce_gamma2: TriforceGamma2 = None,
    triforce_draft_cache: TriforceDraftCache = None, draft_model: DraftModel = None,
    quantspec_gamma: QuantspecGamma = None, quantspec_group: QuantspecGroup = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object: text, token_ids, stats, "
                                          "settings.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Only the answer: no panel, no footer.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Stats on stderr even when stdout is not "
                                          "a terminal.")] = False,
) -> None:
    """Generate one answer, streamed, with live statistics."""
    from .ui import StreamView, consoles, method_label

    text = _read_prompt(prompt)
    settings = config_mod.resolve(config, **_config_flags(locals()))
    out, err = consoles()
    engine = _load(settings, err)
    if as_json:
        print(json.dumps(engine.complete(text).to_dict(), ensure_ascii=False))
        return
    request = engine.request_config()  # the model's sampling defaults filled in, a fresh seed drawn
    live = out.is_terminal and not quiet
    view = StreamView(out, method=method_label(request), live=live, show_footer=not quiet and (live or verbose),
                      stats_console=out if live else err)
    with view:
        view.consume(engine.stream(text, seed=request.seed))


@app.command()
def chat(
    model: ModelArg = None, config: ConfigOpt = None, method: Method = None, max_tokens: MaxTokens = None,
    temperature: Temperature = None, top_p: TopP = None, top_k: TopK = None, min_p: MinP = None,
    seed: Seed = None,
    dtype: Dtype = None, device: Device = None, compile: Compile = None, system: System = None,
    chat_template: ChatTemplate = None,
    trust_remote_code: TrustRemoteCode = None, allow_pickle: AllowPickle = None,
    streams: Streams = None, ngram: Ngram = None, guesses: Guesses = None, prefix: Prefix = None,
    pool_per_key: PoolPerKey = None, compressor: Compressor = None, budget: Budget = None, sink: Sink = None,
    page_size: PageSize = None, refresh: Refresh = None, window: Window = None, kernel: Kernel = None,
    recent: Recent = None, attention: Attention = None,
    lookahead_streams: LookaheadStreams = None, lookahead_ngram: LookaheadNgram = None,
    lookahead_guesses: LookaheadGuesses = None, lookup_ngram: LookupNgram = None, lookup_tokens: LookupTokens = None,
    cacheback_leader: CachebackLeader = None, cacheback_follower: CachebackFollower = None,
    cacheback_followers: CachebackFollowers = None, cacheback_leaders: CachebackLeaders = None,
    cacheback_budget: CachebackBudget = None, cacheback_table: CachebackTable = None,
    triforce_chunk: TriforceChunk = None, triforce_budget: TriforceBudget = None,
    triforce_gamma1: TriforceGamma1 = None, triforce_gamma2: TriforceGamma2 = None,
    triforce_draft_cache: TriforceDraftCache = None, draft_model: DraftModel = None,
    quantspec_gamma: QuantspecGamma = None, quantspec_group: QuantspecGroup = None,
) -> None:
    """Multi-turn chat with the same live panel. /help lists the commands."""
    from .chat import Repl
    from .ui import consoles

    settings = config_mod.resolve(config, **_config_flags(locals()))
    out, err = consoles()
    Repl(_load(settings, err), out, err).run()


@app.command()
def bench(
    model: ModelArg = None, config: ConfigOpt = None,
    suites: Annotated[Optional[str], typer.Option(help="Comma-separated: chat, math, code, summarize, edit "
                                                  "(default: all).", show_default=False)] = None,
    methods: Annotated[Optional[str], typer.Option(help="Comma-separated methods (default: all). vanilla always "
                                                   "runs: it is the reference.", show_default=False)] = None,
    compressors: Annotated[Optional[str], typer.Option(help="FAFO rows, one per compressor (default: the "
                                                       "config's).", show_default=False)] = None,
    tokens: Annotated[int, typer.Option(help="New tokens per answer.", min=1)] = 512,
    repeats: Annotated[int, typer.Option(help="Repetitions per prompt (medians reported).", min=1)] = 3,
    warmup: Annotated[int, typer.Option(help="Untimed runs of every row first.", min=0)] = 1,
    samples: Annotated[int, typer.Option(help="Prompts per suite.", min=1)] = 3,
    prompts: Annotated[Optional[str], typer.Option(help="Your own prompts: a JSONL file, {\"prompt\": ...} or "
                                                   "{\"messages\": [...]} per line.", show_default=False)] = None,
    temperature: Annotated[float, typer.Option(help="0 = greedy (exactness checked); above 0 samples.",
                                               min=0.0)] = 0.0,
    dtype: Dtype = None, device: Device = None, compile: Compile = None,
    external: Annotated[bool, typer.Option("--external/--no-external", help="Time transformers' generate and "
                                           "its prompt lookup too.")] = True,
    verify: Annotated[bool, typer.Option("--verify", help="Re-run the greedy rows in float32 and require "
                                         "identical tokens.")] = False,
    json_file: Annotated[Optional[str], typer.Option("--json", help="Write one record per method × suite.",
                                                     show_default=False)] = None,
    csv_file: Annotated[Optional[str], typer.Option("--csv", help="Write the records as CSV.",
                                                    show_default=False)] = None,
    markdown_file: Annotated[Optional[str], typer.Option("--markdown", help="Write a markdown table (- for "
                                                         "standard output).", show_default=False)] = None,
    plot_file: Annotated[Optional[str], typer.Option("--plot", help="Speedup chart (PNG; needs matplotlib).",
                                                     show_default=False)] = None,
    tune: Annotated[bool, typer.Option("--tune", help="Measure this machine and write the best FAFO settings "
                                       "into the user config.")] = False,
    trust_remote_code: TrustRemoteCode = None, allow_pickle: AllowPickle = None,
) -> None:
    """FAFO against plain decoding, the peer methods and transformers, side by side."""
    from .bench import command
    from .bench.suites import parse_suites
    from .ui import consoles

    settings = config_mod.resolve(config, **_config_flags({k: v for k, v in locals().items() if k != "temperature"}))
    options = command.BenchOptions(
        suites=parse_suites(suites),
        methods=command.parse_list("--methods", methods, config_mod.METHODS, list(config_mod.METHODS)),
        compressors=command.parse_list("--compressors", compressors, config_mod.COMPRESSORS, [settings.compressor]),
        tokens=tokens, repeats=repeats, warmup=warmup, samples=samples, prompts=prompts, temperature=temperature,
        external=external, verify=verify, json_path=json_file, csv_path=csv_file, markdown_path=markdown_file,
        plot_path=plot_file)
    out, err = consoles()
    if tune:
        from .bench import tune as tune_mod

        raise typer.Exit(tune_mod.run(_load(settings, err), settings, out, err, Path(config) if config else None))
    raise typer.Exit(command.run(_load(settings, err), settings, options, out, err))


@app.command()
def pull(
    model: Annotated[str, typer.Argument(help="Hub id, e.g. Qwen/Qwen2.5-0.5B-Instruct.", show_default=False)],
    revision: Annotated[Optional[str], typer.Option(help="Branch, tag or commit.", show_default=False)] = None,
    allow_pickle: AllowPickle = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar; print only the path.")] = False,
) -> None:
    """Download a model's config, tokenizer and safetensors into the Hugging Face cache; print its path."""
    folder = hub.pull(model, revision=revision, allow_pickle=bool(allow_pickle), quiet=quiet)
    hub.check_folder(folder, allow_pickle=bool(allow_pickle), trust_remote_code=True)
    print(folder)


@app.command("list")
def list_models(
    as_json: Annotated[bool, typer.Option("--json", help="One JSON array.")] = False,
) -> None:
    """Models available offline: the Hugging Face cache and converted .gguf models."""
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
    table = Table("name", "size", "modified", box=None, header_style="bold")
    table.add_column("path", overflow="fold")
    for m in models:
        table.add_row(m.name, f"{m.size_bytes / 1e6:,.0f} MB", m.modified.strftime("%Y-%m-%d %H:%M"), str(m.path))
    out.print(table)


@config_app.command("show")
def config_show() -> None:
    """Print the documented default configuration (a valid YAML file)."""
    print(config_mod.default_yaml(), end="")


@config_app.command("path")
def config_path() -> None:
    """Print where the user configuration file is read from."""
    print(config_mod.user_config_path())


@config_app.command("init")
def config_init(force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False) -> None:
    """Write the documented default configuration to the user config path."""
    path = config_mod.user_config_path()
    if path.exists() and not force:
        raise FafoError(f"{path} already exists (use --force to overwrite)")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, config_mod.default_yaml())
    print(path)


@cacheback_app.command("build-table")
def cacheback_build_table(
    files: Annotated[list[str], typer.Argument(help="Text files to learn from.", show_default=False)],
    out: Annotated[str, typer.Option("--out", "-o", help="Table file to write (e.g. table.bin).",
                                     show_default=False)],
    model: Annotated[Optional[str], typer.Option(help="Model whose tokenizer encodes the text (default: the "
                                                 "config's model, else the embedded SmolLM2).",
                                                 show_default=False)] = None,
    config: ConfigOpt = None, cacheback_leader: CachebackLeader = None, cacheback_follower: CachebackFollower = None,
    cacheback_followers: CachebackFollowers = None, cacheback_leaders: CachebackLeaders = None,
    trust_remote_code: TrustRemoteCode = None,
) -> None:
    """Build a frozen Cacheback table from text files, for --cacheback-table."""
    from .decoders.ngram_table import build_table, read_corpus, tokenizer_fingerprint

    settings = config_mod.resolve(config, **_config_flags(locals()))
    texts = read_corpus(files)  # every file checked before the tokenizer loads
    folder = hub.resolve(settings.model, trust_remote_code=settings.trust_remote_code)
    from transformers import AutoTokenizer

    with hub.quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=settings.trust_remote_code)
    streams = [tokenizer(text)["input_ids"] for text in texts]
    table = build_table(streams, settings.cacheback_leader, settings.cacheback_follower,
                        settings.cacheback_followers, settings.cacheback_leaders)
    table.save(out, tokenizer_fingerprint(tokenizer))
    print(f"{out}: {table.leaders:,} leaders, {table.entries:,} followers from {sum(map(len, streams)):,} tokens "
          f"in {len(texts)} file(s)")


def _one_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "invalid usage"


def entrypoint(argv: list[str] | None = None) -> int:
    """Run the CLI; every failure becomes one line on stderr and a non-zero exit code."""
    import torch

    command = typer.main.get_command(app)
    try:
        result = command.main(args=argv, prog_name="fafo", standalone_mode=False)
        return result if isinstance(result, int) else 0
    except FafoError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except typer.Exit as e:
        return e.exit_code
    except typer.Abort:
        print("interrupted", file=sys.stderr)
        return 130
    except typer.TyperException as e:  # bad usage: unknown option, wrong type, missing argument
        ctx = getattr(e, "ctx", None)
        if type(e).__name__ == "NoArgsIsHelpError" and ctx is not None:  # bare `fafo` or `fafo config`
            print(ctx.get_help())
            return 0
        hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        print(f"error: {_one_line(e.format_message())}{hint}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (torch.OutOfMemoryError, MemoryError):
        print("error: out of memory; try a smaller --max-tokens, --dtype bfloat16 or a smaller model", file=sys.stderr)
        return 1
    except RuntimeError as e:
        if "alloc" in str(e) and "memory" in str(e):  # CPU allocator failures are plain RuntimeErrors
            print("error: out of memory; try a smaller --max-tokens, --dtype bfloat16 or a smaller model",
                  file=sys.stderr)
            return 1
        raise
    except BrokenPipeError:  # `fafo run ... | head`
        return 0
