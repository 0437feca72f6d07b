"""The step planner: which guesses a FAFO step verifies, and whether its window runs, for the most tokens per second.

A step's candidates come from two sources: `text`, the continuation of an earlier occurrence of the text's
ending, as long as it kept matching, or a path of what most often followed it (the suffix index), and `window`,
the pool's n-grams that the lookahead window found. Every guessed token gets the chance that plain decoding
reaches it, from running statistics of its source and match length, or of its frequency in the text (see
`Acceptance`); the candidates merge into one tree, and the planner keeps the likeliest nodes and
turns the window on or off so that

    expected tokens per step / cost of the step's rows

is highest. `cost` is one pass's cost against its row count (`StepCosts`): the curve measured ahead (or a
default), corrected by the times of the steps this planner has run, so a machine that is busier, has other
threads or another shape of cost than when it was measured is planned for as it is now; on compiled steps only
the package sizes the decoder has count. When no guess is worth its rows the step is plain decoding's single
row, decided where possible from the candidates' first tokens alone, before the rest of them is built. The
window's value is what its n-grams were accepted for afterwards, per step that ran it. The window runs in bursts
of k steps (its levels need consecutive steps to yield n-grams), first at the start; one that has not
run for a while runs a burst anyway (less often each time the window's n-grams earned fewer tokens than its
steps cost since the previous such burst: the time of its rows, in the tokens those steps were expected to
emit), and guesses that have not been verified for a while get their likeliest token verified, so that what
they are worth stays measured.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from ..tree import ROOT, DraftTree

SOURCES = ("text", "window")
MATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)  # statistics are kept per match length bucket
# Before any evidence: a copy that matched m tokens is often right (more so the longer the match) and keeps going;
# a window n-gram rarely is. Worth PRIOR_WEIGHT observations, so the text's own statistics take over fast.
PRIOR_WEIGHT = 4.0
HISTORY = 256.0  # tries remembered per statistic (older evidence halves away: the text changes character)
WINDOW_PRIOR = 0.3  # tokens per step the window is worth before it is measured
EXPLORE_EVERY = 8  # steps without the window after which it runs once anyway; doubled after a burst that did
EXPLORE_MOST = 128  # not pay for itself, up to this
RECENT = 32  # step times a learned cost correction keeps (the median of those counts: see StepCosts)
CLASS_PRIOR = 8  # steps of a class after which its own times count as much as all steps' (StepCosts)
FIT_LEAST = 3  # recent steps a class needs to count in StepCosts' fit (one stall must not set its slope)
_STALE = ("stale",)  # StepCosts' fit before it is computed


def _median(values) -> float:
    """statistics.median's value, without its checks: the planner takes several per step."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _prior(source: str, match: int) -> tuple[float, float]:
    if source == "text":  # a one-token match is a weak hint; a long one usually continues
        return min(0.85, 0.2 + 0.1 * match), min(0.85, 0.55 + 0.05 * match)
    return 0.15, 0.5


class _Rate:
    """Observed hits / tries, the window of evidence bounded, read against a prior worth PRIOR_WEIGHT tries."""

    __slots__ = ("hits", "tries")

    def __init__(self) -> None:
        self.hits = self.tries = 0.0

    def value(self, prior: float) -> float:
        return (self.hits + prior * PRIOR_WEIGHT) / (self.tries + PRIOR_WEIGHT)

    def add(self, hits: float, tries: float) -> None:
        self.hits += hits
        self.tries += tries
        if self.tries > HISTORY:
            self.hits, self.tries = self.hits / 2, self.tries / 2


@dataclass(frozen=True)
class Chain:
    source: str  # "text" or "window"
    match: int  # tokens of the text's ending that matched where it came from
    tokens: tuple[int, ...]
    # a path of the text's frequency tree: how often each token followed the string before it in the text
    # (smoothed); empty for a copy of one earlier occurrence, or a window n-gram
    odds: tuple[float, ...] = ()


