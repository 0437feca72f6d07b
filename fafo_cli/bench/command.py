"""`fafo bench`: measure, check exactness, report. The CLI parses flags; this module does the work."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import sys
from dataclasses import dataclass, replace
from typing import Iterator

import torch

from .. import __version__
from ..compiled.graphs import GraphSteps
from ..config import METHODS, SAMPLING_NEUTRAL
from ..errors import FafoError, interrupt_handled, is_out_of_memory
from ..files import user_path, write_atomic
from ..runtime.memory import release_dropped_models
from ..ui import live_display
from . import exactness, long, report, suites
from .runner import Failed, Progress, Run, measure, plan_rows, run_once


@dataclass(frozen=True)
class BenchOptions:
    suites: list[str]
    methods: list[str]
    compressors: list[str]
    tokens: int
    repeats: int
    warmup: int
    samples: int
    prompts: str | None
    temperature: float
    external: bool
    verify: bool
    json_path: str | None
    csv_path: str | None
    markdown_path: str | None
    plot_path: str | None
    context: int | None = None  # the long suite's prompt-and-answer length in tokens (None: its defaults)
    documents: tuple[str, ...] = ()  # the long suite's source files (empty: the standard library)


@dataclass(frozen=True)
class Matrix:
    """What `fafo bench` runs unless told otherwise."""
    methods: tuple[str, ...]
    samples: int
    repeats: int
    external: bool


# The default answers "is FAFO faster here, and than what?" in minutes on a 2-core CPU: plain decoding against
# FAFO and the two strongest exact peers, one prompt per suite, one interleaved run each. --full: everything.
QUICK = Matrix(("fafo", "prompt-lookup", "suffix"), samples=1, repeats=1, external=False)
FULL = Matrix(METHODS, samples=3, repeats=3, external=True)


def parse_list(flag: str, spec: str | None, allowed: tuple[str, ...], default: list[str]) -> list[str]:
    if spec is None:
        return default
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise FafoError(f"{flag}: unknown value '{unknown[0] if unknown else spec}' (choose from {', '.join(allowed)})")
    return list(dict.fromkeys(names))


PER_RUN = ("model", "method", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed")


def _meta(engine, options: BenchOptions, config) -> dict:
    import transformers

    return {"model": engine.name, "dtype": str(engine.model.dtype).removeprefix("torch."),
            "device": str(engine.model.device), "tokens": options.tokens, "repeats": options.repeats,
            "samples": options.samples, "temperature": options.temperature,
            "context": long.contexts(options.context, engine.model.max_context, options.tokens)
            if "long" in options.suites else None,  # (the long suite's lengths: --context's, or the defaults that fit)
            # the config's settings, but those the bench sets per run (the method, tokens and sampling above)
            "settings": {k: v for k, v in config.to_dict().items() if k not in PER_RUN},
            "versions": {"fafo-cli": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
                         "python": platform.python_version()},
            "machine": f"{platform.machine()} · {os.cpu_count()} CPUs · {platform.processor() or platform.system()}",
            "date": datetime.date.today().isoformat()}


def _steps_mode(config, ran_compiled: bool, graphs: bool = False) -> str:
    """How the rows' steps ran, for the title: under `compile: auto` rows without "+compiled" run compiled wherever a
    package was built before (or as CUDA graphs on a GPU), so a table that does not say so reads as eager."""
    if config.compile == "on":
        return "eager and +compiled rows"
    if ran_compiled:
        return "CUDA graph steps" if graphs else \
            "compiled steps where built (compile: auto; --compile runs each row eager and compiled)"
    return "eager steps"


def _write(path: str, text: str) -> None:
    if path == "-":
        sys.stdout.write(text)
        return
    try:
        write_atomic(user_path(path), text)
    except OSError as e:
        raise FafoError(f"cannot write {path}: {e.strerror}") from None


def _plot(results, path: str, title: str) -> None:
    try:
        report.plot(results, user_path(path), title)
    except OSError as e:
        raise FafoError(f"cannot write {path}: {e.strerror}") from None


def divergences_from_reference(engine, runs: list[Run]
                               ) -> tuple[dict[tuple[str, str], exactness.Divergence | None], dict[str, float]]:
    """First divergence of each row from vanilla's first repetition, per sample (greedy runs only: the first of its
    repetitions that differs; FAFO's planner may run each in other step shapes), and the rounding noise that tells
    near-ties from bugs. A compiled row is compared with compiled vanilla where the run has it: the same kernels,
    so in bf16 too the tokens agree wherever a row of a compiled step rounds as a plain step does (packed GGUF
    steps: tested). Compiled vanilla itself and every eager row: eager vanilla. Each comparison is judged by the
    noise of its own two modes (`tolerances`): eager rows by eager passes, compiled rows by compiled ones,
    compiled vanilla by compiled one-row passes against eager ones, and a compiled row without compiled vanilla
    to compare with by the sum of those two (the gaps' changes add up at most so); the noise is measured only where
    some row diverged (None where none did: a minute or more of passes on a long suite)."""
    tolerance: dict[str, float] | None = None
    found: dict[tuple[str, str], exactness.Divergence | None] = {}
    loaded = engine.session.compiled  # (rows of compile None ran as the engine loaded)
    for run, base, same_kernels in _compared(runs):
        key = (run.row.name, run.sample.id)
        earlier = found.get(key)
        if run is base or earlier is not None and not earlier.near_tie:
            continue  # (after a near-tie, a later repetition may still hold a bug)
        position = exactness.first_divergence(run.token_ids, base.token_ids)
        if position is not None and tolerance is None:
            tolerance = tolerances(engine, [b for r, b, _ in _compared(runs) if r is b],
                                   any(r.row.compiled or r.row.compiled is None and engine.compiled is not None
                                       for r in runs if not r.row.external))
        steps = loaded if base.row.compiled is None else engine.compiled if base.row.compiled else None
        divergence = None if position is None else exactness.classify(
            engine, engine.encode(list(run.sample.messages)), base.token_ids, run.token_ids, position,
            _tolerance(tolerance, run.row, same_kernels), steps)
        if earlier is None or divergence is not None and not divergence.near_tie:
            found[key] = divergence
    engine.reset()
    return found, tolerance


def unclassified_divergences(runs: list[Run]) -> dict[tuple[str, str], exactness.Divergence | None]:
    """`divergences_from_reference`'s divergences, token equality only: near-tie or not left unknown (what an
    interrupted check can still report)."""
    found: dict[tuple[str, str], exactness.Divergence | None] = {}
    for run, base, _ in _compared(runs):
        position = exactness.first_divergence(run.token_ids, base.token_ids)
        if run is not base and found.get((run.row.name, run.sample.id)) is None:
            found[(run.row.name, run.sample.id)] = None if position is None else exactness.Divergence(
                position, _at(run.token_ids, position), _at(base.token_ids, position), None, None)
    return found


def _at(tokens: list[int], position: int) -> int | None:
    return tokens[position] if position < len(tokens) else None


def _compared(runs: list[Run]) -> Iterator[tuple[Run, Run, bool]]:
    """Each run with the run it is compared with (vanilla's first repetitions: with themselves; its later ones with
    its first, so a reference that changes from run to run shows on its own row, not as the other rows'
    divergences) and whether that one ran the same kernels, by prompt and repetition; runs without a reference are
    left out."""
    reference = {r.sample.id: r for r in runs if r.row.name == "vanilla" and r.repeat == 0}
    compiled = {r.sample.id: r for r in runs if r.row.method == "vanilla" and r.row.compiled and r.repeat == 0}
    for run in sorted(runs, key=lambda r: (r.sample.id, r.repeat)):
        if run.row.name == "vanilla":
            if run.sample.id in reference:
                yield run, reference[run.sample.id], False
            continue
        same_kernels = compiled.get(run.sample.id) if run.row.compiled and run.row.method != "vanilla" else None
        base = same_kernels or reference.get(run.sample.id)
        if base is not None:
            yield run, base, same_kernels is not None


def _tolerance(tolerance: dict[str, float], row, same_kernels: bool) -> float:
    """The noise a row's comparison with plain decoding is judged by (see `tolerances`)."""
    if row.external:  # transformers' own kernels: the loosest measured
        return max(tolerance.values())
    compiled = tolerance.get("compiled")  # (None: no compiled steps in this engine, every row ran eager)
    if compiled is None or row.compiled is False:
        return tolerance["eager"]
    if row.compiled is None or same_kernels:  # None: as the engine loaded (compile: auto), as vanilla ran
        return compiled
    return tolerance["compiled vs eager"] + (compiled if row.method != "vanilla" else 0.0)


