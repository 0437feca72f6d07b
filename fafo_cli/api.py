"""The Python API, which the CLI itself uses.

    from fafo_cli import load
    engine = load()                       # the embedded SmolLM2-135M-Instruct, or load("Qwen/Qwen2.5-0.5B-Instruct")
    for step in engine.stream("Why is the sky blue?"):
        print(step.text, end="", flush=True)
    result = engine.complete([{"role": "user", "content": "Hi"}], max_tokens=64)
    result.text, result.token_ids, result.stats.tokens_per_s
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
import threading
import weakref
from dataclasses import replace
from functools import cached_property
from numbers import Integral
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import torch

from . import config as config_mod
from . import hub
from .decoders import DECODERS
from .compiled.packed import LAYER_MODULES
from .compiled.steps import CompiledSteps
from .compiled.build import identity
from .compiled.timing import read_step_costs
from .runtime.events import Prefill, Result, Step
from .runtime.memory import MB
from .runtime.model import Model, quiet_transformers
from .runtime.sampling import Sampling
from .runtime.session import Emitter, Request, Session
from .runtime.syncs import counted
from .errors import FafoError, first_line, print_notice, says_out_of_memory

Prompt = str | Sequence[dict]
# Settings that shape the loaded model; the others may change per request.
LOAD_KEYS = {"model", "dtype", "device", "gpus", "cuda_graphs", "trust_remote_code", "allow_pickle", "draft_model",
             "compile"}
# Methods that run on a model spread over GPUs: their attention is plain masked attention over each layer's cache
# (FAFO and lookahead without a compressed view); the others keep per-layer copies of the cache on one device.
SPREAD_METHODS = ("vanilla", "prompt-lookup", "suffix", "cacheback", "lookahead")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise FafoError("--device cuda: CUDA is not available on this machine (this torch build or driver has none)")
    if name == "mps" and not torch.backends.mps.is_available():
        raise FafoError("--device mps: Apple's MPS backend is not available on this machine")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    if device.type == "mps":
        return torch.float16
    # On CPUs with native bf16 (AVX512-BF16/AMX) half the bytes per step is a clear win; elsewhere it is emulated
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively, as its flags say; no where they are not listed (off Linux): oneDNN's
    check says yes on any AVX-512 CPU, Skylake's included, where bf16 is emulated (slow, and not float32's tokens)."""
    from .compiled.kernels.loader import cpu_flags

    return bool(set(cpu_flags().split()) & NATIVE_BF16_FLAGS)


NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})  # x86's, and Arm's (/proc/cpuinfo's names)


def load(model: str | os.PathLike | None = None, *, notify: Callable[[str], None] | None = None,
         **settings) -> "Engine":
    """Load a model (hub id, folder, .gguf; None: the embedded default) with config settings as keywords.
    `notify` receives one-line notices (compilation progress, fallbacks); default: standard error."""
    if notify is not None and not callable(notify):
        raise FafoError(f"notify must be a function of one notice (got {notify!r})")
    config = config_mod.build(model=None if model is None else os.fspath(model), **settings)
    # every call may name its method: the draft model TriForce reads is loaded wherever one is configured
    return Engine.from_config(config, notify=notify, load_draft=config.draft_model is not None)


def _weakly(method: Callable) -> Callable:
    """A bound method that does not keep its object alive: the engine's compiled steps keep their builder, which
    held the engine in a cycle (its model stayed in memory after `del engine` until a garbage collection)."""
    ref = weakref.WeakMethod(method)

    def call(*args, **kwargs):
        from .compiled.build import CompileError

        bound = ref()
        if bound is None:  # (steps kept after their engine: nothing to build for, not a failure to record)
            raise CompileError("the engine these steps were built for is gone", transient=True)
        return bound(*args, **kwargs)

    return call


