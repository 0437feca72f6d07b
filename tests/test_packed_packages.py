"""The embedded model's compiled steps over its packed GGUF blocks (where the CPU has our AVX512-BF16 kernel):
every matrix packed and shared by the packages, and a token's logits the same bit for bit in every step size, eager
too. Apart from test_compiled.py so that a test run spreads the two files' package builds over its workers."""

from __future__ import annotations

import pytest
import torch

from fafo_cli import load

from .conftest import first_row_logits


def test_a_gguf_model_packs_its_projections_and_head(compiled_cache, smollm2, monkeypatch):
    """The embedded model (Q4_1 projections, a Q8_0 tied embedding): every projection and the vocabulary head are
    packed, q's and k's rows in the order transformers loaded them, handed to the package build and put in the
    model for every step (eager ones too): no dense matrix is left, each packed module rebuilds the one it replaced
    bit for bit, and a pass through them picks the tokens the dense model picks."""
    from fafo_cli.compiled import packed, steps
    from fafo_cli.compiled.build import CompileError
    from fafo_cli.compiled.kernels import loader

    loader.load(compiled_cache / "compiled")
    if torch.ops.fafo.packed_kernel() == "plain":
        pytest.skip("this CPU lacks AVX512-BF16: its steps keep dense weights")
    built = []

    def build(model, rows, path, packed_modules=None, **options):  # what a build would trace, without the minutes
        built.append(packed_modules)
        raise CompileError("not built in this test")

    monkeypatch.setattr(steps, "build", build)  # where CompiledSteps looks it up
    notices: list[str] = []
    engine = load(str(smollm2), dtype="bfloat16", compile="on", notify=notices.append)
    engine.compiled.builder = None  # built in this process, where the stand-in above answers
    model = engine.model
    modules = engine.compiled.packed_modules()
    assert len(modules) == 7 * len(model.layers) + 1 and "lm_head" in modules
    assert len(packed.kernels(modules)) == 4 * len(model.layers) + 1  # q, k, v in one call; gate and up in one
    assert engine.compiled.runner(1) is None and built == [modules] and notices[-1].startswith("compilation failed")
    assert list(engine.compiled.folder.glob("rows1.failed"))  # (removed after the test: compiled_cache)
    assert engine.packed_matrices == len(modules) and model.lm_head is modules["lm_head"]
    assert not any(isinstance(m, torch.nn.Linear) for m in model.hf.modules())
    assert engine.weights == "Q4_1 GGUF, read as stored"
    dense_model = load(str(smollm2), dtype="bfloat16", compile="off").model
    for name, module in modules.items():
        original = dense_model.hf.get_submodule(name)
        weight, bias = module.dense()
        assert torch.equal(weight.view(torch.int16), original.weight.view(torch.int16)) and bias is None, name
    ids = torch.tensor(engine.encode("Name three colours."))
    positions = torch.arange(len(ids))

    def logits(model) -> torch.Tensor:
        from fafo_cli.runtime.model import causal_attention, prefix_causal_mask

        attend = causal_attention(prefix_causal_mask(0, len(ids), model.device), model.scaling)
        return model.forward(ids, positions, model.new_cache(64), attend)

    dense, swapped = logits(dense_model), logits(model)
    assert torch.equal(swapped.argmax(-1), dense.argmax(-1))
    # bf16 activations round differently after other orders of addition, through 30 layers: close on average
    assert (swapped - dense).abs().mean() < 0.05 * dense.abs().mean()


