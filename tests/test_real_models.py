"""Real instruct models, where their files are present (CI need not download them): Qwen2.5-Coder-0.5B- and
-1.5B-Instruct as Q4_K_M .gguf files (Qwen2: qkv biases, a vocabulary head of its own; Q5_0/Q8_0/Q4_K/Q6_K blocks in
the 0.5B file, Q4_K/Q6_K in the 1.5B one), where `../shared/models/get-qwen-coder.sh 0.5b|1.5b` puts them (or
FAFO_MODELS_DIR): converted once and run end to end, greedy output equal to transformers' own `generate` on the same
dequantized weights, and `fafo run`, `chat` and `bench` over the file's blocks as a user runs them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fafo_cli import hub, load
from fafo_cli.cli import entrypoint

from .conftest import forget_hf_models, hf_greedy

pytestmark = [pytest.mark.device, pytest.mark.slow]  # the exactness test runs on --device (tests/conftest.py)

MODELS = Path(os.environ.get("FAFO_MODELS_DIR") or Path.home() / ".cache" / "fafo-models")  # the script's default
SIZES = ("0.5b", "1.5b")
QUESTION = [{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome, "
                                        "ignoring case and spaces. Explain it briefly."}]


def gguf_file(size: str) -> Path:
    return MODELS / f"qwen2.5-coder-{size}-instruct-q4_k_m.gguf"


@pytest.fixture(scope="module", autouse=True)
def _users_cache():
    """These tests run in the user's fafo cache, not the session's throwaway one (tests/conftest.py): a model is
    converted and packed once at most (minutes for the 1.5B), and later sessions find it so."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FAFO_CACHE", os.environ["FAFO_TESTS_USER_CACHE"])
        yield
    forget_hf_models()  # the 1.5B's float32 copy alone is 6 GB


@pytest.fixture(scope="module", params=SIZES)
def qwen_coder(request) -> tuple[Path, Path]:
    """The .gguf file and its converted folder (converted once at most)."""
    path = gguf_file(request.param)
    if not path.is_file():
        pytest.skip(f"no Qwen2.5-Coder-{request.param.upper()} .gguf file at {path} (get it with "
                    f"../shared/models/get-qwen-coder.sh {request.param}, or set FAFO_MODELS_DIR)")
    return path, hub.resolve(str(path))


# tokens compared with transformers, and the methods: the 1.5B model's float32 passes take about 0.7 s each here,
# so it checks FAFO alone (its output is plain decoding's) on a shorter answer, to keep the suite's time
GREEDY = {"0.5b": (64, ("vanilla", "fafo")), "1.5b": (24, ("fafo",))}


def test_qwen_coder_gguf_greedy_matches_transformers(qwen_coder):
    path, folder = qwen_coder
    tokens, methods = GREEDY[next(size for size in SIZES if path == gguf_file(size))]
    engine = load(str(path), dtype="float32", compile="off")
    assert engine.folder == folder  # not converted again
    assert engine.weights == "Q4_K_M GGUF, dequantized to float32"  # written out, not computed by the code under test
    vocab = engine.tokenizer.get_vocab()  # a chat turn's end, a text's, a file's (as llama.cpp stops this model)
    assert engine.stop_ids == {vocab[t] for t in ("<|im_end|>", "<|endoftext|>", "<|fim_pad|>", "<|repo_name|>",
                                                  "<|file_sep|>")}
    ids = engine.encode(QUESTION)
    assert engine.tokenizer.decode(ids).startswith("<|im_start|>system\n")  # Qwen2's template, its default system
    expected = hf_greedy(folder, ids, tokens)
    for method in methods:
        assert engine.complete(QUESTION, method=method, max_tokens=tokens).token_ids == expected, method


def test_fafo_run_reads_the_blocks_as_stored(qwen_coder, tmp_path, capsys):
    path, folder = qwen_coder
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(QUESTION[0]["content"])
    for method in ("vanilla", "fafo"):
        assert entrypoint(["run", str(path), "-p", str(prompt), "-n", "32", "--json", "--dtype", "float32",
                           "--method", method]) == 0
        result = json.loads(capsys.readouterr().out)
        assert len(result["token_ids"]) == 32 and result["text"].strip()
        packed = result["settings"]["device"] == "cpu"  # our kernels read the blocks on a CPU; a GPU's steps are dense
        assert result["settings"]["weights"] == ("Q4_K_M GGUF, read as stored" if packed else  # every matrix packed
                                                 "Q4_K_M GGUF, dequantized to float32")
        assert result["settings"]["model_path"] == str(folder)
        if method == "vanilla":
            plain = result["token_ids"]
    assert result["token_ids"] == plain  # FAFO over the blocks: plain decoding's tokens over the same blocks


def _python(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True, env=env, timeout=600)


def test_the_packed_model_stays_near_the_files_size_in_memory(qwen_coder, tmp_path):
    """A later start reads the packed blocks kept beside the packages: its peak resident memory over a bare process
    with torch and fafo imported is about the file's size (the dense matrices they replace are never read, and of the
    embedding table only the prompt's rows are)."""
    path, _ = qwen_coder
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(QUESTION[0]["content"])
    assert _python("-m", "fafo_cli", "run", str(path), "-p", str(prompt), "-n", "4", "--dtype", "float32").returncode == 0
    bare = _python("-c", "import torch, fafo_cli.cli; print(int(open('/proc/self/statm').read().split()[1]) * 4096)")
    run = _python("-m", "fafo_cli", "run", str(path), "-p", str(prompt), "-n", "16", "--json", "--dtype", "float32")
    assert run.returncode == 0, run.stderr
    stats = json.loads(run.stdout)["stats"]
    if stats["memory_kind"] != "rss":
        pytest.skip("the model ran on a GPU: its memory is the device's")
    peak_mb, bare_mb = stats["peak_memory_mb"], int(bare.stdout) / 1e6  # (fafo's MB)
    file_mb = path.stat().st_size / 1e6
    # float32 keeps Q5_0 and Q6_K codes as bytes (faster to widen; packed_linear.cpp): 0.5B 1.41x, 1.5B 1.2x (Zen 3)
    assert peak_mb - bare_mb < 1.5 * file_mb, (peak_mb, bare_mb, file_mb)


def test_fafo_chat_answers_two_turns(qwen_coder):
    path, _ = qwen_coder
    chat = _python("-m", "fafo_cli", "chat", str(path), "--dtype", "float32", "-n", "12",
                   stdin="Say hello.\nNow say it in French.\n/stats\n")
    assert chat.returncode == 0, chat.stderr
    assert re.search(r"2 turns · \d+ tokens generated", chat.stdout) and "Traceback" not in chat.stderr


def test_fafo_bench_is_exact_on_code(qwen_coder, tmp_path):
    path, _ = qwen_coder
    out = tmp_path / "bench.json"
    assert entrypoint(["bench", str(path), "--suites", "code", "--samples", "1", "--tokens", "16", "--repeats", "1",
                       "--warmup", "0", "--methods", "fafo", "--no-external", "--dtype", "float32",
                       "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    assert [r["row"] for r in records] == ["vanilla", "fafo"]
    assert all(r["exact"] == "1/1" and r["tokens_per_s"] > 0 for r in records)