class Engine:
    def __init__(self, model: Model, tokenizer, folder: Path, config: config_mod.Config,
                 notify: Callable[[str], None] = print_notice):
        self.model = model
        self.tokenizer = tokenizer
        self.folder = folder
        self.config = config
        # keys of `config` its caller gave explicitly (a command's flags): each must have an effect on every request
        # (config.check_given); the config file's and load()'s are defaults, which a request might not use
        self.explicit: frozenset[str] = frozenset()
        self.explicit_variables: frozenset[str] | None = None  # of chat_template_kwargs, the flag's (None: all)
        self._answering: object | None = None  # the stream the session serves (see _generate)
        self._computing = threading.RLock()  # held while a step computes (see _one_at_a_time)
        self._stepping = False  # a step computes (the thread holding _computing is inside it: a callback's)
        self.session = Session(model, tokenizer)
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))
        self.stop_ids = _stop_ids(model.hf.generation_config, tokenizer, gguf=hub.is_converted(folder))
        self.sampling_defaults = _sampling_defaults(model.hf.generation_config)
        # CompiledSteps or GraphSteps; also in session.compiled while in use (bench toggles it)
        self.compiled: CompiledSteps | None = None
        self.count_syncs = False  # count host-device synchronisations per step on CUDA (`fafo run --verbose`)
        self.notify = notify  # one-line notices (load's `notify`)

    @classmethod
    def from_config(cls, config: config_mod.Config, notify: Callable[[str], None] | None = None,
                    load_draft: bool | None = None) -> "Engine":
        """The engine `config` describes. `load_draft`: whether to load `config.draft_model`, which TriForce alone reads
        (None: where the method is triforce: a command that runs one method; a server and `load` may run TriForce on
        any request, and load it wherever one is configured)."""
        notify = notify or print_notice
        device = pick_device(config.device)
        check_compile(config, device)  # (before minutes of loading)
        dtype = pick_dtype(config.dtype, device)
        tokenizer, hf_model, folder = _load_model(config.model, config, device, dtype, notify)
        engine = cls(Model(hf_model), tokenizer, folder, config, notify)
        if (penalty := _unapplied_penalty(hf_model.generation_config)) is not None:
            notify(f"{engine.name}'s generation_config.json sets repetition_penalty {penalty:g}, which fafo does "
                   "not apply (transformers' generate() would)")
        engine.session.step_costs = read_step_costs(engine.steps_folder)
        if _use_graphs(engine.model, config):
            from .compiled.graphs import GraphSteps

            engine.compiled = engine.session.compiled = GraphSteps(engine.model, notify)
        elif config.compile != "off" and not engine.model.spread:  # compiled steps trace one device's graph
            engine.compiled = CompiledSteps(engine.model, engine.steps_folder, mode=config.compile,
                                            notify=notify, gguf=engine.gguf,
                                            serves=engine.steps_serve,
                                            builder=_weakly(engine.build_elsewhere) if device.type == "cpu" else None)
            engine.session.compiled = engine.compiled
            engine.compiled.install_packed()
        if config.draft_model is not None and (config.method == "triforce" if load_draft is None else load_draft):
            draft_tokenizer, draft, _ = _load_model(config.draft_model, config, device, dtype, notify)
            if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
                raise FafoError(f"the draft model {config.draft_model} does not share the tokenizer of "
                                f"{engine.name} (their vocabularies differ)")
            draft_model = Model(draft)
            if draft_model.vocab_size > engine.model.vocab_size:
                raise FafoError(f"the draft model {config.draft_model} has a larger vocabulary "
                                f"({draft_model.vocab_size}) than {engine.name} ({engine.model.vocab_size})")
            engine.session.draft_model = draft_model
        return engine

    @cached_property
    def hf_model(self):
        """This model as transformers' own class (the bench's hf-generate rows): loaded once, on first use, where
        our modules run it."""
        from transformers import PreTrainedModel

        if isinstance(self.model.hf, PreTrainedModel):
            return self.model.hf
        weights = hub.weights_in(self.folder, str(self.model.dtype).removeprefix("torch."), self.notify)
        return transformers_model(weights, self.config, self.model.dtype, self.model.device)

    @cached_property
    def gguf(self) -> Path | None:
        """The .gguf file a converted model came from, where it is still there (hub.gguf_source): looked for once,
        as the compiled steps' folder and their packed blocks must agree on it."""
        return hub.gguf_source(self.folder)

    @cached_property
    def steps_folder(self) -> Path:
        """Where this model's compiled steps and measured step costs live."""
        return _compiled_folder(self.model, self.folder, self.gguf is not None)

    @property
    def steps_serve(self) -> dict:
        """What `steps_folder` serves (compiled.steps.claim_steps_folder): this model folder, dtype and device kind."""
        return {"model": str(self.folder.resolve()), "dtype": str(self.model.dtype), "device": self.model.device.type}

    def build_elsewhere(self, rows: int, package: Path) -> None:
        """CompiledSteps' builder: the `rows`-row package built at `package` by a process of its own
        (build_process.py), which loads this model again; CompileError with that process's last line if it fails."""
        import shutil
        import subprocess

        from .compiled.build import CompileError
        from .files import remove_abandoned, scratch_dir

        job = {**self.steps_serve, "dtype": str(self.model.dtype).removeprefix("torch."), "rows": rows,
               "package": str(package.absolute()), "folder": str(self.steps_folder.absolute()),
               "allow_pickle": self.config.allow_pickle, "trust_remote_code": self.config.trust_remote_code,
               "parent": os.getpid()}
        # torch's compiler leaves its work in the system's temporary folder (the sources, a library holding the
        # weights, the package unpacked to be checked: hundreds of MB a build, never removed): this build's go to a
        # folder of its own beside the packages, removed after it (one a killed process left, by the next build)
        remove_abandoned(package.parent, ".build")
        scratch = str(scratch_dir(package.parent, ".build"))
        # the cache this engine was loaded with (whatever it is now), and this very fafo_cli on the import path (the
        # current folder's modules not before it: -P's PYTHONSAFEPATH, and on Python 3.10, which has none, a current
        # folder of its own)
        env = {**os.environ, "FAFO_CACHE": str(self.steps_folder.parent.parent.absolute()), "PYTHONSAFEPATH": "1",
               "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), *(
                   os.path.abspath(entry) for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry)]),
               "TMPDIR": scratch, "TORCHINDUCTOR_CACHE_DIR": os.path.abspath(os.environ.get("TORCHINDUCTOR_CACHE_DIR")
                                                                            or scratch)}  # (it runs in `scratch`)
        try:
            process = subprocess.Popen([sys.executable, "-m", "fafo_cli.build_process", json.dumps(job)],
                                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                       text=True, errors="replace", env=env, cwd=scratch)
            try:
                _, said = process.communicate()
            finally:  # (Ctrl-C reaches it too; whatever else stopped this one, it must not go on alone)
                if process.poll() is None:
                    process.kill()
                    process.wait()
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if process.returncode < 0:  # killed: by the kernel when memory ran out (it holds a second copy of the model)
            number = -process.returncode
            try:
                name = signal.Signals(number).name
            except ValueError:  # (a real-time signal has no name)
                name = f"signal {number}"
            raise CompileError(f"the building process was killed ({name}"
                               + (": out of memory?)" if number == signal.SIGKILL else ")"), transient=True)
        if process.returncode != 0:
            lines = [line for line in said.splitlines() if line.strip()]
            last = lines[-1] if lines else f"the building process ended with code {process.returncode}"
            raise CompileError(last, transient=says_out_of_memory(last))

    @property
    def name(self) -> str:
        return self.config.model or hub.EMBEDDED_NAME

    @property
    def packed_matrices(self) -> int:
        """Matrices every step reads as the .gguf file's blocks (compiled/packed.py); 0: dense weights."""
        return self.model.packed_matrices

    @cached_property
    def weights(self) -> str:
        """The weight format the model runs on, in words ("Q4_1 GGUF, dequantized to float32", "safetensors bf16")."""
        if not self.packed_matrices:
            return hub.weights_format(self.folder, str(self.model.dtype).removeprefix("torch."))
        matrices = len(self.model.layers) * len(LAYER_MODULES) + 1  # the layers' projections, the vocabulary head
        dense = "" if self.packed_matrices == matrices else f", {matrices - self.packed_matrices} matrices dense"
        return " ".join(filter(None, [hub.converted_quantization(self.folder), f"GGUF, read as stored{dense}"]))

    def encode(self, prompt: Prompt, config: config_mod.Config | None = None, tokenizer=None) -> list[int]:
        """Token ids for a prompt string or a list of chat messages, with the chat template when enabled.
        `tokenizer`: a copy of the engine's, for a thread other than the one that decodes (the server's requests)."""
        config = config or self.config
        tokenizer = self.tokenizer if tokenizer is None else tokenizer
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else _messages(prompt)
        templated = config.chat_template and self.has_chat_template
        # (without the template, a configured system prompt is left out, as a string prompt's always was)
        if config.system and templated and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": config.system})
        for message in messages:
            _check_text(message["content"], "the prompt")
            _check_text(message.get("name", ""), "a message's name")
        if templated:
            from jinja2 import TemplateError  # what transformers renders chat templates with

            try:
                encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                        return_dict=True, **config_mod.template_variables(config))
            except TemplateError as e:  # e.g. Llama-2's and Mistral's on a system message or two user turns
                raise FafoError(f"the model's chat template refused the messages: {first_line(e)}") from None
            ids = list(encoded["input_ids"])
        else:  # plain continuation of the text (the caller says so to the user)
            text = prompt if isinstance(prompt, str) else _continued(messages)
            ids = tokenizer(text)["input_ids"]
            # a prompt that opens with the BOS the tokenizer adds (a raw template) gets no second one
            if len(ids) > 1 and ids[0] == ids[1] and tokenizer(text, add_special_tokens=False)["input_ids"] == ids[1:]:
                ids = ids[1:]
        if not ids:
            raise FafoError("the prompt is empty")
        return ids

    def request_config(self, **overrides) -> config_mod.Config:
        fixed = LOAD_KEYS & {k for k, v in overrides.items() if v is not None}
        if fixed:
            raise FafoError(f"'{sorted(fixed)[0]}' is fixed when the model is loaded; call load() again to change it")
        config = config_mod.build(self.config, **overrides)
        unset = {key: value for key, value in self.sampling_defaults.items() if getattr(config, key) is None}
        config = replace(config, **unset)  # what the user left empty: the model's own defaults
        if self.model.spread and config.compressor == "auto":  # the one compressor that runs on a spread model
            config = replace(config, compressor="none")  # (before the check: a compressor's settings do nothing)
        self.check_given(config, self.explicit, self.explicit_variables)
        if config.temperature > 0 and config.seed is None:  # a fresh seed, reported so the run can be repeated
            config = replace(config, seed=secrets.randbits(31))
        return config

    def check_given(self, config: config_mod.Config, given: Iterable[str], variables: Iterable[str] | None = None
                    ) -> None:
        """`config.check_given` on this engine's device, `chat_template` and TEMPLATE_KEYS only for a model with a
        chat template, and the template `variables` given (None: all of the config's) only where it reads them (a
        config file's others are defaults, as its keys are)."""
        config_mod.check_given(config, given, accelerator=self.model.device.type != "cpu")
        for key in ("chat_template", *config_mod.TEMPLATE_KEYS):  # nothing changes: the prompt goes in as plain text
            if key in given and getattr(config, key) and not self.has_chat_template:
                raise FafoError(f"'{key}' needs a chat template, and {self.name} has none")
        if "chat_template_kwargs" in given and config.chat_template_kwargs:
            from jinja2 import TemplateError

            from .runtime.tokenizer import variables_read

            template = self.tokenizer.chat_template  # (transformers' may hold named ones: it renders the default)
            try:
                read = variables_read(template if isinstance(template, str) else template.get("default") or "")
            except TemplateError as e:
                raise FafoError(f"the model's chat template cannot be read: {first_line(e)}") from None
            given_variables = config_mod.template_variables(config) if variables is None else variables
            unread = [name for name in given_variables if name not in read]
            if unread:
                others = sorted(read - config_mod.TEMPLATE_RESERVED)
                raise FafoError(f"'chat_template_kwargs': the chat template of {self.name} reads no variable "
                                f"{unread[0]!r} (it reads: {', '.join(others) or 'none'})")

    def settings(self, config: config_mod.Config) -> dict:
        return {**config.to_dict(), "chat_template_kwargs": config_mod.template_variables(config) or None,
                "model": self.name, "model_path": str(self.folder), "weights": self.weights,
                "dtype": str(self.model.dtype).removeprefix("torch."), "device": str(self.model.device)}

    def stream(self, prompt: Prompt, *, stop: Sequence[str] = (), on_prefill: Callable[[Prefill], None] | None = None,
               **overrides) -> Iterator[Step]:
        """Generate an answer, yielding one Step per forward pass (the last one has `finish_reason`). `stop`: strings
        that end the answer where one first appears (it is not included; finish_reason "stop"). `on_prefill` is told
        the prefill's progress after each chunk of a long prompt."""
        def answer() -> Iterator[Step]:
            config = self.request_config(**overrides)
            yield from self._generate(self.encode(prompt, config), config, stop, on_prefill)

        return self._one_at_a_time(answer())

    def generate(self, ids: list[int], config: config_mod.Config, stop: Sequence[str] = (),
                 on_prefill: Callable[[Prefill], None] | None = None) -> Iterator[Step]:
        """`stream` for prompt token ids (`encode`) and a config from `request_config`."""
        return self._one_at_a_time(self._generate(ids, config, stop, on_prefill))

    def _one_at_a_time(self, steps: Iterator[Step]) -> Iterator[Step]:
        """`steps`, each computed under the engine's lock (the tokenizer's work too): an answer asked from another
        thread while one computes is refused, never interleaved."""
        suspended = False  # after a step, before the next: closing the answer then rolls the cache back
        try:
            while True:
                if not self._computing.acquire(blocking=False):
                    raise FafoError("this engine is computing an answer in another thread; an engine runs one "
                                    "answer at a time (take turns, or load an engine per thread)")
                try:
                    self._refuse_inside_a_step()
                    suspended, self._stepping = False, True
                    try:
                        step = next(steps)
                    finally:
                        self._stepping = False
                except StopIteration:
                    return
                finally:
                    self._computing.release()
                suspended = True
                yield step
        finally:  # (closed early: its rollback waits for another thread's step; reentrant for a collected stream's)
            if suspended:
                with self._computing:
                    steps.close()

    def _refuse_inside_a_step(self) -> None:
        """The lock is reentrant (a stream collected during another's step closes under it): a callback of a step
        (on_prefill) that asks this engine for an answer or a reset is refused, not run inside the step."""
        if self._stepping:
            raise FafoError("an answer or a reset was asked of this engine from inside one of its own steps (an "
                            "on_prefill callback); an engine runs one answer at a time")

    def _generate(self, ids: list[int], config: config_mod.Config, stop: Sequence[str],
                  on_prefill: Callable[[Prefill], None] | None) -> Iterator[Step]:
        if self.model.spread:
            check_spread(config)
        context = self.model.max_context
        if not ids:  # (encode refuses an empty text; ids may come from elsewhere)
            raise FafoError("the prompt is empty")
        if len(ids) >= context:
            raise FafoError(f"the prompt is {len(ids)} tokens; the model's context is {context} tokens, and an answer "
                            "needs at least one more")
        # (ids from elsewhere: beyond the embedding an index error on a CPU, a device-side assert on a GPU)
        if not all(isinstance(i, Integral) and not isinstance(i, bool) and 0 <= i < self.model.vocab_size for i in ids):
            raise FafoError(f"prompt token ids must be integers from 0 to {self.model.vocab_size - 1}")
        stop = (stop,) if isinstance(stop, str) else stop  # one string is one stop string, not its characters
        if not isinstance(stop, Sequence) or not all(isinstance(s, str) for s in stop):
            raise FafoError(f"stop must be a string or a list of strings (got {stop!r})")
        if not all(stop):
            raise FafoError("a stop string must not be empty")
        for text in stop:
            _check_text(text, "a stop string")
        if on_prefill is not None and not callable(on_prefill):
            raise FafoError(f"on_prefill must be a function (got {on_prefill!r})")
        sampling = Sampling.of(config)
        stop_ids, stop = self.token_stops(stop)
        request = Request(ids, config.max_tokens, sampling, self.stop_ids | stop_ids, config, stop, on_prefill,
                          continues_text=not (config.chat_template and self.has_chat_template))
        # the session (cache, ids, what decoders learn) serves one answer at a time: one started while this stream
        # was suspended took it over, and this one may neither go on nor undo anything of it
        self._answering = owner = object()
        emitter = Emitter(self.session, request, self.tokenizer)
        try:
            self.session.recall(ids)  # (out of memory while it loads a kept copy: the finally empties the cache)
            steps = DECODERS[config.method](self.session, request, emitter)
            for step in counted(steps, self.model.device) if self.count_syncs else steps:
                yield step
                if step.finish_reason:  # delivered whole: what ran meanwhile (a next request) took nothing of it
                    return
                if self._answering is not owner:
                    raise FafoError("another answer started on this engine (or it was reset) before this stream "
                                    "was finished; an engine runs one answer at a time (finish or close a stream "
                                    "first, or load a second engine)")
        finally:  # interrupted mid-step (Ctrl-C, consumer stopped): keep cache and ids consistent
            if self._answering is owner:
                self._answering = None
                keep = min(len(self.session.ids), self.session.cache.length)
                if emitter.done:  # guesses a step committed past a stop or limit were never emitted: as plain
                    keep = min(keep, len(ids) + len(emitter.token_ids) - 1)  # decoding, all but the last token
                self.session.rollback(keep)

    def token_stops(self, stop: Sequence[str], tokenizer=None) -> tuple[frozenset[int], tuple[str, ...]]:
        """The stop strings that are one special token's text (`<|im_end|>` sent by a client whose template ends
        turns with it), as stop ids: the shown text never holds a special token, so as strings they would never
        match. And the other stop strings. `tokenizer`: another thread's copy of the engine's."""
        tokenizer = self.tokenizer if tokenizer is None else tokenizer
        ids, strings = set(), []
        for text in stop:
            encoded = tokenizer(text, add_special_tokens=False)["input_ids"]
            decode = tokenizer.decode  # (a SentencePiece "▁" decodes to nothing either way: not special)
            shown = decode(encoded, skip_special_tokens=True)
            if len(encoded) == 1 and not shown and decode(encoded) == text:
                ids.add(encoded[0])
            elif shown != decode(encoded):  # it would never match: the shown text holds no special token
                raise FafoError(f"the stop string {json.dumps(text)[:60]} holds a special token's text among other "
                                "text, which the answer's text never shows: send the special token alone")
            else:
                strings.append(text)
        return frozenset(ids), tuple(strings)

    def complete(self, prompt: Prompt, *, stop: Sequence[str] = (), on_prefill: Callable[[Prefill], None] | None = None,
                 **overrides) -> Result:
        """`stream`'s answer whole."""
        config = self.request_config(**overrides)
        steps = list(self.stream(prompt, stop=stop, on_prefill=on_prefill, **{**overrides, "seed": config.seed}))
        last = steps[-1]
        token_ids = [t for step in steps for t in step.token_ids]
        return Result("".join(s.text for s in steps), token_ids, last.stats, last.finish_reason,
                      self.settings(config))

    def reset(self) -> None:
        """Forget the cached conversation (the next request prefills from scratch), the kept ones, and what decoders
        learned from earlier answers. A stream not finished yet stops (see _generate); one computing a step in
        another thread finishes that step first (the cache is not emptied under it)."""
        with self._computing:
            self._refuse_inside_a_step()
            self._answering = None
            self.session.reset()

    def keep_conversations(self, count: int, max_mb: float) -> None:
        """Keep the caches of up to `count` earlier conversations besides the live one (at most `max_mb` MB of keys
        and values), so that clients taking turns each prefill only their new tokens (`fafo serve` does)."""
        self.session.keep_conversations(count, int(max_mb * MB))