class Acceptance:
    """How often guesses are accepted: the chance that each token of a candidate is what plain decoding emits
    next, given that the token before it was. Each token counts under a statistic: for a copy of one earlier
    occurrence or a window n-gram, its source and match length, the first token apart from further ones; for a
    path of the frequency tree, how often its token followed in the text (in tenths).

    Each statistic starts from a prior (for a frequency path, that frequency itself), and the priors of a kind of
    statistic are calibrated by all of its outcomes together (observed hits over what the priors expected), so a
    text whose copies rarely hold discounts every match length after a few steps, not each one after its own few."""

    def __init__(self) -> None:
        self._rates: dict[tuple, _Rate] = {}
        self._calibration: dict[tuple, _Rate] = {}  # (source, kind): hits against what the priors expected
        self._window = _Rate()  # window-found tokens accepted per step that ran the window

    @staticmethod
    def _statistic(chain: Chain, position: int) -> tuple[tuple, float]:
        """The statistic the chain's token at `position` counts under, and its prior."""
        if chain.odds:
            odds = chain.odds[position]
            return ("tree", min(9, int(odds * 10)), 0), odds
        bucket = MATCH_BUCKETS[max(0, bisect.bisect_right(MATCH_BUCKETS, chain.match) - 1)]
        kind = min(position, 1)
        return (chain.source, bucket, kind), _prior(chain.source, bucket)[kind]

    def _given(self, statistic: tuple, prior: float) -> float:
        calibration, rate = self._calibration.get((statistic[0], statistic[2])), self._rates.get(statistic)
        prior *= calibration.value(1.0) if calibration else 1.0
        return min(0.95, rate.value(prior) if rate else prior)

    def chances(self, chain: Chain) -> list[float]:
        """The chance that plain decoding reaches each of the chain's tokens."""
        if chain.odds:
            given = [self._given(*self._statistic(chain, position)) for position in range(len(chain.tokens))]
        else:  # a copy's or an n-gram's tokens after the first share one statistic
            further = self._given(*self._statistic(chain, 1)) if len(chain.tokens) > 1 else 1.0
            given = [self._given(*self._statistic(chain, 0))] + [further] * (len(chain.tokens) - 1)
        chances, chance = [], 1.0
        for p in given:
            chance *= p
            chances.append(chance)
        return chances

    def observe(self, chain: Chain, position: int, hit: bool) -> None:
        """The chain's token at `position` was verified where the one before it was accepted; `hit`: it was too."""
        statistic, prior = self._statistic(chain, position)
        self._rates.setdefault(statistic, _Rate()).add(hit, 1)
        self._calibration.setdefault((statistic[0], statistic[2]), _Rate()).add(hit, prior)

    def window_value(self) -> float:
        """Window-found tokens accepted per step that ran the window."""
        return self._window.value(WINDOW_PRIOR)

    def window_observed(self, ran: bool, earned: int) -> None:
        """A step ran the window or not; `earned`: its accepted tokens the window had found (on any earlier step)."""
        self._window.add(earned, ran)


