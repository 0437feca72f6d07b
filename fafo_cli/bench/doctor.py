"""`fafo doctor [MODEL]`: what this machine gives fafo, whether FAFO is exact here, and the settings to use.

Four parts, about a minute on the embedded model: the machine (device, dtype, what our kernels can use); FAFO
against plain decoding in float32 on two prompts, as configured and with its window on every step, which must agree
token for token; one pass's cost against its
rows (`fafo bench --tune`'s measurement, to more rows); and the window width `streams: auto` derives from that cost,
which `--write` writes where `--tune` writes (the config file, and the cost curve beside the model's compiled steps).
`--gpu-report FILE` adds a 7B-shaped random-weight model's step costs against the bandwidth bound (gpu_report.py).
"""

from __future__ import annotations

import platform
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch

from .. import config as config_mod
from ..api import cpu_has_native_bf16
from ..compiled import packed
from ..compiled.kernels import loader
from ..compiled.steps import claim_steps_folder
from ..decoders.fafo.planner import StepCosts
from ..decoders.fafo.step import (WINDOW_SHARE, FafoSettings, compiled_for, model_streams, steps_cost_arithmetic,
                                  widest_window)
from ..errors import FafoError, first_line, is_out_of_memory
from ..files import user_path
from ..runtime.memory import release_dropped_models
from . import exactness, suites, tune

TOKENS = 64  # per exactness check


def machine(device: torch.device, dtype: torch.dtype, compile_mode: str = "auto",
            kernels_failed: str | None = None) -> dict:
    """The device and dtype decoding uses here, and what our kernels and compiled steps can use under `compile_mode`
    (the config's `compile`); `kernels_failed`: why our kernels did not build or load here (`build_kernels`)."""
    flags = set(loader.cpu_flags().split())
    compiler = loader.compiler_path()
    cuda = torch.cuda.is_available()
    facts = {
        "device": str(device), "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
        "cpu": _cpu_name(), "cpu_vector_level": torch.backends.cpu.get_cpu_capability(),
        "avx512_bf16": "avx512_bf16" in flags, "amx": loader.AMX_FLAGS <= flags,
        "native_bf16": cpu_has_native_bf16(),  # (the CPU's, which `dtype: auto` reads on a CPU only)
        "compiler": compiler,
        "cuda": {"available": cuda, "torch_built_with": torch.version.cuda,
                 "devices": [_gpu(i) for i in range(torch.cuda.device_count())] if cuda else []},
        "mps": {"available": torch.backends.mps.is_available(), "built": torch.backends.mps.is_built()},
    }
    if device.type == "cpu":
        if compile_mode == "off":
            facts["kernels"] = "eager torch only: compile: off keeps dense weights and no kernels of ours"
        elif not compiler:
            facts["kernels"] = "eager torch only: no C++ compiler, so no compiled steps or kernels of ours"
        elif kernels_failed:
            facts["kernels"] = f"eager torch only: our kernels did not build with {compiler} ({kernels_failed})"
        else:
            facts["kernels"] = ("compiled steps and our attention kernel (C++ compiler found; " +
                                ("compile: on builds the steps it runs)" if compile_mode == "on" else
                                 "compile: auto runs the steps `fafo compile` built)"))
            if packed.worth_preparing(SimpleNamespace(device=device, dtype=dtype)):
                facts["kernels"] += f"; a .gguf model's {facts['dtype']} steps read its quantized blocks"
            if not loader.attends():
                facts["kernels"] += "; steps attend with torch's kernel, eager and compiled (no AVX2)"
        if dtype == torch.bfloat16 and not facts["native_bf16"]:
            facts["kernels"] += "; bf16 is emulated on this CPU (no AVX512-BF16 or Arm BF16)"
    else:
        facts["kernels"] = f"stock torch kernels on {device.type} (our kernels are CPU-only)"
    return facts


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")),
                        platform.processor())
    except OSError:
        return platform.processor() or platform.machine()


def _gpu(index: int) -> dict:
    properties = torch.cuda.get_device_properties(index)
    return {"name": properties.name, "capability": f"{properties.major}.{properties.minor}",
            "memory_gib": round(properties.total_memory / 2**30, 1),
            "bf16": properties.major >= 8}  # native from Ampere on (older GPUs emulate it, slowly)


def prompts(engine) -> list[suites.Sample]:
    """A chat question and a code edit (much of the answer is in its prompt: guesses get accepted)."""
    return suites.fitting(engine, suites.load_suite("chat")[:1] + suites.load_suite("edit")[:1], TOKENS,
                          lambda line: None)


