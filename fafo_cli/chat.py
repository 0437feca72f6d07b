"""`fafo chat`: a multi-turn REPL over Engine.stream.

The conversation is a list of messages; each turn sends all of it, and the engine prefills only the tokens
its KV cache does not already hold (so a turn costs its own new tokens, not the whole history).
"""

from __future__ import annotations

import contextlib
import re
import sys
from dataclasses import dataclass

import yaml
from rich.console import Console
from rich.markup import escape

from . import config as config_mod
from .api import Engine
from .errors import FafoError, first_line, interrupt_handled, is_out_of_memory, shortened
from .ui import StreamView, live_display, method_label, on_terminal

QUOTES = '"""'  # open and close a multi-line message
SYSTEM_BLOCK = re.compile(r'\s*/set\s+system\s*"""')  # ollama's `/set system """`, the message on the lines after
COMMANDS = ("/exit", "/quit", "/bye", "/help", "/?", "/reset", "/clear", "/stats", "/set")


def _closes(line: str) -> bool:
    """Whether a line of a block ends it: it ends with the quotes, and holds no others (a pasted one-line Python
    docstring does not)."""
    return line.rstrip().endswith(QUOTES) and line.count(QUOTES) == 1


PROBE = {"role": "user", "content": "?"}  # a message to try the chat template with

SETTABLE = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens")
OLLAMA_NAMES = {"num_predict": "max_tokens"}  # `/set parameter num_predict 64`, as ollama names it

HELP = """Commands:
  /help, /?         this help
  /set KEY VALUE    change a setting for the next answers: temperature, top_p, top_k, min_p, seed (random: a
                    fresh one each answer), max_tokens (-1: up to the context; ollama's `/set parameter KEY
                    VALUE` too)
  /set system TEXT  the system message of this conversation from here on (/set system \"\"\" takes the lines
                    up to the closing quotes)
  /set think, /set nothink
                    a thinking model's answers with or without their thinking part (Qwen3's enable_thinking;
                    /set chat_template_kwargs JSON sets any of the template's variables)
  /set              show the settings
  /reset, /clear    forget the conversation (and the cached keys and values), but its system message
  /stats            totals for this session
  /exit, /bye       leave (Ctrl-D too)
Input: several lines pasted on a terminal are one message; else end a line with \\ to continue it, or wrap
several lines in \"\"\" ... \"\"\" (a line that ends with the closing quotes, and has no others, ends the message).
Ctrl-C stops the current answer; the conversation stays."""


@dataclass
class Totals:
    turns: int = 0
    generated_tokens: int = 0
    decoded_tokens: int = 0  # after each answer's first, over decode_s: the decode speed, as `fafo run` counts it
    decode_s: float = 0.0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    steps: int = 0

    def line(self) -> str:
        speed = self.decoded_tokens / self.decode_s if self.decode_s else 0.0
        tau = self.generated_tokens / self.steps if self.steps else 0.0
        turns = f"{self.turns} turn{'s' if self.turns != 1 else ''}"
        return (f"{turns} · {self.generated_tokens} tokens generated · {speed:.1f} tok/s · τ {tau:.2f} · "
                f"prompt tokens {self.prompt_tokens} ({self.cached_prompt_tokens} reused from the cache)")