def check_compile(config: config_mod.Config, device: torch.device) -> None:
    """`compile: on` builds compiled steps for a CPU: on a GPU a dense model's packages would each hold a copy of its
    weights (a 7B model's 13 GB, one per step size), and none has ever been built there; a GPU's decoding steps run
    as CUDA graphs instead (`cuda_graphs: auto`)."""
    if config.compile == "on" and device.type != "cpu":
        graphs = ("its decoding steps run as CUDA graphs (cuda_graphs: auto)" if device.type == "cuda" else
                  "it runs eager")
        raise FafoError(f"compile: on builds compiled steps for a CPU, not for {device.type}: {graphs}; give "
                        "--no-compile, or leave compile at auto in the config file")


def _use_graphs(model: Model, config: config_mod.Config) -> bool:
    """`cuda_graphs`: decoding steps as CUDA graphs (compiled/graphs.py); `auto` on one CUDA GPU, `on` refuses what
    it cannot do (`compile: on`, CPU packages, is refused on a GPU before: check_compile)."""
    from .compiled.build import STATIC_ROPE

    # (transformers' dynamic rotary scalings compare the positions with what they cached, on the host: no capture)
    rope = getattr(model.rotary, "rope_type", "default")
    usable = model.device.type == "cuda" and config.compile != "on" and not model.spread and rope in STATIC_ROPE
    if config.cuda_graphs != "on":
        return usable and config.cuda_graphs == "auto"
    if model.device.type != "cuda":
        raise FafoError(f"--cuda-graphs needs a CUDA device; the device here is {model.device.type}")
    if model.spread:
        raise FafoError("--cuda-graphs captures one device's steps; not with --gpus")
    if rope not in STATIC_ROPE:
        raise FafoError(f"--cuda-graphs: this model's rotary scaling ({rope}) is recomputed from the text's length "
                        "on the host at each step, which a CUDA graph cannot hold")
    return True


