"""Our tokenizer (runtime/tokenizer.py) against transformers' AutoTokenizer on the same folder: the ids of texts and
of chat templates, decoding, the eos token and the vocabulary; and when transformers must build the tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest

from fafo_cli import hub
from fafo_cli.runtime.tokenizer import Tokenizer, lean_tokenizer

from .conftest import build_tiny_model
from .test_real_models import SIZES, gguf_file

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n\nnew lines  ", "naïve café — 東京 🙂 ÅÆØ",
         "def f(x):\n    return x ** 2  # square\n", "<|im_start|>user\nspecial tokens inside text<|im_end|>",
         "1234567890 3.14159 -42", ""]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another, in 日本語?"}],
]


def assert_same(folder: Path, converted: bool = False) -> None:
    from transformers import AutoTokenizer

    ours = lean_tokenizer(folder, converted, trust_remote_code=False)
    theirs = AutoTokenizer.from_pretrained(folder)
    assert isinstance(ours, Tokenizer)
    for text in TEXTS:
        ids = ours(text)["input_ids"]
        assert ids == theirs(text)["input_ids"], text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False), text
    for messages in CONVERSATIONS:
        for prompt in (True, False):
            options = dict(add_generation_prompt=prompt, tokenize=True, return_dict=True)
            assert ours.apply_chat_template(messages, **options)["input_ids"] == list(
                theirs.apply_chat_template(messages, **options)["input_ids"])
            text = dict(add_generation_prompt=prompt, tokenize=False)
            assert ours.apply_chat_template(messages, **text) == theirs.apply_chat_template(messages, **text)
    assert ours.eos_token_id == theirs.eos_token_id and ours.get_vocab() == theirs.get_vocab()
    assert len(ours) == len(theirs) and ours.chat_template == theirs.chat_template


def test_tiny_models_tokenize_as_transformers(tiny):
    assert_same(tiny)


@pytest.mark.slow
def test_the_embedded_model_tokenizes_as_transformers(smollm2):
    assert hub.is_converted(smollm2)
    assert_same(smollm2, converted=True)


@pytest.mark.slow
@pytest.mark.parametrize("size", SIZES)
def test_qwen_coder_tokenizes_as_transformers(size):
    path = gguf_file(size)
    if not path.is_file():
        pytest.skip(f"no Qwen2.5-Coder .gguf file at {path} (get-qwen-coder.sh {size}, or set FAFO_MODELS_DIR)")
    assert_same(hub.resolve(str(path)), converted=True)


@pytest.mark.parametrize("change", ["LlamaTokenizer", "auto_map", "add_bos_token", "remote code", "no tokenizer.json"])
def test_transformers_builds_what_tokenizer_json_may_not_hold(tmp_path, change):
    folder = build_tiny_model(tmp_path / "m", "llama-gqa")
    path = folder / "tokenizer_config.json"
    settings = json.loads(path.read_text())
    assert lean_tokenizer(folder, False, False) is not None
    if change == "LlamaTokenizer":  # a class that builds its own pipeline: only our conversions are known exact
        settings["tokenizer_class"] = change
        assert lean_tokenizer(folder, True, False) is not None
    elif change == "auto_map":
        settings["auto_map"] = {"AutoTokenizer": ["tokenization_x.XTokenizer", None]}
    elif change == "add_bos_token":
        settings["add_bos_token"] = True
    elif change == "no tokenizer.json":
        (folder / "tokenizer.json").unlink()
    path.write_text(json.dumps(settings))
    assert lean_tokenizer(folder, False, change == "remote code") is None


def template_folder(tmp_path: Path, template: str) -> Tokenizer:
    folder = build_tiny_model(tmp_path / "m", "llama-gqa", chat_template=template)
    tokenizer = lean_tokenizer(folder, False, False)
    assert tokenizer is not None
    return tokenizer


def test_a_template_can_refuse_messages(tmp_path):
    tokenizer = template_folder(tmp_path, "{% if messages[0]['role'] == 'system' %}"
                                          "{{ raise_exception('no system messages') }}{% endif %}ok")
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "ok"
    with pytest.raises(jinja2.TemplateError, match="no system messages"):
        tokenizer.apply_chat_template([{"role": "system", "content": "x"}], tokenize=False)


def test_templates_render_generation_blocks_tojson_and_loop_controls(tmp_path):
    tokenizer = template_folder(tmp_path, "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                                          "{% generation %}{{ m | tojson }}{% endgeneration %}{% endfor %}")
    messages = [{"role": "user", "content": "é <b>"}, {"role": "user", "content": "second"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == '{"role": "user", "content": "é <b>"}'


def test_templates_run_in_a_sandbox(tmp_path):
    tokenizer = template_folder(tmp_path, "{{ messages.append(messages[0]) }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def test_saved_truncation_and_padding_are_not_applied(tmp_path):
    folder = build_tiny_model(tmp_path / "m", "llama-gqa")
    saved = json.loads((folder / "tokenizer.json").read_text())
    saved["truncation"] = {"direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 0}
    saved["padding"] = {"strategy": {"Fixed": 9}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                        "pad_type_id": 0, "pad_token": "<|endoftext|>"}
    (folder / "tokenizer.json").write_text(json.dumps(saved))
    assert_same(folder)
    assert len(lean_tokenizer(folder, False, False)("a b a b a")["input_ids"]) == 9


def test_special_tokens_tokenizer_json_lacks_go_through_transformers(tmp_path):
    folder = build_tiny_model(tmp_path / "m", "llama-gqa")
    path = folder / "tokenizer_config.json"
    settings = json.loads(path.read_text())
    path.write_text(json.dumps({**settings, "additional_special_tokens": ["<|not in the vocabulary|>"]}))
    assert lean_tokenizer(folder, False, False) is None
    path.write_text(json.dumps(settings))
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    assert lean_tokenizer(folder, False, False) is None


@pytest.mark.parametrize("names", [["default", "tool_use"], ["tool_use"]])
def test_named_templates_in_the_config(tmp_path, names):
    folder = build_tiny_model(tmp_path / "m", "llama-gqa")
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    path = folder / "tokenizer_config.json"
    templates = [{"name": name, "template": f"{name}:{{{{ messages[0]['content'] }}}}"} for name in names]
    path.write_text(json.dumps({**json.loads(path.read_text()), "chat_template": templates}))
    tokenizer = lean_tokenizer(folder, False, False)
    if "default" not in names:  # transformers asks which one: not ours to choose
        assert tokenizer is None
        return
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "default:x"


@pytest.mark.parametrize("template", ["{{ dict.update(messages[0], {'role': 'changed'}) }}",
                                      "{{ messages[0].update({'role': 'changed'}) }}",
                                      "{% set ns = namespace(__class__=1) %}", "{% set ns = namespace() %}"
                                                                               "{% set ns._x = 1 %}"])
def test_templates_cannot_change_the_messages_or_reach_internals(tmp_path, template):
    tokenizer = template_folder(tmp_path, template)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(jinja2.TemplateError):  # the sandbox's SecurityError, or an undefined `dict.update`
        tokenizer.apply_chat_template(messages, tokenize=False)
    assert messages == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("broken", ["tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_unreadable_tokenizer_and_generation_files_are_one_line(tmp_path, broken):
    from fafo_cli import load
    from fafo_cli.errors import FafoError

    folder = build_tiny_model(tmp_path / "m", "llama-gqa")
    (folder / broken).write_text("[1, 2]" if broken != "tokenizer.json" else "{not json")
    with pytest.raises(FafoError, match=f"cannot (read|load) .*{folder}") as error:
        load(str(folder), device="cpu", compile="off")
    assert "\n" not in str(error.value)
    if broken == "tokenizer.json":  # read by transformers (a class of its own), which `tokenizers` fails plainly
        settings = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**settings, "tokenizer_class": "Qwen2Tokenizer"}))
        (folder / broken).write_text(json.dumps({"version": "1.0", "model": {"type": "Unheard"}}))
        with pytest.raises(FafoError, match=f"^cannot load the tokenizer in {folder}: ") as error:
            load(str(folder), device="cpu", compile="off")
        assert "\n" not in str(error.value)


def test_a_text_prompt_that_opens_with_the_bos_gets_no_second_one(tmp_path):
    """A raw-template completion prompt (`<s>[INST]...`, `<|begin_of_text|>...`) brings its own BOS; the tokenizer
    adding one more changes the model's answer."""
    from tokenizers import Tokenizer as Backend, processors

    from fafo_cli import load

    folder = build_tiny_model(tmp_path / "m", "llama-gqa")
    backend = Backend.from_file(str(folder / "tokenizer.json"))
    bos = backend.token_to_id("<|im_start|>")
    backend.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[
        ("<|im_start|>", bos)])  # a tokenizer that adds a BOS, as Llama's and Mistral's do
    backend.save(str(folder / "tokenizer.json"))
    engine = load(str(folder), dtype="float32", chat_template=False)
    hello = engine.encode("hello")
    assert hello[0] == bos and hello[1] != bos
    assert engine.encode("<|im_start|>hello") == hello
    assert engine.encode("<|im_start|><|im_start|>hello")[:3] == [bos, bos, hello[1]]  # what the prompt says


# Qwen3's switch, as its template reads it
THINKING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
            "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}{{ eos_token }}")


def test_template_variables_render_as_transformers_renders_them(tmp_path):
    from transformers import AutoTokenizer

    from fafo_cli.runtime.tokenizer import variables_read

    tokenizer = template_folder(tmp_path, THINKING)
    theirs = AutoTokenizer.from_pretrained(tmp_path / "m")
    messages = [{"role": "user", "content": "hi"}]
    # (a variable named as a special token is the caller's: transformers lets it win)
    for variables in ({}, {"enable_thinking": False}, {"enable_thinking": True}, {"eos_token": "[end]"}):
        options = dict(add_generation_prompt=True, **variables)
        text = tokenizer.apply_chat_template(messages, tokenize=False, **options)
        assert text == theirs.apply_chat_template(messages, tokenize=False, **options)
        assert ("<think>" in text) is (variables.get("enable_thinking") is False)
        assert tokenizer.apply_chat_template(messages, **options) == list(
            theirs.apply_chat_template(messages, return_dict=True, **options)["input_ids"])
    assert variables_read(THINKING) == {"messages", "add_generation_prompt", "enable_thinking", "eos_token"}