def exact(engine) -> list[dict]:
    """FAFO's greedy answers against plain decoding's on `prompts`, in the engine's (float32) dtype: FAFO as
    configured (on a CPU often its copies alone), and with its window and compressor on every step (`windowed`)."""
    checks = []
    fits = prompts(engine)
    if not fits:
        return [{"skipped": f"neither check prompt fits this model's context of {engine.model.max_context} tokens "
                            f"with {TOKENS} new ones"}]
    for sample in fits:
        messages = list(sample.messages)
        engine.reset()
        plain = engine.complete(messages, method="vanilla", temperature=0.0, max_tokens=TOKENS)
        for label, settings in (("as configured", {}), windowed(engine.config, engine.model.spread)):
            engine.reset()
            fafo = engine.complete(messages, method="fafo", temperature=0.0, max_tokens=TOKENS, **settings)
            position = exactness.first_divergence(fafo.token_ids, plain.token_ids)
            check = {"prompt": f"{sample.suite} · {sample.id}", "fafo": label, "tokens": len(plain.token_ids),
                     "equal": position is None, "fafo_steps": fafo.stats.steps, "accepted": fafo.stats.accepted_tokens,
                     "streams": fafo.stats.streams or 0}
            if position is not None:
                divergence = exactness.judge_float32(engine, engine.encode(messages), plain.token_ids,
                                                     fafo.token_ids, position)
                check["divergence"], check["near_tie"] = divergence.describe(), divergence.near_tie
            checks.append(check)
    engine.reset()
    return checks


def windowed(config, spread: bool = False) -> tuple[str, dict]:
    """FAFO with its lookahead window and compressor running on every step (the planner off), the configured ones
    or W=2 and `stream` (`none` on a model `spread` over GPUs, where a compressor's view does not run): the paths a
    CPU's `streams: auto` leaves out, checked too."""
    streams = config.streams if isinstance(config.streams, int) and config.streams > 0 else 2
    compressor = ("none" if spread else "stream") if config.compressor == "auto" else config.compressor
    return (f"window on every step (W={streams}, {compressor})",
            {"streams": streams, "compressor": compressor, "planner": False})


def recommend(engine, config, costs: dict[int, float]) -> dict:
    """The settings this cost curve calls for: the window width `streams: auto` derives from it where a window
    runs (`streams`), and whether `auto` runs one here with the configured compressor (`window`)."""
    settings = replace(FafoSettings.from_config(config), streams="auto")
    compiled = compiled_for(engine.session.compiled, config.compressor)
    curve = StepCosts(costs)
    width = {named: model_streams(replace(settings, compressor_named=named), compiled, curve, engine.model)
             for named in {True, settings.compressor_named}}
    if steps_cost_arithmetic(settings, compiled, engine.model.device.type != "cpu", engine.model.packed_matrices > 0):
        why = "one stream where a CPU's steps run compiled or over packed blocks: W=1 measured faster than W=2"
    elif width[True] == widest_window(curve, settings.ngram):
        why = f"the widest window whose step costs at most {WINDOW_SHARE:.0%} more than a plain step"
    else:
        why = f"the least an eager window runs: any wider costs more than {WINDOW_SHARE:.0%} over a plain step"
    return {"streams": width[True], "window": width[settings.compressor_named] > 0, "why": why}


def write(engine, path: Path, recommended: dict, costs: dict[int, float]) -> dict:
    """The recommended settings: the cost curve beside the model's steps, from which `streams: auto` derives the
    recommended width for this model, dtype and device (and the curve measured for another, its own), and
    `streams: auto` into the config file where it fixes a width (a width written there would hold for every model
    and device, this one's measured or not; 0, no window, is the user's to keep). Returns what was written where
    (`written` of the report)."""
    tune.keep_eager_costs(engine, costs)  # (first: a cache that cannot be written leaves the config as it was)
    written = {"step_costs": str(engine.steps_folder)}
    text, _ = tune.settings_file(path)
    configured = config_mod.load_text(text, path).streams
    streams = "auto" if configured not in ("auto", 0) else None  # (0: the user turned the window off)
    try:
        if streams is not None:
            tune.write_settings(path, {"streams": streams})
            written.update(config=str(path), streams=streams)
    except OSError as e:
        raise FafoError(f"cannot write {path}: {e.strerror}") from None
    return written


