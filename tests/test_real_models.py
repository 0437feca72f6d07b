"""Real instruct models, where their files are present (CI need not download them): Qwen2.5-Coder-0.5B-Instruct
as a Q4_K_M .gguf file (Qwen2: qkv biases, its own lm_head tensor, Q5_0/Q8_0/Q4_K/Q6_K blocks), converted and run
end to end, its greedy output equal to transformers' own `generate` on the same dequantized weights."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fafo_cli import hub, load
from fafo_cli.cli import entrypoint

from .conftest import hf_greedy

pytestmark = pytest.mark.device  # run on --device (tests/conftest.py)

QWEN_GGUF = Path(os.environ.get("FAFO_QWEN_GGUF", "/work/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"))
QUESTION = [{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome, "
                                        "ignoring case and spaces. Explain it briefly."}]


@pytest.fixture(scope="session")
def qwen_coder() -> Path:
    """The .gguf file converted once per session at most (into the user's cache, like the embedded model, so later
    sessions find it converted)."""
    if not QWEN_GGUF.is_file():
        pytest.skip(f"no Qwen2.5-Coder .gguf file at {QWEN_GGUF} (set FAFO_QWEN_GGUF to one)")
    return hub.resolve(str(QWEN_GGUF))


# how the engine names the file's weights: written out, not computed with the header reader under test (a file
# given by FAFO_QWEN_GGUF must be a Q4_K_M one too)
WEIGHTS = "Q4_K_M GGUF, dequantized to float32"


@pytest.mark.slow
def test_qwen_coder_gguf_greedy_matches_transformers(qwen_coder):
    engine = load(str(QWEN_GGUF), dtype="float32", compile="off")
    assert engine.folder == qwen_coder  # not converted again
    assert engine.weights == WEIGHTS
    assert engine.stop_ids == {engine.tokenizer.convert_tokens_to_ids("<|im_end|>")}  # the end of a chat turn
    ids = engine.encode(QUESTION)
    assert engine.tokenizer.decode(ids).startswith("<|im_start|>system\n")  # Qwen2's template, its default system
    expected = hf_greedy(qwen_coder, ids, 64)
    for method in ("vanilla", "fafo"):
        assert engine.complete(QUESTION, method=method, max_tokens=64).token_ids == expected, method


@pytest.mark.slow
def test_fafo_run_on_the_qwen_coder_gguf(qwen_coder, tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(QUESTION[0]["content"])
    assert entrypoint(["run", str(QWEN_GGUF), "-p", str(prompt), "-n", "32", "--json", "--dtype", "float32",
                       "--no-compile"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["token_ids"]) == 32 and result["text"].strip()
    assert result["settings"]["weights"] == WEIGHTS
    assert result["settings"]["model_path"] == str(qwen_coder)