def check_spread(config: config_mod.Config) -> None:
    """A model spread over GPUs runs the methods whose attention is plain masked attention (SPREAD_METHODS)."""
    if config.method == "fafo" and config.attention == "block":
        raise FafoError("the block attention path keeps one cache tensor for all layers; on a model spread over GPUs "
                        "(--gpus) use --attention split")
    if config.method == "fafo" and config.compressor not in ("auto", "none"):  # (auto is none there: request_config)
        raise FafoError(f"fafo's {config.compressor} compressor keeps its view of the cache on one GPU; on a model "
                        "spread over GPUs (--gpus) use --compressor none")
    if config.method not in SPREAD_METHODS + ("fafo",):
        raise FafoError(f"method {config.method} keeps a second cache on one GPU and does not run on a model spread "
                        f"over GPUs (--gpus); these do: fafo (--compressor none), {', '.join(SPREAD_METHODS)}")


def _spread_map(config: config_mod.Config, weights: Path, device: torch.device, dtype: torch.dtype) -> dict | None:
    """accelerate's device_map for `gpus` > 1 (runtime/placement.py); None: the whole model on `device`."""
    if config.gpus == 1:
        return None
    if device.type != "cuda":
        raise FafoError(f"--gpus {config.gpus} spreads the model over CUDA GPUs; the device here is {device.type}")
    if config.compile == "on":
        raise FafoError(f"--gpus {config.gpus}: compiled steps run on one device; use --no-compile")
    if torch.cuda.device_count() < config.gpus:
        raise FafoError(f"--gpus {config.gpus}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from .runtime import placement
    from .runtime.model import max_context

    hf_config = AutoConfig.from_pretrained(weights, trust_remote_code=config.trust_remote_code)
    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, trust_remote_code=config.trust_remote_code)
    free = [torch.cuda.mem_get_info(i)[0] for i in range(config.gpus)]
    try:
        return placement.plan(empty, dtype.itemsize, max_context(hf_config), free)
    except placement.DoesNotFit as e:
        raise FafoError(f"--gpus {config.gpus}: {e}") from None


