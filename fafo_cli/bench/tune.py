"""`fafo bench --tune`: find this machine's best FAFO window settings and write them into the user config.

Two measurements: what one forward pass costs against the rows it carries, eager and in each compiled package
FAFO uses, side by side (on GPUs extra rows are nearly free, on a CPU each costs a few percent of a step), which
is kept beside the model's packages for FAFO's step planner; and, on a small sample of chat and edit prompts, the
speed of a few (W, k, G) settings against plain decoding, run side by side. The fastest setting (median
speedup over the sample) is written into the config file, keeping its comments and other keys.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import replace
from pathlib import Path

import torch
import yaml

from .. import config as config_mod
from ..compiled.steps import bucket, claim_steps_folder
from ..compiled.timing import median_ms, write_step_costs
from ..decoders.fafo.planner import StepCosts
from ..decoders.fafo.step import FafoSettings, compiled_for, model_streams
from ..runtime.model import causal_attention
from ..errors import FafoError
from ..files import atomic_path
from . import suites
from .runner import Row, run_once

CANDIDATES = ((1, 3, 1), (1, 4, 1), (2, 3, 1), (2, 4, 1), (1, 5, 1), (2, 3, 2), (3, 4, 2))  # (W, k, G)
# where rows are nearly free (GPUs), the paper's sizes too (it ablates W 10-40, k 4-9)
WIDE_CANDIDATES = ((8, 4, 2), (16, 4, 2), (16, 5, 2), (24, 5, 3), (32, 4, 2))
ROWS = (1, 2, 4, 8, 12, 16, 24)
WIDE_ROWS = (32, 64, 128)  # measured too on an accelerator, for the wide candidates' steps
TOKENS = 96
NOISE = 0.03  # a setting must beat the current one by more than run-to-run noise to replace it
# A decoding step emits its tokens at no less than a plain step's cost, so a speedup above the tokens a decoding
# step emitted means another process slowed the plain runs; beyond this margin the sample is not trusted
DISTURBED = 0.15


# A pass of more rows measured this much cheaper than a one-row pass: another process slowed the one-row passes
CURVE_SLACK = 0.1
CURVE_ATTEMPTS = 3  # measurements of a curve before one that is not disturbed is given up on


def curve_disturbed(costs: dict[int, float]) -> str | None:
    """Why the cost curve `costs` cannot be this machine's when quiet (a pass of more rows cheaper than one row);
    None when it can be."""
    cheaper = [rows for rows in costs if rows > 1 and costs[rows] < (1 - CURVE_SLACK) * costs[1]]
    if not cheaper:
        return None
    return (f"the pass costs were disturbed ({cheaper[0]} rows measured {costs[cheaper[0]] / costs[1]:.2f}× one "
            f"row, {CURVE_ATTEMPTS} times): another process is using this machine; measure again when it is quiet")


def step_costs(engine, context: int = 300, row_counts: tuple[int, ...] | None = None,
               repeats: int = 8) -> dict[int, float]:
    """Median milliseconds of one forward pass with each row count (by default ROWS, and WIDE_ROWS on an
    accelerator, where a wide window's steps are read off the curve too), after `context` cached tokens, the counts
    taking turns (`median_ms`); measured again, up to CURVE_ATTEMPTS times, while `curve_disturbed`."""
    if row_counts is None:
        row_counts = ROWS + (WIDE_ROWS if engine.model.device.type != "cpu" else ())
    for _ in range(CURVE_ATTEMPTS):
        costs = _measured_costs(engine, context, row_counts, repeats)
        if curve_disturbed(costs) is None:
            break
    return costs


def _measured_costs(engine, context: int, row_counts: tuple[int, ...], repeats: int) -> dict[int, float]:
    session, model = engine.session, engine.model
    engine.reset()
    context = min(context, model.max_context - max(row_counts))  # (a model with a short context: what fits)
    if context < 1:
        raise FafoError(f"a {max(row_counts)}-row pass does not fit this model's context of {model.max_context} "
                        "tokens: its step costs cannot be measured")
    ids = (engine.encode("Tell me a story about the sea.") * context)[:context]
    session.prefill(ids, reserve=max(row_counts))
    length = session.cache.length
    passes = {rows: (torch.zeros(rows, dtype=torch.long, device=model.device),
                     torch.arange(length, length + rows, device=model.device),
                     torch.ones(rows, length + rows, dtype=torch.bool, device=model.device)) for rows in row_counts}
    # each pass writes after the prefix, never committed; its attention made anew, as a step makes its own
    runs = {rows: (lambda args=args: model.forward(args[0], args[1], session.cache,
                                                   causal_attention(args[2], model.scaling)))
            for rows, args in passes.items()}
    costs = median_ms(runs, repeats, model.device)
    engine.reset()
    return costs


def keep_eager_costs(engine, costs: dict[int, float]) -> None:
    """The eager cost curve for FAFO's planner: in this session, and beside the model's packages for later runs (an
    OSError where that folder cannot be written: this session's curve is set all the same)."""
    mode = engine.model.eager_mode
    engine.session.step_costs = {**engine.session.step_costs, mode: costs}
    claim_steps_folder(engine.steps_folder, engine.steps_serve)
    write_step_costs(engine.steps_folder, {mode: costs})


def candidates(accelerator: bool) -> tuple[tuple[int, int, int], ...]:
    """The (W, k, G) settings `--tune` runs: a CPU's narrow windows, and on an accelerator wide ones as well."""
    return CANDIDATES + (WIDE_CANDIDATES if accelerator else ())


def settings_file(path: Path) -> tuple[str, yaml.MappingNode | None]:
    """The text of the config file `path` that `write_settings` would edit (the defaults where there is none yet),
    and its top mapping (None: empty); a file that cannot be edited line by line is one FafoError, which the
    commands that measure before they write raise before measuring."""
    try:
        text = path.read_text(encoding="utf-8") if path.exists() else config_mod.default_yaml()
    except (OSError, UnicodeDecodeError) as e:
        raise FafoError(f"cannot read config file {path}: {getattr(e, 'strerror', None) or e}") from None
    config_mod.load_text(text, path)  # a valid config to begin with
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    if root is not None and (not isinstance(root, yaml.MappingNode) or root.flow_style):
        raise FafoError(f"config file {path} is one {{...}} mapping; fafo writes its settings into a file of one "
                        "`key: value` a line: rewrite it so, or give another with --config")
    return text, root


def write_settings(path: Path, values: dict) -> None:
    """Set `values` in a YAML config file, in place of the values given there (every line else, comments
    included, as it was) or as lines of their own at its end (atomic)."""
    text, root = settings_file(path)
    spans = []  # (start, end, new text), replaced from the end so that earlier offsets hold
    for key, value in values.items():
        nodes = [node for key_node, node in (root.value if root else ()) if key_node.value == key]
        if nodes:  # (an empty value, `seed:`, is a node of no text right after the colon)
            spans += [(node.start_mark.index, node.end_mark.index,
                       str(value) if node.end_mark.index > node.start_mark.index else f" {value}") for node in nodes]
        elif commented := re.search(rf"^# {re.escape(key)}:.*$", text, flags=re.MULTILINE):  # as `config init` has it
            spans.append((commented.start(), commented.end(), f"{key}: {value}"))
        else:
            text = (text.rstrip("\n") + "\n" if text.strip() else "") + f"{key}: {value}\n"
    for start, end, new in sorted(spans, reverse=True):
        text = text[:start] + new + text[end:]
    config_mod.load_text(text, path)  # what is written is a valid config
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as partial:
        partial.write_text(text, encoding="utf-8")


def run(engine, config, console, err_console, config_path: Path | None = None) -> int:
    from rich.table import Table

    path = config_path or config_mod.user_config_path()
    settings_file(path)  # one that cannot be written is said before minutes of measuring
    accelerator = engine.model.device.type != "cpu"
    costs = step_costs(engine)
    if curve_disturbed(costs):
        raise FafoError(curve_disturbed(costs) + "; nothing written")
    table = Table("rows per pass", "ms", "× one row", title="step cost on this machine", title_justify="left")
    for rows, ms in costs.items():
        table.add_row(str(rows), f"{ms:.1f}", f"{ms / costs[1]:.2f}×")
    console.print(table)
    compiled = compiled_for(engine.session.compiled, config.compressor)
    planned = FafoSettings.from_config(config)
    planned = replace(planned, streams=model_streams(planned, compiled, StepCosts(costs), engine.model))
    if compiled is not None and compiled.serves(planned.max_rows):
        packages = sorted({bucket(size) for size in planned.step_sizes if compiled.serves(size)})
        timed = compiled.step_costs(packages, refresh=True)  # kept beside the packages (CUDA graphs: None)
        if timed:
            console.print("compiled steps, side by side: " + ", ".join(f"{size} rows {ms:.1f} ms"
                                                                       for size, ms in timed.items()))
    keep_eager_costs(engine, costs)
    console.print(f"The step planner reads these costs from {engine.steps_folder}.")

    sample = suites.fitting(engine, suites.load_suite("chat")[:2] + suites.load_suite("edit")[:1], TOKENS,
                            lambda line: err_console.print(f"[dim]{line}[/]"))
    current = (planned.streams, config.ngram, config.guesses)
    settings = list(dict.fromkeys((current,) + candidates(accelerator)))
    greedy = {"temperature": 0.0, "compressor": config.compressor}
    speed: dict[tuple, list[float]] = {s: [] for s in settings}
    taus: dict[tuple, list[float]] = {s: [] for s in settings}
    # tokens per decoding step, the most a speedup can be (the speed leaves out the prefill's first token)
    ceilings: dict[tuple, list[float]] = {s: [] for s in settings}
    # what its steps cost by the curve, in one-row passes: the rows the planner chose, not the most it may
    curve, step_cost = StepCosts(costs), {s: [] for s in settings}
    if not sample:
        raise FafoError(f"none of the tuning prompts fits the model's context of {engine.model.max_context} tokens "
                        f"with an answer of {TOKENS} tokens; the step costs are kept, {path} is unchanged")

    def fafo_row(w: int, k: int, g: int) -> Row:
        return Row("fafo", "fafo", (("streams", w), ("ngram", k), ("guesses", g)))

    # each setting's first run pays one-time costs (first calls, its step sizes' packages loaded): not compared
    for row in (Row("vanilla", "vanilla"), *(fafo_row(*setting) for setting in settings)):
        run_once(engine, row, sample[0], 0, TOKENS, greedy)
    for turn, item in enumerate(sample):
        base = run_once(engine, Row("vanilla", "vanilla"), item, 0, TOKENS, greedy)
        for setting in settings[turn % len(settings):] + settings[:turn % len(settings)]:  # none always first
            fafo = run_once(engine, fafo_row(*setting), item, 0, TOKENS, greedy)
            speed[setting].append(fafo.tokens_per_s / base.tokens_per_s if base.tokens_per_s else 0.0)
            taus[setting].append(len(fafo.token_ids) / max(1, fafo.steps))
            ceilings[setting].append((len(fafo.token_ids) - 1) / max(1, fafo.steps - 1))
            rows = fafo.extra.get("step_rows") or {1: 1}
            step_cost[setting].append(sum(n * curve.of(r) for r, n in rows.items()) / sum(rows.values())
                                      / curve.of(1))
        err_console.print(f"[dim]measured {item.suite} · {item.id}[/]")
    table = Table("W, k, G", "most rows", "τ", "speedup", "τ / step cost", title="FAFO settings on "
                  f"{len(sample)} prompts ({TOKENS} tokens each)", title_justify="left")
    for setting in settings:
        rows = replace(planned, streams=setting[0], ngram=setting[1], guesses=setting[2]).max_rows
        tau = statistics.median(taus[setting])
        per_step = statistics.median(ceilings[setting])  # decoding steps' tokens, as their costs count
        table.add_row(", ".join(map(str, setting)) + (" (current)" if setting == current else ""), str(rows),
                      f"{tau:.2f}", f"{statistics.median(speed[setting]):.2f}×",
                      f"{per_step / statistics.median(step_cost[setting]):.2f}×")
    console.print(table)
    best = max(settings, key=lambda s: statistics.median(speed[s]))
    before, after = statistics.median(speed[current]), statistics.median(speed[best])
    beyond = [s / c for s, c in zip(speed[best], ceilings[best]) if c]  # (c is 0 where one token was all)
    if beyond and statistics.median(beyond) > 1 + DISTURBED:
        raise FafoError(f"the timings were disturbed (W={best[0]}, k={best[1]}, G={best[2]} ran faster than the "
                        f"tokens its steps emitted allow); {path} is unchanged: run again with the machine otherwise "
                        "idle")
    if best == current or after < before * (1 + NOISE):
        console.print(f"The current settings (W={current[0]}, k={current[1]}, G={current[2]}, {before:.2f}× plain "
                      f"decoding) are the fastest here or within {NOISE:.0%} of it; {path} is unchanged.")
        return 0
    try:
        write_settings(path, dict(streams=best[0], ngram=best[1], guesses=best[2]))
    except OSError as e:
        raise FafoError(f"cannot write {path}: {e.strerror}") from None
    console.print(f"Wrote streams={best[0]}, ngram={best[1]}, guesses={best[2]} to {path}: "
                  f"{before:.2f}× → {after:.2f}× plain decoding on this sample.")
    return 0
