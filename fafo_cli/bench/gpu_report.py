"""`fafo doctor --gpu-report FILE`: a 7B-shaped random-weight Llama's step costs against the memory-bandwidth bound.

A decoding step of a 7B model is memory-bound: it streams every weight (and the cached keys and values) once,
whatever its row count up to a point. So a plain step's time is judged against `bytes read / bandwidth`, the
bandwidth measured here by a device-to-device copy (read + write, which a kernel reading only weights can slightly
beat), and each row count's time against the one-row step: what a FAFO step of that many rows costs. Each row
count runs eager and, on CUDA, as a captured CUDA graph (no per-kernel launch cost; a capture that fails is
reported, and its rows stay eager). Random weights: the time of a step does not depend on their values.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import FafoError
from ..runtime.model import Attention, Model, causal_attention
from ..compiled.timing import synchronize

# hidden_size, intermediate_size, layers, heads, kv heads, vocabulary: Llama-2-7B's, Llama-3-8B's (grouped-query
# attention, as most 7-8B models now: a step's attention takes another path), SmolLM2-135M's, a tiny one (tests)
SHAPES = {
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, vocab_size=49152),  # SmolLM2-135M's: grouped-query attention
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256),
}
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONTEXT = 512  # cached positions every step attends to
REPEATS = 12  # timed runs per row count, after WARMUP
WARMUP = 3


@dataclass
class Measured:
    eager_ms: float
    graph_ms: float | None  # None: no CUDA, or the capture failed


def report_dtype(device: torch.device) -> torch.dtype:
    """bf16, as decoding on a GPU runs by default; fp16 where the GPU lacks bf16."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.float16
    return torch.bfloat16


def random_llama(shape: str, device: torch.device, dtype: torch.dtype) -> Model:
    """A Llama of `shape` with random weights, built on `device` directly (a 7B model never passes through the CPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=False)
    with torch.device(device):
        hf = LlamaForCausalLM._from_config(config, dtype=dtype)
    return Model(hf.eval())


def _fastest_s(run, device: torch.device) -> float:
    """The fastest of five timed runs of `run` (after an untimed one), in seconds."""
    run()
    synchronize(device)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def bandwidth_gbs(device: torch.device, megabytes: int) -> float:
    """Memory bandwidth measured by copying `megabytes` between two buffers (bytes read + written per second)."""
    source = torch.empty(megabytes << 20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return 2 * source.numel() / _fastest_s(lambda: target.copy_(source), device) / 1e9


def read_bandwidth_gbs(device: torch.device, megabytes: int) -> float:
    """Memory bandwidth measured by a sum over `megabytes` of float32 (bytes read per second)."""
    values = torch.ones((megabytes << 20) // 4, device=device)
    return values.numel() * 4 / _fastest_s(values.sum, device) / 1e9


def step_bytes(model: Model, context: int) -> int:
    """What one step reads at least: every weight but the embedding table (only its rows are read), and the
    cache's keys and values."""
    embedding = model.embed.weight
    weights = sum(p.numel() * p.element_size() for p in model.hf.parameters() if p is not embedding)
    kv = 2 * len(model.layers) * context * model.n_kv_heads * model.head_dim * model.attention_dtype.itemsize
    return weights + kv


def timed_ms(run, device: torch.device) -> float:
    for _ in range(WARMUP):
        run()
    synchronize(device)
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def graph_replay(step, device: torch.device):
    """`step` captured as a CUDA graph (warmed up on a side stream first, as capture requires); its replay."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(WARMUP):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def measure(model: Model, rows: tuple[int, ...], context: int, notify,
            attention: Callable[[torch.Tensor, float], Attention] = causal_attention) -> dict[int, Measured]:
    """Each row count's step after `context` cached positions (random keys and values), eager and as a graph;
    `attention(mask, scaling)` makes a step's attention (scripts/gqa_steps.py compares two)."""
    device = model.device
    cache = model.new_cache(initial_slots=context + max(rows), max_slots=context + max(rows))
    cache.keys[:, :context].normal_()
    cache.values[:, :context].normal_()
    cache.commit(context)
    results, graphs = {}, device.type == "cuda"
    for count in rows:
        ids = torch.zeros(count, dtype=torch.long, device=device)
        positions = torch.arange(context, context + count, device=device)
        attend = attention(torch.ones(count, context + count, dtype=torch.bool, device=device), model.scaling)

        def step():  # written after the cached positions, never committed: every run is the same step
            return model.forward(ids, positions, cache, attend)

        eager = timed_ms(step, device)
        graph = None
        if graphs:
            try:
                graph = timed_ms(graph_replay(step, device), device)
            except Exception as error:  # noqa: BLE001 - any capture failure: reported once, eager stays measured
                notify(f"CUDA graph capture failed ({type(error).__name__}: {str(error).strip()[:200]}); "
                       "graph times are left out")
                graphs = False
        results[count] = Measured(eager, graph)
    return results


