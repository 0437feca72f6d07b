"""From measured runs to results: one record per row × suite, and the formats users quote them in."""

from __future__ import annotations

import csv
import io
import json
import statistics
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..files import atomic_path
from .exactness import Divergence
from .runner import Row, Run


@dataclass
class Result:
    suite: str
    row: Row
    tokens_per_s: float  # median over samples of the median over repetitions
    spread: float | None  # median over samples of half the range over repetitions (tokens/s); None: one run each
    speedup: float | None  # median over samples of (row / plain decoding of its mode), each the median over repetitions
    speedups: dict[str, float]  # that ratio per sample: a method that must never lose is judged on the worst
    tau: float | None  # generated tokens / full-model passes, over all runs (None: passes not known)
    step_ms: float | None  # median time of one decoding step (hf-generate: per token; None: passes not known)
    accepted: int
    drafted: int
    peak_memory_mb: float
    draft_memory_mb: float
    matches: int | None  # greedy: samples whose tokens equal vanilla's (None: sampled, not compared)
    compared: int
    divergences: list[tuple[str, Divergence]] = field(default_factory=list)  # (sample id, first divergence)
    runs: int = 0
    draft_steps: int = 0  # steps that verified guesses
    step_rows: dict[int, int] = field(default_factory=dict)  # steps by row count, over all runs
    accepted_from: dict[str, int] = field(default_factory=dict)  # accepted guesses by source (FAFO: text, window)
    eager_steps: int = 0  # a compiled row's decoding steps that ran eager, over all runs
    ttft_ms: float = 0.0  # median over samples of the median over repetitions of the time to the first token
    draft_passes: int | None = None  # passes spent drafting (TriForce's and QuantSpec's own), over all runs; not in τ
    steps: int = 0  # full-model passes, over all runs

    @property
    def draft_passes_per_step(self) -> float | None:
        return self.draft_passes / self.steps if self.draft_passes is not None and self.steps else None

    @property
    def mean_draft(self) -> float | None:
        """Guessed tokens verified per step that verified any."""
        return self.drafted / self.draft_steps if self.draft_steps else None

    @property
    def mean_rows(self) -> float | None:
        steps = sum(self.step_rows.values())
        return sum(rows * n for rows, n in self.step_rows.items()) / steps if steps else None

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def worst_speedup(self) -> float | None:
        return min(self.speedups.values()) if self.speedups else None

    @property
    def bugs(self) -> list[tuple[str, Divergence]]:
        return [(sample, d) for sample, d in self.divergences if d.near_tie is False]

    def record(self, meta: dict) -> dict:
        return {
            "method": self.row.method, "row": self.row.name, "compressor": self.row.compressor, "suite": self.suite,
            "tokens_per_s": round(self.tokens_per_s, 3), "spread": _rounded(self.spread, 3),
            "speedup": _rounded(self.speedup, 4), "worst_speedup": _rounded(self.worst_speedup, 4),
            "speedup_by_prompt": {sample: round(ratio, 4) for sample, ratio in self.speedups.items()},
            "tau": _rounded(self.tau, 4), "step_ms": _rounded(self.step_ms, 2),
            "acceptance": _rounded(self.acceptance, 4),
            "accepted_tokens": self.accepted, "drafted_tokens": self.drafted,
            "exact": None if self.matches is None else f"{self.matches}/{self.compared}",
            "divergences": [dict(sample=s, **asdict(d)) for s, d in self.divergences],
            "peak_memory_mb": round(self.peak_memory_mb, 1), "draft_memory_mb": round(self.draft_memory_mb, 1),
            "mean_draft": _rounded(self.mean_draft, 2), "mean_rows": _rounded(self.mean_rows, 2),
            "step_rows": dict(sorted(self.step_rows.items())), "accepted_from": self.accepted_from,
            "ttft_ms": round(self.ttft_ms, 1), "eager_steps": self.eager_steps,
            "draft_passes_per_step": _rounded(self.draft_passes_per_step, 2),
            "runs": self.runs, **meta,
        }


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _by_sample(runs: list[Run], measure=lambda run: run.tokens_per_s) -> dict[str, list[float]]:
    by_sample: dict[str, list[float]] = {}
    for run in runs:
        by_sample.setdefault(run.sample.id, []).append(measure(run))
    return by_sample


