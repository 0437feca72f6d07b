"""Packed GGUF blocks (compiled/packed.py, packed_linear.cpp): for every block type the kernels read, the weights
they rebuild equal gguf's own dequantizer's bit for bit, in float32 and after the bf16 rounding a bf16 model loads
with (random blocks, edge scales, negative scales and minimums), their products are a linear's of that dtype, and
each row's result does not depend on the other rows of the call. Both the kernel built for this CPU (bf16: AMX or
AVX-512 where it has them; float32: AVX2) and its plain path (what CPUs without them would run; their steps keep
dense weights)."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch

from fafo_cli.errors import FafoError

from .conftest import first_row_logits

KINDS = ["Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K"]
# (type, wide): each format the kernels read, the types packed apart for float32 rows (their codes as bytes) too
FORMATS = [(kind, False) for kind in KINDS] + [("Q4_K", True), ("Q5_0", True), ("Q6_K", True)]
# the offsets of each type's float16 fields in a block
SCALES = {"Q4_1": (0, 2), "Q8_0": (0,), "Q5_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,), "Q5_1": (0, 2)}
# float16 scales at the edges: zeros of both signs, the largest, the smallest normal and subnormals, negatives
EDGES = np.array([0.0, -0.0, 65504.0, -65504.0, 6.1035e-05, -6.1035e-05, 6e-08, -3e-07, 1.0, -1.0], np.float16)


def random_matrix(kind: str, rows: int, columns: int, seed: int, edges: bool = True):
    """A GGUF matrix [rows, columns] of `kind` as GGUFReader hands it over: random bytes for every block (codes,
    6-bit scales and minimums, fifth and sixth bits), its float16 scales random (negative ones included) or, with
    `edges`, one in four drawn from EDGES."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType[kind]
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, columns // block, size), dtype=np.uint8)
    for at in SCALES[kind]:
        scale = (rng.standard_normal(raw.shape[:2]) * (0.02 if kind in ("Q4_1", "Q8_0", "Q5_0") else 0.002))
        scale = scale.astype(np.float16)
        if edges:
            pick = rng.random(raw.shape[:2]) < 0.25
            scale[pick] = rng.choice(EDGES, int(pick.sum()))
        raw[..., at:at + 2] = scale[..., None].view(np.uint8)
    return types.SimpleNamespace(tensor_type=qtype, shape=(columns, rows), data=raw.reshape(rows, -1))


@pytest.fixture(scope="module")
def kernels(compiled_folder, tmp_path_factory):
    """The kernel built for this CPU (torch.ops.fafo) and its plain path (built with FAFO_PLAIN, own namespace)."""
    from fafo_cli.compiled.kernels import loader

    loader.load(compiled_folder / "compiled")
    plain = loader.load_as(loader.SOURCES[1].read_text(), "fafo_plain", tmp_path_factory.mktemp("plain-packed"),
                           "#define FAFO_PLAIN 1\n")
    assert plain.packed_kernel() == "plain"
    return {"native": torch.ops.fafo, "plain": plain}


DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", ["native", "plain"])
@pytest.mark.parametrize("kind, wide", FORMATS)
def test_packed_weights_are_gguf_dequantized_bit_for_bit(kernels, kind, wide, path, dtype):
    from gguf import quants

    from fafo_cli.compiled import packed

    ops = kernels[path]
    for seed, (rows, columns) in enumerate([(48, 256), (37, 512)]):
        tensor = random_matrix(kind, rows, columns, seed)
        expected = torch.from_numpy(quants.dequantize(tensor.data, tensor.tensor_type)).to(dtype)
        assert torch.equal(packed.reference(tensor, dtype=dtype), expected)
        weight = packed.tiled(packed.entries(tensor, wide))
        size = (packed.WIDE_ENTRY_BYTES if wide else packed.ENTRY_BYTES)[kind]
        assert weight.shape == (-(-rows // 16), columns // 64, 16, size)
        rebuilt = ops.packed_weight(weight, rows) if dtype == torch.bfloat16 else ops.packed_weight(weight, rows, dtype)
        assert rebuilt.dtype == dtype
        differ = (packed._bits(rebuilt) != packed._bits(expected)).nonzero()
        assert len(differ) == 0, f"{len(differ)} weights differ, first at {differ[0].tolist()}"
    assert (expected.float() < 0).any() and (expected.float() > 0).any()


@pytest.mark.parametrize("path", ["native", "plain"])
def test_packed_linear_refuses_outputs_and_biases_its_weight_does_not_hold(kernels, path):
    """A packed file that does not match the model (stale, damaged) is an error, not writes past the output."""
    from fafo_cli.compiled import packed

    ops = kernels[path]
    weight = packed.tiled(packed.entries(random_matrix("Q8_0", 48, 256, seed=1, edges=False), False))  # 3 tiles
    x = torch.randn(2, 256)
    for out_features, bias in ((16, None), (49, None), (48, torch.zeros(47))):
        with pytest.raises(RuntimeError, match="fafo::packed_linear: (x and the packed weight|the bias) do"):
            ops.packed_linear(x, weight, out_features, bias)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", ["native", "plain"])
@pytest.mark.parametrize("kind, wide", FORMATS)
@pytest.mark.parametrize("out_features, with_bias", [(48, False), (37, True)])
def test_packed_linear_multiplies_gguf_weights_exactly(kernels, kind, wide, path, out_features, with_bias, dtype):
    """A linear of `dtype` with gguf's weights (17 rows: more than one AMX tile holds), each row's result alike with
    1 to 10, 12 or 16 rows in the call (the float32 path takes 4 at a time; the AVX-512 one 6, 7 to 9 over two weight
    rows at a time, more from a rebuilt copy); a weight that differs from the file's keeps its matrix dense."""
    from fafo_cli.compiled import packed

    ops = kernels[path]
    tensor = random_matrix(kind, out_features, 256, seed=out_features, edges=False)
    expected = packed.reference(tensor, dtype=dtype)
    weight = packed.tiled(packed.entries(tensor, wide))
    bias = torch.randn(out_features) if with_bias else None
    x = torch.randn(17, 256).to(dtype)
    y = ops.packed_linear(x, weight, out_features, bias)
    assert y.dtype == dtype
    reference = torch.nn.functional.linear(x.double(), expected.double(), None if bias is None else bias.double())
    tolerance = (0.02, 0.01) if dtype == torch.bfloat16 else (1e-6, 1e-5)  # bf16 outputs round to 8 bits
    torch.testing.assert_close(y.double(), reference, atol=tolerance[0] * reference.abs().max().item(),
                               rtol=tolerance[1])
    for first in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16):
        assert torch.equal(ops.packed_linear(x[:first].contiguous(), weight, out_features, bias), y[:first]), first
    if path == "native":
        dense = torch.nn.Linear(256, out_features, bias=with_bias).to(dtype)
        dense.weight.data = expected.clone()
        module = packed.packed_linear(tensor, dense)  # float32 rows: the formats of `wide`
        sizes = packed.WIDE_ENTRY_BYTES if dtype == torch.float32 else packed.ENTRY_BYTES
        assert isinstance(module, packed.PackedLinear) and module.packed.shape[-1] == sizes[kind]
        dense.weight.data[3, 5] += 1.0
        assert packed.packed_linear(tensor, dense) is None


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_packing_checks_a_slice_of_rows_at_a_time(kernels, kind, monkeypatch):
    """Packing repacks, dequantizes and compares CHECK_ROWS rows at a time (a vocabulary matrix whole takes GBs):
    the same blocks as in one go; rows in another order (q and k under transformers' rotary layout) matched whole;
    a weight that differs in a later slice keeps the matrix dense."""
    from fafo_cli.compiled import packed

    tensor = random_matrix(kind, 80, 256, seed=3, edges=False)
    whole = packed.tiled(packed.entries(tensor))
    monkeypatch.setattr(packed, "CHECK_ROWS", 32)  # three slices, the last one short
    assert torch.equal(packed.tiled(packed.entries(tensor)), whole)
    assert torch.equal(packed.reference(tensor, 32, 64), packed.reference(tensor)[32:64])
    dense = torch.nn.Linear(256, 80, bias=False).bfloat16()
    dense.weight.data = packed.reference(tensor)
    assert torch.equal(packed.packed_linear(tensor, dense).packed, whole)
    order = torch.randperm(80)
    dense.weight.data = packed.reference(tensor)[order]
    permuted = packed.packed_linear(tensor, dense)
    assert torch.equal(kernels["native"].packed_weight(permuted.packed, 80), dense.weight.data)
    dense.weight.data = packed.reference(tensor)
    dense.weight.data[70, 9] = -dense.weight.data[70, 9]
    assert packed.packed_linear(tensor, dense) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prefill_chunk_multiplies_the_rebuilt_weight_densely(kernels, dtype):
    """Past DENSE_ROWS rows (a prefill chunk) a packed matrix is rebuilt and multiplied as a dense linear of the rows'
    dtype, bit for bit; up to it the kernel multiplies, its rows alike whatever the call's size; no compiled package
    has more."""
    from fafo_cli.compiled import packed, steps

    assert steps.ROW_BUCKETS[-1] <= packed.DENSE_ROWS
    tensor = random_matrix("Q4_K", 48, 256, seed=5, edges=False)
    bias = torch.randn(48)
    module = packed.PackedLinear(packed.tiled(packed.entries(tensor)), 48, bias, dtype)
    x = torch.randn(packed.DENSE_ROWS + 44, 256).to(dtype)
    expected = torch.nn.functional.linear(x, packed.reference(tensor, dtype=dtype), bias.to(dtype))
    assert torch.equal(module(x), expected)
    assert torch.equal(module.dense()[0], packed.reference(tensor, dtype=dtype))
    few = x[:packed.DENSE_ROWS]
    assert torch.equal(module(few)[:5], module(few[:5].contiguous()))
    torch.testing.assert_close(module(few).float(), expected[:packed.DENSE_ROWS].float(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_paths_give_the_same_weights_and_close_products(kernels, dtype):
    """The native and plain kernels multiply the same weights; their sums differ only in the order of additions."""
    from fafo_cli.compiled import packed

    x = torch.randn(3, 512).to(dtype)
    tolerance = dict(atol=0.05, rtol=0.02) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-5)
    for kind, wide in FORMATS:
        weight = packed.tiled(packed.entries(random_matrix(kind, 32, 512, seed=7, edges=False), wide))
        native, plain = kernels["native"], kernels["plain"]
        assert torch.equal(native.packed_weight(weight, 32, dtype), plain.packed_weight(weight, 32, dtype))
        torch.testing.assert_close(native.packed_linear(x, weight, 32, None).float(),
                                   plain.packed_linear(x, weight, 32, None).float(), **tolerance)


def test_the_kernel_names_its_path_per_dtype(kernels):
    """bf16 rows take AMX, AVX-512 or the plain path; float32 rows AVX2 (every x86 CPU with AVX2, FMA and F16C) or
    the plain path; other dtypes are refused in one line."""
    native, plain = kernels["native"], kernels["plain"]
    assert native.packed_kernel() == native.packed_kernel(torch.bfloat16) in ("amx", "avx512-bf16", "plain")
    assert native.packed_kernel(torch.float32) in ("avx2", "plain")
    assert plain.packed_kernel(torch.float32) == "plain"
    weight = torch.zeros(1, 4, 16, 48, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="bf16 or float32"):
        native.packed_linear(torch.zeros(2, 256, dtype=torch.float16), weight, 16, None)
    with pytest.raises(RuntimeError, match="bf16 or float32"):
        native.packed_weight(weight, 16, torch.float16)


def test_types_we_do_not_read_are_refused():
    from fafo_cli.compiled import packed

    tensor = random_matrix("Q8_0", 16, 256, seed=1)
    assert packed.entries(types.SimpleNamespace(**{**vars(tensor), "shape": (96, 16)})) is None  # not whole entries
    from gguf import GGMLQuantizationType

    for kind in ("Q5_1", "Q2_K", "F16"):
        assert packed.entries(types.SimpleNamespace(tensor_type=GGMLQuantizationType[kind], shape=(256, 16),
                                                    data=None)) is None


# The tiny Qwen2 GGUF's matrix types: every type the kernels read, stacked and alone, and one they do not (Q5_1)
TINY_TYPES = {0: dict(attn_q="Q4_K", attn_k="Q5_0", attn_v="Q6_K", attn_output="Q8_0", ffn_gate="Q4_1",
                      ffn_up="Q4_K", ffn_down="Q6_K"),
              1: dict(attn_q="Q5_0", attn_k="Q5_0", attn_v="Q5_0", attn_output="Q5_1", ffn_gate="Q6_K",
                      ffn_up="Q6_K", ffn_down="Q4_K")}
TINY_SHAPES = dict(attn_q=(256, 256), attn_k=(128, 256), attn_v=(128, 256), attn_output=(256, 256),
                   ffn_gate=(512, 256), ffn_up=(512, 256), ffn_down=(256, 512))  # [out, in]


def write_tiny_gguf(path, seed: int = 0, head: str | None = None, architecture: str = "qwen2", types=None,
                    leave_out: tuple[str, ...] = (), parts: int | None = None, context: int = 512,
                    rope_freqs: np.ndarray | None = None, fields=lambda writer: None):
    """A Qwen2 model as a .gguf file (hidden 256, 2 layers, a byte-level vocabulary with one merge, a Q8_0
    embedding: tied, or with a vocabulary head of its own of type `head`), its matrices random blocks of `types`
    (default TINY_TYPES) with scales that keep activations moderate; or its Llama twin (no q, k, v biases;
    llama.cpp stores its query and key rows reordered). `leave_out`: tensors not written; `parts`: the split.count
    its header gives (llama.cpp's gguf-split); `rope_freqs`: llama.cpp's rotary factors of a Llama 3.x model;
    `fields(writer)` adds keys to the header."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from .conftest import CHAT_TEMPLATE

    rng = np.random.default_rng(seed)
    tokens = list(bytes_to_unicode().values()) + ["th", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny-qwen2")
    writer.add_context_length(context)
    writer.add_embedding_length(256)
    writer.add_feed_forward_length(512)
    types = types or TINY_TYPES
    writer.add_block_count(len(types))
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * 257 + [gguf.TokenType.CONTROL] * 3)
    writer.add_token_merges(["t h"])
    writer.add_bos_token_id(len(tokens) - 2)  # no eos: llama.cpp's end tokens by name (<|endoftext|>, <|im_end|>)
    writer.add_pad_token_id(len(tokens) - 3)
    writer.add_chat_template(CHAT_TEMPLATE)
    if parts is not None:
        writer.add_uint16("split.count", parts)
    fields(writer)
    add_tensor = writer.add_tensor
    writer.add_tensor = lambda name, *args, **kwargs: name in leave_out or add_tensor(name, *args, **kwargs)

    def matrix(name: str, kind: str, rows: int, columns: int):
        tensor = random_matrix(kind, rows, columns, int(rng.integers(1 << 30)), edges=False)
        writer.add_tensor(name, tensor.data, raw_dtype=tensor.tensor_type)

    matrix("token_embd.weight", "Q8_0", len(tokens), 256)
    if head is not None:
        matrix("output.weight", head, len(tokens), 256)
    for layer, kinds in types.items():
        for name, kind in kinds.items():
            matrix(f"blk.{layer}.{name}.weight", kind, *TINY_SHAPES[name])
        for name, size in (("attn_q", 256), ("attn_k", 128), ("attn_v", 128)) if architecture == "qwen2" else ():
            writer.add_tensor(f"blk.{layer}.{name}.bias", rng.standard_normal(size).astype(np.float32) * 0.1)
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{name}.weight", 1 + rng.standard_normal(256).astype(np.float32) * 0.1)
    writer.add_tensor("output_norm.weight", np.ones(256, np.float32))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny-gguf") / "tiny-qwen2.gguf")


def test_the_tensor_table_maps_what_ggufs_reader_reads(tiny_gguf, tmp_path):
    """read_tensors (the header walked directly, the data mapped from the file) gives every tensor gguf's own
    GGUFReader gives: name, type, shape and data, for blocks of every type we write and float32 tensors; a tensor
    type the gguf package does not know is a ValueError that names it."""
    import struct

    from gguf import GGUFReader

    from fafo_cli.gguf_header import read_header, read_tensors

    path = write_tiny_gguf(tmp_path / "own-head.gguf", seed=3, head="Q6_K")
    for file in (tiny_gguf, path):
        ours, theirs = read_tensors(file), GGUFReader(file).tensors
        assert [t.name for t in ours] == [t.name for t in theirs] and len(ours) > 20
        for mine, reference in zip(ours, theirs):
            assert mine.tensor_type == reference.tensor_type and mine.shape == tuple(map(int, reference.shape))
            assert mine.data.dtype == reference.data.dtype and mine.data.shape == reference.data.shape, mine.name
            assert np.array_equal(mine.data, reference.data), mine.name
    assert {t.tensor_type.name for t in read_tensors(path)} >= {"Q4_K", "Q5_0", "Q6_K", "Q8_0", "Q4_1", "Q5_1", "F32"}
    data = bytearray(path.read_bytes())
    header = read_header(path)
    unknown = next(i for i in range(200, 1000) if i not in {t.kind for t in header.tensors})
    entry = header.tensors[0]  # its type number, just before its offset, after its dims
    at = data.index(entry.name.encode()) + len(entry.name) + 4 + 8 * len(entry.dims)
    data[at:at + 4] = struct.pack("<I", unknown)
    (tmp_path / "unknown.gguf").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"tensor {entry.name} is of type {unknown}, which the gguf package"):
        read_tensors(tmp_path / "unknown.gguf")
    data = path.read_bytes().replace(b"blk.0.attn_k.weight", b"blk.0.attn_q.weight")  # (as GGUFReader refuses)
    (tmp_path / "twice.gguf").write_bytes(data)
    with pytest.raises(ValueError, match="it names a tensor twice"):
        read_tensors(tmp_path / "twice.gguf")


@pytest.mark.parametrize("architecture, head", [("qwen2", None), ("qwen2", "Q6_K"), ("llama", None)])
def test_a_conversion_holds_what_transformers_reads_from_the_gguf_file(tmp_path, monkeypatch, capsys, architecture,
                                                                        head):
    """Converted a block of rows at a time (conversion.py), the weights are bit for bit those transformers' own
    reading of the .gguf file gives (gguf's dequantizer, llama.cpp's query and key order undone, a tied head not
    stored), and the config is what it builds: from our walk of the header as from gguf's reader. gguf's tensor
    name map is built once (transformers' name mapping asks for it per submodule)."""
    import gguf
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from fafo_cli import conversion, hub
    from fafo_cli.gguf_header import FieldsReader

    monkeypatch.setenv("FAFO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(conversion, "BLOCK_BYTES", 3 * 4 * 256)  # 3 rows of 256 at a time: a short last block too
    path = write_tiny_gguf(tmp_path / f"tiny-{architecture}.gguf", head=head, architecture=architecture)
    built, name_map = [], gguf.get_tensor_name_map
    monkeypatch.setattr(gguf, "get_tensor_name_map", lambda *args: built.append(args) or name_map(*args))
    folder = hub.convert_gguf(path)
    assert len(built) == 1
    with monkeypatch.context() as walked:
        walked.setattr(gguf, "GGUFReader", FieldsReader)
        config_read = load_gguf_checkpoint(path)
    assert config_read == load_gguf_checkpoint(path)
    assert "dequantizing" not in capsys.readouterr().err  # its bar is drawn on a terminal only
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    expected = {name: tensor for name, tensor in theirs.state_dict().items()
                if not (theirs.config.tie_word_embeddings and name == "lm_head.weight")}
    with safe_open(folder / "model.safetensors", framework="pt") as ours:
        assert set(ours.keys()) == set(expected)
        for name in ours.keys():
            assert torch.equal(ours.get_tensor(name).view(torch.int32), expected[name].view(torch.int32)), name
    config = AutoConfig.from_pretrained(folder).to_dict()
    assert config["model_type"] == architecture and config["tie_word_embeddings"] == (head is None)
    assert config["architectures"] == [type(theirs).__name__] and "quantization_config" not in config


def llama3_factors(factor: float, head_dim: int = 64, theta: float = 10000.0) -> np.ndarray:
    """llama.cpp's rope_freqs of a Llama 3.x model (convert_hf_to_gguf.py's rule: low 1, high 4, 8,192 positions)."""
    factors = []
    for freq in 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)):
        wavelength = 2 * math.pi / float(freq)
        if wavelength < 8192 / 4:
            factors.append(1.0)
        elif wavelength > 8192 / 1:
            factors.append(factor)
        else:
            smooth = (8192 / wavelength - 1) / (4 - 1)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_a_llama3_gguf_keeps_its_rotary_scaling(tmp_path, monkeypatch):
    """llama.cpp keeps Llama 3.1-3.3's rotary scaling as a tensor of per-frequency factors, which transformers'
    GGUF reading leaves out: the converted model had plain rotary, another model (at position 1,000 some angles 32×
    too large). It is read back into the `llama3` settings it came from (and the model then decodes as
    transformers decodes those); factors of another rule are refused; a conversion made without them is made again."""
    import json as json_mod

    from fafo_cli import hub, load

    from .conftest import hf_greedy

    monkeypatch.setenv("FAFO_CACHE", str(tmp_path / "cache"))
    factors = llama3_factors(32.0)
    assert 1.0 in factors and 32.0 in factors and ((1 < factors) & (factors < 32)).any()  # every branch of the rule
    path = write_tiny_gguf(tmp_path / "tiny-llama3.gguf", architecture="llama", context=16384, rope_freqs=factors)
    folder = hub.convert_gguf(path)
    rope = json_mod.loads((folder / "config.json").read_text())["rope_parameters"]
    assert rope == {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 32.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    engine = load(str(folder), dtype="float32", chat_template=False)
    prompt = "the rotary angles of a long text " * 4
    assert engine.complete(prompt, max_tokens=16).token_ids == hf_greedy(folder, engine.encode(prompt), 16)
    config = json_mod.loads((folder / "config.json").read_text())  # as a fafo that left the tensor out wrote it
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (folder / "config.json").write_text(json_mod.dumps(config))
    record = json_mod.loads((folder / hub.SOURCE_MARKER).read_text())
    (folder / hub.SOURCE_MARKER).write_text(json_mod.dumps({k: v for k, v in record.items() if k != "converter"}))
    again = hub.convert_gguf(path)
    assert json_mod.loads((again / "config.json").read_text())["rope_parameters"]["rope_type"] == "llama3"
    other = factors.copy()
    other[len(other) // 2] *= 1.5  # not Llama 3's rule
    odd = write_tiny_gguf(tmp_path / "tiny-odd.gguf", architecture="llama", context=16384, rope_freqs=other)
    with pytest.raises(FafoError, match=r"rotary frequency factors \(rope_freqs.weight\) are not Llama 3's"):
        hub.convert_gguf(odd)


def test_what_a_gguf_header_says_beyond_transformers_reading_is_read_or_refused(tmp_path, monkeypatch):
    """A linear rotary scaling in the header (which transformers' GGUF reading leaves out) is in the converted
    config; yarn is refused, as is a mixture of experts under the llama architecture (Mixtral's files) or a tensor
    type gguf cannot dequantize."""
    import gguf
    import json as json_mod

    from fafo_cli import hub

    monkeypatch.setenv("FAFO_CACHE", str(tmp_path / "cache"))

    def scaled(kind, factor=4.0):
        return lambda writer: (writer.add_rope_scaling_type(kind), writer.add_rope_scaling_factor(factor))

    linear = write_tiny_gguf(tmp_path / "linear.gguf", architecture="llama", fields=scaled(gguf.RopeScalingType.LINEAR))
    rope = json_mod.loads((hub.convert_gguf(linear) / "config.json").read_text())["rope_parameters"]
    assert rope["rope_type"] == "linear" and rope["factor"] == 4.0 and rope["rope_theta"] == 10000.0
    # refused from the header, before the file is hashed (seconds for gigabytes) and its room checked
    monkeypatch.setattr(hub, "_content_digest", lambda path: pytest.fail("hashed before it was refused"))
    yarn = write_tiny_gguf(tmp_path / "yarn.gguf", architecture="llama", fields=scaled(gguf.RopeScalingType.YARN))
    with pytest.raises(FafoError, match=r"its rotary scaling \(yarn\) is not one fafo reads from a .gguf file"):
        hub.convert_gguf(yarn)
    experts = write_tiny_gguf(tmp_path / "moe.gguf", architecture="llama", fields=lambda w: w.add_expert_count(8))
    with pytest.raises(FafoError, match=r"it is a mixture of experts \(8 experts\)"):
        hub.convert_gguf(experts)
    doubles = write_tiny_gguf(tmp_path / "f64.gguf", fields=lambda w: w.add_tensor("extra.weight", np.ones(4)))
    with pytest.raises(FafoError, match="it holds F64 tensors, which the gguf package cannot dequantize"):
        hub.convert_gguf(doubles)


def test_a_rotary_factor_without_its_type_scales_linearly_as_in_llama_cpp(tmp_path, monkeypatch):
    """llama.cpp scales linearly by a factor given without a scaling type, under the current key or the older
    `rope.scale_linear` (SuperHOT-style files): converted with plain rotary it was another model. A conversion an
    older fafo made of such a file is made again; one that left nothing out is kept, and so recorded."""
    import json as json_mod

    from fafo_cli import hub

    monkeypatch.setenv("FAFO_CACHE", str(tmp_path / "cache"))
    for key in ("llama.rope.scaling.factor", "llama.rope.scale_linear"):
        path = write_tiny_gguf(tmp_path / f"{key}.gguf", architecture="llama",
                               fields=lambda writer: writer.add_float32(key, 4.0))
        folder = hub.convert_gguf(path)
        rope = json_mod.loads((folder / "config.json").read_text())["rope_parameters"]
        assert rope["rope_type"] == "linear" and rope["factor"] == 4.0, key
    config, record = (json_mod.loads((folder / name).read_text()) for name in ("config.json", hub.SOURCE_MARKER))
    assert record.pop("converter") == hub.CONVERTER
    (folder / hub.SOURCE_MARKER).write_text(json_mod.dumps(record))  # as an older fafo converted it
    (folder / "config.json").write_text(json_mod.dumps({**config, "rope_parameters": {"rope_type": "default",
                                                                                      "rope_theta": 10000.0}}))
    again = hub.convert_gguf(path)
    assert json_mod.loads((again / "config.json").read_text())["rope_parameters"]["rope_type"] == "linear"
    plain = write_tiny_gguf(tmp_path / "plain.gguf", architecture="llama")
    folder = hub.convert_gguf(plain)
    record = json_mod.loads((folder / hub.SOURCE_MARKER).read_text())
    del record["converter"]
    (folder / hub.SOURCE_MARKER).write_text(json_mod.dumps(record))
    monkeypatch.setattr(hub, "write_gguf_as_hf", lambda *args: pytest.fail("converted again"))
    assert hub.convert_gguf(plain) == folder
    assert json_mod.loads((folder / hub.SOURCE_MARKER).read_text())["converter"] == hub.CONVERTER


def test_a_tokenizer_beside_a_gguf_file_does_not_replace_its_own(tmp_path, monkeypatch):
    """transformers reads a tokenizer.json beside a .gguf file in place of the file's own vocabulary, chat template
    and special tokens (llama.cpp's converter writes its .gguf file into the original model's folder; any
    tokenizer.json in a downloads folder would do): the file's own is converted. A conversion an older fafo made so
    is made again."""
    import json as json_mod

    from tokenizers import Tokenizer, models
    from transformers import AutoTokenizer

    from fafo_cli import hub

    monkeypatch.setenv("FAFO_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny.gguf", architecture="llama")  # (Qwen2's tokenizer class reads its own)
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    folder = hub.convert_gguf(path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == 260 and tokenizer.chat_template and tokenizer.tokenize("th") == ["th"]
    record = json_mod.loads((folder / hub.SOURCE_MARKER).read_text())
    del record["converter"]  # as an older fafo converted it, beside that tokenizer.json
    (folder / hub.SOURCE_MARKER).write_text(json_mod.dumps(record))
    converted, write = [], hub.write_gguf_as_hf
    monkeypatch.setattr(hub, "write_gguf_as_hf", lambda *args: converted.append(args[0]) or write(*args))
    assert len(AutoTokenizer.from_pretrained(hub.convert_gguf(path))) == 260 and converted == [path]


def test_a_conversion_s_notices_go_to_the_api_s_notify(tmp_path, monkeypatch, capsys):
    """`load(notify=...)` receives every notice of a load, its conversion's too (they went to standard error)."""
    from fafo_cli import load

    monkeypatch.setenv("FAFO_CACHE", str(tmp_path / "cache"))
    notes = []
    load(str(write_tiny_gguf(tmp_path / "tiny.gguf")), notify=notes.append, dtype="float32", compile="off")
    assert any(note.startswith("converting tiny.gguf") for note in notes), notes
    assert capsys.readouterr().err == ""


def test_two_processes_asking_for_one_conversion_make_it_once(tmp_path, monkeypatch, capsys):
    """A server starting beside a `fafo run` (here two threads, each with a lock file of its own, as two processes
    would hold): the second waits for the first's conversion and finds it, instead of converting the file again."""
    import threading
    import time

    from fafo_cli import conversion, hub

    monkeypatch.setenv("FAFO_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    write, written, second = conversion.write_gguf_as_hf, [], {}

    def slow_write(*args):
        written.append(args[0])
        if len(written) == 1:  # the other one asks while this one converts
            thread = threading.Thread(target=lambda: second.update(folder=hub.convert_gguf(path)))
            thread.start()
            time.sleep(0.5)
            second["thread"] = thread
        return write(*args)

    monkeypatch.setattr(hub, "write_gguf_as_hf", slow_write)
    first = hub.convert_gguf(path)
    second["thread"].join(60)
    assert second["folder"] == first and written == [path]  # converted once
    assert "waiting for another fafo process converting tiny.gguf" in capsys.readouterr().err


def test_a_gguf_missing_tensors_or_split_in_parts_is_refused_in_one_line(tmp_path, monkeypatch):
    """A .gguf file that lacks some of the model's tensors (llama.cpp's first part of a split model, a converter's
    slip) is refused before anything is written: transformers would fill the missing parameters with random numbers."""
    from fafo_cli import hub

    monkeypatch.setenv("FAFO_CACHE", str(tmp_path / "cache"))
    part = write_tiny_gguf(tmp_path / "tiny-00001-of-00002.gguf", parts=2, leave_out=("blk.1.ffn_down.weight",))
    with pytest.raises(FafoError, match="is one of the 2 parts of a split GGUF model: merge them into one file"):
        hub.convert_gguf(part)
    cut = write_tiny_gguf(tmp_path / "tiny.gguf", leave_out=("blk.1.ffn_down.weight", "blk.1.attn_q.bias"))
    with pytest.raises(FafoError, match=r"holds no tensor for 2 of the model's parameters \(such as "
                                        r"model\.layers\.1\.mlp\.down_proj\.weight\): cut short"):
        hub.convert_gguf(cut)
    with pytest.MonkeyPatch.context() as patch:  # a header setting transformers does not read (a key length)
        patch.setitem(TINY_SHAPES, "attn_k", (64, 256))
        narrow = write_tiny_gguf(tmp_path / "narrow-keys.gguf")
    with pytest.raises(FafoError, match=r"its tensor blk\.0\.attn_k\.weight is \[64, 256\], where the model "
                                        r"transformers reads from its header has \[128, 256\]$"):
        hub.convert_gguf(narrow)
    biased = write_tiny_gguf(tmp_path / "llama-biased.gguf", architecture="llama",  # (a "llamafied" Qwen's)
                             fields=lambda writer: writer.add_tensor("blk.0.attn_q.bias", np.ones(256, np.float32)))
    with pytest.raises(FafoError, match=r"transformers' LlamaForCausalLM has no parameter for 1 of its "
                                        r"tensors \(such as blk\.0\.attn_q\.bias\), which a conversion would drop"):
        hub.convert_gguf(biased)
    assert not list((tmp_path / "cache").glob("models/*"))  # nothing half-written


def test_a_gguf_with_each_type_runs_packed_end_to_end(compiled_cache, tiny_gguf):
    """The tiny Qwen2 GGUF in bf16 with compiled steps: every matrix of a type the kernels read is packed in its
    format (q, k and v stacked where they share one), the Q5_1 one stays dense and one notice says so, and the
    compiled one-row step's logits are those of the model's own (dense) weights up to the order of additions."""
    from fafo_cli import load
    from fafo_cli.compiled import packed
    from fafo_cli.compiled.build import stored_dtype
    from fafo_cli.compiled.kernels import loader

    loader.load(compiled_cache / "compiled")
    if torch.ops.fafo.packed_kernel() == "plain":
        pytest.skip("this CPU lacks AVX512-BF16: its steps keep dense weights")
    notices: list[str] = []
    engine = load(str(tiny_gguf), dtype="bfloat16", compile="on", notify=notices.append)
    model = engine.model
    modules = engine.compiled.packed_modules()
    names = {f"model.layers.{layer}.{packed.LAYER_MODULES[name]}": kind
             for layer, kinds in TINY_TYPES.items() for name, kind in kinds.items()}
    assert set(modules) == {name for name, kind in names.items() if kind != "Q5_1"} | {"lm_head"}
    for name, module in modules.items():
        weight = module.fused.packed if isinstance(module, packed.FusedPart) else module.packed
        assert weight.shape[-1] == packed.ENTRY_BYTES[names.get(name, "Q8_0")], name  # the head: the tied embedding
    # layer 0: q, k, v of three formats and gate, up of two (5 calls) and o, down; layer 1: qkv, gate+up, down; head
    assert len(packed.kernels(modules)) == 7 + 3 + 1
    unread = [n for n in notices if "stay dense" in n]
    assert unread == [f"{tiny_gguf.name}: the matrices of type Q5_1 (1) stay dense bf16 in its steps (packed "
                      "blocks are read for Q4_1, Q8_0, Q5_0, Q4_K, Q6_K)"]

    step = engine.compiled.runner(1)
    assert step is not None, notices
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        context = 40
        cache = model.new_cache(context + 1, context + 1)
        for part in (cache.keys, cache.values):  # values a bf16 cache holds exactly
            part.copy_(torch.randn(part.shape, generator=gen).bfloat16())
        dense_cache = model.new_cache(context + 1, context + 1)
        dense_cache.keys.copy_(cache.keys), dense_cache.values.copy_(cache.values)
        cache.commit(context), dense_cache.commit(context)
        cache.store_as(stored_dtype(model))
        ids = torch.tensor([65])
        compiled = step(ids, torch.tensor([context]), torch.ones(1, 1, dtype=torch.bool),
                        torch.ones(1, dtype=torch.bool), torch.zeros(1, dtype=torch.bool),
                        torch.zeros(context, len(model.layers), dtype=torch.bool),
                        list(cache.keys.unbind(0)), list(cache.values.unbind(0)))[0].float()
        from fafo_cli.runtime.model import causal_attention, prefix_causal_mask

        attend = causal_attention(prefix_causal_mask(context, 1, model.device), model.scaling)
        dense = model.forward(ids, torch.tensor([context]), dense_cache, attend)[0].float()
    assert compiled.argmax() == dense.argmax()
    assert (compiled - dense).abs().mean() < 0.05 * dense.abs().mean()
    engine.stop_ids = frozenset()  # random weights: run to the token limit
    result = engine.complete("one two three four", max_tokens=12, method="vanilla")
    assert len(result.token_ids) == 12 and engine.compiled.calls == 11


def test_a_gguf_model_stops_where_llama_cpp_does(compiled_cache, tiny_gguf):
    """A .gguf file names one eos (or none, as the tiny one); llama.cpp also ends a generation at the end tokens of
    other templates by their text, and so does fafo (Qwen2's files name <|im_end|>, and a completion without the
    chat template ends at <|endoftext|>)."""
    from fafo_cli import load

    engine = load(str(tiny_gguf), dtype="float32", compile="off")
    vocab = engine.tokenizer.get_vocab()
    assert engine.stop_ids == {vocab["<|endoftext|>"], vocab["<|im_end|>"]}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_eager_rows_over_packed_blocks_compute_plain_decodings_logits_bit_for_bit(compiled_cache, smollm2, dtype):
    """SmolLM2 over its packed blocks, eager: our kernels serve every product and, with AVX-512, the attention, so a
    step of several rows gives each row exactly the logits a one-row step gives it (with torch's attention, which
    rounds a row differently beside others, the last rows here differ by up to 0.7 in bf16): eager FAFO and its
    peers then decode plain decoding's tokens in bf16 too, not only up to near-ties. With AVX2 alone (float32,
    torch's attention) the rows agree up to float32 rounding."""
    from fafo_cli import load
    from fafo_cli.compiled.kernels import loader
    from fafo_cli.runtime import model as model_module
    from fafo_cli.runtime.model import causal_attention, prefix_causal_mask

    engine = load(str(smollm2), dtype=dtype, compile="auto")
    if engine.model.packed_matrices == 0:
        pytest.skip(f"our kernel has no fast {dtype} path on this CPU: its steps keep dense weights")
    engine.session.compiled = None  # eager steps over the packed blocks
    session, model = engine.session, engine.model
    prompt = [100 + (i * 7919) % 40000 for i in range(300)]
    text = [7, 19, 3, 88, 41, 2, 60, 11, 500, 1000, 2000, 3000, 4000]
    with torch.inference_mode():
        session.prefill(prompt, reserve=len(text))
        single = torch.stack([session.step(token) for token in text])
        session.rollback(len(prompt))
        multi = session.forward(text, causal_attention(prefix_causal_mask(len(prompt), len(text), model.device),
                                                       model.scaling))
    if model_module._cpu_attention is None:  # torch's attention: float32 rounding apart, the same tokens
        torch.testing.assert_close(multi, single, atol=1e-4, rtol=1e-4)
        assert torch.equal(multi.argmax(-1), single.argmax(-1))
        return
    assert torch.equal(multi, single)
    if dtype == "bfloat16":  # our kernel reads bf16 keys itself: half the bytes (float32 where AMX would read them)
        assert session.cache.dtype == session.cache.read_dtype == (torch.float32 if loader.has_amx() else torch.bfloat16)


def test_a_head_matrix_of_its_own_is_packed_apart_from_the_embedding(compiled_cache, tmp_path):
    """A GGUF with its own `output.weight` (as Qwen2.5-Coder's files have): converted untied, the vocabulary head
    packed from that matrix in its own format (not from the embedding), the embedding left as it is, and greedy
    decoding over the blocks gives the dense model's tokens."""
    from fafo_cli import load
    from fafo_cli.compiled import packed
    from fafo_cli.compiled.kernels import loader

    loader.load(compiled_cache / "compiled")
    if torch.ops.fafo.packed_kernel(torch.float32) == "plain":
        pytest.skip("this CPU lacks AVX2: float32 steps keep dense weights")
    path = write_tiny_gguf(tmp_path / "tiny-own-head.gguf", seed=1, head="Q6_K")
    dense = load(str(path), dtype="float32", compile="off")
    assert not dense.model.hf.config.tie_word_embeddings
    assert not torch.equal(dense.model.hf.lm_head.weight, dense.model.embed.weight)
    engine = load(str(path), dtype="float32", compile="auto", notify=lambda _: None)
    head = engine.model.lm_head
    assert isinstance(head, packed.PackedLinear) and head.packed.shape[-1] == packed.WIDE_ENTRY_BYTES["Q6_K"]
    weight, _ = head.dense()
    assert torch.equal(weight, dense.model.hf.lm_head.weight)  # the head's own values, bit for bit
    ours, theirs = (run.complete("one two three four", max_tokens=24, method=method)
                    for run, method in ((engine, "fafo"), (dense, "vanilla")))
    assert ours.token_ids == theirs.token_ids and len(ours.token_ids) == 24


def test_a_float32_gguf_steps_over_its_packed_blocks(compiled_cache, tiny_gguf):
    """The tiny Qwen2 GGUF in float32, eager (the default where a CPU lacks AVX512-BF16): every matrix of a type the
    kernels read is installed packed, the Q5_1 one stays dense with one notice, a step's logits are those of the
    dense model up to the order of additions, and greedy decoding gives the dense model's tokens."""
    from fafo_cli import load
    from fafo_cli.compiled import packed
    from fafo_cli.compiled.kernels import loader

    loader.load(compiled_cache / "compiled")
    if torch.ops.fafo.packed_kernel(torch.float32) == "plain":
        pytest.skip("this CPU lacks AVX2: float32 steps keep dense weights")
    notices: list[str] = []
    engine = load(str(tiny_gguf), dtype="float32", compile="auto", notify=notices.append)
    dense = load(str(tiny_gguf), dtype="float32", compile="off")
    assert dense.model.packed_matrices == 0
    packed_layers = sum(kind != "Q5_1" for kinds in TINY_TYPES.values() for kind in kinds.values())
    assert engine.model.packed_matrices == packed_layers + 1  # and the head (the tied Q8_0 embedding)
    assert isinstance(engine.model.lm_head, packed.PackedLinear) and engine.model.lm_head.dtype == torch.float32
    names = {f"model.layers.{layer}.{packed.LAYER_MODULES[name]}": kind
             for layer, kinds in TINY_TYPES.items() for name, kind in kinds.items()}
    for name, module in engine.compiled.packed_modules().items():  # Q5_0 and Q6_K codes as bytes
        weight = module.fused.packed if isinstance(module, packed.FusedPart) else module.packed
        assert weight.shape[-1] == packed.WIDE_ENTRY_BYTES[names.get(name, "Q8_0")], name
    assert [n for n in notices if "stay dense" in n] == [
        f"{tiny_gguf.name}: the matrices of type Q5_1 (1) stay dense float32 in its steps (packed blocks are read "
        "for Q4_1, Q8_0, Q5_0, Q4_K, Q6_K)"]
    prompt = list(range(60, 100))
    logits = []
    with torch.inference_mode():
        for run in (engine, dense):
            run.session.prefill(prompt, reserve=1)
            logits.append(run.session.step(7).float())
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4 * logits[1].abs().max().item(), rtol=1e-4)
    assert not torch.equal(logits[0], logits[1])  # the packed kernel's sums, not torch's
    ours, theirs = (run.complete("one two three four", max_tokens=24, method="vanilla") for run in (engine, dense))
    assert ours.token_ids == theirs.token_ids and len(ours.token_ids) == 24

def test_float32_steps_over_packed_blocks_give_a_token_the_same_logits_in_every_step_size(compiled_cache, tmp_path):
    """Where every matrix is read packed, a float32 compiled step (the default on CPUs without AVX512-BF16) gives a
    token the logits of the one-row step bit for bit in a 4-row package too, window rows beside it: compiled FAFO
    decodes compiled plain decoding's very tokens, not only up to near-ties. (A matrix left dense runs inductor's
    GEMM, whose sums may part by row count: the tiny model's Q5_1 one did, by 2e-5.)"""
    from fafo_cli import load
    from fafo_cli.compiled.kernels import loader

    loader.load(compiled_cache / "compiled")
    if torch.ops.fafo.packed_kernel(torch.float32) == "plain":
        pytest.skip("this CPU lacks AVX2: float32 steps keep dense weights")
    types = {layer: {name: "Q8_0" if kind == "Q5_1" else kind for name, kind in kinds.items()}
             for layer, kinds in TINY_TYPES.items()}
    path = write_tiny_gguf(tmp_path / "tiny-packed.gguf", seed=2, types=types)
    notices: list[str] = []
    engine = load(str(path), dtype="float32", compile="on", notify=notices.append)
    assert not [n for n in notices if "stay dense" in n]
    runners = {rows: engine.compiled.runner(rows) for rows in (1, 4)}
    assert all(runners.values()), notices
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for context in (40, 300):
            logits = first_row_logits(engine.model, runners, context, 20, gen)
            assert torch.equal(logits[1], logits[4]), f"after {context} cached tokens"



def test_a_conversion_draws_no_progress_bars_off_a_terminal(tmp_path, monkeypatch, capfd):
    from fafo_cli import hub

    monkeypatch.setenv("FAFO_CACHE", str(tmp_path / "cache"))
    hub.convert_gguf(write_tiny_gguf(tmp_path / "bars.gguf", seed=2))
    err = capfd.readouterr().err
    assert "Converting" not in err and "shards" not in err, err  # (`--json`, pipes and logs get no \r lines)
