"""The compiled step (`compile`): float32 token ids identical to transformers' greedy generate with it on,
built once and loaded from disk afterwards, steps padded to the decoder's largest (or to a smaller size that
measured cheaper), C(kv) as a mask, and eager fallbacks that say so in one line instead of failing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from fafo_cli import load
from fafo_cli.cli import entrypoint
from fafo_cli.compiled.timing import read_step_costs, write_step_costs

from .conftest import LONG, PEERS, SHORT, TOKENS, hf_greedy

# Each package costs a build (a minute or more on a small CPU, most of this file's time), so the methods share
# sizes: 1 row (plain steps); 2 (FAFO's anchor with one guess); 6 (FAFO W=1's window with 3 guesses, 1 + 2 + 3; FAFO
# W=2's window alone, 1 + 5; prompt lookup's 1 + 5); 12 (FAFO W=2's window with 6 guesses, 1 + 5 + 6; cacheback's
# 1 + 11); 3 (FAFO W=1's window alone).
METHODS = {
    "vanilla": dict(method="vanilla"),
    # budget between SHORT and LONG: on LONG the fumble rows see C(kv) only (the compiled step's mask)
    "fafo-stream": dict(method="fafo", compressor="stream", budget=48, sink=4, streams=2, ngram=3, guesses=2,
                        draft_tokens=6),
    "fafo-snapkv": dict(method="fafo", compressor="snapkv", budget=48, window=8, draft_tokens=3),
    "prompt-lookup": dict(method="prompt-lookup", lookup_tokens=5),
    "cacheback": dict(method="cacheback", cacheback_budget=11),
}


@pytest.mark.parametrize("method", list(METHODS))
def test_compiled_steps_match_transformers(compiled_engine, tiny, method):
    engine = compiled_engine
    for prompt in (SHORT, LONG):
        before = engine.compiled.calls
        result = engine.complete(prompt, max_tokens=TOKENS, **METHODS[method])
        assert result.token_ids == hf_greedy(tiny, engine.encode(prompt), TOKENS), (method, prompt[:20])
        assert engine.compiled.calls - before == result.stats.steps - 1  # every step after the prefill's
        assert result.stats.compiled_steps == result.stats.steps - 1 and result.stats.steps_ran == "compiled"
    assert not [n for n in engine.notices if "running eager" in n or "runs eager" in n]


def test_one_package_per_row_count_built_once(compiled_engine, compiled_cache):
    engine = compiled_engine
    engine.complete(SHORT, max_tokens=8, method="vanilla")
    # the planner's sizes: 1 row, one guess (2), the window alone (W·k = 6), with D = 6 guesses (12)
    engine.complete(SHORT, max_tokens=8, **METHODS["fafo-stream"])
    # streams: auto with a compressor named is W=1 compiled: 1, 2, 3, 6 rows
    auto = engine.complete(SHORT, max_tokens=8, method="fafo", compressor="stream", draft_tokens=3)
    quest = engine.complete(SHORT, max_tokens=8, method="fafo", compressor="quest", budget=48, page_size=8, refresh=8)
    assert (auto.settings["streams"], auto.stats.streams, quest.stats.streams) == ("auto", 1, 2)
    assert any("quest compressor reads each step's queries" in n for n in engine.notices)  # eager, so W=2: no build
    folder = engine.compiled.folder
    built = {int(p.stem.removeprefix("rows")) for p in folder.glob("*.pt2")}
    assert built == {1, 2, 3, 6, 12}
    records = [json.loads(p.read_text()) for p in folder.glob("rows*.json")]
    assert {r["rows"] for r in records} == built and all(r["compiled_ms"] > 0 and r["eager_ms"] > 0 for r in records)
    compiling = [n for n in engine.notices if n.startswith("compiling")]
    assert len(compiling) == len(built)  # one build per size, however many requests used it


def test_second_load_reads_the_packages(compiled_cache, compiled_engine, tiny):
    compiled_engine.complete(SHORT, max_tokens=8, method="vanilla")  # the package exists
    notices: list[str] = []
    engine = load(str(tiny), dtype="float32", chat_template=False, compile="on", notify=notices.append)
    result = engine.complete(SHORT, max_tokens=TOKENS, method="vanilla")
    assert notices == []  # a load: a build would say "compiling" and engine.compiled.calls == TOKENS - 1
    assert result.token_ids == hf_greedy(tiny, engine.encode(SHORT), TOKENS)


def test_a_package_another_process_builds_is_waited_for_and_loaded(tiny, tmp_path, monkeypatch):
    """Two processes that need the same package at once (a server and a `fafo run`): one builds it, the other waits
    for that build, says so, and loads what it built instead of building it again (minutes, and another copy of the
    model in memory)."""
    import fcntl
    import threading
    import time

    from fafo_cli.compiled import steps

    monkeypatch.setenv("FAFO_CACHE", str(tmp_path))
    notices: list[str] = []
    compiled = load(str(tiny), dtype="float32", chat_template=False, compile="on", notify=notices.append).compiled
    loaded = object()  # a package's load, without building one: what matters is who builds
    monkeypatch.setattr(steps.CompiledSteps, "_built", lambda self, package, record: loaded if package.exists() and
                        record.exists() else steps.REBUILD)
    monkeypatch.setattr(steps.CompiledSteps, "build_here", lambda *args: pytest.fail("built again"))
    compiled.builder = lambda *args: pytest.fail("built again")
    package, record = compiled.paths(5)
    compiled._claim_folder()
    got: list = []
    with open(compiled.folder / "rows5.lock", "a") as other:  # the other process, building
        fcntl.flock(other, fcntl.LOCK_EX)
        waiter = threading.Thread(target=lambda: got.append(compiled.runner(5)))
        waiter.start()
        deadline = time.monotonic() + 30
        while not any(n.startswith("waiting for another fafo process") for n in notices):
            assert time.monotonic() < deadline, notices
            time.sleep(0.01)
        package.write_bytes(b"built")
        record.write_text("{}")
        fcntl.flock(other, fcntl.LOCK_UN)
    waiter.join(30)
    assert got == [loaded] and not any(n.startswith("compiling") for n in notices), notices


def test_a_failed_build_is_recorded_before_its_lock_is_let_go(tiny, tmp_path, monkeypatch):
    """A process waiting for the build (`fafo compile` beside a server) takes the lock when it is let go: the
    failure must be on record by then, or it builds the same failing package again (minutes)."""
    from contextlib import contextmanager

    from fafo_cli.compiled import steps
    from fafo_cli.compiled.build import CompileError

    monkeypatch.setenv("FAFO_CACHE", str(tmp_path))
    compiled = load(str(tiny), dtype="float32", chat_template=False, compile="on", notify=lambda note: None).compiled
    recorded = []
    held = steps.exclusive

    @contextmanager
    def watched(path, waiting=lambda: None):
        with held(path, waiting):
            yield
            recorded.append((compiled.folder / "rows5.failed").exists())

    monkeypatch.setattr(steps, "exclusive", watched)
    monkeypatch.setattr(steps, "load_kernels", lambda *args: None)  # (built into this empty cache: half a minute)

    def fails(*args):
        raise CompileError("unsupported op: aten::foo")

    compiled.builder = fails
    monkeypatch.setattr(steps.CompiledSteps, "build_here", fails)
    assert compiled.runner(5) is None and recorded == [True]


def test_a_failed_kernel_build_is_tried_again_not_taken_for_a_dense_model(tiny, tmp_path, monkeypatch):
    """Our kernels failing to build once (the compiler killed, say) is no answer to which matrices are packed: it
    was kept as "none", and packages built over the packed blocks were then loaded without their weights."""
    from fafo_cli.compiled import steps
    from fafo_cli.compiled.build import CompileError

    monkeypatch.setenv("FAFO_CACHE", str(tmp_path))
    compiled = load(str(tiny), dtype="float32", chat_template=False, compile="on").compiled
    calls = []

    def failing(*args):
        calls.append(args)
        raise CompileError("g++ was killed")

    monkeypatch.setattr(steps, "load_kernels", failing)
    for _ in range(2):
        with pytest.raises(CompileError):
            compiled.packed_modules()
    assert len(calls) == 2
    monkeypatch.setattr(steps, "load_kernels", lambda *args: None)
    assert compiled.packed_modules() == {}  # (a safetensors model: nothing to pack)
    # where a .gguf model's blocks could not be prepared at load, its steps stay dense and eager for the process:
    # its packages run on the packed blocks (a later retry that packed them would run the two apart)
    monkeypatch.setattr(steps, "load_kernels", failing)
    monkeypatch.setattr(steps.packed, "worth_preparing", lambda model: True)
    compiled._packed, compiled.gguf = None, tmp_path / "model.gguf"
    compiled.install_packed()
    package, record = compiled.paths(1)  # a package an earlier run built over the packed blocks
    package.parent.mkdir(parents=True, exist_ok=True)
    package.write_bytes(b"built")
    record.write_text("{}")
    monkeypatch.setattr(steps, "load_kernels", lambda *args: None)  # (the kernels build later on: the blocks pack)
    monkeypatch.setattr(steps.CompiledSteps, "constants", lambda self: {})
    monkeypatch.setattr(steps, "load_package", lambda *args: pytest.fail("loaded over blocks the eager steps lack"))
    compiled.builder = lambda *args: pytest.fail("built a package for a model without its packed blocks")
    assert compiled.dense_only and compiled.runner(1) is None


def test_a_package_is_built_by_a_process_of_its_own_that_says_why_it_failed(tiny, tmp_path):
    """Builds run in a process of their own (torch's compiler and its caches stay out of a chat's or server's
    process); what stops one is its last line, and nothing is left half-written."""
    from fafo_cli.compiled.build import CompileError

    engine = load(str(tiny), dtype="float32", compile="on")
    assert engine.compiled.builder is not None  # engine.build_elsewhere, held weakly (the other tests' packages)
    engine.__dict__["steps_folder"] = tmp_path / "elsewhere"  # not the folder that process finds for this model
    with pytest.raises(CompileError, match="^the model in .* loaded again is not the one whose steps are built$"):
        engine.build_elsewhere(1, tmp_path / "rows1.pt2")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_build_says_the_compilers_error_and_whether_memory_ran_out():
    """torch's first line of a C++ compiler's failure is only "C++ compile error": the compiler's first error line
    says why; a compiler killed for memory is a failure of the moment (not recorded: tried again next time)."""
    from fafo_cli.compiled.build import failure

    missing = RuntimeError("C++ compile error\n\nCommand:\ng++ /tmp/x.cpp -o x.so\n\nOutput:\n/tmp/x.cpp:3:10: fatal "
                           "error: Python.h: No such file or directory\ncompilation terminated.")
    said = failure(missing)
    assert str(said) == ("RuntimeError: C++ compile error: /tmp/x.cpp:3:10: fatal error: Python.h: No such file or "
                         "directory") and not said.transient
    killed = RuntimeError("C++ compile error\nOutput:\ng++: fatal error: Killed signal terminated program cc1plus")
    assert failure(killed).transient and failure(MemoryError()).transient
    assert not failure(RuntimeError("unsupported op: aten::foo")).transient


def test_packages_unpack_beside_them_and_what_a_killed_process_left_goes(tiny, tmp_path, monkeypatch):
    """torch's loader unpacks a package into $TMPDIR until the process lets go of it, which none did before it
    ended: here into a folder beside the packages, removed as the process ends, by a failed load at once, and by
    the next load where a killed process left it."""
    import os

    from fafo_cli.compiled import steps as steps_mod

    model = load(str(tiny), dtype="float32", chat_template=False, compile="off").model
    steps = steps_mod.CompiledSteps(model, tmp_path, mode="auto", notify=print)
    stale = tmp_path / ".unpacked-999999999-left"  # (no such process)
    (stale / "aotinductor_x").mkdir(parents=True)
    before, seen = os.environ.get("TMPDIR"), []

    def loading(package, constants):
        seen.append(Path(os.environ["TMPDIR"]))
        (seen[-1] / "aotinductor_y").mkdir()
        if package.name == "damaged.pt2":
            raise RuntimeError("PytorchStreamReader failed reading zip archive")
        return "runner"

    monkeypatch.setattr(steps_mod, "load_package", loading)
    monkeypatch.setattr(steps_mod, "UNPACKED", [])  # (not the folders of the packages other tests hold)
    assert steps._load_package(tmp_path / "rows1.pt2") == "runner"
    assert seen[0].parent == tmp_path and seen[0].name.startswith(f".unpacked-{os.getpid()}@")
    assert not stale.exists() and os.environ.get("TMPDIR") == before
    with pytest.raises(RuntimeError):
        steps._load_package(tmp_path / "damaged.pt2")
    assert not seen[1].exists() and seen[0].exists() and os.environ.get("TMPDIR") == before
    steps_mod.remove_unpacked()  # as the process ends (torch's loader never removed them: every run left its own)
    assert not seen[0].exists()


def test_a_building_process_leaves_no_compiler_files_behind(tiny, tmp_path, monkeypatch):
    """torch's compiler writes its sources, libraries and unpacked packages to the system's temporary folder and
    never removes them: the building process's temporary folder and compiler cache are a folder beside the
    packages, removed after the build (one a killed process left, by the next build)."""
    import subprocess
    import sys

    from fafo_cli.compiled.build import CompileError

    engine = load(str(tiny), dtype="float32", compile="on")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    stale = tmp_path / ".build-999999999-left"  # (no such process)
    (stale / "torchinductor").mkdir(parents=True)
    popen = subprocess.Popen
    work = ("import os, sys, tempfile; open(os.path.join(tempfile.gettempdir(), 'aotinductor_x'), 'w').write('x'); "
            "print(os.environ['TORCHINDUCTOR_CACHE_DIR'], tempfile.gettempdir(), os.getcwd(), file=sys.stderr); "
            "sys.exit(1)")
    monkeypatch.setattr(subprocess, "Popen", lambda args, **kwargs: popen([sys.executable, "-c", work], **kwargs))
    with pytest.raises(CompileError) as raised:
        engine.build_elsewhere(1, tmp_path / "rows1.pt2")
    cache, temporary, current = str(raised.value).split()  # (the current folder too: Python 3.10 imports from it)
    assert cache == temporary == current and Path(cache).parent == tmp_path and Path(cache).name.startswith(".build-")
    assert list(tmp_path.iterdir()) == [] and not raised.value.transient
    # its compiler killed for memory, as that process says: a failure of the moment, tried again next time
    said = "import sys; print('C++ compile error: g++: fatal error: Killed signal terminated program cc1plus', " \
           "file=sys.stderr); sys.exit(1)"
    monkeypatch.setattr(subprocess, "Popen", lambda args, **kwargs: popen([sys.executable, "-c", said], **kwargs))
    with pytest.raises(CompileError, match="Killed signal") as raised:
        engine.build_elsewhere(1, tmp_path / "rows1.pt2")
    assert raised.value.transient


@pytest.mark.parametrize("number, said", [(9, "SIGKILL: out of memory?"), (35, "signal 35")])
def test_a_building_process_killed_for_memory_says_so(tiny, tmp_path, monkeypatch, number, said):
    """The kernel's out-of-memory killer ends a build with SIGKILL (it holds a second copy of the model): said so,
    not as an exit code; a signal without a name (a job manager's real-time one) by its number."""
    import re
    import subprocess
    import sys

    from fafo_cli.compiled.build import CompileError

    engine = load(str(tiny), dtype="float32", compile="on")
    popen = subprocess.Popen
    killed = f"import os; os.kill(os.getpid(), {number})"
    monkeypatch.setattr(subprocess, "Popen", lambda args, **kwargs: popen([sys.executable, "-c", killed], **kwargs))
    with pytest.raises(CompileError, match=f"^the building process was killed \\({re.escape(said)}\\)$"):
        engine.build_elsewhere(1, tmp_path / "rows1.pt2")


def test_a_process_that_runs_for_weeks_dates_its_steps_folder_once_a_day(compiled_engine):
    """A folder no run has used for a week is swept by another version's first build; a server that has run its
    steps for longer than that dates it again, once a day, not at every step."""
    import os
    import time

    from fafo_cli.compiled.steps import CLAIM_EVERY_S, STALE_STEPS_S, STEPS_RECORD

    compiled = compiled_engine.compiled
    compiled_engine.complete(SHORT, max_tokens=4, method="vanilla")  # its package built or loaded
    record = compiled.folder / STEPS_RECORD
    old = time.time() - STALE_STEPS_S - 60
    os.utime(record, (old, old))
    compiled_engine.complete(SHORT, max_tokens=4, method="vanilla")
    assert record.stat().st_mtime < time.time() - STALE_STEPS_S  # dated when it was found, not at each step
    compiled._claimed_at -= CLAIM_EVERY_S  # a day later
    compiled_engine.complete(SHORT, max_tokens=4, method="vanilla")
    assert time.time() - record.stat().st_mtime < 60


def test_auto_uses_only_packages_that_measured_faster(compiled_engine, compiled_cache, tiny):
    compiled_engine.complete(SHORT, max_tokens=8, method="vanilla")
    record = compiled_engine.compiled.folder / "rows1.json"  # (the session's cache holds other models' and dtypes')
    original = json.loads(record.read_text())
    try:
        for compiled_ms, used in ((original["eager_ms"] * 2, False), (original["eager_ms"] / 2, True)):
            record.write_text(json.dumps({**original, "compiled_ms": compiled_ms}))
            engine = load(str(tiny), dtype="float32", chat_template=False, compile="auto", notify=print)
            engine.complete(SHORT, max_tokens=8, method="vanilla")
            assert (engine.compiled.calls > 0) == used
    finally:
        record.write_text(json.dumps(original))


def test_fafo_steps_in_the_planners_packages_match_transformers(compiled_cache, tiny):
    """FAFO's planner runs each step in one of its packages (1 row, one guess, the window alone, the window with
    guesses), as their side-by-side costs make worth it: still transformers' greedy tokens, on a prompt longer than the
    compressed budget."""
    settings = dict(METHODS["fafo-stream"], streams=1, guesses=1, draft_tokens=3)  # sizes 1, 2, 3, 6
    notices: list[str] = []
    engine = load(str(tiny), dtype="float32", chat_template=False, compile="on", notify=notices.append)
    result = engine.complete(LONG, max_tokens=TOKENS, **settings)
    assert not [n for n in notices if "running eager" in n or "runs eager" in n]
    assert result.token_ids == hf_greedy(tiny, engine.encode(LONG), TOKENS)
    assert len(engine.compiled.calls_by_size) >= 2 and set(engine.compiled.calls_by_size) <= {1, 2, 3, 6}
    assert sum(engine.compiled.calls_by_size.values()) == result.stats.steps - 1
    kept = read_step_costs(engine.compiled.folder)["compiled"]  # the planner's costs, timed side by side and kept
    assert {1, 2, 3, 6} <= set(kept) and all(ms > 0 for ms in kept.values())
    assert engine.compiled.step_costs([1, 2, 3, 6]) == {size: kept[size] for size in (1, 2, 3, 6)}


def test_tune_times_the_packages_side_by_side_for_the_planner(compiled_cache, tiny, tmp_path, monkeypatch, capsys):
    """`fafo bench --tune` on compiled steps keeps the packages' costs, timed side by side, beside them; the planner
    then reads those."""
    from fafo_cli.bench import tune
    from fafo_cli.compiled.timing import STEP_COSTS

    config = tmp_path / "config.yaml"  # fafo-stream with the sizes 1, 2, 3, 6 the test above built
    config.write_text("compile: on\ncompressor: stream\nbudget: 48\nsink: 4\nstreams: 1\nngram: 3\nguesses: 1\n"
                      "draft_tokens: 3\nchat_template: false\n")
    monkeypatch.setattr(tune, "CANDIDATES", ((1, 3, 1),))  # the current setting only: no other package to build
    monkeypatch.setattr(tune, "TOKENS", 8)
    monkeypatch.setattr(tune, "DISTURBED", float("inf"))  # the tiny model's millisecond runs are all host jitter
    engine = load(str(tiny), dtype="float32", chat_template=False, compile="auto", notify=lambda _: None)
    costs_file = engine.steps_folder / STEP_COSTS
    costs_file.unlink(missing_ok=True)  # what an earlier FAFO test kept: tune must write its own
    try:
        assert entrypoint(["bench", str(tiny), "--tune", "--config", str(config), "--dtype", "float32"]) == 0
        assert "compiled steps, side by side: 1 rows" in capsys.readouterr().out
        tuned = read_step_costs(engine.steps_folder)
        assert set(tuned) == {"eager", "compiled"} and {1, 6} <= set(tuned["compiled"]) <= {1, 2, 3, 6}
        assert all(ms > 0 for ms in tuned["compiled"].values())
        sizes = sorted(tuned["compiled"])  # what the planner's StepCosts are built from
        assert engine.compiled.step_costs(sizes) == tuned["compiled"]
    finally:
        costs_file.unlink(missing_ok=True)  # the next FAFO run times its packages side by side again


def test_fafo_stays_compiled_where_only_its_larger_packages_are_missing(compiled_cache, tiny):
    """Under `compile: auto` a package that measured slower than eager (or was never built) is not used: FAFO's
    steps then keep to the sizes that are, instead of the whole answer running eager."""
    settings = dict(METHODS["fafo-stream"], streams=1, guesses=1, draft_tokens=3)  # sizes 1, 2, 3, 6
    load(str(tiny), dtype="float32", chat_template=False, compile="on",
         notify=lambda _: None).complete(SHORT, max_tokens=8, **settings)  # builds what is missing of 1, 2, 3, 6
    engine = load(str(tiny), dtype="float32", chat_template=False, compile="auto", notify=lambda _: None)
    longer = dict(settings, draft_tokens=16)  # sizes 1, 2, 3, 6, 19: a 20-row package that does not exist
    result = engine.complete(LONG, max_tokens=TOKENS, **longer)
    assert result.token_ids == hf_greedy(tiny, engine.encode(LONG), TOKENS)
    assert result.stats.streams == 1 and set(engine.compiled.calls_by_size) <= {1, 2, 3, 6}
    assert sum(engine.compiled.calls_by_size.values()) == result.stats.steps - 1  # every step compiled
    assert max(result.stats.step_rows) <= 6


def test_auto_uses_no_package_whose_record_cannot_be_read(compiled_cache, compiled_engine, tiny):
    """`compile: auto` runs the packages recorded as faster than eager; one whose record cannot be read is not
    known to be (it ran all the same)."""
    compiled_engine.complete(SHORT, max_tokens=4, method="vanilla")  # its 1-row package built or loaded
    package, record = compiled_engine.compiled.paths(1)
    kept = record.read_bytes()
    try:
        record.write_text("{not json")
        engine = load(str(tiny), dtype="float32", chat_template=False, compile="auto", notify=lambda _: None)
        assert engine.compiled.runner(1) is None and package.is_file()
    finally:
        record.write_bytes(kept)
    engine = load(str(tiny), dtype="float32", chat_template=False, compile="auto", notify=lambda _: None)
    assert engine.compiled.runner(1) is not None


def test_a_build_failing_for_a_reason_of_the_moment_is_not_remembered(compiled_cache, tiny_models):
    """A building process killed (memory running out) or out of memory is tried again at the next start; a failure
    recorded by another process while this one waited for the lock is not repeated."""
    from fafo_cli.compiled import steps as steps_mod
    from fafo_cli.compiled.build import CompileError

    folder = tiny_models["qwen2-bias"]
    engine = load(str(folder), dtype="float32", chat_template=False, compile="on", notify=lambda _: None)
    failures = [CompileError("the building process was killed (SIGKILL: out of memory?)", transient=True),
                MemoryError()]
    for failure in failures:
        def fails(rows, package, failure=failure):
            raise failure

        engine.compiled.builder, engine.compiled._runners = fails, {}
        assert engine.compiled.runner(1) is None
        assert not list(engine.compiled.folder.glob("rows1.failed"))  # tried again next time

    real, built = steps_mod.exclusive, []

    def another_process_failed(path, waiting):  # it held the lock, failed, and recorded why
        (engine.compiled.folder / "rows1.failed").write_text('{"reason": "no compiler"}')
        return real(path, waiting)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(steps_mod, "exclusive", another_process_failed)
        engine.compiled.builder, engine.compiled._runners = lambda rows, package: built.append(rows), {}
        assert engine.compiled.runner(1) is None and built == []


def test_a_torch_without_the_flat_loader_refuses_a_package_without_weights(monkeypatch, tmp_path):
    """Where torch's package loader lacks the call that hands a package the model's own weights, such a package is
    refused (the caller runs eager), not run on no weights."""
    from fafo_cli.compiled import build
    from fafo_cli.compiled.build import CompileError

    class OlderLoader:  # (no boxed_run)
        pass

    monkeypatch.setattr(torch._C, "_aoti", type("Aoti", (), {"AOTIModelPackageLoader": OlderLoader}), raising=False)
    with pytest.raises(CompileError, match="cannot load a package with the model's own weights"):
        build.load_package(tmp_path / "rows1.pt2", constants={})


def test_side_by_side_times_each_package(compiled_engine):
    from fafo_cli.compiled import timing

    steps = compiled_engine.compiled
    ms = timing.side_by_side(steps.model, {1: steps.runner(1), 6: steps.runner(6)}, repeats=2)
    assert set(ms) == {1, 6} and all(value > 0 for value in ms.values())


def test_side_by_side_keeps_the_least_of_its_groups_medians(monkeypatch):
    """A disturbance (another process's second of work) that lifts one group's medians is not kept for good."""
    from types import SimpleNamespace

    from fafo_cli.compiled import timing

    groups = iter([{1: 9.0, 4: 15.0}, {1: 6.0, 4: 9.5}, {1: 6.2, 4: 9.0}])  # the first group disturbed
    monkeypatch.setattr(timing, "median_ms", lambda runs, repeats, device: next(groups))
    monkeypatch.setattr(timing, "_step_inputs", lambda model, rows, context: (None,) * 7)
    model = SimpleNamespace(new_cache=lambda *args: SimpleNamespace(commit=lambda n: None, store_as=lambda d: None,
                                                                    keys=torch.zeros(1, 1), values=torch.zeros(1, 1)),
                            device=torch.device("cpu"), dtype=torch.float32)
    monkeypatch.setattr(timing, "stored_dtype", lambda model: torch.float32)
    assert timing.side_by_side(model, {1: None, 4: None}, groups=3) == {1: 6.0, 4: 9.0}


def test_kept_step_costs_that_are_no_times_are_left_out(tmp_path):
    """A step-costs file edited by hand or damaged (0 ms, negative, NaN) would have the planner divide by them:
    that mode is left out (the default curve plans), the others read."""
    from fafo_cli.compiled.timing import STEP_COSTS

    (tmp_path / STEP_COSTS).write_text('{"eager": {"1": 0, "4": 2.0}, "compiled": {"1": 7.0, "4": 9.5}, '
                                       '"eager-packed": {"1": NaN}, "eager-spread": {"1": -3}}')
    assert read_step_costs(tmp_path) == {"compiled": {1: 7.0, 4: 9.5}}


def test_a_compiled_step_out_of_memory_runs_eager_and_keeps_its_package(tiny, tmp_path):
    """A step whose package runs out of memory runs eager (the caller's None), said once; the package serves the
    next step (a moment's shortage on a long-running server is not a broken package)."""
    from fafo_cli.compiled import steps as steps_mod
    from fafo_cli.runtime.rows import plain_step

    model = load(str(tiny), dtype="float32", chat_template=False, compile="off").model
    notices: list[str] = []
    steps = steps_mod.CompiledSteps(model, tmp_path, mode="auto", notify=notices.append)
    calls = []

    def short_of_memory(*args):
        calls.append(1)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    steps._runners = {1: short_of_memory}
    cache = model.new_cache(64, 64)
    cache.commit(steps_mod.MIN_LENGTH)
    step = plain_step(5, model.device)
    ids, positions = torch.tensor([5]), torch.tensor([cache.length])
    assert steps(step, ids, positions, cache) is None and steps(step, ids, positions, cache) is None
    assert len(calls) == 2 and steps._runners[1] is short_of_memory
    assert notices == ["a compiled step ran out of memory; that step ran eager"]


def test_package_costs_are_timed_side_by_side_once_and_kept(tiny, tmp_path, monkeypatch):
    """The planner's package costs: timed together when first asked for (not each package's build record), kept
    beside the packages and read from there after; a size not kept yet re-times it with the kept ones whose
    packages are still there; `refresh` (bench --tune) times them again; a folder that cannot keep them keeps them
    in memory."""
    import time

    from fafo_cli.compiled import steps as steps_mod

    model = load(str(tiny), dtype="float32", chat_template=False, compile="off").model
    notices: list[str] = []
    steps = steps_mod.CompiledSteps(model, tmp_path, mode="auto", notify=notices.append)
    calls: list[int] = []

    def package(rows: int):
        def run(*_):
            calls.append(rows)
            time.sleep(rows / 1e3)
        return run

    steps._runners = {1: package(1), 2: package(2), 3: package(3), 4: None}
    for rows in (1, 2, 3):
        steps.paths(rows)[0].touch()
    write_step_costs(tmp_path, {"eager": {1: 9.0}})  # `bench --tune`'s eager curve stays beside them
    first = steps.step_costs([1, 3])
    assert set(first) == {1, 3} and first[3] > first[1] and set(calls) == {1, 3}
    assert read_step_costs(tmp_path) == {"eager": {1: 9.0}, "compiled": first}
    calls.clear()
    assert steps.step_costs([3, 1]) == first and calls == [] and len(notices) == 1  # kept: not timed again
    assert steps_mod.CompiledSteps(model, tmp_path, mode="auto", notify=print).step_costs([1, 3]) == first  # read
    steps.paths(3)[0].unlink()  # a kept size whose package is gone is not timed again, and no longer kept
    assert set(steps.step_costs([1, 2])) == {1, 2} and set(calls) == {1, 2}
    assert set(read_step_costs(tmp_path)["compiled"]) == {1, 2}
    steps.paths(3)[0].touch()  # a kept size this process has not loaded is not loaded to be timed (a dense model's
    loaded, steps._runners = steps._runners, {1: package(1), 3: package(3)}  # packages each hold the weights)
    calls.clear()
    assert set(steps.step_costs([1, 3])) == {1, 3} and set(calls) == {1, 3} and 2 not in steps._runners
    steps._runners = loaded
    steps.paths(3)[0].unlink()
    calls.clear()
    assert steps.step_costs([1, 2], refresh=True) and set(calls) == {1, 2}
    assert steps.step_costs([1, 4]) is None and steps.step_costs([1, 1000]) is None  # no package serves 4, 1000

    def full(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(steps_mod, "write_step_costs", full)
    costs = steps.step_costs([1, 2], refresh=True)
    assert set(costs) == {1, 2} and any("cannot keep the compiled steps' timings" in n for n in notices)
    calls.clear()
    assert steps.step_costs([2, 1]) == costs and calls == []  # kept in memory

    def fails(*_):
        raise RuntimeError("fafo::attend: unsupported shapes")

    steps._runners[3] = fails
    steps.paths(3)[0].touch()
    told = len(notices)
    assert steps.step_costs([1, 3]) is None and steps.step_costs([3, 1]) is None  # tried once, not per request
    assert notices[told:] == ["timing the compiled steps side by side for the step planner, once (later runs read "
                              "it)", "timing the compiled steps failed (RuntimeError: fafo::attend: unsupported "
                                     "shapes)"]


def test_a_damaged_build_record_is_no_record(tmp_path):
    from fafo_cli.compiled.timing import Timing

    record = tmp_path / "rows1.json"
    for text in ('{"rows": 1, "eager_ms": null, "compiled_ms": 2.0}', '{"rows": 1, "eager_ms": 1, "compiled_ms": 2, '
                 '"build_s": "x"}', "[1, 2]", "{", '{"rows": true, "eager_ms": 1, "compiled_ms": 2}'):
        record.write_text(text)
        assert Timing.read(record) is None, text
    record.write_text('{"rows": 1, "eager_ms": 3, "compiled_ms": 2.5, "build_s": 40.0}')
    assert Timing.read(record) == Timing(1, 3, 2.5, 40.0) and Timing.read(record).pays_off


def test_auto_never_builds(compiled_cache, tiny_models):
    engine = load(str(tiny_models["mistral"]), dtype="float32", chat_template=False, compile="auto",
                  notify=pytest.fail)
    engine.complete(SHORT, max_tokens=8, method="vanilla")
    assert engine.compiled.calls == 0


def test_on_without_builds_runs_eager_where_no_package_is_built(compiled_cache, tiny_models):
    """What a server does once its method's packages are built: a size not built runs eager, never built then."""
    engine = load(str(tiny_models["mistral"]), dtype="float32", chat_template=False, compile="on",
                  notify=pytest.fail)
    engine.compiled.builds = False
    engine.complete(SHORT, max_tokens=8, method="vanilla")
    assert engine.compiled.calls == 0 and engine.compiled.failed() == []


def test_compiler_failure_falls_back_to_eager_in_one_line(compiled_cache, tiny_models):
    import torch._inductor.config as inductor

    from fafo_cli.compiled.ahead import build_ahead
    from fafo_cli.compiled.build import CompileError

    folder = tiny_models["qwen2-bias"]  # no package of it is built elsewhere: inductor compiles its graph afresh
    notices: list[str] = []
    engine = load(str(folder), dtype="float32", chat_template=False, compile="on", notify=notices.append)
    engine.compiled.builder = None  # built in this process, whose inductor the patch below reaches
    with inductor.patch({"cpp.cxx": ("/nonexistent/c++",)}):  # inductor's own patch: undone cleanly after
        result = engine.complete(SHORT, max_tokens=32, method="vanilla")
    assert result.token_ids == hf_greedy(folder, engine.encode(SHORT), 32)
    failed = [n for n in notices if n.startswith("compilation failed, running eager")]
    assert len(failed) == 1 and all("\n" not in n for n in notices)
    # nothing half-written (a loaded package unpacks into a folder named as the file it was written as: not ours)
    half = [path for path in compiled_cache.glob("**/*.partial*") if ".unpacked-" not in str(path)]
    assert not list(compiled_cache.glob("compiled/qwen2-bias-*/*.pt2")) and not half
    # the next start does not spend minutes failing the same way: it says so and runs eager; `fafo compile` retries
    (marker,) = compiled_cache.glob("compiled/qwen2-bias-*/rows1.failed")
    notices.clear()
    again = load(str(folder), dtype="float32", chat_template=False, compile="on", notify=notices.append)
    again.compiled.builder = pytest.fail  # (no build is tried)
    assert again.complete(SHORT, max_tokens=8, method="vanilla").token_ids == result.token_ids[:8]
    assert any(n.startswith("the 1-row step failed to compile here before (") and n.endswith(
        "running eager (`fafo compile` tries again)") for n in notices), notices
    retried = []

    def fails_again(rows, package):
        retried.append(rows)
        raise CompileError("still no compiler")

    again = load(str(folder), dtype="float32", chat_template=False, compile="on", notify=notices.append)
    again.compiled.builder = fails_again
    assert list(build_ahead(again, ["vanilla"])) == [("vanilla", [])] and retried == []  # (a server's start)
    again = load(str(folder), dtype="float32", chat_template=False, compile="on", notify=notices.append)
    again.compiled.builder = fails_again
    assert list(build_ahead(again, ["vanilla"], retry_failed=True)) == [("vanilla", [])]  # `fafo compile`'s
    assert retried == [1] and "still no compiler" in marker.read_text()
    marker.unlink()  # (the other tests' compiled runs of this model build as usual)


def test_steps_near_the_context_end(compiled_engine, tiny):
    """To the model's last position (2,048: the prompt fills most of it), with steps whose padding would pass it
    running in the package of their own rows where one is loaded (else eager, as they would part from plain
    decoding's compiled one-row steps at bf16 near-ties): transformers' tokens."""
    ids = compiled_engine.encode(LONG * 6)
    calls = compiled_engine.compiled.calls_by_size
    for settings in (METHODS["vanilla"], METHODS["prompt-lookup"]):
        one_row = calls.get(1, 0)
        result = compiled_engine.complete(LONG * 6, max_tokens=500, **settings)
        assert result.finish_reason == "context" and result.token_ids == hf_greedy(tiny, ids, 2048 - len(ids))
    assert calls[1] > one_row  # prompt lookup's last steps, a row each: in the one-row package, not eager


def test_cli_compile_flag(compiled_cache, compiled_engine, tiny, tmp_path, capsys):
    compiled_engine.complete(SHORT, max_tokens=8, method="vanilla")  # built: the CLI only loads
    prompt = tmp_path / "p.txt"
    prompt.write_text(SHORT)
    code = entrypoint(["run", str(tiny), "-p", str(prompt), "--compile", "--dtype", "float32", "--no-chat-template",
                       "--method", "vanilla", "-n", "16", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["settings"]["compile"] == "on" and out["stats"]["steps_ran"] == "compiled"
    assert out["token_ids"] == hf_greedy(tiny, compiled_engine.encode(SHORT), 16)
    entrypoint(["run", str(tiny), "-p", str(prompt), "--no-compile", "--dtype", "float32", "-n", "4", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["settings"]["compile"] == "off" and out["stats"]["steps_ran"] == "eager"


def test_fafo_compile_builds_what_each_method_runs_in(compiled_cache, compiled_engine, tiny, capsys):
    code = entrypoint(["compile", str(tiny), "--methods", "vanilla,prompt-lookup", "--lookup-tokens", "5", "--dtype",
                       "float32"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0 and [line.split(" rows")[0] for line in out] == ["vanilla: compiled steps of 1",
                                                                      "prompt-lookup: compiled steps of 6"]
    assert {1, 6} <= {int(p.stem.removeprefix("rows")) for p in compiled_engine.compiled.folder.glob("*.pt2")}
    assert entrypoint(["compile", str(tiny), "--no-compile"]) == 1
    assert "contradicts" in capsys.readouterr().err


def test_a_decoders_package_is_loaded_before_its_first_token(compiled_cache, compiled_engine, tiny):
    compiled_engine.complete(SHORT, max_tokens=4, method="prompt-lookup", lookup_tokens=5)  # built: now only loads
    engine = load(str(tiny), dtype="float32", chat_template=False, compile="on", notify=lambda _: None)
    first = next(engine.stream(SHORT, max_tokens=8, method="prompt-lookup", lookup_tokens=5))
    assert first.stats.steps == 1 and engine.compiled.built() == [6]  # loaded during the prefill, not step 2


def test_view_mask_is_the_compressors_selection(tiny):
    """The compiled step's C(kv) mask marks exactly the positions the eager split attention copies."""
    from fafo_cli.decoders.fafo.compressors.stream import StreamCompressor

    engine = load(str(tiny), dtype="float32", chat_template=False, compile="off")
    session = engine.session
    session.prefill(engine.encode(LONG), reserve=16)
    compressor = StreamCompressor(budget=40, sink=4, tail_rows=8)
    compressor.rebuild(session.cache)
    mask = compressor.view_mask(session.cache)
    assert mask.shape == (session.cache.length, len(engine.model.layers))
    for layer in range(mask.shape[1]):
        assert torch.nonzero(mask[:, layer]).flatten().tolist() == compressor.selected_positions(session.cache, layer)


@pytest.mark.parametrize("ours", [True, False])
def test_graph_attention_is_ours_where_its_vectors_fit(compiled_cache, tiny, monkeypatch, ours):
    """What a package traces, run eagerly: where the CPU has AVX2 or AVX-512 our kernel, elsewhere torch's (folded
    over the KV heads), both the eager step's logits up to rounding, window rows (C(kv) only) included."""
    from fafo_cli.compiled import build
    from fafo_cli.compiled.kernels import loader

    loader.load(compiled_cache / "compiled")
    monkeypatch.setattr(loader, "attends", lambda: ours)
    engine = load(str(tiny), dtype="float32", chat_template=False, compile="off")
    model, rows, context = engine.model, 5, 40
    assert build.uses_kernel(model) is ours and build.stored_dtype(model) == torch.float32
    cache = model.new_cache(context + rows, context + rows)
    gen = torch.Generator().manual_seed(0)
    for part in (cache.keys, cache.values):
        part.copy_(torch.randn(part.shape, generator=gen))
    cache.commit(context)
    ids, positions = torch.tensor([5, 17, 3, 9, 11]), torch.arange(context, context + rows)
    local = torch.ones(rows, rows, dtype=torch.bool).tril()
    sees_cache = torch.tensor([True, True, True, False, False])  # the last two: window rows
    view = torch.rand(context, len(model.layers), generator=gen) < 0.5
    traced = build._Step(model)(ids, positions, local, sees_cache, ~sees_cache, view,
                                list(cache.keys.unbind(0)), list(cache.values.unbind(0)))

    def attend(layer, q, k, v):  # every row its own mask: the cache (or the layer's C(kv)), then the step's rows
        prefix = sees_cache[:, None] | (~sees_cache[:, None] & view[:, layer][None, :])
        mask = torch.cat([prefix, local], dim=1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=model.scaling,
                                                                enable_gqa=True)

    eager = model.forward(ids, positions, cache, attend)
    torch.testing.assert_close(traced.float(), eager, atol=1e-4, rtol=1e-4)


def test_rope_table_is_what_eager_steps_compute(tiny):
    """The packages' table of rotary factors holds, for any rows, exactly what an eager step computes for them."""
    from fafo_cli.compiled.build import rope_table

    engine = load(str(tiny), dtype="bfloat16", chat_template=False, compile="off")
    model = engine.model
    cos, sin = rope_table(model)
    assert cos.shape == (model.max_context, 1, model.head_dim) and cos.dtype == torch.bfloat16
    generator = torch.Generator().manual_seed(0)
    for rows in (1, 6, 9):
        for _ in range(20):
            positions = torch.randint(0, model.max_context - rows, (1,), generator=generator) + torch.arange(rows)
            step_cos, step_sin = model.rotation(positions)
            assert torch.equal(cos[positions], step_cos) and torch.equal(sin[positions], step_sin)


def test_bench_runs_eager_and_compiled_side_by_side(compiled_cache, compiled_engine, tiny, tmp_path, capsys):
    for method in ("vanilla", "fafo"):  # built: the bench only loads (its FAFO: W=1, sizes 1, 3 and 6)
        compiled_engine.complete(SHORT, max_tokens=8, method=method, draft_tokens=3)
    out, config = tmp_path / "bench.json", tmp_path / "config.yaml"
    config.write_text("draft_tokens: 3\n")
    code = entrypoint(["bench", str(tiny), "--config", str(config), "--compile", "--dtype", "float32",
                       "--methods", "vanilla,fafo",
                       "--suites", "chat", "--samples", "1", "--repeats", "1", "--warmup", "0", "--tokens", "24",
                       "--no-external", "--json", str(out)])
    capsys.readouterr()
    records = {r["row"]: r for r in json.loads(out.read_text())}
    assert code == 0
    assert set(records) == {"vanilla", "vanilla+compiled", "fafo", "fafo+compiled"}
    assert all(r["exact"] == "1/1" and r["step_ms"] > 0 for r in records.values())


@pytest.mark.compiled
def test_a_full_disk_after_the_build_is_one_notice(tiny, tmp_path, monkeypatch, compiled_folder, compiled_engine):
    """The build succeeds (the session's package, copied into an empty cache, stands in for it) and writing its
    timing record fails: one notice, and the steps run eager."""
    import shutil

    from fafo_cli.api import Engine
    from fafo_cli.compiled.timing import Timing

    def no_space(self, path):
        raise OSError(28, "No space left on device")

    compiled_engine.complete(SHORT, max_tokens=4, method="vanilla")  # its 1-row package built or loaded
    shutil.copytree(compiled_folder / "compiled", tmp_path / "compiled", symlinks=True)
    for record in (tmp_path / "compiled").rglob("rows*.json"):
        record.unlink()  # a package without its record is built again
    monkeypatch.setattr(Engine, "build_elsewhere", lambda self, rows, package: None)
    monkeypatch.setattr(Timing, "write", no_space)
    monkeypatch.setenv("FAFO_CACHE", str(tmp_path))
    notices: list[str] = []
    engine = load(str(tiny), dtype="float32", chat_template=False, compile="on", notify=notices.append)
    result = engine.complete(SHORT, max_tokens=TOKENS, method="vanilla")
    assert result.token_ids == hf_greedy(tiny, engine.encode(SHORT), TOKENS)
    assert engine.compiled.calls == 0  # eager
    assert [n for n in notices if n.startswith("compilation failed")] == [
        "compilation failed, running eager: OSError: [Errno 28] No space left on device"]


@pytest.mark.parametrize("rows, slots, heads, kv_heads, dim, any_sees_all", [
    (1, 5, 4, 2, 16, True), (3, 130, 4, 4, 32, True), (13, 300, 9, 3, 64, True), (13, 300, 9, 3, 64, False),
    (40, 129, 8, 1, 16, True)])
def test_attention_kernel_matches_torch(compiled_cache, vector_attend, narrow_attend, rows, slots, heads, kv_heads,
                                        dim, any_sees_all):
    """Our CPU attention kernel against torch's, on GQA groups, ragged chunks, rows that see every cached slot,
    rows that see a StreamingLLM view (sink and recent: their middle chunks skipped while other rows' are
    not), rows that see only the step's own rows (padding), chunks no row sees, with keys, values and the
    visible positions as views into larger tensors (a layer's column of the per-layer selection); float32 and
    bfloat16, the latter also built without its AMX path (as CPUs without AMX run it); and the 8-float build."""
    from fafo_cli.compiled.kernels import loader

    loader.load(compiled_cache / "compiled")
    gen = torch.Generator().manual_seed(rows)
    q = torch.randn(rows, heads, dim, generator=gen)
    k, v = (torch.randn(slots + 7, kv_heads, dim, generator=gen)[:slots] for _ in range(2))
    cached = slots - rows
    sees_all = (torch.arange(rows) % 3 == 0) & any_sees_all
    sees_part = torch.arange(rows) % 3 == 1
    visible = torch.zeros(cached, 3, dtype=torch.bool)[:, 1]
    visible[:4] = visible[-20:] = True
    local = torch.rand(rows, rows, generator=gen) < 0.5
    local.fill_diagonal_(True)
    mask = torch.cat([sees_all[:, None] | (sees_part[:, None] & visible), local], dim=1)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, scale=0.3,
        enable_gqa=True)[0].transpose(0, 1)
    for attend in _builds(torch.ops.fafo.attend, narrow_attend):
        torch.testing.assert_close(attend(q, k, v, sees_all, sees_part, visible, local, 0.3), expected, atol=2e-6,
                                   rtol=1e-5)
    # a bf16 model's step: bf16 queries and a compact (bf16) cache, against the same values in float64. Where the
    # kernel multiplies bf16 pairs (AMX tiles, or AVX512-BF16's pair dot products when dim is a multiple of 32), the
    # value sum takes the probabilities rounded to bf16 (as a bf16 attention does), elsewhere as they are
    q16, k16, v16 = q.bfloat16(), k.bfloat16(), v.bfloat16()
    exact, rounded = (_attention_reference(q16, k16, v16, mask, 0.3, rounding) for rounding in (False, True))
    by_pairs = torch.ops.fafo.packed_kernel() != "plain" and dim % 32 == 0  # the kernels are built alike (-march=native)
    for attend in _builds(torch.ops.fafo.attend, vector_attend, narrow_attend):  # with AMX where the CPU has it, ...
        compact = attend(q16, k16, v16, sees_all, sees_part, visible, local, 0.3)
        assert compact.dtype == torch.float32
        pairs = by_pairs and attend is not narrow_attend  # (the 8-float build widens bf16: no pair products)
        apart = (compact.double() - (rounded if pairs else exact)).abs().max().item()
        assert apart < 5e-5, apart


@pytest.fixture(scope="module")
def vector_attend(compiled_folder, tmp_path_factory):
    """fafo::attend without its AMX path, as CPUs without AMX run it: on such a CPU ours (built for it, it has no
    other path), elsewhere built with FAFO_NO_AMX under its own op namespace."""
    from fafo_cli.compiled.kernels import loader

    if "amx_tile" not in loader.cpu_flags().split():
        loader.load(compiled_folder / "compiled")
        return torch.ops.fafo.attend
    return loader.load_as(loader.SOURCES[0].read_text(), "fafo_vector", tmp_path_factory.mktemp("vector-attend"),
                          "#define FAFO_NO_AMX 1\n").attend


@pytest.fixture(scope="module")
def narrow_attend(compiled_folder, tmp_path_factory):
    """fafo::attend in 8-float vectors, as CPUs with AVX2 and not AVX-512 run it: on such a CPU ours, on an AVX-512
    one built with FAFO_VECTOR8 under its own op namespace; None without AVX2."""
    from fafo_cli.compiled.kernels import loader

    flags = loader.cpu_flags().split()
    if "avx2" not in flags:
        return None
    if "avx512f" not in flags:
        loader.load(compiled_folder / "compiled")
        return torch.ops.fafo.attend
    return loader.load_as(loader.SOURCES[0].read_text(), "fafo_narrow", tmp_path_factory.mktemp("narrow-attend"),
                          "#define FAFO_VECTOR8 1\n#define FAFO_NO_AMX 1\n").attend


def _builds(*ops) -> list:
    """The distinct kernel builds among `ops` (None: not on this CPU)."""
    return list(dict.fromkeys(op for op in ops if op is not None))


def _attention_reference(q, k, v, mask, scale, round_probabilities, chunk=64):
    """Masked GQA attention in float64 ([rows, heads, dim]), summed per `chunk` cached slots as the kernel does
    (flash decoding); with `round_probabilities`, each chunk's value sum takes its probabilities, relative to the
    chunk's own maximum, rounded to bf16, while the normaliser takes them as they are."""
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = (torch.einsum("rhd,shd->hrs", q, k) * scale).masked_fill(~mask, float("-inf"))
    parts = []
    for start in range(0, scores.shape[-1], chunk):
        part = scores[..., start:start + chunk]
        top = part.amax(-1, keepdim=True).clamp(min=-1e300)  # a chunk a row sees nothing of adds nothing
        probs = torch.exp(part - top)
        weights = probs.float().bfloat16().double() if round_probabilities else probs
        parts.append((top, torch.einsum("hrs,shd->hrd", weights, v[start:start + chunk]), probs.sum(-1, keepdim=True)))
    top = torch.stack([t for t, _, _ in parts]).amax(0)
    total = sum(sums * torch.exp(t - top) for t, _, sums in parts)
    out = sum(values * torch.exp(t - top) for t, values, _ in parts)
    return (out / total).transpose(0, 1)


def test_attention_kernel_refuses_values_that_do_not_fit_the_keys(compiled_cache):
    """A value head size or slot count other than the keys' was read past its end (the loops follow the keys)."""
    from fafo_cli.compiled.kernels import loader

    loader.load(compiled_cache / "compiled")
    q, k = torch.randn(1, 4, 16), torch.randn(5, 2, 16)
    visibility = (torch.ones(1, dtype=torch.bool), torch.zeros(1, dtype=torch.bool), torch.ones(4, dtype=torch.bool),
                  torch.ones(1, 1, dtype=torch.bool))
    for v in (torch.randn(5, 2, 8), torch.randn(4, 2, 16), torch.randn(5, 1, 16)):
        with pytest.raises(RuntimeError, match="fafo::attend: the keys, values and queries do not fit"):
            torch.ops.fafo.attend(q, k, v, *visibility, 0.3)
    assert torch.ops.fafo.attend(q, k, k.clone(), *visibility, 0.3).shape == (1, 4, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [16, 64])  # bf16 scores by pairs of dimensions where dim allows, widened where not
def test_attention_kernel_rows_do_not_depend_on_each_other(compiled_cache, vector_attend, narrow_attend, dtype, dim):
    """What lossless decoding rests on: a row's result is bit for bit the same whatever rows follow it in the step
    (a verify row computes exactly what a plain step computes for that token)."""
    from fafo_cli.compiled.kernels import loader

    loader.load(compiled_cache / "compiled")
    gen = torch.Generator().manual_seed(dim)
    rows, cached, heads, kv_heads = 13, 290, 9, 3
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    k, v = (torch.randn(cached + rows, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    sees_all = torch.arange(rows) % 3 == 0
    sees_part = ~sees_all
    visible = torch.rand(cached, generator=gen) < 0.3
    local = torch.ones(rows, rows, dtype=torch.bool).tril()
    for attend in _builds(torch.ops.fafo.attend, vector_attend, narrow_attend):  # with AMX where the CPU has it, ...
        whole = attend(q, k, v, sees_all, sees_part, visible, local, 0.125)
        for first in (1, 4, 9):
            alone = attend(q[:first], k[:cached + first], v[:cached + first], sees_all[:first], sees_part[:first],
                           visible, local[:first, :first], 0.125)
            assert torch.equal(alone, whole[:first])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cached", [60, 290])  # the step's rows across a chunk boundary (64 slots), and within one
def test_a_draft_trees_rows_compute_what_plain_steps_along_their_branch_would(compiled_cache, vector_attend,
                                                                               narrow_attend, dtype, cached):
    """A tree's row that sees ancestors which are not the step's first rows gives, bit for bit, what a plain step
    after its branch gives: each row reads its ancestors at the slots plain decoding has them (the AMX path, where
    a CPU has it, reads them in place and is not asked this)."""
    from fafo_cli.compiled.kernels import loader

    loader.load(compiled_cache / "compiled")
    gen = torch.Generator().manual_seed(cached)
    parents = [-1, 0, 1, 2, 0, 4, 2, 6]  # the anchor, a chain of three, a branch at depth 1, one at depth 3
    rows, heads, kv_heads, dim = len(parents), 9, 3, 64
    branch = [[r] for r in range(rows)]
    for r in range(rows):
        while parents[branch[r][0]] >= 0:
            branch[r].insert(0, parents[branch[r][0]])
    local = torch.zeros(rows, rows, dtype=torch.bool)
    for r, seen in enumerate(branch):
        local[r, seen] = True
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    k, v = (torch.randn(cached + rows, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    every, nothing = torch.ones(rows, dtype=torch.bool), torch.zeros(rows, dtype=torch.bool)
    ours = (torch.ops.fafo.attend,) if dtype == torch.float32 else ()  # (bf16: its AMX path is not asked this)
    for attend in _builds(vector_attend, narrow_attend, *ours):
        tree = attend(q, k, v, every, nothing, nothing[:1].expand(cached), local, 0.125)
        for r, seen in enumerate(branch):
            slots = torch.cat([torch.arange(cached), cached + torch.tensor(seen)])
            plain = attend(q[r:r + 1], k[slots], v[slots], every[:1], nothing[:1], nothing[:1].expand(len(slots) - 1),
                           every[:1, None], 0.125)
            assert torch.equal(plain[0], tree[r]), (r, seen)


def test_bfloat16_package_matches_eager(compiled_cache, tiny):
    """A bf16 package (our bf16 GEMM kernel where the CPU has AVX512-BF16) is as close to the float32 model's logits
    as eager bf16 steps are, and its steps run compiled, reading the cache in bf16 (prompt lookup's 1 + 95 rows: one
    build, of a size beyond the rows and cache the build's example holds by default)."""
    from fafo_cli.compiled.build import stored_dtype
    from fafo_cli.runtime.model import causal_attention, prefix_causal_mask

    notices: list[str] = []
    engine = load(str(tiny), dtype="bfloat16", chat_template=False, compile="on", notify=notices.append)
    model, rows, context = engine.model, 96, 40
    runner = engine.compiled.runner(rows)
    assert runner is not None, notices
    cache = model.new_cache(context + rows, context + rows)
    gen = torch.Generator().manual_seed(0)
    for part in (cache.keys, cache.values):  # values a bf16 model's keys and values can take
        part.copy_(torch.randn(part.shape, generator=gen).bfloat16())
    cache.commit(context)
    ids = torch.randint(model.vocab_size, (rows,), generator=gen)
    positions = torch.arange(context, context + rows)
    mask = prefix_causal_mask(context, rows, model.device)
    truth_model = load(str(tiny), dtype="float32", chat_template=False).model
    truth_cache = truth_model.new_cache(context + rows, context + rows)
    truth_cache.keys.copy_(cache.keys), truth_cache.values.copy_(cache.values), truth_cache.commit(context)
    truth = truth_model.forward(ids, positions, truth_cache, causal_attention(mask, truth_model.scaling))
    eager = model.forward(ids, positions, cache, causal_attention(mask, model.scaling)).float()
    cache.store_as(stored_dtype(model))  # what the package was traced with (bf16 where our kernel reads it)
    compiled = runner(ids, positions, mask[:, context:].contiguous(), torch.ones(rows, dtype=torch.bool),
                      torch.zeros(rows, dtype=torch.bool), torch.ones(context, len(model.layers), dtype=torch.bool),
                      list(cache.keys.unbind(0)), list(cache.values.unbind(0))).float()
    # (the two bf16 paths round differently: 96 rows apart by up to 0.13 where each is 0.3 from float32's logits)
    eager_error, compiled_error = (eager - truth).abs(), (compiled - truth).abs()
    assert compiled_error.max() <= 1.25 * eager_error.max() and compiled_error.mean() <= 1.1 * eager_error.mean()
    result = engine.complete(SHORT, max_tokens=12, method="prompt-lookup", lookup_tokens=rows - 1)
    assert len(result.token_ids) == 12 and not [n for n in notices if "running eager" in n]
    assert set(engine.compiled.calls_by_size) == {rows}
    assert engine.session.cache.keys.dtype == stored_dtype(model)  # compact while compiled steps serve


@pytest.mark.compiled
def test_our_bf16_gemm_kernel_packs_a_product_of_activations_itself():
    """A product of two activations (attention where our attention kernel does not serve, a head size not in whole
    vectors) comes unpacked: inductor asks the micro-kernel to pack B itself, which ours did not (wrong products,
    and the autotuner chose it for its speed)."""
    from torch._inductor.utils import run_and_get_code

    from fafo_cli.compiled.kernels import bf16_gemm, loader

    if "avx512_bf16" not in loader.cpu_flags().split() or "amx_bf16" in loader.cpu_flags().split():
        pytest.skip("our bf16 GEMM kernel serves CPUs with AVX512-BF16 and without AMX")
    assert bf16_gemm.register()
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 37, 64, generator=gen).bfloat16(), torch.randn(3, 64, 96, generator=gen).bfloat16()
    product = torch.compile(lambda a, b: torch.bmm(a, b).float(), options={
        "max_autotune": True, "max_autotune_gemm_backends": "CPP", "autotune_num_choices_displayed": 0,
        "fx_graph_cache": False, "autotune_local_cache": False})  # (a cached graph: not the kernel as it is now)
    out, code = run_and_get_code(product, a, b)
    assert any("_mm512_dpbf16_ps" in part for part in code)  # ours, not inductor's fp32 kernel
    torch.testing.assert_close(out, torch.bmm(a.float(), b.float()), rtol=1e-5, atol=1e-4)


COMPACT_READERS = {
    "vanilla": dict(method="vanilla"),
    **{f"fafo-{name}": dict(method="fafo", compressor=name, budget=48, sink=4, window=8, recent=16, page_size=8,
                            refresh=8) for name in ("stream", "quest", "snapkv", "h2o")},
    **PEERS,
}


@pytest.mark.parametrize("attention", ["torch", "ours"])
def test_eager_work_reads_a_compact_cache_exactly(tiny, compiled_folder, monkeypatch, attention):
    """Compiled steps keep a bf16 model's CPU cache in bf16. What runs eager on such a cache (the next request's
    prefill, the compressors' observations and selection) stores it in eager attention's dtype again (once,
    instead of converting it per layer per step: fp32 for torch's kernel, bf16 where our kernel reads it), and
    every method gives the same tokens as from a cache that was never compact."""
    from fafo_cli.compiled.kernels import loader
    from fafo_cli.runtime import model

    loader.load(compiled_folder / "compiled")
    if attention == "torch":
        monkeypatch.setattr(model, "_cpu_attention", None)
        monkeypatch.setattr(model, "_cpu_attention_reads_bf16", False)
    engine = load(str(tiny), dtype="bfloat16", chat_template=False, compile="off")
    cache = engine.session.cache
    expected = torch.float32 if attention == "torch" or not model._cpu_attention_reads_bf16 else torch.bfloat16
    assert engine.model.attention_dtype == expected
    other = torch.bfloat16 if engine.model.attention_dtype == torch.float32 else torch.float32
    for name, settings in COMPACT_READERS.items():
        answers = []
        for compact in (False, True):
            engine.reset()
            cache.store_as(engine.model.attention_dtype)
            first = engine.complete(LONG, max_tokens=24, **settings)
            if compact:  # the conversation's cache as compiled steps leave it, then a turn that reuses it
                cache.store_as(other)
                assert cache.length > len(engine.encode(LONG)) and cache.keys.dtype == other
            second = engine.complete(LONG + first.text + " Then?", max_tokens=16, **settings)
            assert second.stats.cached_prompt_tokens >= len(engine.encode(LONG)), name  # (read from it)
            answers.append((first.token_ids, second.token_ids))
        assert answers[0] == answers[1], name
        assert cache.keys.dtype == cache.read_dtype == engine.model.attention_dtype, name


def test_kernel_build_failure_is_one_line(tmp_path, monkeypatch):
    """No C++ compiler for our kernels: a one-line error (callers then run eager), and no partial library."""
    from fafo_cli.compiled.kernels import loader

    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(loader.BuildError, match=r"^cannot run /nonexistent/c\+\+: [^\n]+$"):
        loader.compile_library(tmp_path / "ops.so")
    assert not list(tmp_path.iterdir())


def test_a_mac_without_its_command_line_tools_never_runs_the_compiler_stub(tmp_path, monkeypatch):
    """macOS's /usr/bin/g++ without the Command Line Tools opens a dialog asking to install them: every start
    asked the compiler for its macros (a steps folder is named by the toolchain). xcode-select says first."""
    import subprocess
    import sys

    from fafo_cli.compiled.kernels import loader

    ran = []
    run = subprocess.run

    def fake(command, **kwargs):
        ran.append(command[0])
        if command[0] == "xcode-select":
            return subprocess.CompletedProcess(command, 2, b"", b"error: no developer tools were found")
        return run(command, **kwargs)

    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(subprocess, "run", fake)
    caches = (loader.developer_tools, loader._macros)
    for cache in caches:
        cache.cache_clear()
    try:
        assert loader._macros(("g++",), ()) is None and loader.compiler_path() is None
        with pytest.raises(loader.BuildError, match=r"Command Line Tools are not installed \(xcode-select --install\)"):
            loader.compile_library(tmp_path / "ops.so")
        assert ran == ["xcode-select"] and not list(tmp_path.iterdir())
    finally:
        for cache in caches:
            cache.cache_clear()


@pytest.mark.parametrize("with_bias", [False, True])
def test_matrices_that_read_one_input_share_one_call(compiled_cache, with_bias):
    """A layer's q, k and v (gate and up) are stacked into one packed matrix: each part gives bit for bit what its
    matrix gives alone, and parts called with the same input make one kernel call in the traced graph. Parts
    that would leave padding rows between them, or mix bias and none, are not stacked."""
    from fafo_cli.compiled.kernels import loader
    from fafo_cli.compiled import packed

    from .test_packed import random_matrix

    loader.load(compiled_cache / "compiled")

    def part(out_features: int, seed: int, bias: bool = with_bias, dtype=torch.bfloat16) -> packed.PackedLinear:
        weight = packed.tiled(packed.entries(random_matrix("Q4_1", out_features, 192, seed, edges=False)))
        return packed.PackedLinear(weight, out_features, torch.randn(out_features) if bias else None, dtype)

    alone = [part(48, 1), part(32, 2), part(16, 3)]
    fused = packed.FusedPackedLinear.stacked(alone)
    parts = [fused.part(i) for i in range(3)]

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.parts = torch.nn.ModuleList(parts)

        def forward(self, x):
            return [p(x) for p in self.parts]

    x = torch.randn(1, 6, 192).bfloat16()
    for separate, stacked in zip(alone, Layer()(x)):
        assert torch.equal(separate(x), stacked)
    assert fused._latest is None  # every part took its output: none is held until the next call
    assert torch.equal(parts[1](x), alone[1](x)) and fused._latest is not None  # a part alone: its own call
    fused.forget()
    graph = torch.export.export(Layer(), (x,), strict=False).graph
    calls = [n for n in graph.nodes if n.target is torch.ops.fafo.packed_linear.default]
    assert len(calls) == 1
    assert packed.FusedPackedLinear.fits(alone)
    assert not packed.FusedPackedLinear.fits([part(48, 1), part(37, 4)])
    assert not packed.FusedPackedLinear.fits([part(48, 1), part(32, 2, bias=not with_bias)])
    assert not packed.FusedPackedLinear.fits([part(48, 1), None])
    assert not packed.FusedPackedLinear.fits([part(48, 1), part(32, 2, dtype=torch.float32)])


def test_kernels_are_named_by_the_instruction_sets_the_compiler_enables(monkeypatch):
    """Our kernels' and the packages' version follows what -march=native enables, not /proc/cpuinfo's whole line:
    a kernel update or a VM moved to another host changes its other flags, which orphaned every package."""
    import shutil

    from fafo_cli.compiled.kernels import loader

    if shutil.which(loader.compiler()) is None:
        pytest.skip("no C++ compiler here")

    flags, before = loader.cpu_flags(), loader.version()
    try:
        loader.cpu_features.cache_clear()
        monkeypatch.setattr(loader, "cpu_flags", lambda: flags + " hypervisor nonstop_tsc_moved")
        features = loader.cpu_features().split()[1:]  # (after the vector level)
        assert loader.version() == before and "hypervisor" not in features
        # what -march=native adds (on x86 SSE3 at least, on Arm its __ARM_FEATURE_ macros), not what every build has,
        # nor the CPU model's name (__znver4__: another model of the same instruction sets runs the same code)
        assert features and all(re.match(r"__[A-Z]", name) for name in features) and "__STDC__" not in features
        # where the compiler cannot say: the CPU's instruction-set flags, still not the others
        monkeypatch.setattr(loader, "compiler_command", lambda: ["no-such-compiler-here"])
        loader.cpu_features.cache_clear()
        fallback = loader.cpu_features().split()
        assert "hypervisor" not in fallback and {"sse2", "asimd"} & set(fallback)
    finally:
        monkeypatch.undo()
        loader.cpu_features.cache_clear()


def test_our_kernels_are_named_by_the_toolchain_they_are_built_with(monkeypatch):
    """A cache shared by machines (a home folder on a network) whose compilers, C libraries or torch builds differ
    keeps a library for each: one built by a newer compiler's C++ runtime does not load on the other machine."""
    import platform

    from fafo_cli.compiled.kernels import loader

    before = loader.version()
    other_libc = (platform, "libc_ver", lambda *a, **k: ("glibc", "2.17"))
    other_compiler = (loader, "_macros", lambda command, flags: frozenset(['#define __VERSION__ "99.1.0"']))
    try:
        for where, name, value in (other_libc, other_compiler):
            with monkeypatch.context() as other:
                other.setattr(where, name, value)
                loader.toolchain.cache_clear()
                assert loader.version() != before, name
            loader.toolchain.cache_clear()
            assert loader.version() == before
    finally:
        loader.toolchain.cache_clear()


def test_gpu_packages_are_named_by_the_gpu_they_hold_kernels_for(monkeypatch):
    """A package compiled on a GPU holds kernels for its compute capability: a cache shared by an H100's and an
    A100's machine keeps one set for each."""
    from types import SimpleNamespace

    from fafo_cli.compiled.build import identity

    config = SimpleNamespace(to_json_string=lambda: '{"hidden_size": 64}')

    def on(capability):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        return identity(SimpleNamespace(config=config, dtype=torch.bfloat16, device=torch.device("cuda", 0)), "m")

    cpu = identity(SimpleNamespace(config=config, dtype=torch.bfloat16, device=torch.device("cpu")), "m")
    assert len({on((9, 0)), on((8, 0)), cpu}) == 3 and on((9, 0)) == on((9, 0))


def test_packages_are_named_by_the_code_they_are_traced_from(monkeypatch, tmp_path):
    """A change to the Python a step is traced from (our layers, the step's wrapper) or to transformers' version
    names other packages: an upgrade never loads a graph of the old code, bumped GRAPH_VERSION or not."""
    from importlib import metadata
    from types import SimpleNamespace

    from fafo_cli.compiled import build

    model = SimpleNamespace(config=SimpleNamespace(to_json_string=lambda: "{}"), dtype=torch.float32,
                            device=torch.device("cpu"))
    source = tmp_path / "llama.py"
    source.write_text("x = 1\n")
    sources = build.TRACED_SOURCES
    assert all(path.is_file() for path in sources)  # (a file renamed away would fail every start)
    monkeypatch.setattr(build, "TRACED_SOURCES", (source,))

    def named() -> str:
        build.traced_code.cache_clear()
        return build.identity(model, "m")

    first = named()
    assert named() == first
    source.write_text("x = 2\n")
    assert named() != first
    version = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "9.9" if name == "transformers" else version(name))
    source.write_text("x = 1\n")
    assert named() != first
    monkeypatch.setattr(metadata, "version", version)
    monkeypatch.setattr(build, "TRACED_SOURCES", sources)
    build.traced_code.cache_clear()  # (this process's other tests name their packages as before)


def test_a_building_process_stops_when_the_asking_one_is_gone(tmp_path):
    """The asking process killed (the out-of-memory killer, SIGKILL): its lock on the package is gone, so its
    building process stops too rather than build beside the next one that asks."""
    import os
    import subprocess
    import sys
    import time

    watching = tmp_path / "watching"  # the building process is up and watching: then its parent goes
    child = ("import os, sys, time; from fafo_cli.build_process import exit_with_parent; "
             f"exit_with_parent(int(sys.argv[1]), 0.05); open({str(watching)!r}, 'w').close(); time.sleep(60)")
    parent = (f"import os, subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {child!r}, "
              "str(os.getpid())], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(p.pid, flush=True); "
              f"deadline = time.monotonic() + 30\nwhile not os.path.exists({str(watching)!r}) and "
              "time.monotonic() < deadline: time.sleep(0.05)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    pid = int(subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, env=env,
                             timeout=60).stdout)

    def running() -> bool:
        try:
            state = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return False
        return "State:\tZ" not in state  # (a zombie has ended: whoever adopted it reaps it)

    deadline = time.monotonic() + 20
    while running() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert watching.exists() and not running()
