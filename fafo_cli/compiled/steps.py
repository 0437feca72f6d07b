"""The compiled steps of one model: one package per row count, loaded from disk or built on first need, and the
dispatch of a decoding step to the package that serves it (padding rows up to its size)."""

from __future__ import annotations

import atexit
import contextlib
import glob
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from ..errors import first_line, is_out_of_memory
from ..files import exclusive, remove_abandoned, scratch_dir, write_atomic
from ..runtime.cache import KVCache
from ..runtime.memory import release_freed_memory
from ..runtime.model import STEP_ROWS, Model
from ..runtime.rows import StepRows
from .build import MIN_LENGTH, CompileError, build, load_kernels, load_package, step_constants, stored_dtype
from .timing import Timing, measure, read_step_costs, side_by_side, write_step_costs
from . import packed
from .kernels import loader


# A decoder names the size each step is padded to (its largest step's, or, for FAFO's planner, one of a few sizes).
# Padding rows see no cached position but cost matrix arithmetic, which a many-row step on a CPU is bound by, so
# small steps get packages of their exact size; larger ones are bucketed to bound the number of builds.
PACKED_FILE = "packed.safetensors"  # beside a model's packages: its packed modules (packed.save)
PREPARE_S = 20  # building our kernel library, as it took on 2 cores (17 s) with the packing (3 s)
ROW_BUCKETS = (*range(1, 17), 20, 24, 28, 32, 48, 64, 96, 128, 192, STEP_ROWS)  # larger steps run eager
COST_ROUNDS = 12  # rounds of the packages' side-by-side timing (kept for good: more than a build's check takes)
COST_GROUPS = 3  # of COST_ROUNDS each, the least median kept (a few seconds, once)


REBUILD = object()  # CompiledSteps._built: no package to load
STEPS_RECORD = "serves.json"  # in a compiled-steps folder: the model, dtype and device it serves; its time: last use
STALE_STEPS_S = 7 * 24 * 3600
CLAIM_EVERY_S = 24 * 3600  # a process that runs for weeks (a server) dates its folder's use this often


def claim_steps_folder(folder: Path, serves: dict) -> None:
    """Before a run uses or writes the compiled-steps folder `folder` (hub.compiled_steps_folder) for what `serves`
    names (a model folder, dtype and device): date its use, or create it, and then remove the folders that serve the same
    but belong to another version of fafo, its kernels or torch (their identity differs: this version never loads
    them; hundreds of MB to GBs each) and that no run has used for STALE_STEPS_S (another installation may still use
    one). A folder of its model's name made before records were kept (by an older version) counts as such, dated by
    its last change."""
    record = folder / STEPS_RECORD
    if folder.is_dir():
        with contextlib.suppress(OSError):
            if record.is_file():
                os.utime(record)
            else:
                write_atomic(record, json.dumps(serves))
        return
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(record, json.dumps(serves))
    prefix = folder.name[:folder.name.rindex("-") + 1]
    for other in folder.parent.glob(glob.escape(prefix) + "*"):
        if other == folder or len(other.name) != len(folder.name) or not other.is_dir():
            continue
        kept = other / STEPS_RECORD
        try:
            recorded = json.loads(kept.read_text(encoding="utf-8")) if kept.exists() else None
            used = (kept if kept.exists() else other).stat().st_mtime
        except (OSError, ValueError):  # being written, or removed meanwhile: left alone
            continue
        if recorded in (None, serves) and time.time() - used > STALE_STEPS_S:
            shutil.rmtree(other, ignore_errors=True)


def bucket(rows: int) -> int | None:
    return next((b for b in ROW_BUCKETS if b >= rows), None)


