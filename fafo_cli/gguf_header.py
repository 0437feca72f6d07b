"""A .gguf file's header: the architecture it names, how its weights are quantized, and its tensors mapped from
the file.

gguf's GGUFReader builds numpy views for every entry of every array (11-30 s for the header of a model with a
150k-token vocabulary on a small CPU); this walks the key-value section and the tensor descriptions directly
(GGUF versions 2 and 3, little-endian), in a fraction of a second: skipping arrays where it only needs the
architecture and the tensors, or reading every value in GGUFReader's layout for transformers (FieldsReader).
"""

from __future__ import annotations

import math
import mmap
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import numpy as np

# GGUF value types: 0-7, 10-12 scalars (struct formats), 8 a string, 9 an array
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
MOST_NESTED = 16  # arrays of arrays (a crafted file nests them a thousand deep: Python's recursion limit)
WANTED = ("general.architecture", "general.file_type", "general.alignment", "split.count")
# tensor types stored as plain numbers, by numpy's names (gguf's reader: the others are blocks of bytes)
PLAIN = {"F32": "float32", "F16": "float16", "F64": "float64", "I8": "int8", "I16": "int16", "I32": "int32",
         "I64": "int64"}


class TensorEntry(NamedTuple):
    name: str
    dims: tuple[int, ...]  # the file's order: columns first
    kind: int  # gguf's tensor type number
    offset: int  # from the start of the data section


