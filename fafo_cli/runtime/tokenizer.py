"""A model folder's tokenizer and chat template read with `tokenizers` and jinja2 directly, as transformers would.

transformers' AutoTokenizer costs half a second of imports on every start (the package itself, then its tokenizer
classes). Where a folder's tokenizer.json is the whole tokenizer, that is not needed: classes that build their
pipeline in Python (Llama's, Qwen2's, ...) may ignore parts of a downloaded tokenizer.json, so `lean_tokenizer`
serves only folders whose config names the plain tokenizers-backed class, and the GGUF files we convert (their
tokenizer.json was written by transformers' own class, pipeline included), and only where tokenizer.json already
holds every special token the config names (transformers would add or re-flag the others). Anything else loads
through transformers. Tests compare both on every string, conversation and decoding they use.
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
    """The folder's tokenizer without transformers, or None where transformers must build it. A file that cannot
    be read is a ValueError naming it."""
    files = folder / "tokenizer.json", folder / "tokenizer_config.json"
    if trust_remote_code or not all(f.is_file() for f in files) or (folder / "special_tokens_map.json").is_file():
        return None
    try:
        settings = json.loads(files[1].read_text(encoding="utf-8"))
        if not isinstance(settings, dict):
            raise ValueError("it does not hold a JSON object")
        if not converted and settings.get("tokenizer_class") not in PLAIN_CLASSES:
            return None
        # custom code, a regex fix, special tokens transformers adds on top of tokenizer.json's own
        if {"auto_map", "fix_mistral_regex"} & set(settings) or settings.get("add_bos_token") or \
                settings.get("add_eos_token"):
            return None
        tokenizer = Tokenizer(folder, settings)
    except Exception as e:  # noqa: BLE001 - `tokenizers` raises plain Exceptions on a malformed file
        raise ValueError(f"cannot read the tokenizer files in {folder}: {e}") from None
    return tokenizer if tokenizer.complete(settings) else None


class Tokenizer:
    """What decoding asks of a tokenizer, under transformers' names: `tokenizer(text)["input_ids"]`, `decode`,
    `apply_chat_template`, `eos_token_id`, `get_vocab`, `chat_template`."""

    def __init__(self, folder: Path, settings: dict):
        from tokenizers import Tokenizer as Backend

        self.backend = Backend.from_file(str(folder / "tokenizer.json"))
        self.backend.no_truncation()  # as transformers does on every call that does not ask for them
        self.backend.no_padding()
        self.special = {key: _content(settings[key]) for key in SPECIAL_KEYS if settings.get(key) is not None}
        eos = self.special.get("eos_token")
        self.eos_token_id = self.backend.token_to_id(eos) if eos is not None else None
        self.chat_template = _chat_template(folder, settings)

    def complete(self, settings: dict) -> bool:
        """Whether tokenizer.json holds, as special tokens, every token the config names, and the config's chat
        template was found."""
        special = {token.content for token in self.backend.get_added_tokens_decoder().values() if token.special}
        named = [*self.special.values(), *map(_content, settings.get("additional_special_tokens") or ()),
                 *map(_content, settings.get("extra_special_tokens") or ()),
                 *(_content(t) for t in (settings.get("added_tokens_decoder") or {}).values() if t.get("special"))]
        return set(named) <= special and (self.chat_template is not None or settings.get("chat_template") is None)

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
                            tokenize: bool = True, return_dict: bool = False, **variables):
        """The template rendered as transformers renders it (the special tokens' texts visible to it, and `variables`
        over them), then tokenized without adding special tokens (the template writes its own)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        plain = [{key: value for key, value in message.items() if value is not None} for message in messages]
        text = _compiled(self.chat_template).render(messages=json.loads(json.dumps(plain)), tools=None,
                                                    documents=None, add_generation_prompt=add_generation_prompt,
                                                    **{**self.special, **variables})
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
def variables_read(template: str) -> frozenset[str]:
    """The names a chat template reads that it does not set itself: what the caller may give it."""
    from jinja2 import meta

    return frozenset(meta.find_undeclared_variables(_environment().parse(template)))


@lru_cache(maxsize=8)
def _compiled(template: str):
    return _environment().from_string(template)


@lru_cache(maxsize=1)
def _environment():
    """jinja2's sandbox with transformers' settings, filters and globals. Hub templates are untrusted code: the
    sandbox refuses internals and changing known containers, `dict` only builds new ones, a namespace refuses names
    that begin with an underscore, and templates see a copy of the messages."""
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

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # jinja's own signature: `namespace(self=...)` stays a plain name
            self, attributes = args[0], dict(*args[1:], **kwargs)
            for name in attributes:
                Namespace.check(name)
            jinja2.utils.Namespace.__init__(self, attributes)

        def __setitem__(self, name, value):
            Namespace.check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not name {name!r} in a namespace")

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[Generation, loopcontrols])
    environment.globals["dict"] = lambda *args, **kwargs: dict(*args, **kwargs)  # no `dict.update(...)`
    environment.globals["namespace"] = Namespace
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return environment