def aggregate(runs: list[Run], rows: list[Row], divergences: dict[tuple[str, str], Divergence | None],
              greedy: bool) -> list[Result]:
    """Results per suite (in first-seen order) and row; `divergences[(row, sample)]` from the exactness check."""
    suites = list(dict.fromkeys(run.sample.suite for run in runs))
    results = []
    for suite in suites:
        def base_of(name: str) -> dict[str, float]:
            reference = _by_sample([r for r in runs if r.sample.suite == suite and r.row.name == name])
            return {sample: statistics.median(speeds) for sample, speeds in reference.items()}

        eager, compiled = base_of("vanilla"), base_of("vanilla+compiled")
        for row in rows:
            mine = [r for r in runs if r.sample.suite == suite and r.row == row]
            if not mine:
                continue
            by_sample = _by_sample(mine)
            medians = {s: statistics.median(v) for s, v in by_sample.items()}
            # against plain decoding of the same mode: a compiled row against vanilla+compiled (and that one, as
            # transformers' rows, against eager vanilla: what compiling gives); none where that one failed
            base = compiled if row.compiled and row.method != "vanilla" else eager
            # (0: no time to divide by, as transformers' prompt lookup whose prefill pass finished the answer)
            ratios = {s: medians[s] / base[s] for s in medians if base.get(s) and medians[s]}
            measured = {s: speed for s, speed in medians.items() if speed} or {s: 0.0 for s in medians}
            compared = [(r.sample.id, divergences.get((row.name, r.sample.id))) for r in mine if r.repeat == 0]
            found = [(sample, d) for sample, d in compared if d is not None]
            step_rows: dict[int, int] = {}
            accepted_from: dict[str, int] = {}
            for run in mine:
                for size, n in run.extra.get("step_rows", {}).items():
                    step_rows[size] = step_rows.get(size, 0) + n
                for source, n in run.extra.get("accepted_from", {}).items():
                    accepted_from[source] = accepted_from.get(source, 0) + n
            results.append(Result(
                suite, row, statistics.median(measured.values()),
                statistics.median((max(by_sample[s]) - min(by_sample[s])) / 2 for s in measured)
                if any(len(by_sample[s]) > 1 for s in measured) else None,  # (one run a prompt: no spread known)
                statistics.median(ratios.values()) if ratios else None, ratios,
                (sum(len(r.token_ids) for r in mine) / sum(r.steps for r in mine)) if any(r.steps for r in mine)
                else None,
                _median_step_ms(mine),
                sum(r.accepted for r in mine), sum(r.drafted for r in mine),
                max(r.peak_memory_mb for r in mine), max(r.draft_memory_mb for r in mine),
                (len(compared) - len(found)) if greedy else None, len(compared), found, len(mine),
                sum(r.extra.get("draft_steps", 0) for r in mine), step_rows, accepted_from,
                sum(r.extra.get("eager_steps", 0) for r in mine),
                1e3 * statistics.median(statistics.median(times) for times in
                                        _by_sample(mine, lambda run: run.ttft_s).values()),
                sum(r.extra["draft_passes"] for r in mine) if all(r.extra.get("draft_passes") is not None
                                                                  for r in mine) else None,
                sum(r.steps for r in mine)))
    return results


def _median_step_ms(runs: list[Run]) -> float | None:
    """Median ms per step over the runs that timed a step (0: an answer that its first pass finished); None where a
    row's steps are hidden (transformers' prompt lookup) or none was timed."""
    timed = [run.step_ms for run in runs if run.step_ms]
    return None if any(run.step_ms is None for run in runs) or not timed else statistics.median(timed)


COLUMNS = ("suite", "method", "tokens/s", "speedup", "worst", "τ", "draft", "rows", "ms/step", "first token",
           "acceptance", "from text", "peak memory", "exact")