class StepCosts:
    """Milliseconds of one pass against its rows. `sizes`: the only row counts a step may have (compiled packages;
    fewer rows are padded up); None: any count (eager), costs between measured points interpolated.

    `observe` corrects the curve with the times of steps actually run (but the first of each class), per class of
    steps (by rows: compiled, each count; eager, 1 to 4 rows each and then powers of two; and whether the window
    ran, as its attention reads the compressed view besides). What the RECENT last steps took beyond the curve is
    fitted as a + b·rows over the classes' medians (each class with at least FIT_LEAST steps, weighted by its
    steps): milliseconds the host adds to every step, and milliseconds each row adds (at a long context each row's
    attention reads the whole cache; on a slower machine both grow). Each class is then drawn towards its own
    median by CLASS_PRIOR steps' worth. While the recent steps hold one row count only, they cannot tell a cost
    per step from one per row: a size is then costed by whichever of three explanations (the same ratio, the same
    milliseconds, the same milliseconds per row) makes it cheaper, so an estimate too low is corrected by running
    that size once, where one too high would never be run again. Medians, because single steps are sometimes
    several times slower (a page fault, a burst of another process) and a mean would let one of them make a class
    look dearer than one of twice its rows."""

    def __init__(self, ms: dict[int, float], sizes: Sequence[int] | None = None):
        if not ms:
            raise ValueError("no step costs")
        self.points = sorted(ms.items())
        self._point_rows = [rows for rows, _ in self.points]
        self.sizes = tuple(sorted(sizes)) if sizes is not None else None
        # the recent steps: (class, rows, ms beyond the curve, ratio to it), overall and per class
        self._recent: deque[tuple[tuple[int, bool], int, float, float]] = deque(maxlen=RECENT)
        self._own: dict[tuple[int, bool], deque[float]] = {}
        self._own_median: dict[tuple[int, bool], float] = {}  # of each class's own, kept as steps are observed
        self._seen: dict[tuple[int, bool], int] = {}  # steps counted per class
        self._fitted: tuple | None = _STALE  # _fit's answer since the last observe
        self._warm: set[tuple[int, bool]] = set()  # classes whose first step was seen (and not counted)
        self._curve: dict[int, float | None] = {}  # _measured's answers: the curve never changes

    def of(self, rows: int, window: bool = False) -> float | None:
        """The cost of a step of `rows` rows (with the window's or not); None where no allowed size holds it."""
        measured = self._measured(rows)
        if measured is None:
            return None
        if self._fitted is _STALE:  # a step's plan asks for many costs between two observations: fitted once
            self._fitted = self._fit()
        if self._fitted is None:
            return measured
        if self._fitted[0] == "fit":
            _, a, b = self._fitted
            cost = measured + a + b * rows
        else:  # one row count seen: the cheapest explanation (per row only for steps slower than measured)
            _, added, per_row, ratio = self._fitted
            cost = min(measured * ratio, measured + added, measured + max(per_row, 0.0) * rows)
        step_class = self._class(rows, window)
        own = self._own_median.get(step_class)
        if own is not None:
            weight = self._seen[step_class] / (self._seen[step_class] + CLASS_PRIOR)
            cost += (measured + own - cost) * weight
        return max(cost, 0.1 * measured)  # (a fit's slope below the curve's must not make steps free)

    def _fit(self) -> tuple | None:
        if not self._recent:
            return None
        classes: dict[tuple[int, bool], list[tuple[int, float]]] = {}
        for step_class, rows, beyond, _ in self._recent:
            classes.setdefault(step_class, []).append((rows, beyond))
        points = [(_median(r for r, _ in steps), _median(b for _, b in steps), len(steps))
                  for steps in classes.values() if len(steps) >= FIT_LEAST]
        if len({rows for rows, _, _ in points}) >= 2:  # weighted least squares over the classes' medians
            total = sum(n for _, _, n in points)
            mean_rows = sum(rows * n for rows, _, n in points) / total
            mean_beyond = sum(beyond * n for _, beyond, n in points) / total
            spread = sum(n * (rows - mean_rows) ** 2 for rows, _, n in points)
            b = sum(n * (rows - mean_rows) * (beyond - mean_beyond) for rows, beyond, n in points) / spread
            return "fit", mean_beyond - b * mean_rows, b
        rows = _median(r for _, r, _, _ in self._recent)
        beyond = _median(b for _, _, b, _ in self._recent)
        return "one", beyond, beyond / rows, _median(ratio for *_, ratio in self._recent)

    def observe(self, rows: int, window: bool, ms: float) -> None:
        """A step of `rows` rows (with the window's or not) took `ms` (the same units as the curve)."""
        measured = self._measured(rows)
        if not measured or ms <= 0:
            return
        step_class = self._class(rows, window)
        if step_class not in self._warm:  # a class's first step carries one-time costs (a package's first call,
            self._warm.add(step_class)    # the cache growing), which would set every class's estimate at once
            return
        self._recent.append((step_class, rows, ms - measured, ms / measured))
        own = self._own.setdefault(step_class, deque(maxlen=RECENT))
        own.append(ms - measured)
        self._own_median[step_class] = _median(own)
        self._seen[step_class] = self._seen.get(step_class, 0) + 1
        self._fitted = _STALE

    def unseen(self, rows: int, window: bool = False) -> bool:
        """Whether fewer than FIT_LEAST steps of this class have counted. A size the planner never runs keeps the
        cost it was given, which for compiled packages is a timing taken at another moment, on a CPU whose speed
        swings (once each package's own build record: a 4-row package timed cheaper than the 1-row one made every
        step verify guesses that did not pay). So the planner runs compiled plain steps until theirs counts."""
        return self._seen.get(self._class(rows, window), 0) < FIT_LEAST

    def _class(self, rows: int, window: bool) -> tuple[int, bool]:
        # on compiled steps each row count apart: a package's padding rows skip attention, which at long contexts
        # is much of a row's cost
        return (rows if self.sizes is not None or rows <= 4 else 1 << (rows - 1).bit_length()), window

    def _measured(self, rows: int) -> float | None:
        if rows not in self._curve:
            self._curve[rows] = self._on_curve(rows)
        return self._curve[rows]

    def _on_curve(self, rows: int) -> float | None:
        if self.sizes is not None:
            at = bisect.bisect_left(self.sizes, rows)
            if at == len(self.sizes):
                return None
            rows = self.sizes[at]
        points = self.points
        if len(points) == 1:
            return points[0][1]
        at = min(max(1, bisect.bisect_left(self._point_rows, rows)), len(points) - 1)
        (r0, m0), (r1, m1) = points[at - 1], points[at]
        if rows > r1:  # past the last point never cheaper than it (a last segment sloping down, from noise, would
            return m1 + max(0.0, (m1 - m0) / (r1 - r0)) * (rows - r1)  # make the widest steps free)
        return m0 + (m1 - m0) * (rows - r0) / (r1 - r0)

    def size(self, rows: int) -> int:
        """The package size a step of `rows` rows runs in (its own row count when eager)."""
        return rows if self.sizes is None else self.sizes[bisect.bisect_left(self.sizes, rows)]

    @classmethod
    def default(cls, accelerator: bool, sizes: Sequence[int] | None = None) -> "StepCosts":
        """Before anything is measured: on a CPU each row adds a few percent of a one-row pass; on an accelerator
        about half a percent (as an H200's CUDA graph steps measured: docs/gpu.md). Relative units (only ratios
        matter)."""
        per_row = 0.005 if accelerator else 0.04
        return cls({1: 1.0, 64: 1.0 + 63 * per_row}, sizes)