def test_auto_prepares_packed_weights_once_and_builds_no_package(compiled_cache, smollm2, monkeypatch):
    """`compile: auto` builds no package, but a .gguf model's eager steps read its blocks as stored: the first start
    packs them (our kernel library too, were it missing) and says so once; later starts read them back in silence;
    `off` keeps the dense weights."""
    from fafo_cli.compiled import steps
    from fafo_cli.compiled.kernels import loader

    loader.load(compiled_cache / "compiled")
    if torch.ops.fafo.packed_kernel() == "plain":
        pytest.skip("this CPU lacks AVX512-BF16: its steps keep dense weights")

    from fafo_cli.api import Engine

    def build(*args, **kwargs):
        raise AssertionError("compile: auto built a package")

    monkeypatch.setattr(steps, "build", build)
    monkeypatch.setattr(steps.CompiledSteps, "build_here", build)  # (a builder process would call that)
    monkeypatch.setattr(Engine, "build_elsewhere", build)
    notices: list[str] = []
    first = load(str(smollm2), dtype="bfloat16", compile="auto", notify=notices.append)
    kept = first.compiled.folder / steps.PACKED_FILE
    kept.unlink(missing_ok=True)  # as on a first start (another test may have kept it)
    notices.clear()
    first = load(str(smollm2), dtype="bfloat16", compile="auto", notify=notices.append)
    assert first.packed_matrices > 0 and kept.is_file() and first.weights == "Q4_1 GGUF, read as stored"
    assert len(notices) == 1 and notices[0].startswith("preparing ") and "once" in notices[0], notices
    again = load(str(smollm2), dtype="bfloat16", compile="auto", notify=notices.append)
    assert again.packed_matrices == first.packed_matrices and len(notices) == 1
    assert again.complete("Name a colour.", max_tokens=4, method="vanilla").token_ids  # eager, on packed blocks
    assert load(str(smollm2), dtype="bfloat16", compile="off").packed_matrices == 0
    # a kernel built without the fast paths (an old compiler, say) packs nothing: said nothing, start after start
    from fafo_cli.compiled import packed

    monkeypatch.setattr(packed, "supported", lambda model: False)
    kept.unlink()
    for _ in range(2):
        assert load(str(smollm2), dtype="bfloat16", compile="auto", notify=notices.append).packed_matrices == 0
    assert len(notices) == 1 and not kept.exists()


def test_packing_is_prepared_only_where_the_kernel_can_serve(monkeypatch):
    """No library is built for a model our kernel's fast paths cannot serve: bf16 on a CPU without AVX512-BF16 or
    AMX, float32 on one without AVX2, FMA and F16C, or no compiler."""
    from types import SimpleNamespace

    from fafo_cli.compiled import packed
    from fafo_cli.compiled.kernels import loader

    bf16 = SimpleNamespace(device=torch.device("cpu"), dtype=torch.bfloat16)
    monkeypatch.setattr(loader, "compiler", lambda: "sh")  # a program every machine has
    for flags, dtype, expected in (("fpu avx512bw avx512_bf16 f16c", torch.bfloat16, True),
                                   ("fpu amx_tile amx_bf16", torch.bfloat16, True),
                                   ("fpu avx2 fma f16c", torch.bfloat16, False),
                                   ("fpu avx2 fma f16c", torch.float32, True),
                                   ("fpu avx2 f16c", torch.float32, False),
                                   ("fpu avx512bw avx512_bf16 f16c", torch.float32, False),
                                   ("fpu avx2 fma f16c", torch.float16, False)):
        monkeypatch.setattr(loader, "cpu_flags", lambda flags=flags: flags)
        assert packed.worth_preparing(SimpleNamespace(device=bf16.device, dtype=dtype)) is expected, flags
    monkeypatch.setattr(loader, "cpu_flags", lambda: "avx512bw avx512_bf16 f16c")
    monkeypatch.setattr(loader, "compiler", lambda: "no-such-compiler-here")
    assert not packed.worth_preparing(bf16)


def test_packed_modules_are_kept_beside_the_packages(compiled_cache, smollm2, monkeypatch):
    """The embedded model's packed modules are read from the .gguf file and checked once, then read back from the
    file kept beside its packages: the same modules, stacks and bits, without reading the .gguf file again."""
    from fafo_cli.compiled import packed, steps
    from fafo_cli.compiled.kernels import loader

    loader.load(compiled_cache / "compiled")
    if torch.ops.fafo.packed_kernel() == "plain":
        pytest.skip("this CPU lacks AVX512-BF16: its steps keep dense weights")
    first = load(str(smollm2), dtype="bfloat16", compile="on", notify=lambda _: None).compiled
    packed_first = first.packed_modules()
    assert (first.folder / steps.PACKED_FILE).exists()
    pack_model = packed.pack_model
    monkeypatch.setattr(packed, "pack_model", lambda *a, **k: pytest.fail("the .gguf file was read again"))
    again = load(str(smollm2), dtype="bfloat16", compile="on", notify=lambda _: None).compiled.packed_modules()
    assert list(again) == list(packed_first)
    for name, module in packed_first.items():
        other = again[name]
        assert type(other) is type(module) and other.out_features == module.out_features, name
        if isinstance(module, packed.FusedPart):
            assert other.index == module.index and other.fused.sizes == module.fused.sizes
            module, other = module.fused, other.fused
        assert torch.equal(other.packed, module.packed) and (other.bias is None) == (module.bias is None), name
    stacks = {id(m.fused) for m in again.values() if isinstance(m, packed.FusedPart)}
    assert len(stacks) == len({id(m.fused) for m in packed_first.values() if isinstance(m, packed.FusedPart)})
    monkeypatch.setattr(packed, "pack_model", pack_model)
    (first.folder / steps.PACKED_FILE).write_bytes(b"cut short")  # a damaged file is packed again and replaced
    repacked = load(str(smollm2), dtype="bfloat16", compile="on", notify=lambda _: None).compiled.packed_modules()
    assert list(repacked) == list(packed_first) == list(packed.load(first.folder / steps.PACKED_FILE))