def _cells(result: Result) -> list[str]:
    exact = "sampled" if result.matches is None else f"{result.matches}/{result.compared}"
    acceptance = "—" if result.acceptance is None else f"{result.acceptance:.0%}"
    memory = f"{result.peak_memory_mb:,.0f} MB"
    if result.draft_memory_mb >= 0.05:  # (what rounds to 0.0 is not shown)
        memory += f" (+{result.draft_memory_mb:,.1f})"
    speedup, worst = ("—" if value is None else f"{value:.2f}×" for value in (result.speedup, result.worst_speedup))
    accepted = sum(result.accepted_from.values())
    from_text = f"{result.accepted_from.get('text', 0) / accepted:.0%}" if accepted else "—"
    spread = "" if result.spread is None else f" ± {result.spread:.1f}"
    return [result.suite, result.row.name, f"{result.tokens_per_s:.1f}{spread}", speedup, worst,
            _number(result.tau), _number(result.mean_draft, 1), _number(result.mean_rows, 1),
            _number(result.step_ms, 1), f"{result.ttft_ms:,.0f} ms", acceptance, from_text, memory, exact]


def _number(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def print_tables(results: list[Result], console, title: str) -> None:
    from rich.table import Table
    from rich.text import Text

    for suite in dict.fromkeys(r.suite for r in results):
        # (a prompts file's suite and ids, the model's path: shown as written, never read as rich's markup)
        table = Table(title=Text(f"{suite} · {title}"), title_justify="left", header_style="bold")
        names = [r.row.name for r in results if r.suite == suite]
        table.add_column(COLUMNS[1], no_wrap=True, min_width=max(map(len, names)))  # method names stay whole
        for column in COLUMNS[2:]:
            table.add_column(column)
        for result in (r for r in results if r.suite == suite):
            cells = [Text(cell) for cell in _cells(result)[1:]]
            cells[-1].stylize("bold red" if result.bugs else "yellow" if result.divergences else "")
            table.add_row(*cells)
        console.print(table)
        for result in (r for r in results if r.suite == suite):
            for note, bad in _notes(result):
                console.print(f"  {note}", style="bold red" if bad else "yellow", markup=False)


def _notes(result: Result) -> list[tuple[str, bool]]:
    """What a row's figures need said beside them, each with whether it is a bug."""
    notes = [(f"{result.row.name}: {result.eager_steps} of its decoding steps ran eager (no package of their size "
              "built or loaded): its figures are partly eager's", False)] if result.eager_steps else []
    if result.draft_passes_per_step:  # (what τ, tokens per full-model pass, leaves out)
        notes.append((f"{result.row.name}: {result.draft_passes_per_step:.2f} drafting passes a full-model pass "
                      "besides it (τ counts the full model's)", False))
    return notes + [(f"{result.row.name} on {sample}: {d.describe()}", d.near_tie is False)
                    for sample, d in result.divergences]


def markdown(results: list[Result], title: str) -> str:
    lines = [f"{title}", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in results]
    notes = [note for r in results for note, _ in _notes(r)]
    return "\n".join(lines + ([""] + [f"- {note}" for note in notes] if notes else [])) + "\n"


def to_csv(records: list[dict]) -> str:
    out = io.StringIO()
    flat = [{k: (json.dumps(v) if isinstance(v, (list, dict)) else v) for k, v in rec.items()} for rec in records]
    writer = csv.DictWriter(out, fieldnames=list(flat[0]) if flat else ["method"])
    writer.writeheader()
    writer.writerows(flat)
    return out.getvalue()


def plot(results: list[Result], path: Path, title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        from ..errors import FafoError

        raise FafoError("--plot needs matplotlib: pip install 'fafo-cli[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suites = list(dict.fromkeys(r.suite for r in results))
    names = list(dict.fromkeys(r.row.name for r in results))
    width = 0.8 / max(1, len(names))
    inches = max(6, 1.6 * len(suites) + 2)
    figure, axes = plt.subplots(figsize=(inches, 4))
    for i, name in enumerate(names):
        # a row with no speedup in a suite (plain decoding of its mode failed there) has no bar, not one at 0×
        bars = [(j, r.speedup) for j, s in enumerate(suites) for r in results
                if r.suite == s and r.row.name == name and r.speedup is not None]
        axes.bar([j + i * width for j, _ in bars], [value for _, value in bars], width, label=name)
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(suites))], suites)
    axes.set_ylabel("speedup over plain decoding of the same mode")
    axes.set_title(textwrap.fill(title, int(inches * 13)), fontsize=9)  # ~13 characters an inch at 9 points
    axes.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    with atomic_path(path) as partial:
        figure.savefig(partial, dpi=120)
    plt.close(figure)