@dataclass
class Plan:
    tree: DraftTree  # the guesses to verify, node i on row 1 + i
    chains: list[tuple[Chain, list[int]]]  # each candidate with the tree's nodes of its tokens (a prefix of them)
    sources: list[str]  # per tree node, the source of the first chain that put it there
    window: bool  # whether the window's rows run
    rows: int  # the step's rows (the anchor, the tree, the window's)
    expected: float  # tokens this step is expected to emit


def _merge(chains: Sequence[Chain], acceptance: Acceptance) -> tuple[DraftTree, list[float], list[str], list[list[int]]]:
    """One tree of all candidates (shared prefixes once), each node's chance, source, and each chain's nodes.

    Each chain's chances are estimated as if it were the only guess; where chains part, their next tokens exclude
    each other (plain decoding picks one), so a node's children's chances given it are scaled down to sum to at
    most 1: two copies that disagree at their first token cannot both be 0.7 likely."""
    tree, chance, sources, nodes_of = DraftTree(), [], [], []
    for chain in chains:
        node, nodes = ROOT, []
        for token, p in zip(chain.tokens, acceptance.chances(chain)):
            child = tree.add_chain((token,), parent=node)
            if child == len(chance):
                chance.append(p)
                sources.append(chain.source)
            else:  # a node two chains share: as likely as the likelier says (they agree up to here)
                chance[child] = max(chance[child], p)
            node = child
            nodes.append(node)
        nodes_of.append(nodes)
    # (a long copy's chances can underflow to 0 deep down: a node under one of chance 0 has chance 0)
    given = [p if parent == ROOT else p / chance[parent] if chance[parent] > 0 else 0.0
             for p, parent in zip(chance, tree.parents)]
    siblings: dict[int, float] = {}
    for p, parent in zip(given, tree.parents):
        siblings[parent] = siblings.get(parent, 0.0) + p
    for node, parent in enumerate(tree.parents):  # parents first: each scales its already scaled parent's chance
        chance[node] = given[node] / max(1.0, siblings[parent]) * (chance[parent] if parent != ROOT else 1.0)
    return tree, chance, sources, nodes_of