def _load_model(name: str | None, config: config_mod.Config, device: torch.device, dtype: torch.dtype,
                notify: Callable[[str], None]):
    """(tokenizer, transformers model on `device` or spread over `gpus` GPUs, folder) for a hub id, folder or .gguf
    (None: the embedded one); `notify`: the notices of its conversion or download."""
    from safetensors import SafetensorError

    from .runtime import llama

    folder = hub.resolve(name, allow_pickle=config.allow_pickle, trust_remote_code=config.trust_remote_code,
                         notify=notify)
    weights = hub.weights_in(folder, str(dtype).removeprefix("torch."), notify)
    device_map = _spread_map(config, weights, device, dtype)
    try:
        # our own modules where they compute the checkpoint exactly: transformers' model classes cost seconds
        # to import; a model spread over GPUs or with code of its own loads through transformers
        lean = None if device_map is not None or config.trust_remote_code else llama.load(weights, dtype, device)
        tokenizer = load_tokenizer(folder, config, lean.config if lean is not None else None)
        model = lean if lean is not None else transformers_model(weights, config, dtype, device, device_map)
    except (OSError, ValueError, SafetensorError) as e:  # (a weights file cut short: safetensors' own error)
        raise FafoError(f"cannot load the model in {folder}: {first_line(e)}") from None
    return tokenizer, model, folder


