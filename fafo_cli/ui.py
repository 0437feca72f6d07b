"""Rendering Step events: streamed text with a live stats panel on a terminal, plain text otherwise.

Completed lines are printed above the live area and scroll away normally; only the unfinished line and the
panel are redrawn, at a bounded rate (never per token), so long answers stay cheap and tidy.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Iterable

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from .runtime.events import Prefill, Stats, Step

REFRESH_PER_SECOND = 8
PREFILL_BAR_AFTER_S = 1.0  # a prefill shorter than this shows no bar (it would only flicker)


def _memory(stats: Stats) -> str:
    label = "peak GPU" if stats.memory_kind == "cuda" else "peak RSS"
    extra = f" (drafting {stats.draft_memory_mb:,.1f} MB)" if stats.draft_memory_mb else ""
    return f"{label} {stats.peak_memory_mb:,.0f} MB{extra}"


def _draft_passes(stats: Stats) -> str:
    return "" if stats.draft_passes is None else f"draft passes [bold]{stats.draft_passes:,}[/]"


def _acceptance(stats: Stats) -> str:
    if stats.acceptance_rate is None:
        return "—"
    return f"{stats.accepted_tokens}/{stats.drafted_tokens} ({stats.acceptance_rate:.0%})"


def _pool(stats: Stats) -> str:
    return "—" if stats.pool_keys is None else f"{stats.pool_keys:,} keys / {stats.pool_ngrams:,} n-grams"


def _drafts(stats: Stats) -> str:
    """Mean draft (over the steps that verified any: said so), mean rows a step, and where accepted guesses came
    from."""
    if not stats.draft_steps and not stats.step_rows:
        return "—"
    text = f"{stats.mean_draft:.1f} guessed a draft · {stats.mean_rows:.1f} rows a step"
    accepted = sum((stats.accepted_from or {}).values())
    if accepted:
        text += " · " + " ".join(f"{source} {n / accepted:.0%}" for source, n in stats.accepted_from.items())
    return text


def method_label(config) -> str:
    """How the panel and footer name the method (fafo with its compressor and budget) and the sampling."""
    label = config.method
    if config.method == "fafo" and config.compressor != "auto":  # auto: no compressor named
        label += f" · {config.compressor}" + ("" if config.compressor == "none" else f" B={config.budget}")
    if config.temperature:
        label += f" · T={config.temperature:g} top-p {config.top_p:g}" + (f" top-k {config.top_k}" if config.top_k
                                                                          else "")
    return label


def _fumble(stats: Stats) -> str:
    if stats.fumble_positions is None:
        return "—"
    return f"{stats.fumble_positions:,} positions" + ("" if stats.streams is None else f" · W={stats.streams}")


def stats_panel(stats: Stats, title: str, weights: str | None = None) -> Panel:
    """The live statistics, titled with the method; the weight format in use along the bottom edge."""
    table = Table.grid(padding=(0, 3))
    for _ in range(5):
        table.add_column(justify="left")
    table.add_row(f"[bold]{stats.tokens_per_s:6.1f}[/] tok/s", f"tokens [bold]{stats.generated_tokens}[/]",
                  f"steps [bold]{stats.steps}[/]", f"tokens/step τ [bold]{stats.tokens_per_step:.2f}[/]",
                  _memory(stats))
    table.add_row(f"accepted n-grams [bold]{stats.accepted_ngrams if stats.drafted_tokens else '—'}[/]",
                  f"accepted/drafted [bold]{_acceptance(stats)}[/]", f"pool [bold]{_pool(stats)}[/]",
                  f"fumble rows see [bold]{_fumble(stats)}[/]", _draft_passes(stats))
    table.add_row(f"per step [bold]{_drafts(stats)}[/]", "", "", "", "")
    return Panel(table, title=title, title_align="left", subtitle=f"weights: {weights}" if weights else None,
                 subtitle_align="left", border_style="cyan", expand=False)


def footer(stats: Stats, method: str, finish_reason: str | None) -> str:
    """One line per answer, the same vocabulary every time."""
    parts = [method, f"{stats.generated_tokens} tokens", f"{stats.tokens_per_s:.1f} tok/s",
             f"τ {stats.tokens_per_step:.2f}", f"{stats.steps_ran} steps"]
    if stats.drafted_tokens:
        parts.append(f"accepted/drafted {_acceptance(stats)} in {stats.accepted_ngrams} n-grams")
        parts.append(f"per step {_drafts(stats)}")
    if stats.draft_passes is not None:
        parts.append(f"{stats.draft_passes} draft passes")
    prompt = f"prompt {stats.prompt_tokens} tok"
    if stats.cached_prompt_tokens:
        prompt += f" ({stats.cached_prompt_tokens} cached)"
    parts += [f"{prompt} @ {stats.prompt_tokens_per_s:.0f} tok/s", f"TTFT {stats.ttft_s:.2f} s",
              f"total {stats.total_s:.2f} s", _memory(stats)]
    if stats.syncs_per_step is not None:
        parts.append(f"{stats.syncs_per_step:.1f} GPU syncs/step")
    if finish_reason and finish_reason != "stop":
        parts.append(f"stopped: {finish_reason}")
    return " · ".join(parts)


class StreamView:
    """Consumes Step events and shows them; `last` is the final Step seen."""

    def __init__(self, console: Console, *, method: str, live: bool, show_footer: bool,
                 stats_console: Console | None = None, weights: str | None = None):
        self.console = console
        self.stats_console = stats_console or console
        self.method = method
        self.weights = weights
        self.live_enabled = live
        self.show_footer = show_footer
        self.last: Step | None = None
        self._pending = ""  # the unfinished line, shown inside the live area
        self._prefill: Prefill | None = None  # a long prefill's progress, shown until the first token
        self._live: Live | None = None
        self._ends_line = True  # the text written so far (without a live view) ends with a newline, or is none
        # (written as it is to a file or a pipe; on a terminal without the live view, `-q`, as the live view shows
        # it: an escape sequence the model wrote must not clear the screen or set the window's title)
        self._terminal = on_terminal(console)

    def _unfinished_line(self, rows: int) -> Text:
        """The unfinished line's end, as much as `rows` rows of the terminal show (the whole line is printed once it
        ends): a long paragraph would push the panel off the screen, and the newest text with it."""
        rows, width = max(1, rows), self.console.size.width
        pending = shown(self._pending)
        tail = pending[-rows * width:]  # (at least `rows` rows: a character takes a column or more)
        lines = Text(tail).wrap(self.console, width)
        if len(lines) <= rows and len(tail) == len(pending):
            return Text(pending)
        if rows == 1:
            return lines[-1]
        return Text("\n").join([Text("…", style="dim"), *lines[len(lines) - rows + 1:]])  # (a row: text left out)

    def _renderable(self):
        stats = self.last.stats if self.last else Stats()
        panel = stats_panel(stats, self.method, self.weights)
        parts = []
        prefill = self._prefill
        if prefill is not None:
            bar = Table.grid(padding=(0, 1))
            bar.add_row("reading the prompt", ProgressBar(total=prefill.total, completed=prefill.done, width=40),
                        f"{prefill.done:,}/{prefill.total:,} tokens · {prefill.elapsed_s:.1f} s")
            parts.append(bar)
        room = self.console.size.height - len(self.console.render_lines(panel, pad=False)) - len(parts)
        return Group(self._unfinished_line(room), *parts, panel)

    def prefill(self, event: Prefill) -> None:
        """A prefill chunk is done: the bar shows once the prefill has taken PREFILL_BAR_AFTER_S (Live's refresh
        thread draws it; torch releases the interpreter while it computes the next chunk)."""
        if self._live and event.elapsed_s >= PREFILL_BAR_AFTER_S:
            self._prefill = event if event.done < event.total else None

    def __enter__(self) -> "StreamView":
        if self.live_enabled:
            # the panel is rendered by Live's refresh thread at its own rate, never per step or token
            # a note on the terminal's stderr (a build's, a warning) is printed above the live area, which would
            # otherwise erase it on its next refresh; stderr sent elsewhere is left alone
            self._live = Live(console=self.console, get_renderable=self._renderable,
                              refresh_per_second=REFRESH_PER_SECOND, transient=True, redirect_stdout=False,
                              redirect_stderr=bool(getattr(sys.stderr, "isatty", lambda: False)()))
            self._live.__enter__()
        return self

    def show(self, step: Step) -> None:
        self.last = step
        self._prefill = None
        if not step.text:
            return
        if not self._live:
            self._ends_line = step.text.endswith("\n")
            self.console.file.write(shown(step.text) if self._terminal else step.text)
            self.console.file.flush()
            return
        lines = (self._pending + step.text).split("\n")
        for line in lines[:-1]:  # soft: the terminal wraps a long line, which so copies as one (code stays code)
            self._live.console.print(AnswerLine(line), soft_wrap=True)
        self._pending = lines[-1]

    def consume(self, steps: Iterable[Step]) -> Step | None:
        for step in steps:
            self.show(step)
        return self.last

    def __exit__(self, *exc) -> None:
        if self._live:
            self._live.__exit__(*exc)
            if self._pending:
                self.console.print(AnswerLine(self._pending), soft_wrap=True)
        elif not self._ends_line:  # (the text is written as decoded; a last line is ended, as a terminal's)
            self.console.file.write("\n")
            self.console.file.flush()
        if self.show_footer and self.last:
            interrupted = exc and exc[0] is not None and issubclass(exc[0], KeyboardInterrupt)
            line = footer(self.last.stats, self.method, "interrupted" if interrupted else self.last.finish_reason)
            if self.stats_console.is_terminal:
                self.stats_console.print(Text(line, style="dim"))
            else:
                print(line, file=self.stats_console.file, flush=True)


# what a terminal would act on rather than show (an escape sequence moves the cursor, clears the screen, sets the
# window's title): a model that copies a log's colour codes must not redraw the live view
CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def shown(text: str) -> str:
    """`text` as the live view shows it: tabs and line ends kept, the other control characters left out (the
    answer itself, in the conversation and in --json, keeps them)."""
    return CONTROLS.sub("", text)


class AnswerLine:
    """A line of the answer as written, tabs kept (rich's Text turns them into spaces: a Makefile or Go code copied
    from the terminal would not be the answer); control characters left out (`shown`)."""

    def __init__(self, line: str):
        self.line = shown(line)

    def __rich_console__(self, console: Console, options) -> Iterable[Segment]:
        yield Segment(self.line)
        yield Segment.line()


PIPED_WIDTH = 200  # a table written to a file or a pipe is read whole later: never cut to a terminal's 80 columns


def on_terminal(console: Console) -> bool:
    """Whether `console` writes to a terminal itself (the chat's prompts only there). rich's is_terminal says yes
    under FORCE_COLOR or TTY_COMPATIBLE=1 too, which ask for colours in a log or a pipe."""
    try:
        return console.is_terminal and bool(getattr(console.file, "isatty", lambda: False)())
    except ValueError:  # (a closed file)
        return False


def live_display(console: Console) -> bool:
    """Whether a live display (the panel, progress bars, spinners) may redraw on `console`: a terminal's that can
    move its cursor (not TERM=dumb's, Emacs' shell, where rich draws no frame, and the answer's unfinished line would
    not show until its end); in a log or a pipe its redrawn frames would fill it."""
    return on_terminal(console) and not console.is_dumb_terminal


def consoles() -> tuple[Console, Console]:
    """(stdout, stderr) consoles; colour and live display only where the stream is a terminal."""
    return _console(sys.stdout), _console(sys.stderr)


def _console(stream) -> Console:
    terminal = getattr(stream, "isatty", lambda: False)()
    wide = None if terminal or os.environ.get("COLUMNS") else PIPED_WIDTH
    return Console(file=stream, highlight=False, width=wide)