class Planner:
    """`fixed`: every step verifies every candidate (up to `max_nodes`) and runs the window (lookahead decoding's
    step, and FAFO with `planner: false`)."""

    def __init__(self, acceptance: Acceptance, costs: StepCosts, window_rows: int, max_nodes: int,
                 fixed: bool = False, burst: int = 1):
        self.acceptance, self.costs = acceptance, costs
        self.window_rows, self.max_nodes, self.fixed = window_rows, max_nodes, fixed
        self.burst = burst  # once the window runs, it runs this many steps in a row (its k levels need them)
        self.idle = EXPLORE_EVERY  # steps since the window last ran: it warms up first
        self.explore_every = EXPLORE_EVERY
        self.burst_left = 0
        self.bursts = 0  # bursts begun because the window had been idle
        self.window_earned = 0  # window-found tokens accepted since the last such burst began
        self.window_price = 0.0  # and what the window's steps since then cost, in tokens (see plan)
        self.unverified = 0  # steps since guesses were last verified

    def plan(self, chains: Sequence[Chain] | Callable[[], Sequence[Chain]], room: int,
             firsts: Sequence[Chain] | None = None, depth: int | None = None) -> Plan:
        """The step to run with these candidates, at most `room` rows, no path longer than `depth` guesses (those
        past the answer's end would never be emitted). With `firsts` (one-token chains at least as likely as each
        candidate's first token), `chains` may be a function that builds them: every token of a candidate is at
        most as likely as its first, so n guesses gain at most n times the likeliest of `firsts`, and where even
        that pays for no guess's rows the step is plain without the candidates being built (most steps of free
        prose, whose host work would otherwise cost more than its guesses earn)."""
        window_value = self.acceptance.window_value()
        # near the context's end the window's rows may not fit: no step runs it then, forced or not (a step forced
        # to run it verified nothing, the copies that fit included)
        window_fits = 0 < self.window_rows < room
        idle = window_fits and not self.fixed and self.burst_left == 0 and self.idle >= self.explore_every
        if idle:  # a burst because the window has been idle: back off while bursts earn nothing
            if self.bursts:  # tried as often as before only while its tokens paid for its steps
                paid = self.window_earned > 0 and self.window_earned >= self.window_price
                self.explore_every = EXPLORE_EVERY if paid else min(2 * self.explore_every, EXPLORE_MOST)
            self.bursts += 1
            self.window_earned, self.window_price = 0, 0.0
        forced = self.fixed or idle or self.burst_left > 0
        options = (False,) if not window_fits else (True,) if forced else (False, True)
        if firsts is not None and not forced and self.unverified < EXPLORE_EVERY:
            top = max((chances[0] for chances in map(self.acceptance.chances, firsts) if chances), default=0.0)
            bound = [top * n for n in range(self.max_nodes + 1)]
            if self._choose(bound, options, window_value, room)[:2] == (0, False):
                return self._plain()
        chains = chains() if callable(chains) else chains
        merged, chance, sources, nodes_of = _merge(chains, self.acceptance)
        # Chances fall along every path, so the likeliest n nodes always include their ancestors.
        order = sorted((i for i in range(len(chance)) if depth is None or merged.depths[i] <= depth),
                       key=lambda i: (-chance[i], i))[:self.max_nodes]
        gains = [0.0]
        for node in order:
            gains.append(gains[-1] + chance[node])
        n, window, fits = self._choose(gains, options, window_value, room)
        if not fits:  # not even the anchor fits a package: the caller runs a plain eager step
            n, window = 0, False
        elif n == 0 and order and self.unverified >= EXPLORE_EVERY and 2 + (self.window_rows if window else 0) <= room \
                and self.costs.of(2 + (self.window_rows if window else 0)) is not None:
            n = 1  # now and then the likeliest guess is verified anyway, so its statistics stay measured
        elif n and not window and not self.fixed and gains[n] < 1.0 and self.costs.sizes is not None \
                and self.costs.unseen(1):
            n = 0  # compiled: plain steps until their cost is measured, where less than a guess is expected
        if window:  # the tokens this step would have emitted in the time its window's rows took
            with_window, without = self.costs.of(1 + n + self.window_rows, True), self.costs.of(1 + n)
            if with_window and without:
                self.window_price += (1 + gains[n]) * max(0.0, with_window / without - 1)
        kept = sorted(order[:n])  # parents before children
        tree, index = DraftTree(), {ROOT: ROOT}
        for node in kept:
            index[node] = tree.add(index[merged.parents[node]], merged.tokens[node])
        if window:
            self.burst_left = self.burst_left - 1 if self.burst_left > 0 else self.burst - 1
        self.idle = 0 if window else self.idle + 1
        self.unverified = 0 if n else self.unverified + 1
        verified = [(chain, [index[node] for node in nodes if node in index]) for chain, nodes in zip(chains, nodes_of)]
        return Plan(tree, verified,
                    [sources[node] for node in kept], window, 1 + n + (self.window_rows if window else 0),
                    1 + gains[n] + (window_value if window else 0.0))

    def _choose(self, gains: Sequence[float], options: Sequence[bool], window_value: float,
                room: int) -> tuple[int, bool, bool]:
        """(guesses n, window, whether any step fits) of the highest expected tokens per millisecond, where
        `gains[n]` is what the n likeliest guesses are expected to add; the earliest of equals (fewer rows)."""
        best = (-1.0, 0, False)
        for window in options:
            extra = self.window_rows if window else 0
            for n in range(len(gains)):
                rows = 1 + n + extra
                cost = self.costs.of(rows, window) if rows <= room else None
                if cost is None:
                    break
                rate = (1 + gains[n] + (window_value if window else 0.0)) / cost
                if rate > best[0] * (1 + 1e-9) or self.fixed:  # fixed: the most that fits
                    best = (rate, n, window)
        return best[1], best[2], best[0] >= 0

    def _plain(self) -> Plan:
        """Plain decoding's one row, no candidate read."""
        self.idle += 1
        self.unverified += 1
        return Plan(DraftTree(), [], [], False, 1, 1.0)

    def observe(self, plan: Plan, path: Sequence[int]) -> list[str]:
        """Learn from the step's outcome (`path`: the accepted nodes); returns the source of each accepted guess,
        in order. Each verified node whose parent was accepted counts once, under the first chain that holds it."""
        accepted, counted = set(path), set()
        for chain, nodes in plan.chains:
            for position, node in enumerate(nodes):
                if node not in counted:
                    counted.add(node)
                    self.acceptance.observe(chain, position, node in accepted)
                if node not in accepted:
                    break
        sources = [plan.sources[node] for node in path]
        self.acceptance.window_observed(plan.window, sources.count("window"))
        self.window_earned += sources.count("window")
        return sources