def tolerances(engine, references: list[Run], compiled: bool) -> dict[str, float]:
    """The rounding noise (the largest over every prompt's vanilla answer: it differs from text to text) of eager
    passes, and where compiled rows ran, of compiled ones (their multi-row passes in a package already built:
    another would be built now, minutes on a CPU) and of compiled one-row passes against eager ones."""
    def noise(single, multi, rows=exactness.CALIBRATION_ROWS) -> float:
        return max(exactness.rounding_noise(engine, engine.encode(list(r.sample.messages)), r.token_ids,
                                            single=single, multi=multi, rows=rows) for r in references)

    found = {"eager": noise(None, None)}
    if compiled and engine.compiled is not None:
        steps = engine.compiled
        built = [size for size in getattr(steps, "built", list)() if 1 < size <= 16]
        found["compiled"] = noise(steps, steps, max(built)) if built else noise(steps, None)
        found["compiled vs eager"] = noise(steps, None, rows=1)
    return found


def verify_float32(engine_config, rows, samples, tokens: int, console) -> list[str]:
    """Re-run every greedy row once per sample in float32; every row must equal plain decoding token for token,
    compared as the bench compares (`divergences_from_reference`: a compiled row with compiled vanilla where the
    run has it, each divergence remade in its reference's mode), but on a GPU, whose float32 kernels are picked by
    shape, at a near-tie within the noise measured there: said, not failed. On a CPU float32 is exact by
    construction: any divergence fails."""
    from ..api import Engine

    engine = Engine.from_config(replace(engine_config, dtype="float32"),
                                load_draft=any(row.method == "triforce" for row in rows))
    runs = []
    for sample in samples:
        runs += [run_once(engine, row, sample, 0, tokens, {"temperature": 0.0}) for row in rows]
        console.print(f"run in float32: {sample.suite} · {sample.id}", style="dim", markup=False)
    found, _ = divergences_from_reference(engine, runs)
    cpu = engine.model.device.type == "cpu"
    failures = []
    for (name, sample_id), divergence in found.items():
        if divergence is None:
            continue
        if divergence.near_tie and not cpu:
            console.print(f"{name} on {sample_id}: float32 {divergence.describe()}", style="yellow", markup=False)
        else:
            failures.append(f"{name} on {sample_id}: differs from vanilla at token {divergence.position} in float32")
    return failures


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def run(load, config, options: BenchOptions, console, err_console) -> int:
    """The bench; `load()` loads the engine, which this function alone then holds (--verify frees it before its
    float32 copy loads: an engine passed in would stay on the caller's stack)."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    engine = load()

    def skipped(line: str) -> None:
        err_console.print(line, style="yellow", markup=False)

    long_settings = suites.LongSettings(engine.encode, engine.model.max_context, options.tokens, options.context,
                                        options.documents, skipped)
    samples = suites.fitting(engine, suites.collect(options.suites, options.samples, options.prompts, long_settings),
                             options.tokens, skipped)
    if not samples:
        raise FafoError("no prompt fits the model's context with --tokens "
                        f"{options.tokens}")
    rows = plan_rows(options.methods, options.compressors, options.external, compiled=config.compile == "on")
    compiled_before = engine.session.compiled_runs  # steps run compiled (packages or CUDA graphs) so far
    if engine.model.eager_mode not in engine.session.step_costs and any(row.method == "fafo" for row in rows):
        from . import tune  # FAFO's planner weighs rows by what they cost here: measured once, kept for later runs

        err_console.print("[dim]measuring what a pass costs against its rows, once (fafo bench --tune refreshes it)[/]")
        costs = tune.step_costs(engine)
        if tune.curve_disturbed(costs):  # the planner's default curve this time
            err_console.print(f"[yellow]{tune.curve_disturbed(costs)}; not kept[/]")
        else:
            try:
                tune.keep_eager_costs(engine, costs)
            except OSError as e:  # (a read-only cache: the bench needs the curve for this run only)
                err_console.print(f"[yellow]the measured step costs are not kept for later runs: cannot write "
                                  f"{engine.steps_folder} ({e.strerror or e})[/]")
    greedy = options.temperature == 0
    settings = {"temperature": options.temperature, **SAMPLING_NEUTRAL, "seed": 0}
    runs: list[Run] = []
    failed: dict[str, Failed] = {}
    interrupted = False
    bar = Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
              TextColumn("left"), TimeRemainingColumn(),
              console=err_console, transient=True, disable=not live_display(err_console))
    with bar:
        task = bar.add_task("bench", total=None)
        try:
            for event in measure(engine, rows, samples, tokens=options.tokens, repeats=options.repeats,
                                 warmup=options.warmup, settings=settings):
                if isinstance(event, Progress):
                    bar.update(task, completed=event.done, total=event.total, description=event.label)
                    if not live_display(err_console) and event.first_row:  # logs: a line a round
                        left = bar.tasks[task].time_remaining
                        eta = f" (about {_minutes(left)} left)" if left else ""
                        err_console.print(f"bench {event.done:.0f}/{event.total:.0f}{eta}: {event.label}", markup=False)
                elif isinstance(event, Failed):
                    failed[event.row.name] = event
                else:
                    runs.append(event)
        except KeyboardInterrupt:
            interrupt_handled()
            interrupted = True
    for name, failure in failed.items():
        err_console.print(f"{name} failed on {failure.sample.id}: {failure.message}; "
                          f"{'measuring stopped there' if name == 'vanilla' else 'its row is left out'}",
                          style="bold red", markup=False)
    rows = [row for row in rows if row.name not in failed or row.name == "vanilla"]  # (the reference stays)
    runs = [run for run in runs if run.row.name not in failed or run.row.name == "vanilla"]
    # only samples every row finished count: a partial sample would compare rows on different prompts
    complete = {s.id for s in samples if sum(r.sample.id == s.id for r in runs) == options.repeats * len(rows)}
    runs = [r for r in runs if r.sample.id in complete]
    if not runs and "vanilla" in failed:
        raise FafoError("plain decoding (vanilla), which every row is compared with, failed: nothing to report")
    if interrupted or "vanilla" in failed:
        err_console.print(f"{'interrupted' if interrupted else 'stopped'}: reporting the {len(complete)} prompt"
                          f"{'s' * (len(complete) != 1)} that every row finished")
    if not runs:
        return 130 if interrupted else 1
    if greedy:
        try:
            checking = "checking where rows diverge from vanilla (near-ties or not)"  # (a spinner: not into a log)
            with err_console.status(checking) if live_display(err_console) else contextlib.nullcontext():
                divergences, tolerance = divergences_from_reference(engine, runs)
        except KeyboardInterrupt:  # the measurements stand: their exactness without the near-tie check
            interrupt_handled()
            interrupted = True
            err_console.print("interrupted: divergences from vanilla are reported without telling near-ties from "
                              "bugs")
            divergences, tolerance = unclassified_divergences(runs), None
        except Exception as error:  # noqa: BLE001 - memory ran out prefilling a prompt again: so do the rows' figures
            if not is_out_of_memory(error):
                raise
            err_console.print("out of memory telling near-ties from bugs: divergences from vanilla are reported "
                              "without it", style="yellow", markup=False)
            divergences, tolerance = unclassified_divergences(runs), None
    else:
        divergences, tolerance = {}, None
    results = report.aggregate(runs, rows, divergences, greedy)
    meta = {**_meta(engine, options, config), "tie_tolerance": tolerance,  # per mode: {"eager": ...}
            "steps": _steps_mode(config, engine.session.compiled_runs > compiled_before,
                                 graphs=isinstance(engine.compiled, GraphSteps)),
            # (prompts every row finished, of those planned: fewer where Ctrl-C or plain decoding's failure stopped it)
            "prompts": len(complete), "planned_prompts": len(samples), "interrupted": interrupted}
    title = (f"{meta['model']} · {meta['dtype']} · {meta['device']} · {meta['steps']} · {options.tokens} tokens · "
             f"median of {options.repeats} · {'greedy' if greedy else f'T={options.temperature:g}'}")
    if len(complete) < len(samples):
        title += f" · {len(complete)} of {len(samples)} prompts ({'interrupted' if interrupted else 'stopped'})"
    if tolerance and any(tolerance.values()):
        title += " · near-tie: logit gap ≤ " + ", ".join(f"{gap:.2f} {mode}" for mode, gap in tolerance.items())
    report.print_tables(results, console, title)
    records = [r.record(meta) for r in results]
    titled = f"{title} · {meta['machine']} · torch {meta['versions']['torch']} · {meta['date']}"
    texts = ((options.json_path, lambda: json.dumps(records, indent=2, ensure_ascii=False) + "\n"),
             (options.csv_path, lambda: report.to_csv(records)),
             (options.markdown_path, lambda: report.markdown(results, titled)),
             (options.plot_path, None))
    unwritten = []  # one output that fails does not cost the others hours of measuring
    for path, text in texts:
        if path:
            try:
                if text is None:
                    _plot(results, path, title)
                else:
                    _write(path, text())
            except FafoError as e:
                unwritten.append(e)
                print(f"error: {e}", file=sys.stderr)
    failures = []
    if options.verify and greedy and not interrupted:
        # the measured model leaves memory first (its caller keeps no reference), transformers' copy with it: the
        # float32 copy, twice a bf16 model's size, may not fit beside them
        engine = long_settings = None  # (the settings hold its tokenizer's method)
        release_dropped_models()
        try:
            failures = verify_float32(config, rows, [s for s in samples if s.id in complete], options.tokens,
                                      err_console)
        except (MemoryError, RuntimeError) as e:  # (torch's OutOfMemoryError is a RuntimeError)
            if not is_out_of_memory(e):
                raise
            failures = ["--verify: the model in float32 does not fit in this device's memory: not verified"]
        for failure in failures:
            err_console.print(failure, style="bold red", markup=False)
    bugs = [b for r in results for b in r.bugs]
    if interrupted:
        return 130
    return 1 if failures or bugs or unwritten or failed else 0