class OnceNotices:
    """`notify_once`: a notice that would repeat every step (a fallback, a refusal) is told once per process."""

    notify: Callable[[str], None]
    _said: set[str]

    def notify_once(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            self.notify(message)


# the folders this process unpacked packages into (CompiledSteps._load_package)
UNPACKED: list[Path] = []


@atexit.register
def remove_unpacked() -> None:
    """As the process ends (its packages' libraries stay mapped till then, whatever their files)."""
    while UNPACKED:
        shutil.rmtree(UNPACKED.pop(), ignore_errors=True)


class CompiledSteps(OnceNotices):
    """The compiled steps of one model: a package per row count, loaded from disk or built on first need.

    mode "on" builds what is missing; "auto" uses only packages that measured faster than eager when they
    were built (their record says so). Any failure prints one notice and leaves that size to eager.
    """

    def __init__(self, model: Model, folder: Path, *, mode: str, notify: Callable[[str], None],
                 gguf: Path | None = None, serves: dict | None = None,
                 builder: Callable[[int, Path], None] | None = None):
        self.model, self.folder, self.mode, self.notify = model, folder, mode, notify
        self.record = serves or {}  # what the folder serves (claim_steps_folder): Engine.steps_serve
        self.gguf = gguf  # the .gguf file the model came from: its blocks serve the projections (packed.py)
        # builder(rows, package): builds a package in a process of its own (api.build_elsewhere), which loads the
        # model again and reads the packed blocks kept here; None: build_here. A build leaves torch's compiler and
        # its caches in the process (about half a GB, docs/benchmarks.md), for the life of a chat or a server.
        self.builder = builder
        self._packed: dict | None = None
        self.dense_only = False  # the packed blocks could not be prepared: no package runs (install_packed)
        # under "on", whether a missing package is built when a step first needs it; False: it runs eager (a server,
        # once its method's packages are built, must not stop every client for a build a request's settings need)
        self.builds = True
        # whether a size whose build failed here before is tried again (`fafo compile`); else it runs eager, said, and
        # no later start spends minutes failing the same way
        self.retry_failed = False
        self._constants: dict | None | bool = False  # step_constants, once (False: not looked at yet)
        self._runners: dict[int, object | None] = {}
        self._timings: dict[int, float] | None = None  # the packages' side-by-side timings (step_costs), once read
        self._timing_failed = False  # (not tried again until a package is built or bench --tune asks)
        self._layer_views: tuple | None = None  # per-layer views of the cache, rebuilt when it is reallocated
        # constant inputs, sliced per step: the view mask of a step that has no view, and per-row flags
        self._whole_cache = torch.ones(0, len(model.layers), dtype=torch.bool, device=model.device)
        self._true_rows = torch.ones(STEP_ROWS, dtype=torch.bool, device=model.device)
        self._false_rows = torch.zeros(STEP_ROWS, dtype=torch.bool, device=model.device)
        self.calls, self.seconds = 0, 0.0  # steps run compiled and their time inside the package (diagnostics)
        self.calls_by_size: dict[int, int] = {}
        self._said: set[str] = set()
        self._claimed_at = float("-inf")
        if folder.is_dir():
            self._claim_folder()  # dated as in use

    def _claim_folder(self) -> None:
        """Before writing into this model's folder (and once per run that finds it, and each CLAIM_EVERY_S while
        steps run): claim_steps_folder."""
        claim_steps_folder(self.folder, self.record)
        self._claimed_at = time.monotonic()

    def packed_modules(self) -> dict:
        """The projections that run on packed GGUF blocks in this model's graphs (packed.py): read from the .gguf
        file and checked once per model (seconds), kept beside its packages, read from there afterwards."""
        if self._packed is None:
            # (kept only once known: a failure here, the kernels' compiler killed say, must not leave the model
            # "dense" for good, which loaded packages built over its packed blocks without their weights)
            load_kernels(self.model, self.folder.parent)
            modules = {}
            if self.gguf is not None and packed.supported(self.model):
                kept = self._kept_packed()
                modules = kept if kept is not None else self._pack()
            self._packed = modules
        return self._packed

    def install_packed(self) -> None:
        """Put the packed modules in the model for every step, eager ones too (packed.install): a .gguf model's steps
        read its quantized blocks as stored, eager or compiled, where our kernel's fast paths serve the CPU. Where
        none are kept yet they are prepared once, under "auto" too (it builds no package): our kernel library, once
        per machine and version (PREPARE_S here), and the file's blocks read and checked (seconds, once per model).
        The model counts them (`Model.packed_matrices`; 0: it keeps its dense weights)."""
        if self.gguf is None or not packed.worth_preparing(self.model):
            return
        preparing = f"preparing {self.gguf.name} for this CPU once: its quantized blocks"
        try:
            if not loader.loaded() and not loader.library_path(self.folder.parent).is_file():
                self.notify(f"{preparing} and fafo's CPU kernels (about {PREPARE_S} s)")
            elif not (self.folder / PACKED_FILE).is_file():
                load_kernels(self.model, self.folder.parent)
                if packed.supported(self.model):  # else nothing is packed, nor kept: no notice on every start
                    self.notify(preparing)
            modules = self.packed_modules()
        except Exception as error:  # noqa: BLE001 - the compiler failed, say: every step stays dense
            # and eager: this model's packages run on the packed blocks the eager steps then do not have
            self.notify_once(f"packed weights unusable ({first_line(error, named=True)}); running dense weights, "
                             "eager")
            self.dense_only = True
            return
        packed.install(self.model, modules)

    def _kept_packed(self) -> dict | None:
        """The packed modules kept beside the packages; None where there are none or they cannot be read (a damaged
        file is packed again from the .gguf file)."""
        try:
            return packed.load(self.folder / PACKED_FILE)
        except Exception:  # noqa: BLE001 - none yet, cut short, or another version's: pack again and replace it
            return None

    def _pack(self) -> dict:
        """The .gguf file's blocks read and checked (seconds), kept beside the packages for later processes (even
        when none could be packed, so that no later start reads the file again)."""
        from safetensors import SafetensorError

        try:
            modules = packed.pack_model(self.model, self.gguf, notify=self.notify_once)
        except Exception as error:  # noqa: BLE001 - an unreadable file: the graphs keep dense weights
            self.notify_once(f"cannot read the packed weights of {self.gguf.name} "
                             f"({first_line(error, named=True)}); compiling with dense weights")
            return {}
        finally:
            release_freed_memory()  # the blocks dequantized to check them, a matrix at a time
        try:
            self._claim_folder()
            packed.save(modules, self.folder / PACKED_FILE)
        except (OSError, SafetensorError):  # a full or read-only disk: the next process packs them again
            pass
        return modules

    def constants(self) -> dict | None:
        """The model's tensors its packages read, shared by all of them (build.step_constants); None: each package
        holds its own copy (a model with dense matrices)."""
        if self._constants is False:
            self._constants = step_constants(self.model, self.packed_modules())
        return self._constants

    def step_costs(self, sizes: list[int], refresh: bool = False) -> dict[int, float] | None:
        """What a step takes in the package serving each of `sizes` (ms), timed side by side: as kept beside the
        packages, else (or with `refresh`, as `fafo bench --tune` asks) timed now with the kept sizes whose packages
        are still on disk, and kept. Not each package's build record: those are taken minutes apart, and on a CPU
        whose speed drifts they misstate the ratios the planner weighs rows by (docs/benchmarks.md). None: a size
        no usable package serves, or the timing failed (the planner then starts from a default curve)."""
        packages = {size: bucket(size) for size in sizes}
        if None in packages.values():
            return None
        if self._timings is None:
            self._timings = read_step_costs(self.folder).get("compiled", {})
        if refresh or not set(packages.values()) <= set(self._timings):
            if self._timing_failed and not refresh or any(self.runner(package) is None
                                                          for package in set(packages.values())):
                return None
            # with the kept sizes this process runs, whose packages are still there: the others are not loaded to
            # be timed (a dense model's packages each hold the weights) and are timed again where a run needs them
            timed = self._time_side_by_side(set(packages.values()) | {
                size for size in self._timings if self._runners.get(size) and self.paths(size)[0].exists()})
            self._timing_failed = timed is None
            if timed is None:
                return None
            self._timings = timed
        return {size: self._timings[package] for size, package in packages.items()}

    def _time_side_by_side(self, sizes: set[int]) -> dict[int, float] | None:
        """Every package of `sizes` that loads (a kept size whose package no longer does is dropped), timed side
        by side and kept beside them (in memory too, where the folder cannot be written)."""
        runners = {size: self.runner(size) for size in sorted(sizes)}
        runners = {size: runner for size, runner in runners.items() if runner is not None}
        self.notify("timing the compiled steps side by side for the step planner, once (later runs read it)")
        try:
            timed = side_by_side(self.model, runners, repeats=COST_ROUNDS, groups=COST_GROUPS)
        except Exception as error:  # noqa: BLE001 - a package that fails to run: the planner's default curve
            self.notify_once(f"timing the compiled steps failed ({first_line(error, named=True)})")
            return None
        try:
            write_step_costs(self.folder, {"compiled": timed})
        except OSError as error:
            self.notify_once(f"cannot keep the compiled steps' timings in {self.folder} ({error.strerror})")
        return timed

    def paths(self, rows: int) -> tuple[Path, Path]:
        return self.folder / f"rows{rows}.pt2", self.folder / f"rows{rows}.json"

    def forget_cache(self) -> None:
        """Let go of the views of the cache kept between steps (before it is reallocated: see Session)."""
        self._layer_views = None

    def serves(self, rows: int) -> bool:
        """Whether a decoder whose largest step has `rows` rows runs compiled (under "on" this builds the
        package now rather than at the first step)."""
        size = bucket(rows)
        return size is not None and self.runner(size) is not None

    def runner(self, rows: int):
        """The loaded package for `rows` rows, building it when allowed; None: run eager."""
        if rows not in self._runners:
            self._runners[rows] = self._load(rows)
        return self._runners[rows]

    def _load(self, rows: int):
        if self.dense_only:
            return None
        package, record = self.paths(rows)
        built = self._built(package, record)
        if built is not REBUILD or self.mode != "on" or not self.builds:
            return None if built is REBUILD else built
        failure = self._failure(rows)
        if failure is not None and not self.retry_failed:
            self.notify(f"the {rows}-row step failed to compile here before ({failure}); running eager (`fafo "
                        "compile` tries again)")
            return None
        try:
            self._claim_folder()
            # one build per package however many processes ask at once (a server and a `fafo run`): the others
            # wait for it, then load what it built (or find why it failed: recorded before the lock is let go)
            waiting = f"waiting for another fafo process to finish building the {rows}-row step"
            with exclusive(self.folder / f"rows{rows}.lock", lambda: self.notify(waiting)):
                if (built := self._built(package, record)) is not REBUILD:  # (built meanwhile: waited for, or not)
                    return built
                if (failure := self._failure(rows)) is not None and not self.retry_failed:  # (failed meanwhile)
                    self.notify(f"the {rows}-row step failed to compile just now ({failure}); running eager")
                    return None
                self.notify(f"compiling the {rows}-row step for this model once ({self._build_estimate()}; later "
                            "runs load it)")
                try:
                    runner, timing = self._build_and_time(rows, package, record)
                except Exception as error:  # noqa: BLE001 - build, load, first run or record: whatever failed
                    return self._failed(rows, error)
                with contextlib.suppress(OSError):
                    (self.folder / f"rows{rows}.failed").unlink(missing_ok=True)
        except Exception as error:  # noqa: BLE001 - the folder or its lock
            return self._failed(rows, error)
        self.notify(f"compiled in {timing.build_s:.0f} s: a {rows}-row step takes {timing.compiled_ms:.1f} ms "
                    f"(eager {timing.eager_ms:.1f} ms)")
        # timed before this package was: the next step_costs times them all again
        self._timings, self._timing_failed = {}, False
        with contextlib.suppress(OSError):  # (a folder that takes no more is told when the timings are written)
            write_step_costs(self.folder, {"compiled": {}})
        return runner

    def _failure(self, rows: int) -> str | None:
        """Why the `rows`-row package failed to build in this folder before (its kernels, torch and fafo the same:
        the folder's name says so); None where it did not."""
        try:
            return json.loads((self.folder / f"rows{rows}.failed").read_text(encoding="utf-8"))["reason"]
        except (OSError, ValueError, KeyError, TypeError):  # (none, or unreadable: tried again)
            return None

    def _built(self, package: Path, record: Path):
        """The package built before, loaded: None where it is not used (under "auto": it did not pay off, or it
        fails to load), REBUILD where there is none (or, under "on", it fails to load: damaged or foreign)."""
        if not (package.exists() and record.exists()):
            return REBUILD
        timing = Timing.read(record)
        if self.mode == "auto" and (timing is None or not timing.pays_off):  # (unreadable: not known to pay off)
            return None
        try:
            load_kernels(self.model, self.folder.parent)
            return self._load_package(package)
        except Exception as error:  # noqa: BLE001 - a damaged or foreign package: rebuilt under "on"
            if self.mode == "auto" or is_out_of_memory(error):  # (not damaged: memory ran out loading it)
                self.notify(f"compiled step unusable ({first_line(error, named=True)}); running eager")
                return None
            return REBUILD

    def _load_package(self, package: Path):
        """load_package, unpacked beside the packages: torch's loader unpacks a package into the temporary folder and
        removes it only when the process lets go of the package, which a process never did before it ended (every
        run left each package it loaded in /tmp, hundreds of MB for a dense model's). Here they go as the process
        ends (UNPACKED), one whose load failed at once, and what a killed process left with the next load (the
        folder's pid gone)."""
        remove_abandoned(self.folder, ".unpacked")
        into = scratch_dir(self.folder, ".unpacked")
        tempfile.gettempdir()  # (Python's own temporary folder chosen before, kept after)
        before = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = str(into)  # (read by torch's C++ loader as it unpacks)
        try:
            runner = load_package(package, self.constants())
        except BaseException:
            shutil.rmtree(into, ignore_errors=True)
            raise
        finally:
            if before is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = before
        UNPACKED.append(into)
        return runner

    def _build_and_time(self, rows: int, package: Path, record: Path) -> tuple:
        """(its runner, its Timing): the package built (elsewhere, where the packed blocks it reads are kept),
        loaded, timed and recorded."""
        started = time.perf_counter()
        if self.builder is not None and (self.packed_modules() == {} or (self.folder / PACKED_FILE).is_file()):
            self.builder(rows, package)  # (where the packed blocks could not be kept, it could not read them)
        else:
            self.build_here(rows, package)
        runner = self._load_package(package)
        timing = measure(self.model, runner, rows)
        timing.build_s = time.perf_counter() - started
        timing.write(record)
        return runner, timing

    def _failed(self, rows: int, error: Exception) -> None:
        """A build that failed: said, and where it would fail again (not memory running out, nor a failure of the
        moment), recorded, so that later starts run that size eager until `fafo compile`."""
        reason = error if isinstance(error, CompileError) else first_line(error, named=True)
        self.notify(f"compilation failed, running eager: {reason}")
        if not (getattr(error, "transient", False) or is_out_of_memory(error)):  # (else tried again next time)
            with contextlib.suppress(OSError):  # (a folder that takes nothing more: tried again next time too)
                write_atomic(self.folder / f"rows{rows}.failed", json.dumps({"reason": str(reason)}))
        return None

    def build_here(self, rows: int, package: Path) -> None:
        """The `rows`-row package built at `package` in this process (build.build); CompileError on failure."""
        build(self.model, rows, package, self.packed_modules(), shared_constants=self.constants() is not None)

    def _build_estimate(self) -> str:
        """How long a build takes here: as the builds recorded beside this model's packages took."""
        builds = [t.build_s for t in map(Timing.read, self.folder.glob("rows*.json")) if t is not None and t.build_s]
        if not builds:
            return "a minute or more on a CPU"
        return f"about {sum(builds) / len(builds):.0f} s, as builds here took"

    def failed(self) -> list[int]:
        """The package sizes that could not be built or loaded where `compile: on` asked for them (they run eager)."""
        if self.mode != "on" or not self.builds:
            return []
        return sorted(size for size, runner in self._runners.items() if runner is None)

    def built(self) -> list[int]:
        """The package sizes loaded in this process so far (each runs its steps compiled)."""
        return sorted(size for size, runner in self._runners.items() if runner is not None)

    def __call__(self, step: StepRows, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor | None:
        """Logits [rows, vocab] in the model's dtype of the step's `ids` at `positions`, written after the committed
        prefix of `cache`; None when no compiled step serves this step (the caller runs eager). Rows are padded to
        the package of `step.size` rows.

        The package's one masked attention call per layer takes, per row, whether it sees every cached position
        (`sees_cache`) or the positions of its layer the view mask marks (`sees_view`), and `local` among the step's
        rows; padding rows see neither, only themselves.
        """
        layout = step.layout
        rows, length, device = ids.shape[0], cache.length, self.model.device
        size = bucket(max(rows, step.size))
        if size is not None and length + size > cache.max_slots:  # near the context's end: the package of the
            size = bucket(rows) if self._runners.get(bucket(rows)) else None  # rows alone, where one is loaded
        if size is None or length < MIN_LENGTH or length + size > cache.max_slots:
            return None
        runner = self.runner(size)
        if runner is None:
            return None
        cache.store_as(stored_dtype(self.model))  # once: the package was traced with it
        cache.reserve(length + size)
        view_mask = step.view.view_mask() if step.view is not None else None
        local = layout.local
        sees_cache = self._true_rows[:rows] if layout.sees_cache is None else layout.sees_cache
        sees_view = ~sees_cache
        if size > rows:  # padding rows: token 0 at the anchor's position, seeing only themselves
            pad = size - rows
            ids = torch.cat([ids, ids.new_zeros(pad)])
            positions = torch.cat([positions, positions[:1].expand(pad)])
            padded = torch.eye(size, dtype=torch.bool, device=device)
            padded[:rows, :rows] = local
            local = padded
            sees_cache, sees_view = (torch.cat([part, self._false_rows[:pad]]) for part in (sees_cache, sees_view))
        if view_mask is None:  # no view: a mask of every cached position in every layer
            if self._whole_cache.shape[0] < cache.capacity:
                self._whole_cache = torch.ones(cache.capacity, len(self.model.layers), dtype=torch.bool, device=device)
            view_mask = self._whole_cache[:length]
        storage = (cache.keys.data_ptr(), cache.capacity)
        if self._layer_views is None or self._layer_views[0] != storage:
            self._layer_views = (storage, list(cache.keys.unbind(0)), list(cache.values.unbind(0)))
        started = time.perf_counter()
        try:
            logits = runner(ids, positions, local, sees_cache, sees_view, view_mask, self._layer_views[1], self._layer_views[2])
        except Exception as error:  # noqa: BLE001 - e.g. a shape the package was not built for: run eager
            if is_out_of_memory(error):  # a moment's shortage: this step eager, the package kept for the next
                self.notify_once("a compiled step ran out of memory; that step ran eager")
                return None
            self.notify(f"compiled step failed, running eager: {first_line(error, named=True)}")
            self._runners[size] = None
            return None
        self.calls += 1
        self.calls_by_size[size] = self.calls_by_size.get(size, 0) + 1
        self.seconds += time.perf_counter() - started
        if time.monotonic() - self._claimed_at > CLAIM_EVERY_S:  # (another version's first build would sweep it)
            with contextlib.suppress(OSError):  # (a full or read-only disk: not a reason to fail a step)
                self._claim_folder()
        return logits[:rows]