def load_tokenizer(folder: Path, config: config_mod.Config, model_config=None):
    """The folder's tokenizer: ours where tokenizer.json is the whole of it (half a second of transformers' imports
    spared), else transformers'."""
    from .runtime.tokenizer import lean_tokenizer

    try:
        lean = lean_tokenizer(folder, hub.is_converted(folder), config.trust_remote_code)
    except ValueError as e:
        raise FafoError(first_line(e)) from None
    if lean is not None:
        return lean
    from transformers import AutoTokenizer

    from .runtime import llama

    # the model's config given to the tokenizer spares transformers loading its own (a second of imports)
    known = {"config": llama.Config(**{**vars(model_config), "_name_or_path": str(folder)})} if model_config else {}
    with quiet_transformers():
        try:
            return AutoTokenizer.from_pretrained(folder, trust_remote_code=config.trust_remote_code, **known)
        except MemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - `tokenizers` raises plain Exceptions on a file it cannot read
            raise FafoError(f"cannot load the tokenizer in {folder}: {first_line(e, named=True)}") from None


def transformers_model(weights: Path, config: config_mod.Config, dtype: torch.dtype, device: torch.device,
                       device_map: dict | None = None):
    """The checkpoint as transformers' own model class (hf-generate rows, models our modules do not cover)."""
    from transformers import AutoModelForCausalLM

    with quiet_transformers():
        model, loading = AutoModelForCausalLM.from_pretrained(
            weights, dtype=dtype, trust_remote_code=config.trust_remote_code,
            use_safetensors=None if config.allow_pickle else True, device_map=device_map, output_loading_info=True)
    missing = sorted(loading.get("missing_keys") or ())
    if missing:  # (transformers fills them with random numbers, and says so in a warning quieted above)
        raise ValueError(f"its weights hold nothing for {len(missing)} of the model's parameters (such as "
                         f"{missing[0]}): a file cut short, or a checkpoint of another model")
    if device_map is None:
        model.to(device)
    return model.eval()


