"""`fafo doctor`: the machine's facts, FAFO's float32 exactness, the pass cost, the recommended settings (written as
`bench --tune` writes them), and the GPU report (a tiny shape on a CPU here; the 7B shape needs CUDA)."""

from __future__ import annotations

import json

import pytest
import torch

from fafo_cli.bench import tune
from fafo_cli.cli import entrypoint

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """A config file of its own and a throwaway fafo cache: the measured cost curve goes there, not to the user's."""
    from fafo_cli import config as config_mod

    monkeypatch.setenv("FAFO_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "config.yaml"
    path.write_text("# my settings\nmax_tokens: 100\n", encoding="utf-8")
    config_mod.load_file(path)
    return path


def test_doctor_json_reports_machine_exactness_costs_and_advice(tiny, isolated, capsys):
    code = entrypoint(["doctor", str(tiny), "--dtype", "float32", "--json", "--config", str(isolated)])
    out = capsys.readouterr().out
    assert code == 0
    report = json.loads(out)
    machine = report["machine"]
    assert machine["device"] == "cpu" and machine["dtype"] == "float32"
    assert machine["cuda"]["available"] == torch.cuda.is_available()
    assert isinstance(machine["avx512_bf16"], bool) and isinstance(machine["amx"], bool)
    checks = report["exactness"]
    assert len(checks) in (2, 4) and all(check["equal"] and check["tokens"] == 64 for check in checks)
    # each prompt as configured (no window on a CPU unless a compressor is named) and with the window every step
    assert [(check["fafo"], check["streams"]) for check in checks[:2]] == [
        ("as configured", 0), ("window on every step (W=2, stream)", 2)]
    assert sorted(map(int, report["step_ms"])) == list(tune.ROWS)  # as --tune measures them on a CPU
    assert all(ms > 0 for ms in report["step_ms"].values())
    # a window's width eager: never below the CPU's W=2; none runs here unless a compressor is named
    assert 2 <= report["recommended"]["streams"] <= 32 and report["recommended"]["window"] is False
    assert report["recommended"]["why"].startswith(("the widest window whose step costs at most 25% more",
                                                     "the least an eager window runs"))  # (dense eager steps here)
    assert "written" not in report and isolated.read_text() == "# my settings\nmax_tokens: 100\n"


def test_doctor_says_when_no_check_prompt_fits(tiny, isolated, capsys, monkeypatch):
    from fafo_cli.bench import doctor

    monkeypatch.setattr(doctor, "prompts", lambda engine: [])  # (a model whose context holds neither prompt)
    code = entrypoint(["doctor", str(tiny), "--dtype", "float32", "--config", str(isolated)])
    out = capsys.readouterr().out
    assert code == 0 and "float32 exactness: not checked: neither check prompt fits this model's context" in out


def test_the_advice_names_the_rule_that_chose_the_width(tiny, monkeypatch):
    """Over packed blocks (or compiled) a CPU runs one stream, whatever the curve; that is the reason given, even
    where the widest window by the curve is one stream too."""
    from fafo_cli import load
    from fafo_cli.bench.doctor import recommend

    engine = load(str(tiny), dtype="float32", compile="off")
    steep = {rows: float(rows) for rows in tune.ROWS}  # each row costs a plain step: the widest window is one stream
    monkeypatch.setattr(engine.model, "packed_matrices", 7)
    packed = recommend(engine, engine.config, steep)
    assert packed["streams"] == 1 and packed["why"].startswith("one stream where a CPU's steps run compiled or over")
    monkeypatch.setattr(engine.model, "packed_matrices", 0)
    dense = recommend(engine, engine.config, steep)
    assert dense["streams"] == 2 and dense["why"].startswith("the least an eager window runs")


@pytest.mark.kept_costs
def test_doctor_write_keeps_the_curve_that_streams_auto_reads(tiny, isolated, capsys):
    from fafo_cli import config as config_mod, load
    from fafo_cli.compiled.timing import read_step_costs

    code = entrypoint(["doctor", str(tiny), "--dtype", "float32", "--write", "--config", str(isolated)])
    out = capsys.readouterr().out
    assert code == 0 and "Wrote the cost curve" in out  # no window on a CPU, none named: streams stays auto
    assert config_mod.load_file(isolated).streams == "auto"
    code = entrypoint(["doctor", str(tiny), "--dtype", "float32", "--write", "--config", str(isolated), "--json"])
    assert code == 0 and set(json.loads(capsys.readouterr().out)["written"]) == {"step_costs"}  # no config written
    isolated.write_text(isolated.read_text() + "compressor: stream\n")  # a window recommended: `auto` derives its
    before = isolated.read_text()  # width from the curve (a width written would hold for every model and device)
    code = entrypoint(["doctor", str(tiny), "--dtype", "float32", "--write", "--config", str(isolated), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["recommended"]["window"] and set(report["written"]) == {"step_costs"}
    assert isolated.read_text() == before
    engine = load(str(tiny), dtype="float32", compressor="stream")
    assert engine.complete("hi", max_tokens=2).stats.streams == report["recommended"]["streams"]
    folder = next((isolated.parent / "cache" / "compiled").glob("*/step-costs.json")).parent
    assert sorted(read_step_costs(folder)["eager"]) == list(tune.ROWS)
    isolated.write_text("max_tokens: 100\nstreams: 8\n")  # a width fixed: auto again
    code = entrypoint(["doctor", str(tiny), "--dtype", "float32", "--write", "--config", str(isolated)])
    out = capsys.readouterr().out
    assert code == 0 and f"Wrote streams=auto to {isolated}" in out.replace("\n", "")
    assert isolated.read_text() == "max_tokens: 100\nstreams: auto\n"
    isolated.write_text("streams: 0\n")  # no window: the user's choice, kept
    assert entrypoint(["doctor", str(tiny), "--dtype", "float32", "--write", "--config", str(isolated)]) == 0
    assert isolated.read_text() == "streams: 0\n"
    new = isolated.parent / "new.yaml"  # a --config file that does not exist yet: what it writes creates it
    code = entrypoint(["doctor", str(tiny), "--dtype", "float32", "--write", "--config", str(new)])
    assert code == 0 and new.is_file(), capsys.readouterr().err  # though no window is written on a CPU
    assert config_mod.load_file(new) == config_mod.Config()


def test_gpu_report_tiny_shape_on_this_device(tiny, isolated, tmp_path, capsys):
    target = tmp_path / "gpu.json"
    code = entrypoint(["doctor", str(tiny), "--dtype", "float32", "--config", str(isolated), "--gpu-report",
                       str(target), "--gpu-shape", "tiny"])
    out = capsys.readouterr().out
    assert code == 0 and "GPU report (tiny shape" in out
    report = json.loads(target.read_text())
    assert sorted(map(int, report["rows"])) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert report["dtype"] == "bfloat16" and report["bandwidth_gbs"] > 0 and report["bound_ms"] > 0
    one = report["rows"]["1"]
    assert one["vs_one_row"] == 1.0 and 0 < one["bound_share"]
    assert report["graphs"] == torch.cuda.is_available()
    paths = {"split", "block"} | ({"split_graph"} if torch.cuda.is_available() else set())
    assert set(report["fafo_64_rows_ms"]) == paths and all(report["fafo_64_rows_ms"].values())
    assert all(ratio > 0 for ratio in report["fafo_64_rows_vs_one_row"].values())


def test_a_failed_gpu_report_keeps_the_doctor_report(tiny, isolated, tmp_path, capsys, monkeypatch):
    """The GPU report runs last, after minutes of checks: where its steps run out of memory, the rest of the report
    is shown all the same, then one line, and nothing is written for it."""
    from fafo_cli.bench import gpu_report

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(gpu_report, "run", out_of_memory)
    target = tmp_path / "gpu.json"
    for extra in ([], ["--json"]):
        code = entrypoint(["doctor", str(tiny), "--dtype", "float32", "--config", str(isolated), "--gpu-report",
                           str(target), "--gpu-shape", "tiny", *extra])
        out, err = capsys.readouterr()
        assert code == 1 and not target.exists()
        assert err.strip().splitlines()[-1] == ("error: --gpu-report: the tiny-shaped model's steps ran out of this "
                                                "GPU's memory; nothing written")
        if extra:
            assert json.loads(out)["gpu_report"] == {"error": err.strip().splitlines()[-1][len("error: "):]}
        else:
            assert "float32 exactness" in out and "GPU report" not in out


def test_doctor_on_a_model_with_a_short_context(tmp_path, isolated, capsys):
    """Its pass costs are measured after as many cached tokens as fit with the most rows measured."""
    from .conftest import build_tiny_model

    short = build_tiny_model(tmp_path / "short", "llama-mha", max_positions=64)
    code = entrypoint(["doctor", str(short), "--dtype", "float32", "--json", "--config", str(isolated)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert sorted(map(int, json.loads(out)["step_ms"])) == list(tune.ROWS)


def test_gpu_report_7b_needs_cuda_and_a_writable_file(tiny, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the 7B report would run")
    assert entrypoint(["doctor", str(tiny), "--gpu-report", str(tmp_path / "r.json")]) == 1
    assert capsys.readouterr().err.strip() == ("error: --gpu-report's 7B-shaped model runs on a CUDA GPU only; the "
                                               "device here is cpu")
    assert entrypoint(["doctor", str(tiny), "--gpu-report", str(tmp_path)]) == 1
    assert "is a folder, not a file" in capsys.readouterr().err
    assert entrypoint(["doctor", str(tiny), "--gpu-report", str(tmp_path / "no" / "r.json")]) == 1
    assert "no such folder" in capsys.readouterr().err
    config = tmp_path / "c.yaml"
    config.write_text("dtype: float32\n")
    assert entrypoint(["doctor", str(tiny), "-c", str(config), "--gpu-report", str(config)]) == 1
    assert "--gpu-report " + str(config) + " is also an input (the config file)" in capsys.readouterr().err
    assert config.read_text() == "dtype: float32\n"
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    assert entrypoint(["doctor", str(model), "--gpu-report", str(model)]) == 1
    assert "--gpu-report " + str(model) + " is also an input (MODEL)" in capsys.readouterr().err
    assert model.read_bytes() == b"GGUF"
    assert entrypoint(["doctor", str(tiny), "--gpu-report", "r.json", "--gpu-shape", "13b"]) == 1
    assert capsys.readouterr().err.strip() == "error: --gpu-shape must be one of 7b, 8b, 135m, tiny (got '13b')"
    assert entrypoint(["doctor", str(tiny), "--gpu-report", "r.json", "--gpu-shape", "8b"]) == 1
    assert "--gpu-report's 8B-shaped model runs on a CUDA GPU only" in capsys.readouterr().err


def test_machine_facts_name_what_our_kernels_can_use():
    from fafo_cli.bench.doctor import machine

    facts = machine(torch.device("cpu"), torch.float32)
    assert facts["torch"] == torch.__version__ and facts["cpu_vector_level"]
    assert ("C++ compiler found" in facts["kernels"]) == (facts["compiler"] is not None)
    # compile: off keeps dense weights and none of our kernels, whatever the machine has
    off = machine(torch.device("cpu"), torch.float32, "off")["kernels"]
    assert off == "eager torch only: compile: off keeps dense weights and no kernels of ours"


def test_machine_facts_say_which_steps_read_packed_blocks(monkeypatch):
    """Which dtype's steps read a .gguf model's blocks here, and whether steps (eager and compiled) attend with our
    kernel, by the CPU's flags (a compiler present)."""
    from fafo_cli.bench.doctor import machine
    from fafo_cli.compiled.kernels import loader

    monkeypatch.setattr(loader, "compiler", lambda: "sh")  # a program every machine has
    for flags, dtype, blocks, ours in (("avx2 fma f16c", torch.float32, True, True),
                                       ("avx2 fma f16c", torch.bfloat16, False, True),
                                       ("avx2 fma f16c avx512f avx512bw avx512_bf16", torch.bfloat16, True, True),
                                       ("sse2", torch.float32, False, False),
                                       ("fp asimd bf16", torch.bfloat16, False, False)):  # an Arm CPU's
        monkeypatch.setattr(loader, "cpu_flags", lambda flags=flags: flags)
        kernels = machine(torch.device("cpu"), dtype)["kernels"]
        assert ("steps read its quantized blocks" in kernels) is blocks, (flags, dtype)
        assert ("attend with torch's kernel, eager and compiled (no AVX2)" in kernels) is not ours, (flags, dtype)
        # bf16 is native where `dtype: auto` picks it (AVX512-BF16, Arm's BF16)
        assert ("bf16 is emulated" in kernels) is (dtype == torch.bfloat16 and "bf16" not in flags), flags


@CUDA
def test_gpu_report_captures_cuda_graphs():
    from fafo_cli.bench import gpu_report

    report = gpu_report.run(torch.device("cuda"), "tiny", rows=(1, 8, 64), context=128)
    assert report["graphs"] and all(row["graph_ms"] > 0 for row in report["rows"].values())
    assert report["fafo_64_rows_ms"]["split_graph"] > 0


def test_doctor_checks_exactness_on_a_float32_copy_of_a_half_precision_model(tiny, isolated, capsys):
    code = entrypoint(["doctor", str(tiny), "--dtype", "bfloat16", "--json", "--config", str(isolated)])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["machine"]["dtype"] == "bfloat16"  # costs measured as configured
    assert report["exactness"] and all(check["equal"] for check in report["exactness"])  # in float32


def test_a_missing_model_is_one_line_before_any_progress(tmp_path, capsys):
    code = entrypoint(["doctor", str(tmp_path / "none.gguf")])
    err = capsys.readouterr().err
    assert code == 1 and err == f"error: no such model file or folder: {tmp_path / 'none.gguf'}\n", err


def test_gpu_report_keeps_its_figures_when_the_block_path_fails(monkeypatch):
    """flex attention is compiled at its first call: a failure there was a traceback and no report."""
    from fafo_cli.bench import gpu_report

    step = gpu_report.fafo_step

    def failing(model, context, path, graph=False):
        if path == "block":
            raise RuntimeError("inductor failed\\nmore")
        return step(model, context, path, graph=graph)

    monkeypatch.setattr(gpu_report, "fafo_step", failing)
    notices = []
    report = gpu_report.run(torch.device("cpu"), "tiny", rows=(1, 8), context=64, notify=notices.append)
    assert set(report["fafo_64_rows_ms"]) == {"split"} and len(notices) == 1 and "block path" in notices[0]


def test_a_compiler_that_cannot_build_our_kernels_is_said(tiny, monkeypatch):
    """A compiler on the PATH is not a working toolchain: the kernels are built (once per machine) to find out."""
    from fafo_cli import load
    from fafo_cli.bench.doctor import build_kernels, machine
    from fafo_cli.compiled.kernels import loader

    engine = load(str(tiny), dtype="float32")
    monkeypatch.setattr(loader, "compiler", lambda: "sh")

    def broken(folder):
        raise loader.BuildError("g++ failed: g++: fatal error: cc1plus: No such file or directory")

    monkeypatch.setattr(loader, "load", broken)
    failure = build_kernels(engine, "auto")
    assert failure and "cc1plus" in failure and "\n" not in failure
    kernels = machine(torch.device("cpu"), torch.float32, "auto", failure)["kernels"]
    assert kernels.startswith("eager torch only: our kernels did not build with") and "cc1plus" in kernels
    assert build_kernels(engine, "off") is None  # nothing of ours runs: nothing to build


def test_a_disturbed_curve_recommends_nothing(tiny, isolated, monkeypatch, capsys):
    from rich.console import Console

    from fafo_cli.bench import doctor

    monkeypatch.setattr(doctor, "build_kernels", lambda engine, mode: None)  # (not what this tests: seconds)
    monkeypatch.setattr(tune, "CURVE_SLACK", 0.1)  # (tests take every curve as undisturbed: conftest)
    monkeypatch.setattr(tune, "step_costs", lambda engine: {rows: 10.0 if rows == 1 else 5.0 for rows in tune.ROWS})
    assert entrypoint(["doctor", str(tiny), "--dtype", "float32", "--config", str(isolated), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["disturbed"] and report["recommended"] is None
    report["step_ms"] = {int(rows): ms for rows, ms in report["step_ms"].items()}  # (as the command renders it)
    console = Console(width=300, record=True)
    doctor.render(report, console)
    out = console.export_text()
    assert "another process is using this machine" in out and "nothing recommended" in out
    assert "Recommended" not in out


def test_a_float32_near_tie_is_said_but_not_failed():
    """On a GPU float32 kernels are picked by shape and may part a row from plain decoding's at a near-tie (judged by
    the measured noise): said in yellow, not reported as a bug; a divergence beyond the noise still fails."""
    from rich.console import Console

    from fafo_cli.bench import doctor

    check = {"prompt": "chat · x", "fafo": "as configured", "tokens": 64, "equal": False, "fafo_steps": 30,
             "accepted": 20, "divergence": "token 7: 5 vs vanilla's 6, logit gap 1e-06 (near-tie)", "near_tie": True}
    assert not doctor.failed({"exactness": [check]})
    assert doctor.failed({"exactness": [{**check, "near_tie": False}]})
    console = Console(width=300, record=True)
    doctor.render({"model": "m", "machine": doctor.machine(torch.device("cpu"), torch.float32), "exactness": [check],
                   "step_ms": {1: 1.0}, "disturbed": "curve disturbed"}, console)
    assert "parted at a near-tie" in console.export_text() and "DIFFERENT" not in console.export_text()