def test_a_packed_models_packages_share_its_weights(compiled_cache, smollm2):
    """Every matrix of the embedded model is packed, so its packages are built without copies of the weights and
    loaded with the model's own tensors: one set of weights in memory however many packages a method loads."""
    from fafo_cli.compiled.kernels import loader

    loader.load(compiled_cache / "compiled")
    if torch.ops.fafo.packed_kernel() == "plain":
        pytest.skip("this CPU lacks AVX512-BF16: its steps keep dense weights (each package holds its own)")
    engine = load(str(smollm2), dtype="bfloat16", compile="on", notify=lambda _: None)
    constants = engine.compiled.constants()
    assert constants is not None and any(name.endswith(".packed") for name in constants)
    plain, wide = engine.compiled.runner(1), engine.compiled.runner(4)  # (4: the next test's too)
    assert plain.constants is constants and wide.constants is constants
    weights = sum(t.numel() * t.element_size() for t in {id(t): t for t in constants.values()}.values())
    assert engine.compiled.paths(1)[0].stat().st_size < weights / 4  # kernels only, no weights


def test_a_token_gets_the_same_logits_in_every_step_size(compiled_cache, smollm2):
    """SmolLM2 in bf16 (packed GGUF matrices where the CPU has them): the plain step's package and FAFO's 2- and
    4-row ones give a token the same logits bit for bit, so compiled FAFO decodes compiled plain decoding's tokens
    even in bf16 (it parted at the 14th token of this prompt while inductor dropped roundings by row count)."""
    from fafo_cli.bench import suites
    from fafo_cli.compiled.kernels import loader

    loader.load(compiled_cache / "compiled")
    if torch.ops.fafo.packed_kernel() == "plain":
        pytest.skip("this CPU lacks AVX512-BF16: no packed steps (autotuned GEMMs may differ by row count)")
    notices: list[str] = []
    engine = load(str(smollm2), dtype="bfloat16", compile="on", notify=notices.append)
    plain, one_guess, fafo_step = engine.compiled.runner(1), engine.compiled.runner(2), engine.compiled.runner(4)
    assert plain is not None and one_guess is not None and fafo_step is not None, notices
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for context in (300, 1300):
            logits = first_row_logits(engine.model, {1: plain, 2: one_guess, 4: fafo_step}, context, 252, gen)
            assert torch.equal(logits[1], logits[2]), f"after {context} cached tokens"
            assert torch.equal(logits[1], logits[4]), f"after {context} cached tokens"
    sample = next(s for s in suites.load_suite("summarize") if s.id == "doc-json")
    vanilla = engine.complete(list(sample.messages), max_tokens=48, method="vanilla")
    engine.reset()  # both prefill the whole prompt (a reused one prefills its last token alone: other roundings)
    fafo = engine.complete(list(sample.messages), max_tokens=48, method="fafo", draft_tokens=3)
    # the CPU's default (no window), in the three packages above (sizes 1, 2 and 4: a short copy covers D); guesses
    # from the text were verified in several-row steps, whether or not any held
    assert fafo.stats.streams == 0 and fafo.stats.drafted_tokens > 0 and max(map(int, fafo.stats.step_rows)) > 1
    built = [notice for notice in notices if notice.startswith("compiling the")]
    assert all(any(f"the {rows}-row" in notice for rows in (1, 2, 4)) for notice in built), notices
    assert fafo.token_ids == vanilla.token_ids
    # and eager steps over the same blocks compute those logits bit for bit, step after step (inductor's RMSNorm
    # summed in another order and parted once in ~30 steps: both now run fafo::rms_norm)
    session, ids = engine.session, engine.encode(list(sample.messages))
    logits = {}
    for mode in ("compiled", "eager"):
        engine.reset()
        session.compiled = engine.compiled if mode == "compiled" else None
        session.prefill(ids, reserve=64)
        runs_before = session.compiled_runs
        logits[mode] = [session.step(token) for token in vanilla.token_ids]
        assert (session.compiled_runs > runs_before) == (mode == "compiled")
    session.compiled = engine.compiled
    parted = [i for i, (a, b) in enumerate(zip(logits["compiled"], logits["eager"])) if not torch.equal(a, b)]
    assert parted == [], f"eager and compiled steps part from step {parted[0]}"
