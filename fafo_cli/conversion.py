"""A .gguf model written as a float32 safetensors folder that transformers and our modules load, a block at a time.

transformers reads a .gguf file by dequantizing every tensor into one dict and loading a model from it: more than the
model's float32 size in memory at once (an 8B model: over 32 GB), to be written out again. Here its config, tokenizer
and tensor names come from transformers as before (its GGUF name mapping, and its processors that undo llama.cpp's
reordering of query and key rows), but each tensor is dequantized and appended to the file a block of rows at a time
(a query or key matrix whole, where its rows are reordered): a conversion's memory does not grow with the model.
"""

from __future__ import annotations

import copy
import functools
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from .errors import FafoError, first_line
from .files import write_safetensors
from .gguf_header import GgufHeader

BLOCK_BYTES = 64 << 20  # a large tensor is dequantized and written this many float32 bytes of rows at a time
# what transformers' GGUF reading raises on metadata it does not expect (a tokenizer without merges: an
# AttributeError, transformers#31553), besides the ValueError it raises on purpose
GGUF_PARSE_ERRORS = (ValueError, KeyError, NotImplementedError, AttributeError, TypeError, IndexError)
_HEADER_PATCH = threading.Lock()


@contextmanager
def _read_once() -> Iterator[None]:
    """Within this block, what transformers reads of a .gguf file and of gguf's tables is read once: the file's
    whole header, which it reads for the config, then again while it loads the tokenizer (from our walk of it: see
    _read_with_our_header_walk), and gguf's tensor name map, which its name mapping builds again for each of the
    model's submodules (3 s for a 24-layer model). A transformers or gguf without those functions reads them as
    before."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as module

    kept: dict[str, dict] = {}
    read = getattr(module, "load_gguf_checkpoint", None)

    def once(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:
            return read(path, return_tensors=return_tensors, **kwargs)
        if str(path) not in kept:
            kept[str(path)] = _read_with_our_header_walk(read, gguf, path)
        return copy.deepcopy(kept[str(path)])  # (each caller may change what it gets)

    name_map = getattr(gguf, "get_tensor_name_map", None)
    # (two conversions in threads of one process: one at a time, each restoring the libraries' own functions)
    with _HEADER_PATCH:
        patches = [(module, "load_gguf_checkpoint", read, once),
                   (gguf, "get_tensor_name_map", name_map, name_map and functools.lru_cache(maxsize=None)(name_map))]
        patches = [patch for patch in patches if patch[2] is not None]
        for owner, name, _, replacement in patches:
            setattr(owner, name, replacement)
        try:
            yield
        finally:
            for owner, name, original, _ in patches:
                setattr(owner, name, original)


def _read_with_our_header_walk(read, gguf, path) -> dict:
    """transformers' `read` (load_gguf_checkpoint: the config it reads from the header at `path`), given our walk
    of the header (gguf_header's FieldsReader: under a second, where gguf's GGUFReader takes 10-15 s for a 150k-token
    vocabulary) in place of GGUFReader; where that fails in any way (a file it refuses, a transformers that wants
    more of the reader), with GGUFReader as before."""
    from .gguf_header import FieldsReader

    original = gguf.GGUFReader
    gguf.GGUFReader = FieldsReader  # (transformers imports it from gguf when it reads; under _HEADER_PATCH)
    try:
        return read(path, return_tensors=False)
    except Exception:  # noqa: BLE001 - whatever it was, GGUFReader's own reading decides
        pass
    finally:
        gguf.GGUFReader = original
    return read(path, return_tensors=False)


@contextmanager
def _alone(path: Path) -> Iterator[tuple[str, str]]:
    """(folder, file name) of a folder of its own holding only a link to the .gguf file at `path`: transformers
    reads the tokenizer of a tokenizer.json beside a .gguf file in place of the file's own (llama.cpp's converter
    writes its .gguf file into the model's folder, beside the original's)."""
    with tempfile.TemporaryDirectory(prefix="fafo-gguf-") as folder:
        (Path(folder) / path.name).symlink_to(path.resolve())
        yield folder, path.name


def _unsaid(error: Exception) -> bool:
    """Whether an error's message means little without its type's name (a KeyError's is the key alone)."""
    return not isinstance(error, (ValueError, OSError, NotImplementedError))


ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's per-frequency rotary factors (Llama 3.1, 3.2, 3.3)
MODEL_TENSORS = ("blk.", "output", "token_embd")  # llama.cpp's names of the layers', the head's, the embedding's
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def llama3_rope(config, factors, path: Path) -> dict:
    """The rotary settings of a Llama 3.x model whose .gguf file holds them as llama.cpp writes them: a tensor of
    one factor per frequency (which transformers' GGUF reading leaves out), each frequency divided by its factor. The
    factors must be Llama 3's rule (transformers' `llama3` rotary, Meta's settings: the largest factor, low 1, high
    4, 8,192 positions originally) to the file's float32 precision; any other is refused, not run as plain rotary."""
    import numpy as np

    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    rope = dict(getattr(config, "rope_parameters", None) or {})
    theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    settings = {"rope_type": "llama3", "rope_theta": theta, "factor": float(factors.max()), **LLAMA3_ROPE}
    wavelength = 2 * np.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    original, low, high = (settings[key] for key in ("original_max_position_embeddings", "low_freq_factor",
                                                      "high_freq_factor"))
    smooth = (original / wavelength - low) / (high - low)
    expected = np.where(wavelength < original / high, 1.0, np.where(
        wavelength > original / low, settings["factor"], 1 / ((1 - smooth) / settings["factor"] + smooth)))
    if getattr(config, "model_type", None) != "llama" or factors.shape != expected.shape or \
            not np.allclose(factors, expected, rtol=1e-5):
        raise FafoError(f"cannot convert {path}: its rotary frequency factors ({ROPE_FREQS}) are not Llama 3's "
                        "scaling, the only one fafo reads from a .gguf file")
    return settings


def refuse_unconvertible(path: Path, header: GgufHeader) -> None:
    """What the header alone says fafo cannot convert, refused before the file is hashed (seconds for gigabytes)
    and its room checked: a tensor type the gguf package cannot dequantize, a mixture of experts under the llama
    architecture (Mixtral's files), a rotary scaling other than linear (yarn, longrope)."""
    from gguf.quants import GGMLQuantizationType, _type_traits

    dense = {GGMLQuantizationType.F32.name, GGMLQuantizationType.F16.name}
    integers = {"I8", "I16", "I32", "I64"}  # never a model's weights (a converter's extras, which are not read)
    unread = sorted(set(header.tensor_bytes) - dense - integers - {kind.name for kind in _type_traits})
    if unread:
        raise FafoError(f"cannot convert {path}: it holds {unread[0]} tensors, which the gguf package cannot "
                        "dequantize")
    experts, scaling, factor = unread_settings(path, header)
    if (experts or 0) > 0:
        raise FafoError(f"cannot convert {path}: it is a mixture of experts ({experts} experts), which fafo does not "
                        "run")
    if scaling not in (None, "", "none") and (scaling != "linear" or not factor or factor <= 0):
        raise FafoError(f"cannot convert {path}: its rotary scaling ({scaling}) is not one fafo reads from a .gguf "
                        "file (linear, or Llama 3's factors); the model's safetensors folder from the hub runs")


def unread_settings(path: Path, header: GgufHeader) -> tuple:
    """What a .gguf header says that transformers' GGUF reading leaves out, and that would make the converted model
    another one: (experts, rotary scaling type, its factor), each None where the header has none."""
    from .gguf_header import FieldsReader

    try:
        fields = FieldsReader(path).fields
    except ValueError:  # (what our walk refuses, transformers' reading has read: nothing more to learn here)
        return None, None, None

    def value(key: str):
        field = fields.get(f"{header.architecture}.{key}")
        if field is None:
            return None
        part = field.parts[field.data[0]]
        return bytes(part).decode("utf-8", "replace") if isinstance(part, (bytes, bytearray)) else part[0]

    factor = value("rope.scaling.factor")
    if factor is None:  # (the older key, which llama.cpp reads where the newer one is not given)
        factor = value("rope.scale_linear")
    scaling = value("rope.scaling.type")
    if scaling is None and factor and factor != 1.0:  # a factor alone: llama.cpp scales linearly by it
        scaling = "linear"
    return value("expert_count"), scaling, factor


def _read_back_linear_rotary(path: Path, header: GgufHeader, config) -> None:
    """A linear rotary scaling (the one `refuse_unconvertible` lets through) into the config, which transformers'
    GGUF reading leaves without it."""
    _, scaling, factor = unread_settings(path, header)
    if scaling == "linear":
        rope = dict(getattr(config, "rope_parameters", None) or {})
        config.rope_parameters = {**rope, "rope_type": "linear", "factor": float(factor)}


def write_gguf_as_hf(path: Path, header: GgufHeader, out: Path) -> None:
    """Write the .gguf model at `path` (`header`: its read_header) into the folder `out`: config, generation
    settings, tokenizer, and its weights dequantized into float32 (gguf's own dequantizer, as transformers reads
    them)."""
    import torch
    from accelerate import init_empty_weights
    from gguf import dequantize
    from tqdm import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, LlamaTensorProcessor, TensorProcessor,
                                                          get_gguf_hf_weights_map)

    from .gguf_header import read_tensors
    from .runtime.architectures import check_architecture
    from .runtime.model import quiet_transformers

    # (convert_gguf read the header first, so the gguf package is known to be there)
    with quiet_transformers(), _read_once(), _alone(path) as (folder, file_name):
        try:
            config = AutoConfig.from_pretrained(folder, gguf_file=file_name)
        except (OSError, *GGUF_PARSE_ERRORS) as e:
            raise FafoError(f"cannot read {path} as a GGUF model: {first_line(e, named=_unsaid(e))}") from None
        check_architecture(config.to_dict(), str(path))
        _read_back_linear_rotary(path, header, config)  # (what the header refuses, convert_gguf refused)
        try:  # (a tokenizer type transformers does not read, or metadata it trips on)
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file_name)
        except GGUF_PARSE_ERRORS as e:
            raise FafoError(f"cannot convert {path}: {first_line(e, named=_unsaid(e))}") from None
        with init_empty_weights():  # the model's parameter names, on no memory
            skeleton = AutoModelForCausalLM.from_config(config)
        settings = config.to_dict()  # (as transformers' own GGUF reading hands its processors the model's settings)
        processor = TENSOR_PROCESSORS.get(header.architecture, TensorProcessor)(config=settings)
        try:
            names = get_gguf_hf_weights_map(skeleton, processor)
        except NotImplementedError as e:  # (a model type the gguf package has no tensor names for)
            raise FafoError(f"cannot convert {path}: {first_line(e)}") from None
    try:
        tensors = read_tensors(path, header)
    except ValueError as e:  # (a tensor type the gguf package does not know)
        raise FafoError(f"cannot convert {path}: {e}") from None
    wanted = [tensor for tensor in tensors if tensor.name in names]
    # a tensor of the model's layers or head that transformers' class has no parameter for (a llama file's attention
    # biases, which llama.cpp runs and transformers' GGUF reading gives the model no room for) would be dropped
    unread = sorted(tensor.name for tensor in tensors if tensor.name not in names and tensor.name != ROPE_FREQS
                    and tensor.name.startswith(MODEL_TENSORS))
    if unread:
        raise FafoError(f"cannot convert {path}: transformers' {type(skeleton).__name__} has no parameter for "
                        f"{len(unread)} of its tensors (such as {unread[0]}), which a conversion would drop")
    rope_freqs = next((tensor for tensor in tensors if tensor.name == ROPE_FREQS), None)
    if rope_freqs is not None:  # (transformers' GGUF reading leaves it out: plain rotary, another model)
        config.rope_parameters = llama3_rope(config, dequantize(rope_freqs.data, rope_freqs.tensor_type), path)
    # a tensor of another shape than the model's parameter (a setting of the header that transformers' GGUF reading
    # leaves out: a Qwen3 file's attention.key_length) would make a conversion no load can use
    shapes = {name: tuple(parameter.shape) for name, parameter in skeleton.state_dict().items()}
    for tensor in wanted:
        shape = tuple(int(size) for size in reversed(tensor.shape))
        if shapes.get(names[tensor.name], shape) != shape:
            raise FafoError(f"cannot convert {path}: its tensor {tensor.name} is {list(shape)}, where the model "
                            f"transformers reads from its header has {list(shapes[names[tensor.name]])}")
    # a parameter without its tensor would be filled with random numbers at load (transformers warns, quietly here)
    missing = set(shapes) - {names[tensor.name] for tensor in wanted}
    if getattr(config, "tie_word_embeddings", False):
        missing.discard("lm_head.weight")
    if missing:
        raise FafoError(f"cannot convert {path}: it holds no tensor for {len(missing)} of the model's parameters "
                        f"(such as {min(missing)}): cut short, or written by a converter that left them out")
    bar = tqdm(total=len(wanted), desc="dequantizing", unit="tensor", disable=None)  # (None: on a terminal only)

    def whole(tensor) -> bool:
        """Whether transformers' processor changes this tensor as a whole (llama.cpp's query and key order)."""
        if type(processor) is TensorProcessor:
            return False
        return not isinstance(processor, LlamaTensorProcessor) or ".attn_q." in tensor.name or ".attn_k." in tensor.name

    def blocks(tensor) -> Iterable[torch.Tensor]:
        data, step = tensor.data, max(1, BLOCK_BYTES // max(1, 4 * int(tensor.shape[0])))
        rows = data.shape[0] if data.ndim > 1 and not whole(tensor) else None
        for first in range(0, rows, step) if rows is not None else [None]:
            part = data if first is None else data[first:first + step]
            try:
                array = dequantize(part, tensor.tensor_type)
            except NotImplementedError as e:  # (a tensor type the gguf package cannot dequantize)
                raise FafoError(f"cannot convert {path}: {first_line(e, named=True)}") from None
            if first is None:
                array = processor.process(weights=array, name=tensor.name, tensor_key_mapping=names,
                                          parsed_parameters={"config": settings, "tensors": {}}).weights
            yield torch.from_numpy(array if array.flags.writeable else array.copy())  # (float32 ones: the file's)
        bar.update()

    with bar:
        write_safetensors(out / "model.safetensors",
                          [(names[t.name], list(reversed(t.shape)), torch.float32,
                            functools.partial(blocks, t)) for t in wanted], metadata={"format": "pt"})
    # The weights are dequantized: a plain float32 checkpoint, not "gguf-quantized"
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    config.architectures = [type(skeleton).__name__]
    with quiet_transformers():
        config.save_pretrained(out)
        GenerationConfig.from_model_config(config).save_pretrained(out)
        tokenizer.save_pretrained(out)