def run(config, load, *, write_to: Path | None = None, progress=lambda line: None):
    """Every part but the GPU report: the report as one dict, which `--json` prints (the engine it loaded goes when
    it returns: the GPU report needs the memory). `load(config)` loads an engine. The float32 check runs first, on a
    float32 copy of the model where the configured dtype differs, released before the configured model loads:
    never both in memory at once."""
    from ..api import pick_device, pick_dtype

    if write_to is not None:
        tune.settings_file(write_to)  # one that cannot be written is said before a minute of measuring
    float32 = pick_dtype(config.dtype, pick_device(config.device)) == torch.float32
    progress("checking FAFO against plain decoding in float32")
    if float32:
        engine = load(config)
        checks = exact(engine)
    else:
        copy = None
        try:
            copy = load(replace(config, dtype="float32"))
            checks = exact(copy)
        except (MemoryError, RuntimeError) as e:  # (torch's OutOfMemoryError is a RuntimeError)
            if not is_out_of_memory(e):
                raise
            checks = [{"skipped": "the model in float32 does not fit in this device's memory"}]
        finally:
            copy = None  # released before the configured model loads
        release_dropped_models()
        engine = load(config)
    if write_to is not None:  # where the cost curve goes: one that cannot be written is said before measuring too
        claim_steps_folder(engine.steps_folder, engine.steps_serve)
    progress("measuring one pass against its rows")
    costs = tune.step_costs(engine)  # the rows --tune measures: --write keeps the same curve
    # (our kernels built after the passes are timed: loaded, they serve every eager step of the process, which a run
    # of this model may not load)
    report = {"model": engine.name, "machine": machine(engine.model.device, engine.model.dtype, config.compile,
                                                       build_kernels(engine, config.compile)),
              "exactness": checks, "step_ms": {rows: round(ms, 3) for rows, ms in costs.items()}}
    report["disturbed"] = tune.curve_disturbed(costs)
    # (a disturbed curve recommends nothing: another process's load, not this machine's costs, would set it)
    report["recommended"] = None if report["disturbed"] else recommend(engine, config, costs)
    if write_to is not None and report["disturbed"]:
        raise FafoError(f"{report['disturbed']}; nothing written")
    if write_to is not None:
        report["written"] = write(engine, write_to, report["recommended"], costs)
    return report


def build_kernels(engine, compile_mode: str) -> str | None:
    """Build (once per machine: seconds) and load our kernels where a CPU engine would use them; why they failed, or
    None. A compiler on the PATH that cannot build them (a broken toolchain) is said, not taken for a working one."""
    if engine.model.device.type != "cpu" or compile_mode == "off" or not loader.compiler_path():
        return None
    try:
        loader.load(engine.steps_folder.parent)
    except Exception as error:  # noqa: BLE001 - whatever the compiler or the loader said: one line of it
        return first_line(error, named=True)
    return None


def failed(report: dict) -> bool:
    """Whether a float32 check found FAFO's output different from plain decoding's (but at a near-tie, which a GPU's
    float32 kernels may part at)."""
    return any(check.get("equal") is False and not check.get("near_tie") for check in report["exactness"])


def render(report: dict, console) -> None:
    from rich.markup import escape
    from rich.table import Table

    facts = report["machine"]
    cuda = facts["cuda"]
    gpus = ", ".join(f"{g['name']} (sm {g['capability']}, {g['memory_gib']} GiB, bf16 {'yes' if g['bf16'] else 'no'})"
                     for g in cuda["devices"]) or "none"
    console.print(f"[bold]{escape(report['model'])}[/] on {facts['device']} in {facts['dtype']} · "
                  f"torch {facts['torch']}")
    console.print(f"CPU: {facts['cpu']} ({facts['cpu_vector_level']}; AVX512-BF16 {_yes(facts['avx512_bf16'])}, AMX "
                  f"{_yes(facts['amx'])}) · C++ compiler: {facts['compiler'] or 'none found'}")
    console.print(f"CUDA: {'available' if cuda['available'] else 'not available'} (torch built with "
                  f"{cuda['torch_built_with'] or 'no CUDA'}); GPUs: {gpus} · MPS: "
                  f"{'available' if facts['mps']['available'] else 'not available'}")
    console.print(f"Kernels: {facts['kernels']}")
    for check in report["exactness"]:
        if "skipped" in check:
            console.print(f"float32 exactness: [yellow]not checked[/]: {check['skipped']}")
            continue
        verdict = ("[green]equal[/]" if check["equal"] else f"[yellow]parted at a near-tie[/], {check['divergence']}"
                   if check.get("near_tie") else f"[red]DIFFERENT[/] at {check['divergence']}")
        console.print(f"float32 exactness, {check['prompt']}: FAFO {check['fafo']} vs plain decoding over "
                      f"{check['tokens']} tokens: {verdict} ({check['fafo_steps']} FAFO steps, {check['accepted']} "
                      f"guessed tokens accepted)")
    costs = report["step_ms"]
    table = Table("rows per pass", "ms", "× one row", title="one pass against its rows", title_justify="left")
    for rows, ms in costs.items():
        table.add_row(str(rows), f"{ms:.2f}", f"{ms / costs[1]:.2f}×")
    console.print(table)
    if report["disturbed"]:
        console.print(f"[yellow]{report['disturbed']}[/]; nothing recommended")
        return
    streams, window = report["recommended"]["streams"], report["recommended"]["window"]
    width = f"streams={streams} ({report['recommended']['why']}; `streams: auto` derives it here)"
    console.print(f"Recommended: {width}" if window else "Recommended: no window (`streams: auto` on a CPU, unless a "
                  f"compressor is named: its rows cost more than its guesses earn here); with one named, {width}")
    if "written" in report:
        written = report["written"]
        console.print((f"Wrote streams={written['streams']} to {written['config']} and the" if "config" in written
                       else "Wrote the") + f" cost curve to {written['step_costs']}.")


def _yes(value: bool) -> str:
    return "yes" if value else "no"


def default_config_path(given: str | None) -> Path:
    return user_path(given) if given else config_mod.user_config_path()