class Repl:
    def __init__(self, engine: Engine, out: Console, err: Console):
        self.engine, self.out, self.err = engine, out, err
        self.messages: list[dict] = []
        self.settings: dict = {}  # /set overrides for the next answers
        self.totals = Totals()
        self.interactive = live_display(out)  # the live panel and its footer
        # prompts and line editing where a person types and reads (not for a script piped in, nor into a log)
        self.prompting = on_terminal(out) and sys.stdin is not None and sys.stdin.isatty()
        self.failed = False  # an input was refused: a script fed to `fafo chat` exits 1
        if engine.config.system:  # (--system, or the config's: a template that refuses it would refuse every message)
            self._check_system({"role": "system", "content": engine.config.system})

    @property
    def typed(self) -> bool:
        """Whether a person types the input (a terminal), not a script (a file, a pipe)."""
        return sys.stdin is not None and sys.stdin.isatty()

    def _warn(self, message: str) -> None:
        """One line on stderr, never wrapped (scripts and tests read it whole)."""
        self.err.print(message, markup=False, highlight=False, soft_wrap=True)

    def _error(self, message: str) -> None:
        self.failed = True
        self._warn(f"error: {message}")

    def _read(self) -> tuple[str, bool] | None:
        """One user message (possibly multi-line) and whether it was a \"\"\" block (a message even where it
        starts with /); None at end of input."""
        try:
            line = input(">>> " if self.prompting else "")
        except EOFError:
            return None
        except (OSError, RuntimeError) as e:  # stdin closed (`<&-`: "lost sys.stdin") or unreadable (`nohup`'s)
            self._error(f"cannot read standard input: {getattr(e, 'strerror', None) or e}")
            return None
        if line.lstrip().startswith(QUOTES):  # a block, as ollama reads one
            block = self._block(line.lstrip()[3:])
            return None if block is None else (block, True)
        if opened := SYSTEM_BLOCK.match(line):  # a system message as a block
            block = self._block(line[opened.end():])
            return None if block is None else ("/set system " + block, False)
        lines = [line]
        while lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1]
            try:
                lines.append(input("... " if self.prompting else ""))
            except EOFError:
                break
        return "\n".join(lines), False

    def _block(self, first: str) -> str | None:
        """A \"\"\" block's text, `first` what follows the opening quotes on their line (the line that ends with the
        closing ones is its last); None where the input ends inside it."""
        if _closes(first):
            return first.rstrip()[:-3]
        lines = [first] if first.strip() else []
        while True:
            try:
                more = input("... " if self.prompting else "")
            except EOFError:
                self._error('the input ended inside a """ block; that message was not sent')
                return None
            if _closes(more):
                last = more.rstrip()[:-3]
                return "\n".join(lines + ([last] if last.strip() else []))
            lines.append(more)

    def run(self) -> int:
        """The session; its exit status: 1 where a script's input was refused somewhere, else 0."""
        # undecodable bytes arrive as lone surrogates, which the check below refuses line by line (a strict
        # reader, as under most UTF-8 locales, would throw away the rest of its buffer with them)
        getattr(sys.stdin, "reconfigure", lambda **_: None)(errors="surrogateescape")
        if self.prompting:
            with contextlib.suppress(ImportError):  # input() then edits lines and recalls earlier ones (arrow keys)
                import readline
                if "libedit" not in (readline.__doc__ or ""):  # GNU readline: a pasted text is one message, as
                    # ollama reads it, not a message a line (CPython turns bracketed paste off for its own REPL)
                    readline.parse_and_bind("set enable-bracketed-paste on")
            label = method_label(self.engine.request_config())
            self.out.print(f"[bold]{escape(self.engine.name)}[/] · {label} · /help for commands, Ctrl-D to leave")
        while True:
            try:
                read = self._read()
                if read is not None:
                    read[0].encode("utf-8")
            except KeyboardInterrupt:
                if not self.typed:  # a script's input: Ctrl-C stops the script, not one of its questions
                    raise
                interrupt_handled()
                self.err.print("\n(use /exit or Ctrl-D to leave)")  # (not into a transcript on stdout)
                continue
            except UnicodeEncodeError:
                self._error("that message is not UTF-8 text; it was not sent")
                continue
            if read is None:
                if self.prompting:
                    self.out.print()
                return self._status()
            text, block = read
            if not text.strip():
                continue
            try:
                if not block and self._is_command(text.strip()):
                    if self._command(text.strip()):
                        return self._status()
                    continue
                self._answer(text)
            except KeyboardInterrupt:  # outside the answer's own (fitting a long chat, a command): that turn only
                if not self.typed:
                    raise
                interrupt_handled()
                if self.messages and self.messages[-1]["role"] == "user":  # (its answer never came)
                    self.messages.pop()
                self.err.print("[dim](stopped)[/]")

    def _status(self) -> int:
        return int(self.failed and not self.typed)  # (read from a file or pipe)

    @staticmethod
    def _is_command(text: str) -> bool:
        """A line that starts with / is a command; several lines (a paste) only where they open with one of ours: a
        pasted path or `/* comment */` is a message."""
        return text.startswith("/") and ("\n" not in text or text.split()[0].lower() in COMMANDS)

    def _command(self, line: str) -> bool:
        """Handle a /command; True means leave."""
        name = line.split()[0].lower()
        if name in ("/exit", "/quit", "/bye"):
            return True
        if name in ("/help", "/?"):
            self.out.print(HELP, markup=False)
        elif name in ("/reset", "/clear"):
            self.messages[:] = [m for m in self.messages if m["role"] == "system"]
            self.engine.reset()
            self.out.print("conversation cleared")
        elif name == "/stats":
            self.out.print(self.totals.line())
        elif name == "/set":
            self._set(line.split(maxsplit=1)[1] if len(line.split()) > 1 else "")
        else:
            self._error(f'unknown command {shortened(name, 40)} (try /help; to send it as text, wrap it in """)')
        return False

    def _set(self, args: str) -> None:
        words = args.split()
        if words[:1] == ["parameter"]:  # (ollama's form)
            if len(words) < 2:
                self._error("usage: /set parameter KEY VALUE")
                return
            args, words = args.split(maxsplit=1)[1], [OLLAMA_NAMES.get(words[1], words[1])] + words[2:]
        if words[:1] == ["system"]:
            self._set_system(args.split(maxsplit=1)[1] if len(words) > 1 else "")
            return
        if not words:
            self.out.print("  ".join(f"{key}={value}" for key, value in self._current().items()), markup=False)
            return
        if words in (["think"], ["nothink"]):  # ollama's switch for thinking models: Qwen3's template variable
            self._set_value("chat_template_kwargs", {"enable_thinking": words == ["think"]})
            return
        if words[:1] == ["chat_template_kwargs"]:  # (its JSON may hold spaces)
            value = args.split(maxsplit=1)[1] if len(words) > 1 else ""
            self._set_value("chat_template_kwargs", value or None)
            return
        if len(words) != 2 or words[0] not in SETTABLE:
            self._error(f"usage: /set KEY VALUE, with KEY one of {', '.join(SETTABLE)}; /set system TEXT; or /set "
                        "think, /set nothink")
            return
        key, raw = words
        if key == "max_tokens" and raw in ("-1", "-2"):  # ollama's num_predict for no limit, and to fill the context
            raw = str(self.engine.model.max_context)  # (an answer stops where the context ends)
        try:
            value = "" if key == "seed" and raw == "random" else yaml.safe_load(raw)  # ("": a fresh seed each answer)
        except (yaml.YAMLError, ValueError, RecursionError) as e:  # (ValueError: an integer past Python's limit of
            # digits; RecursionError: brackets nested hundreds deep)
            self._error(f"cannot read {raw[:40]!r} as a value ({first_line(e) or type(e).__name__})")
            return
        self._set_value(key, value)

    def _set_value(self, key: str, value) -> None:
        try:
            config = self.engine.request_config(**{**self.settings, key: value})  # validated like the config file
            if value not in (None, ""):  # (which restores the default)
                self._check_effective(config, key, value)  # and like a flag: it must change something
        except FafoError as e:
            self._error(str(e))
            return
        self.settings[key] = value
        # what an earlier /set asked for that this one leaves without effect (temperature 0 after a top_p): cleared,
        # so the session never holds what `fafo run` would refuse
        config = self.engine.request_config(**self.settings)
        idle = [other for other, given in self.settings.items()
                if other != key and given not in (None, "") and not self._effective(config, other, given)]
        for other in idle:
            del self.settings[other]
        cleared = f"  ({', '.join(idle)} no longer {'applies' if len(idle) == 1 else 'apply'}: cleared)" if idle else ""
        shown = (f"{self._current()[key]} (the default)" if value is None else
                 "random (a fresh seed each answer)" if value == "" else
                 config.chat_template_kwargs if key == "chat_template_kwargs" else value)
        self.out.print(f"{key} = {shown}{cleared}", markup=False)

    def _current(self) -> dict:
        """The settings the next answer runs with, as `/set` shows them."""
        config = self.engine.request_config(**self.settings)
        seed = config_mod.build(self.engine.config, **self.settings).seed  # (before request_config's draw)
        if seed is None and config.temperature > 0:  # each sampled answer draws its own
            seed = "random"
        shown = {**{key: getattr(config, key) for key in SETTABLE}, "seed": seed}
        return {**shown, "chat_template_kwargs": config.chat_template_kwargs} if config.chat_template_kwargs else shown

    def _set_system(self, text: str) -> None:
        """The conversation's system message from here on (ollama's `/set system`): the first message, so that it
        counts in the context as the template writes it."""
        if not text.strip():
            self._error("usage: /set system TEXT")
            return
        system = {"role": "system", "content": text}
        try:
            self.engine.check_given(self.engine.request_config(system=text), {"system"})
            self._check_system(system)
        except FafoError as e:
            self._error(str(e))
            return
        self.messages[:] = [system] + [m for m in self.messages if m["role"] != "system"]
        self.out.print("system message set", markup=False)

    def _check_system(self, system: dict) -> None:
        """Refuses a system message now rather than every later message: one the chat template refuses, or one that
        leaves no room in the model's context for a message and its answer (the room `_fit_context` keeps)."""
        context = self.engine.model.max_context
        room = min(self.engine.request_config(**self.settings).max_tokens, context // 4)
        if len(self._encode([system, PROBE])) > context - room:
            raise FafoError(f"the system message leaves no room for a message and its answer in the model's context "
                            f"({context} tokens)")

    def _encode(self, messages: list[dict]) -> list[int]:
        """The messages' tokens as the next answer reads them (its template variables: /set think)."""
        return self.engine.encode(messages, self.engine.request_config(**self.settings))

    def _check_effective(self, config, key: str, value) -> None:
        """As a flag is checked: a FafoError where `key` given `value` changes nothing (of the template's variables,
        those given here)."""
        variables = config_mod.variables_in(value) if key == "chat_template_kwargs" else None
        self.engine.check_given(config, {key}, variables)

    def _effective(self, config, key: str, value) -> bool:
        try:
            self._check_effective(config, key, value)
        except FafoError:
            return False
        return True

    def _fit_context(self) -> bool:
        """Where the conversation leaves the answer too little room in the model's context (its max_tokens, at most
        a quarter of the context), drop the oldest exchanges until the earlier ones take at most half of the room
        the newest message leaves, as llama.cpp's context shift discards half: the turns after that reuse the
        cached start of the conversation instead of each dropping one more exchange and prefilling all of it.
        False, with its error, if the newest message cannot be sent (alone beyond the context, refused by the chat
        template)."""
        context = self.engine.model.max_context
        room = min(self.engine.request_config(**self.settings).max_tokens, context // 4)
        messages, dropped = list(self.messages), 0
        try:
            length = len(self._encode(messages))
            limit = context - room
            if length > limit:  # the newest message, and half the room it leaves the earlier ones
                newest = len(self._encode([m for m in messages if m["role"] == "system"] + messages[-1:]))
                limit = (limit + newest) // 2
            if length > limit:
                first = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
                exchanges = max(0, (len(messages) - 1 - first) // 2)  # the oldest first, user message and answer

                def fits(drop: int) -> bool:
                    return len(self._encode(messages[:first] + messages[first + 2 * drop:])) <= limit

                # the fewest dropped that fit, found by halving (a long chat's hundred exchanges: 7 encodings, not
                # one encoding of the whole conversation per exchange dropped)
                low, high = 0, exchanges
                while low < high:
                    middle = (low + high) // 2
                    low, high = (low, middle) if fits(middle) else (middle + 1, high)
                dropped, messages = low, messages[:first] + messages[first + 2 * low:]
                length = len(self._encode(messages))
                if length > limit and length >= context:  # the newest message alone: answered in what room there is
                    raise FafoError(f"this message alone does not fit the model's context ({context} tokens)")
        except FafoError as e:  # refused, and the conversation kept as it was
            self.messages.pop()
            self._error(str(e))
            return False
        self.messages[:] = messages
        if dropped:
            self._warn(f"note: the conversation outgrew the model's context ({context} tokens); dropped the "
                       f"oldest {dropped} exchange{'s' if dropped > 1 else ''} (/reset starts over)")
        return True

    def _answer(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})
        if not self._fit_context():
            return
        view = StreamView(self.out, method=method_label(self.engine.request_config(**self.settings)),
                          live=self.interactive,
                          show_footer=self.interactive, weights=self.engine.weights)
        stream = self.engine.stream(self.messages, on_prefill=view.prefill, **self.settings)
        answer = []
        try:
            with view:
                for step in stream:
                    answer.append(step.text)  # (first: what is shown is in the conversation, however it stops)
                    view.show(step)
        except KeyboardInterrupt:
            stream.close()
            if not self.typed:  # a script's input: the whole script stops
                raise
            interrupt_handled()
            self.err.print("[dim](stopped)[/]")  # (not into the answer's text where stdout is a file)
            if not "".join(answer):  # stopped before a word: the exchange did not happen
                self.messages.pop()
                return
        except FafoError as e:
            self.messages.pop()
            self._error(f"{e}. /reset starts a new conversation.")
            return
        except (MemoryError, RuntimeError) as e:  # the conversation so far is kept: a shorter answer may fit
            if not is_out_of_memory(e):
                raise
            self.messages.pop()
            self._error("out of memory in this answer; /set max_tokens N asks for a shorter one, /reset starts a "
                        "new conversation")
            return
        self.messages.append({"role": "assistant", "content": "".join(answer)})
        if view.last:
            limit = {"length": "max_tokens", "context": "the model's context"}.get(view.last.finish_reason)
            if limit and not self.interactive:  # (no footer says so where stdout is not a terminal)
                self._warn(f"note: the answer stopped at {limit}")
            stats = view.last.stats
            t = self.totals
            t.turns += 1
            t.generated_tokens += stats.generated_tokens
            t.decoded_tokens += max(0, stats.generated_tokens - 1)
            t.decode_s += stats.decode_s
            t.prompt_tokens += stats.prompt_tokens
            t.cached_prompt_tokens += stats.cached_prompt_tokens
            t.steps += stats.steps
