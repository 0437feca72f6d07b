"""CUDA graph steps (`cuda_graphs`): the static step they capture (rows padded to the step size, attention over the
cache's whole capacity masked by the committed length, writes at slots computed on the device) decodes exactly as
eager steps do. On a CPU the same step runs without capture; the capture itself is tested where CUDA is present."""

from __future__ import annotations

import pytest
import torch

from fafo_cli import load
from fafo_cli.compiled.graphs import GraphSteps

from .conftest import LONG, hf_greedy

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("method,options", [
    ("vanilla", {}),
    ("prompt-lookup", {}),
    ("fafo", dict(compressor="stream", budget=48, streams=2)),  # window rows see C(kv) through the view mask
    ("fafo", dict(compressor="none", streams=3)),
])
def test_static_graph_step_decodes_like_generate(tiny, method, options):
    engine = load(str(tiny), dtype="float32", chat_template=False, compile="off")
    graphs = engine.session.compiled = GraphSteps(engine.model, lambda message: None, capture=False)
    result = engine.complete(LONG, method=method, max_tokens=40, temperature=0.0, **options)
    assert result.token_ids == hf_greedy(tiny, engine.encode(LONG), 40)
    assert sum(graphs.calls_by_size.values()) == result.stats.steps - 1  # every step but the prefill's token
    if method != "vanilla":
        assert max(graphs.calls_by_size) > 1 and result.stats.accepted_tokens > 0


def test_steps_near_the_context_end_run_in_the_graph_of_their_own_rows(tiny):
    """A peer's steps are padded to its largest draft: in the last positions that padding would pass the context,
    and every step there ran eager, parting from plain decoding's graph steps at bf16 near-ties."""
    engine = load(str(tiny), dtype="float32", chat_template=False, compile="off")
    graphs = engine.session.compiled = GraphSteps(engine.model, lambda message: None, capture=False)
    ids = engine.encode(LONG * 6)
    result = engine.complete(LONG * 6, method="prompt-lookup", max_tokens=500, temperature=0.0)
    assert result.finish_reason == "context" and result.token_ids == hf_greedy(tiny, ids, 2048 - len(ids))
    assert sum(graphs.calls_by_size.values()) == result.stats.steps - 1


def test_static_graph_step_logits_equal_eager_ones_window_rows_included(tiny_models):
    """Every row's logits, the window's too (they only feed the pool, so the tokens cannot tell whether they saw
    C(kv)), equal the eager split path's, padding rows and all."""
    from fafo_cli.decoders.fafo.attention import CompressedView
    from fafo_cli.decoders.fafo.compressors import StreamCompressor
    from fafo_cli.decoders.fafo.window import LookaheadWindow
    from fafo_cli.runtime.rows import draft_step

    engine = load(str(tiny_models["qwen2-bias"]), dtype="float32", chat_template=False, compile="off")
    session, model = engine.session, engine.model
    prompt = engine.encode(LONG)
    session.prefill(prompt, reserve=64)
    compressor = StreamCompressor(budget=40, sink=4, tail_rows=16)
    compressor.rebuild(session.cache)
    window = LookaheadWindow(streams=3, ngram=3, prefix=2, seed_tokens=prompt)
    window.levels = [[11, 12], [13, 14, 15], [16, 17, 18]]
    view = CompressedView(session.cache, compressor, model.scaling)
    step = draft_step(prompt[-1], [5, 6, 7, 8, 9, 10], [-1, 0, 1, -1, 3, 4], model.device, size=20,
                      view_tokens=window.tokens(), view_rows=window.layout.rows, view=view)
    ids, positions = torch.tensor(step.ids), session.cache.length + step.layout.offsets
    eager = model.forward(ids, positions, session.cache, view.attention(step.layout))
    graphs = GraphSteps(model, lambda message: None, capture=False)
    static = graphs(step, ids, positions, session.cache)
    assert static.shape == eager.shape == (15, model.vocab_size) and graphs.calls_by_size == {20: 1}
    torch.testing.assert_close(static.float(), eager, atol=1e-4, rtol=1e-4)


def test_cuda_graphs_need_cuda(tiny):
    from fafo_cli.errors import FafoError

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(FafoError, match="--cuda-graphs needs a CUDA device; the device here is cpu"):
        load(str(tiny), cuda_graphs="on")


def test_graphs_are_used_only_where_they_can_run(tiny):
    """auto: not on a CPU, and not beside compiled packages that `compile: on` asks for."""
    from fafo_cli.errors import FafoError

    engine = load(str(tiny), chat_template=False, device="cpu", compile="off")
    assert engine.config.cuda_graphs == "auto" and not isinstance(engine.session.compiled, GraphSteps)
    if torch.cuda.is_available():
        assert isinstance(load(str(tiny), chat_template=False, device="cuda").session.compiled, GraphSteps)
        with pytest.raises(FafoError, match="builds compiled steps for a CPU"):
            load(str(tiny), chat_template=False, device="cuda", cuda_graphs="on", compile="on")