def _compiled_folder(model: Model, folder: Path, packed: bool) -> Path:
    """Where this model's compiled steps live: named by its folder, weight files and code of its own (size, time),
    dtype, device, and whether its .gguf file is there (`packed`: its packages read the file's blocks instead of
    holding weights)."""
    folder = folder.resolve()  # `fafo run .` and a link to the folder: the same steps (and the building process's)
    weights = sorted((p.name, stat.st_size, stat.st_mtime_ns) for p in folder.iterdir()
                     # (.py: a trust_remote_code model's; not an editor's lock file, a link to nothing)
                     if p.suffix in {".safetensors", ".bin", ".gguf", ".pt", ".py"} and not p.name.startswith(".")
                     and (stat := _stat(p)) is not None)
    source = json.dumps([str(folder), weights, packed])
    return hub.compiled_steps_folder(folder, identity(model, source))


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except OSError:
        return None


TRANSFORMERS_TOP_K = 50  # what transformers' generate() samples with where a sampling config names no top_k


def _sampling_defaults(generation_config) -> dict:
    """The model's sampling settings (generation_config.json), as transformers would apply them."""
    fallback = {"temperature": 0.0, **config_mod.SAMPLING_NEUTRAL}
    if not getattr(generation_config, "do_sample", False):
        return fallback
    given = {key: getattr(generation_config, key, None) for key in fallback}
    return {**fallback, "temperature": 1.0, "top_k": TRANSFORMERS_TOP_K,
            **{key: value for key, value in given.items() if value is not None}}


