"""Timing compiled steps: against eager when a package is built, and packages against each other, side by side."""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..files import write_atomic
from ..runtime.model import Model, causal_attention, prefix_causal_mask
from .build import stored_dtype


@dataclass
class Timing:
    rows: int
    eager_ms: float
    compiled_ms: float
    build_s: float = 0.0

    @property
    def pays_off(self) -> bool:
        return self.compiled_ms < self.eager_ms

    def write(self, path: Path) -> None:
        write_atomic(path, json.dumps(asdict(self)))

    @classmethod
    def read(cls, path: Path) -> "Timing | None":
        """The record at `path`; None where it cannot be read or is not a record of numbers (damaged, foreign)."""
        try:
            timing = cls(**json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            return None
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in asdict(timing).values())
        return timing if numbers else None


# beside a model's packages: {mode: {rows: ms}}, mode "compiled" or Model.eager_mode's ("eager", "eager-packed"
# over packed blocks, "eager-spread" over GPUs); eager from `fafo bench --tune` or `fafo doctor --write`, compiled
# also on the packages' first use (CompiledSteps.step_costs)
STEP_COSTS = "step-costs.json"


def read_step_costs(folder: Path) -> dict[str, dict[int, float]]:
    """The pass costs measured for this model (none yet: empty); a mode with a cost that is no time (0, negative,
    NaN: a file edited or damaged) is left out, the planner's default curve then used (it divided by them)."""
    try:
        data = json.loads((folder / STEP_COSTS).read_text(encoding="utf-8"))
        kept = {mode: {int(rows): float(ms) for rows, ms in costs.items()} for mode, costs in data.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}
    return {mode: costs for mode, costs in kept.items()
            if costs and all(rows > 0 and math.isfinite(ms) and ms > 0 for rows, ms in costs.items())}


def write_step_costs(folder: Path, costs: dict[str, dict[int, float]]) -> None:
    """Keep `costs` beside the packages: their modes' figures replace those kept, the other modes' stay (read and
    written without a lock: two processes writing at once may lose one's figures, which are then measured again)."""
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / STEP_COSTS, json.dumps({**read_step_costs(folder), **costs}, indent=1))


def _step_inputs(model: Model, rows: int, context: int):
    """A `rows`-row step after `context` cached positions: ids, positions, the eager mask and the compiled step's
    visibility pieces (every row sees the whole cache)."""
    device = model.device
    ids = torch.zeros(rows, dtype=torch.long, device=device)
    positions = torch.arange(context, context + rows, device=device)
    mask = prefix_causal_mask(context, rows, device)
    sees_cache = torch.ones(rows, dtype=torch.bool, device=device)
    view_mask = torch.ones(context, len(model.layers), dtype=torch.bool, device=device)
    return ids, positions, mask, mask[:, context:].contiguous(), sees_cache, ~sees_cache, view_mask


def synchronize(device: torch.device | None) -> None:
    """Wait for the GPU's queued work: a CUDA or MPS pass returns once launched, and a timer would time only the
    launch."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device is not None and device.type == "mps":
        torch.mps.synchronize()


def median_ms(runs: dict, repeats: int, device: torch.device | None) -> dict:
    """Median ms of each of `runs`, called in turn (A B A B ...) so that the machine's drift and the first calls'
    warm-up hit all alike (timed one after another, the first measured a one-row pass dearer than a two-row one);
    the first two rounds are warm-up. `device`: whose queued work each call waits for."""
    times: dict = {name: [] for name in runs}
    for _ in range(repeats + 2):
        for name, run in runs.items():
            synchronize(device)
            start = time.perf_counter()
            run()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t[2:]) * 1e3 for name, t in times.items()}


def measure(model: Model, runner, rows: int, context: int = 256, repeats: int = 8) -> Timing:
    """Median time of a `rows`-row step after `context` cached positions, eager and compiled."""
    cache = model.new_cache(context + rows, context + rows)
    cache.commit(context)
    ids, positions, mask, local, sees_cache, sees_view, view_mask = _step_inputs(model, rows, context)
    with torch.inference_mode():
        eager = median_ms({0: lambda: model.forward(ids, positions, cache, causal_attention(mask, model.scaling))},
                           repeats, model.device)[0]
        cache.store_as(stored_dtype(model))  # each path with the cache it runs with
        keys, values = list(cache.keys.unbind(0)), list(cache.values.unbind(0))
        compiled = median_ms({0: lambda: runner(ids, positions, local, sees_cache, sees_view, view_mask, keys, values)},
                              repeats, model.device)[0]
    return Timing(rows, eager, compiled)


def side_by_side(model: Model, runners: dict, context: int = 256, repeats: int = 8, groups: int = 1
                 ) -> dict[int, float]:
    """Median ms of a step in each package of `runners` ({rows: runner}), called in turn after `context` positions;
    with `groups`, the least of that many medians: a second or so of another process's work, which lifted every
    median of one group by up to half on a 2-core VM, is not what the planner keeps for good."""
    cache = model.new_cache(context + max(runners), context + max(runners))
    cache.commit(context)
    cache.store_as(stored_dtype(model))
    keys, values = list(cache.keys.unbind(0)), list(cache.values.unbind(0))
    runs = {}
    for rows, runner in runners.items():
        ids, positions, _, local, sees_cache, sees_view, view_mask = _step_inputs(model, rows, context)
        runs[rows] = (lambda runner=runner, args=(ids, positions, local, sees_cache, sees_view, view_mask):
                      runner(*args, keys, values))
    with torch.inference_mode():
        timed = [median_ms(runs, repeats, model.device) for _ in range(groups)]
    return {rows: min(group[rows] for group in timed) for rows in runs}