@dataclass(frozen=True)
class GgufHeader:
    architecture: str | None
    file_type: int | None  # general.file_type: llama.cpp's name for the mix (15: Q4_K_M); absent in some files
    tensor_bytes: dict[str, int]  # tensor type name ("Q4_K", "F32", ...) -> bytes its tensors take
    elements: int = 0  # numbers its tensors hold, all together
    tensors: tuple[TensorEntry, ...] = ()
    data_start: int = 0  # where the data section starts in the file
    parts: int = 1  # split.count: llama.cpp's gguf-split writes a large model as several files, each with some tensors

    @property
    def quantization(self) -> str | None:
        """The file type llama.cpp recorded ("Q4_K_M", "Q4_1", "F16"...), else the type holding the most bytes."""
        from gguf import LlamaFileType

        if self.file_type in {t.value for t in LlamaFileType} and self.file_type != LlamaFileType.GUESSED:
            return LlamaFileType(self.file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        if not self.tensor_bytes:
            return None
        return max(self.tensor_bytes, key=self.tensor_bytes.__getitem__)


def read_header(path: Path) -> GgufHeader:
    """The header of the .gguf file at `path`. Raises ValueError on a file that is not one, OSError on no file."""
    with open(path, "rb") as file:
        if file.seek(0, 2) < 24:
            raise ValueError("too short for a GGUF file")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            try:
                return _parse(data)
            except struct.error:  # a value read past the end
                raise ValueError("the file ends inside its header (cut short?)") from None


def _opening(data) -> tuple[int, int, int]:
    """The header's version, tensor count and key count (ValueError: not a GGUF file we read)."""
    if data[:4] != b"GGUF":
        raise ValueError("no GGUF magic number at its start")
    version, n_tensors, n_values = struct.unpack_from("<IQQ", data, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
    return version, n_tensors, n_values


def _parse(data) -> GgufHeader:
    _, n_tensors, n_values = _opening(data)
    reader = _Reader(data, 24)
    found = {}
    for _ in range(n_values):
        key = reader.string()
        kind = reader.unpack("<I")
        if key in WANTED:
            found[key] = reader.value(kind)
        else:
            reader.skip(kind)
    tensor_bytes: Counter[str] = Counter()
    tensors = []
    data_end = elements = 0  # where the last tensor's data ends, from the start of the data section
    for _ in range(n_tensors):
        tensors.append(entry := reader.tensor_entry())
        type_name, size = _tensor_type(entry.kind, entry.dims)
        tensor_bytes[type_name] += size
        elements += math.prod(entry.dims)
        data_end = max(data_end, entry.offset + size)
    alignment = found.get("general.alignment")
    alignment = alignment if isinstance(alignment, int) and alignment > 0 else 32
    data_start = -(-reader.at // alignment) * alignment  # the data section starts aligned
    if data_start + data_end > len(data):
        raise ValueError("the file ends before its tensors' data does (cut short?)")
    architecture, file_type = found.get("general.architecture"), found.get("general.file_type")
    parts = found.get("split.count")
    return GgufHeader(architecture if isinstance(architecture, str) else None,
                      file_type if isinstance(file_type, int) else None, dict(tensor_bytes), elements,
                      tuple(tensors), data_start, parts if isinstance(parts, int) and parts > 1 else 1)


@dataclass(frozen=True)
class GgufTensor:
    """A tensor of a .gguf file under the names of gguf's ReaderTensor: `shape` in the file's order (columns first),
    `data` a read-only view of the file (rows of bytes for a type of blocks, as gguf's dequantize reads them)."""
    name: str
    tensor_type: object  # gguf's GGMLQuantizationType
    shape: tuple[int, ...]
    data: "np.ndarray"


def read_tensors(path: Path, header: GgufHeader | None = None) -> list[GgufTensor]:
    """The tensors of the .gguf file at `path`, mapped from the file (what GGUFReader's tensors hold, without its
    parsing of the header's arrays); `header`: its read_header, where the caller has it. A type the gguf package
    does not know is a ValueError naming it."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    header = header or read_header(path)
    if len({entry.name for entry in header.tensors}) < len(header.tensors):
        raise ValueError("it names a tensor twice")
    # plain arrays over the mapping: np.memmap's own slicing costs more than dequantizing the slice (a converter
    # slices each tensor into thousands of row groups)
    data = np.memmap(path, mode="r").view(np.ndarray)
    tensors = []
    for entry in header.tensors:
        try:
            kind = GGMLQuantizationType(entry.kind)
        except ValueError:
            raise ValueError(f"its tensor {entry.name} is of type {entry.kind}, which the gguf package does not "
                             "know") from None
        shape = tuple(reversed(entry.dims))  # numpy's order: rows first
        start = header.data_start + entry.offset
        if kind.name in PLAIN:
            item = np.dtype(PLAIN[kind.name])
            view = data[start:start + math.prod(shape) * item.itemsize].view(item).reshape(shape)
        else:
            block, size = GGML_QUANT_SIZES[kind]
            if not shape or shape[-1] % block:
                raise ValueError(f"its tensor {entry.name} of type {kind.name} has rows of {shape[-1:]} numbers, not "
                                 f"of whole blocks of {block}")
            row = shape[-1] // block * size
            view = data[start:start + math.prod(shape[:-1]) * row].reshape(*shape[:-1], row)
        tensors.append(GgufTensor(entry.name, kind, tuple(entry.dims), view))
    return tensors


def _tensor_type(kind: int, dims: tuple[int, ...]) -> tuple[str, int]:
    """A tensor type's name and the bytes `dims` elements of it take (gguf's block sizes)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        kind = GGMLQuantizationType(kind)
    except ValueError:
        return f"type {kind}", 0  # newer than our gguf package: named by number, size unknown
    if kind not in GGML_QUANT_SIZES:
        return kind.name, 0
    block, size = GGML_QUANT_SIZES[kind]
    return kind.name, math.prod(dims) // block * size


class ReaderField(NamedTuple):
    """A key's value as gguf's ReaderField holds it: `types` (the value's type, and an array's item type after 9),
    `parts` and `data` (the parts holding the value, or each item of an array, one by one)."""
    name: str
    parts: list
    data: list[int]
    types: list[int]


class FieldsReader:
    """What transformers' GGUF loading reads of gguf's GGUFReader, from one walk of the header: `fields` (every
    key's value, as gguf's ReaderField holds it: a string as its bytes, a number in a one-item tuple) and `tensors`
    (their names). Under a second for a large vocabulary, where GGUFReader builds numpy views of every item (10-30 s).
    ValueError on what GGUFReader refuses (a key twice, a name not UTF-8) and on an array of arrays (GGUFReader's
    own layout is used for those)."""

    def __init__(self, path):
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            version, n_tensors, n_values = _opening(data)
            reader = _Reader(data, 24)
            own = (("GGUF.version", version, 4), ("GGUF.tensor_count", n_tensors, 10), ("GGUF.kv_count", n_values, 10))
            self.fields: dict[str, ReaderField] = {  # (GGUFReader's own entries first)
                name: ReaderField(name, [(value,)], [0], [kind]) for name, value, kind in own}
            for _ in range(n_values):
                key = reader.string(strict=True)  # (as GGUFReader: a file it refuses goes to it)
                if key in self.fields:
                    raise ValueError(f"the key {key} is in the header twice")
                self.fields[key] = ReaderField(key, *reader.parts(reader.unpack("<I")))
            self.tensors = [reader.tensor_entry(strict=True) for _ in range(n_tensors)]


class _Reader:
    """Little-endian values from `data`, from offset `at` on."""

    def __init__(self, data, at: int):
        self.data, self.at = data, at

    def unpack(self, fmt: str, many: bool = False):
        values = struct.unpack_from(fmt, self.data, self.at)
        self.at += struct.calcsize(fmt)
        return values if many else values[0]

    def string(self, strict: bool = False) -> str:
        """`strict`: text that is not UTF-8 is a ValueError (else its bad bytes are replaced)."""
        return self.raw_string().decode("utf-8", errors="strict" if strict else "replace")

    def tensor_entry(self, strict: bool = False) -> TensorEntry:
        name = self.string(strict)
        dims = self.unpack(f"<{self.unpack('<I')}Q", many=True)
        kind, offset = self.unpack("<IQ", many=True)
        return TensorEntry(name, dims, kind, offset)

    def raw_string(self) -> bytes:
        length = self.unpack("<Q")
        if self.at + length > len(self.data):
            raise ValueError("a string runs past the end of the file")
        self.at += length
        return bytes(self.data[self.at - length:self.at])

    def parts(self, kind: int) -> tuple[list, list[int], list[int]]:
        """A value of type `kind` as (parts, data, types): FieldsReader's fields."""
        if kind == STRING:
            return [self.raw_string()], [0], [kind]
        if kind in SCALARS:
            return [(self.unpack(SCALARS[kind]),)], [0], [kind]
        if kind != ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, count = self.unpack("<IQ", many=True)
        if item == STRING:
            parts = [self.raw_string() for _ in range(count)]
        elif item in SCALARS:
            values = self.unpack(f"<{count}{SCALARS[item][1:]}", many=True)
            parts = [(value,) for value in values]
        else:
            raise ValueError(f"an array of GGUF value type {item}")
        return parts, list(range(count)), [kind, item]

    def value(self, kind: int):
        if kind == STRING:
            return self.string()
        if kind in SCALARS:
            return self.unpack(SCALARS[kind])
        self.skip(kind)  # an array: not a value we read
        return None

    def skip(self, kind: int, depth: int = 0) -> None:
        if depth > MOST_NESTED:
            raise ValueError(f"arrays nested more than {MOST_NESTED} deep")
        if kind == STRING:
            length = self.unpack("<Q")
            self.at += length
        elif kind in SCALARS:
            self.at += struct.calcsize(SCALARS[kind])
        elif kind == ARRAY:
            item, count = self.unpack("<IQ", many=True)
            if item in SCALARS:
                self.at += count * struct.calcsize(SCALARS[item])
            else:
                for _ in range(count):
                    self.skip(item, depth + 1)
        else:
            raise ValueError(f"unknown GGUF value type {kind}")
        if self.at > len(self.data):
            raise ValueError("a value runs past the end of the file")