def _unapplied_penalty(generation_config) -> float | None:
    """The repetition penalty a model's generation_config.json asks for (Qwen2.5's files do), which no method here
    applies: its answers are plain decoding's without it, where transformers' generate() would apply it."""
    penalty = getattr(generation_config, "repetition_penalty", None)
    return penalty if isinstance(penalty, (int, float)) and penalty != 1.0 else None


# The tokens llama.cpp ends a generation at besides a .gguf file's eos, by their text (llama-vocab.cpp's
# end-of-generation set: ends of turns, and the fill-in-the-middle separators a completion must not run past): a
# converted .gguf model stops where llama.cpp and ollama stop it (Qwen2.5's files name <|im_end|> alone, and a
# completion without the chat template ends at <|endoftext|> or, for the coder models, <|file_sep|>)
GGUF_END_TOKENS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
                   "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
                   "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")


def _stop_ids(generation_config, tokenizer, gguf: bool = False) -> frozenset[int]:
    """The model's generation_config decides, as in transformers; the tokenizer's eos is the fallback; a converted
    .gguf model also ends at GGUF_END_TOKENS."""
    ids = getattr(generation_config, "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    stops = set([ids] if isinstance(ids, int) else ids or [])
    if gguf:
        vocab = tokenizer.get_vocab()
        stops |= {vocab[token] for token in GGUF_END_TOKENS if token in vocab}
    return frozenset(stops)


def _check_text(text, what: str) -> None:
    """`text` is text the tokenizer can take: undecodable bytes read as surrogate escapes (standard input in
    some locales) or a JSON string's lone \\ud800-style escape are not characters."""
    if isinstance(text, str):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise FafoError(f"{what} is not UTF-8 text: character {e.start + 1} is a lone surrogate "
                            f"({ascii(text[e.start])}), not a character") from None


ROLES = ("system", "user", "assistant")  # what every supported chat template takes


def _continued(messages: list[dict]) -> str:
    """A conversation as plain text, for a model without a chat template: each message on a line of its own but an
    assistant's, which goes on from the text before it as the model wrote it (a next turn's prompt then holds the
    answer's tokens as they were, and the cache serves them)."""
    return "".join(("" if i == 0 or m["role"] == "assistant" else "\n") + m["content"]
                   for i, m in enumerate(messages))


def _messages(prompt) -> list[dict]:
    """A prompt's chat messages, each a dict with a string `role` and string `content` (copied), and optionally the
    speaker's `name`, which the chat template may show (as transformers passes it; SmolLM2's and Qwen's do not)."""
    if isinstance(prompt, (bytes, dict)) or not isinstance(prompt, Sequence):
        raise FafoError(f"a prompt is a string or a list of messages {{'role': ..., 'content': ...}} (got "
                        f"{type(prompt).__name__})")
    if not prompt:
        raise FafoError("the prompt has no messages")
    for i, message in enumerate(prompt):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str) or set(message) - {"role", "content", "name"} \
                or not isinstance(message.get("name", ""), str):
            raise FafoError(f"message {i} of the prompt must be a dict of a string 'role' and string 'content' "
                            f"(and optionally a string 'name') (got {message!r:.80})")
        if message["role"] not in ROLES:
            raise FafoError(f"message {i} of the prompt: the role must be one of {', '.join(ROLES)} (got "
                            f"{message['role']!r})")
    return [dict(message) for message in prompt]