def fafo_step(model: Model, context: int, path: str, graph: bool = False) -> float:
    """A 64-row FAFO step's time (ms) on `path` ("split" or "block"), eager or as a CUDA graph: the anchor and a
    16-token draft chain over the whole cache, a W=16, k=3 window (47 rows) over a 256-token StreamingLLM view of
    it, as the decoder builds them. The cache holds `context` random positions."""
    from ..decoders.fafo.attention import KV_BLOCK, BlockSparseMasks, CompressedView, flex_attention_kernel
    from ..decoders.fafo.compressors import StreamCompressor
    from ..decoders.fafo.window import LookaheadWindow
    from ..runtime.rows import draft_step

    device, block = model.device, path == "block"
    window = LookaheadWindow(streams=16, ngram=3, prefix=2, seed_tokens=list(range(100)))
    window.levels = [list(range(15)), list(range(16, 32)), list(range(32, 48))]
    cache = model.new_cache(initial_slots=context + 64, max_slots=context + 64)
    cache.use_lead(KV_BLOCK if block else 0)
    cache.keys[:, :context].normal_()
    cache.values[:, :context].normal_()
    cache.commit(context)
    compressor = StreamCompressor(budget=256, sink=4, tail_rows=1 + len(window.tokens()))
    compressor.rebuild(cache)
    view = CompressedView(cache, compressor, model.scaling,
                          block_masks=BlockSparseMasks.for_device(device) if block else None,
                          flex=flex_attention_kernel(device) if block else None)
    step = draft_step(0, list(range(16)), list(range(-1, 15)), device, view_tokens=window.tokens(),
                      view_rows=window.layout.rows, view=view)
    ids = torch.tensor(step.ids, device=device)
    positions = context + step.layout.offsets
    if graph:  # the attention built once: a graph replays its kernels, not the host's work of building it
        attention = view.attention(step.layout)
        return timed_ms(graph_replay(lambda: model.forward(ids, positions, cache, attention), device), device)
    return timed_ms(lambda: model.forward(ids, positions, cache, view.attention(step.layout)), device)


def run(device: torch.device, shape: str = "7b", rows: tuple[int, ...] = ROWS, context: int = CONTEXT,
        notify=lambda message: None) -> dict:
    """The report: the shape, dtype, device, bandwidth, the bound of one step, and each row count's times."""
    check(device, shape)
    dtype = report_dtype(device)
    try:
        model = random_llama(shape, device, dtype)
    except torch.OutOfMemoryError:
        raise FafoError(f"--gpu-report: a {shape}-shaped model does not fit in this GPU's memory") from None
    bandwidth = bandwidth_gbs(device, 1024 if device.type == "cuda" else 64)
    needed = step_bytes(model, context)
    bound_ms = needed / (bandwidth * 1e9) * 1e3
    measured = measure(model, rows, context, notify)
    plain = measured[rows[0]]
    one_row = min(t for t in (plain.eager_ms, plain.graph_ms) if t is not None)
    table = {}
    for count, m in measured.items():
        best = min(t for t in (m.eager_ms, m.graph_ms) if t is not None)
        table[count] = {"eager_ms": round(m.eager_ms, 4),
                        "graph_ms": None if m.graph_ms is None else round(m.graph_ms, 4),
                        "bound_share": round(bound_ms / best, 4),  # 1.0: the step runs at the bandwidth bound
                        "vs_one_row": round(best / one_row, 4)}
    fafo = {"split": round(fafo_step(model, context, "split"), 4)}
    # the block path compiles flex attention at its first call, and a capture may meet an op graphs refuse: either
    # failing is said once, and the other figures stand
    tried = [("block", "block", False, "the FAFO step's block path (flex attention)")]
    if device.type == "cuda":
        tried.append(("split_graph", "split", True, "CUDA graph capture of the FAFO step"))
    for name, path, graph, what in tried:
        try:
            fafo[name] = round(fafo_step(model, context, path, graph=graph), 4)
        except Exception as error:  # noqa: BLE001
            notify(f"{what} failed ({type(error).__name__}: {str(error).strip()[:200]})")
    return {"shape": shape, **SHAPES[shape], "dtype": str(dtype).removeprefix("torch."), "device": device_name(device),
            "context": context, "bandwidth_gbs": round(bandwidth, 2), "step_bytes": needed,
            "bound_ms": round(bound_ms, 4), "graphs": any(m.graph_ms is not None for m in measured.values()),
            "rows": table,
            # a 64-row FAFO step on each attention path (eager; split also as a graph), against the fastest plain step
            "fafo_64_rows_ms": fafo, "fafo_64_rows_vs_one_row": {p: round(ms / one_row, 4) for p, ms in fafo.items()}}


def check(device: torch.device, shape: str) -> None:
    """The report's shape must be known, and the 7B and 8B shapes need a CUDA GPU (a CPU would take minutes a
    step)."""
    if shape not in SHAPES:
        raise FafoError(f"--gpu-shape must be one of {', '.join(SHAPES)} (got {shape!r})")
    if shape in ("7b", "8b") and device.type != "cuda":
        raise FafoError(f"--gpu-report's {shape.upper()}-shaped model runs on a CUDA GPU only; the device here is "
                        f"{device.type}")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