def test_fafo_compile_is_for_a_cpu(tiny, monkeypatch, capsys):
    from fafo_cli import api
    from fafo_cli.cli import entrypoint

    monkeypatch.setattr(api, "pick_device", lambda device: torch.device("cuda"))
    assert entrypoint(["compile", str(tiny)]) == 1
    assert capsys.readouterr().err == ("error: fafo compile builds compiled steps for a CPU, not for cuda: a GPU's "
                                       "steps run as CUDA graphs, captured as they run\n")


def test_compile_on_is_refused_off_the_cpu():
    """Compiled packages are CPU steps: on a GPU a dense model's would each hold a copy of the weights (a 7B
    model's 13 GB a step size); a GPU runs CUDA graphs. Said before the model loads."""
    from fafo_cli.api import check_compile
    from fafo_cli.config import Config
    from fafo_cli.errors import FafoError

    with pytest.raises(FafoError, match=r"^compile: on builds compiled steps for a CPU, not for cuda: its decoding "
                                        r"steps run as CUDA graphs \(cuda_graphs: auto\); give --no-compile, or "
                                        r"leave compile at auto in the config file$"):
        check_compile(Config(compile="on"), torch.device("cuda"))
    with pytest.raises(FafoError, match="not for mps: it runs eager"):
        check_compile(Config(compile="on"), torch.device("mps"))
    for compile in ("auto", "off"):
        check_compile(Config(compile=compile), torch.device("cuda"))
    check_compile(Config(compile="on"), torch.device("cpu"))


@pytest.mark.parametrize("device,spread,compile,graphs,expected,rope", [
    ("cuda", False, "auto", "auto", True, "default"), ("cuda", False, "on", "auto", False, "default"),
    ("cuda", True, "auto", "auto", False, "default"), ("cuda", False, "auto", "off", False, "default"),
    ("cpu", False, "auto", "auto", False, "default"), ("cuda", False, "auto", "on", True, "llama3"),
    ("cpu", False, "auto", "on", "needs a CUDA device", "default"),
    ("cuda", False, "on", "on", True, "default"),  # (check_compile refuses compile: on there first)
    ("cuda", True, "auto", "on", "not with --gpus", "default"), ("cuda", False, "auto", "auto", False, "dynamic"),
    ("cuda", False, "auto", "on", r"rotary scaling \(longrope\) is recomputed", "longrope")])
def test_where_graphs_run(device, spread, compile, graphs, expected, rope):
    """auto: on one CUDA GPU unless compiled packages are asked for, or the rotary factors are recomputed on the
    host (dynamic scalings); on: there or a one-line refusal."""
    from types import SimpleNamespace

    from fafo_cli import api, config as config_mod
    from fafo_cli.errors import FafoError

    model = SimpleNamespace(device=torch.device(device), spread=spread, rotary=SimpleNamespace(rope_type=rope))
    config = config_mod.Config(compile=compile, cuda_graphs=graphs)
    if isinstance(expected, str):
        with pytest.raises(FafoError, match=expected):
            api._use_graphs(model, config)
    else:
        assert api._use_graphs(model, config) is expected


@CUDA
@pytest.mark.parametrize("method", ["vanilla", "fafo"])
def test_captured_cuda_graphs_equal_eager_steps(tiny, method):
    notices: list[str] = []
    eager = load(str(tiny), device="cuda", dtype="float32", chat_template=False, compile="off", cuda_graphs="off")
    graphs = load(str(tiny), device="cuda", dtype="float32", chat_template=False, notify=notices.append)
    options = dict(method=method, max_tokens=40, temperature=0.0, streams=2)
    assert graphs.complete(LONG, **options).token_ids == eager.complete(LONG, **options).token_ids
    assert not notices and graphs.session.compiled.calls_by_size  # auto: captured, replayed, no fallback
    assert eager.session.compiled is None


def test_a_graph_out_of_memory_runs_that_size_eager_until_the_cache_changes(tiny, monkeypatch):
    """One long request's capture running out of memory turned graphs off for the life of a server."""
    from fafo_cli.compiled import graphs as graphs_mod

    engine = load(str(tiny), dtype="float32", chat_template=False, compile="off")
    notices = []
    graphs = engine.session.compiled = GraphSteps(engine.model, notices.append, capture=False)
    run = graphs_mod._Static.run

    def short_of_memory(static):
        if static.size > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        run(static)

    monkeypatch.setattr(graphs_mod._Static, "run", short_of_memory)
    result = engine.complete(LONG, method="prompt-lookup", max_tokens=40, temperature=0.0)
    assert result.token_ids == hf_greedy(tiny, engine.encode(LONG), 40)  # its padded steps eager
    assert not graphs.failed and not graphs.calls_by_size and len(notices) == 1
    engine.complete(LONG, method="vanilla", max_tokens=8, temperature=0.0)  # its one-row steps still graphs
    assert graphs.calls_by_size[1] == 7
    assert graphs._refused  # (and forgotten when the cache grows or moves)
