"""A model folder's tokenizer and chat template read with `tokenizers` and jinja2 directly, as transformers would.

transformers' AutoTokenizer costs half a second of imports on every start (the package itself, then its tokenizer
classes). Where a folder's tokenizer.json is the whole tokenizer, that is not needed: classes that build their
pipeline in Python (Llama's, Qwen2's, ...) may ignore parts of a downloaded tokenizer.json, so `lean_tokenizer`
serves only folders whose config names the plain tokenizers-backed class, and the GGUF files we convert (their
tokenizer.json was written by transformers' own class, pipeline included). Anything else loads through
transformers. Tests compare both on every string, conversation and decoding they use.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

# tokenizer_config.json's classes whose whole tokenizer is tokenizer.json (transformers 5 and 4 names)
PLAIN_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def lean_tokenizer(folder: Path, converted: bool, trust_remote_code: bool) -> "Tokenizer | None":
    """The folder's tokenizer without transformers, or None where transformers must build it."""
    files = folder / "tokenizer.json", folder / "tokenizer_config.json"
    if trust_remote_code or not all(f.is_file() for f in files):
        return None
    settings = json.loads(files[1].read_text(encoding="utf-8"))
    if not converted and settings.get("tokenizer_class") not in PLAIN_CLASSES:
        return None
    if "auto_map" in settings or settings.get("add_bos_token") or settings.get("add_eos_token"):
        return None  # custom code, or special tokens transformers adds on top of tokenizer.json's own
    return Tokenizer(folder, settings)


class Tokenizer:
    """What decoding asks of a tokenizer, under transformers' names: `tokenizer(text)["input_ids"]`, `decode`,
    `apply_chat_template`, `eos_token_id`, `get_vocab`, `chat_template`."""

    def __init__(self, folder: Path, settings: dict):
        from tokenizers import Tokenizer as Backend

        self.backend = Backend.from_file(str(folder / "tokenizer.json"))
        self.special = {key: _content(settings[key]) for key in SPECIAL_KEYS if settings.get(key) is not None}
        eos = self.special.get("eos_token")
        self.eos_token_id = self.backend.token_to_id(eos) if eos is not None else None
        self.chat_template = _chat_template(folder, settings)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.backend.encode(text, add_special_tokens=add_special_tokens).ids}

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def decode(self, ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False) -> str:
        if clean_up_tokenization_spaces:
            raise ValueError("clean_up_tokenization_spaces is not supported here")
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = False,
                            tokenize: bool = True, return_dict: bool = False):
        """The template rendered as transformers renders it (the special tokens' texts visible to it), then tokenized
        without adding special tokens (the template writes its own)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        text = _compiled(self.chat_template).render(messages=messages, tools=None, documents=None,
                                                    add_generation_prompt=add_generation_prompt, **self.special)
        if not tokenize:
            return text
        ids = self(text, add_special_tokens=False)
        return ids if return_dict else ids["input_ids"]


def _content(token) -> str:
    return token["content"] if isinstance(token, dict) else str(token)


def _chat_template(folder: Path, settings: dict) -> str | None:
    """chat_template.jinja beside the config (transformers 5), else the config's own (a string, or named ones)."""
    path = folder / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = settings.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template}
        return named.get("default")
    return template


@lru_cache(maxsize=8)
def _compiled(template: str):
    """The template in jinja2's sandbox with transformers' settings, filters and globals (hub templates are
    untrusted code: the sandbox refuses attribute access to internals)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks: rendered as its body."""
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # not jinja's own filter, which escapes HTML characters
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[Generation, loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return environment.from_string(template)
