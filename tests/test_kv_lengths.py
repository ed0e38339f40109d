"""kv-length-buckets and in-place cache updates: attention whose work follows the tokens held."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

from foldline.backends.inplace_state import elide_inplace_aliases
from foldline.frontend.arch import get_preset
from foldline.passes.kv_length_buckets import length_ladder, variant_name
from foldline.passes.manager import run_pipeline
from foldline.testing.golden import (
    GOLDEN_TOL,
    UnitRunner,
    copy_unit,
    held_slots,
    make_steps,
    scaled_error,
)

pytestmark = pytest.mark.usefixtures("torch_one_thread")

LENGTHS = [8, 16, 32, 64]  # 8: below the tiny presets' 16-slot rings, which the _8 variants read in part
COMPILED_LENGTHS = [8, 32, 64]


def test_length_ladder_doubles_below_the_context():
    assert length_ladder(8192) == [256, 512, 1024, 2048, 4096]
    assert length_ladder(512) == [256]
    assert length_ladder(256) == [] and length_ladder(100) == []
    assert length_ladder(32768, smallest=1024) == [1024, 2048, 4096, 8192, 16384]


def _bucketed(exported_unit, preset: str, batch: int = 2):
    cfg = get_preset(preset)
    unit = copy_unit(exported_unit(cfg, batch=batch, chunk=8))
    unit.options = {"kv_lengths": LENGTHS}
    run_pipeline(unit, ["ring-buffer-swa", "kv-length-buckets"], progress=lambda _m: None)
    return cfg, unit


def test_the_pass_adds_one_entry_point_per_length_and_is_idempotent(exported_unit):
    cfg, unit = _bucketed(exported_unit, "llama-tiny")
    want = {"prefill", "decode"} | {variant_name(e, n) for e in ("prefill", "decode") for n in LENGTHS}
    assert set(unit.programs) == want and unit.kv_lengths == LENGTHS
    lengths = {name: sorted({n.args[7] for n in p.graph.nodes if n.target == torch.ops.foldline.cache_attention.default})
               for name, p in unit.programs.items()}
    assert lengths["decode_16"] == [16] and lengths["prefill_64"] == [64] and lengths["decode"] == [128]
    again = run_pipeline(unit, ["kv-length-buckets"], progress=lambda _m: None)
    assert set(unit.programs) == want and again[0]["sites"] == cfg.num_layers * len(LENGTHS) * 2


@pytest.mark.parametrize("preset", ["llama-tiny", "gemma3-tiny", "qwen35-tiny", "ripple-tiny"])
def test_length_variants_match_the_full_entry_points(preset, exported_unit):
    """Batch 2, rows at different positions (padded and empty chunks), crossing every length."""
    cfg, unit = _bucketed(exported_unit, preset)
    steps = make_steps([37, 21], 8, 40, cfg.vocab_size, seed=3)  # up to position 77: past 16, 32 and 64
    full, routed = UnitRunner(unit), UnitRunner(unit)
    used = set()
    for i, step in enumerate(steps):
        end = int(step.end_pos.max())
        length = next((n for n in LENGTHS if end <= n), None)
        entry = step.entry if length is None else variant_name(step.entry, length)
        used.add(entry)
        want, scale = full.step(step)
        got, _ = routed.step(dataclasses.replace(step, entry=entry))
        rows = step.n_valid > 0 if step.n_valid is not None else torch.ones(got.shape[0], dtype=torch.bool)
        assert scaled_error(got[rows], want[rows], scale[rows]) < GOLDEN_TOL["float32"], f"step {i} ({entry})"
        for spec, a, b in zip(unit.state_specs, routed.state, full.state):
            if spec.kind == "global_kv":
                a, b = held_slots(a, step.end_pos), held_slots(b, step.end_pos)
            assert scaled_error(a, b, max(float(b.abs().max()), 1e-30)) < GOLDEN_TOL["float32"], (i, spec.name)
    assert {"prefill_8", "prefill_16", "prefill_32", "prefill_64", "decode_64", "decode"} <= used


def test_lengths_below_the_window_read_part_of_each_ring(exported_unit):
    """gemma3-tiny (16-slot rings): the _8 variants read 8 slots of every ring, the others the whole ring."""
    from foldline.passes.kv_length_buckets import RING_LENGTH_ARG

    cfg, unit = _bucketed(exported_unit, "gemma3-tiny")
    assert cfg.sliding_window == 16
    for name, program in unit.programs.items():
        rings = [n for n in program.graph.nodes if n.target in RING_LENGTH_ARG]
        assert rings, name
        cut = {n.args[RING_LENGTH_ARG[n.target]] if len(n.args) > RING_LENGTH_ARG[n.target] else 0 for n in rings}
        assert cut == ({8} if name.endswith("_8") else {0}), (name, cut)


# ---- in-place cache updates in the compiled module ----------------------------------------------

_MLIR = """
  util.func public @f$async(%arg0: !hal.buffer_view, %arg1: !hal.buffer_view, %arg2: !hal.fence, %arg3: !hal.fence) {
    %0 = hal.tensor.import wait(%arg2) => %arg0 : !hal.buffer_view -> tensor<4x8xf32>
    %1 = hal.tensor.import wait(%arg2) => %arg1 : !hal.buffer_view -> tensor<4x8xf32>
    %2 = iree_linalg_ext.scatter dimension_map = [0] unique_indices(false) ins(%u, %i : tensor<1x8xf32>, tensor<1x1xi64>) outs(%0 : tensor<4x8xf32>) {
    %3 = iree_linalg_ext.scatter dimension_map = [0] unique_indices(false) ins(%u, %i : tensor<1x8xf32>, tensor<1x1xi64>) outs(%1 : tensor<4x8xf32>) {
    %4 = linalg.generic ins(%1 : tensor<4x8xf32>)
    %5 = hal.tensor.alias wait(%arg2) => %2 : tensor<4x8xf32> to %arg0 : !hal.buffer_view
    %6 = hal.tensor.alias wait(%arg2) => %3 : tensor<4x8xf32> to %arg1 : !hal.buffer_view
    %7 = hal.tensor.alias wait(%arg2) => %4 : tensor<4x8xf32> to %arg1 : !hal.buffer_view
    %8:3 = hal.tensor.barrier join(%5, %6, %7 : tensor<4x8xf32>, tensor<4x8xf32>, tensor<4x8xf32>) => %arg3 : !hal.fence
  }
"""


def test_elide_drops_only_aliases_of_sole_in_place_scatters():
    edited, report = elide_inplace_aliases(_MLIR)
    # %2 scatters into the sole use of arg0's import: elided. %3's import is also read by %4: IREE
    # would copy it before scattering, so the alias must stay; %4 is a fresh result: stays.
    assert (report.elided, report.kept) == (1, 2)
    assert "=> %2 : tensor<4x8xf32> to %arg0" not in edited and "=> %3 :" in edited and "=> %4 :" in edited
    assert "join(%2, %6, %7 :" in edited


def test_elide_drops_aliases_of_sole_in_place_slice_updates():
    """A one-token decode write is a slice update at the step's slot: in place like a scatter."""
    mlir = _MLIR.replace(
        "%2 = iree_linalg_ext.scatter dimension_map = [0] unique_indices(false) ins(%u, %i : tensor<1x8xf32>, "
        "tensor<1x1xi64>) outs(%0 : tensor<4x8xf32>) {",
        "%2 = tensor.insert_slice %u into %0[%i, 0] [1, 8] [1, 1] : tensor<1x8xf32> into tensor<4x8xf32>",
    )
    assert "tensor.insert_slice" in mlir
    edited, report = elide_inplace_aliases(mlir)
    assert (report.elided, report.kept) == (1, 2)
    assert "to %arg0" not in edited and "join(%2, %6, %7 :" in edited


def test_elide_is_scoped_to_each_function():
    two = _MLIR + _MLIR.replace("@f$async", "@g$async").replace("outs(%0 ", "outs(%1 ")
    _, report = elide_inplace_aliases(two)
    assert (report.elided, report.kept) == (1, 2 + 3)


@pytest.mark.slow
def test_decode_writes_rings_and_caches_in_place():
    """gemma3-tiny (rings and a global cache): a decode step copies no cache or ring, scatters into
    none (each write is a slice update at a slot computed on the host from pos_shape), and runs as
    one command buffer with no wait inside (a read of the position from device memory would add a
    wait and a second command buffer; a host check between the layers' writes would split the step
    into one submission per layer)."""
    import iree.compiler as ireec

    from foldline.backends.attention_kernels import expand_decode_attention_ops
    from foldline.backends.importer import import_programs
    from foldline.backends.targets import cpu_target
    from foldline.frontend.export import export_model
    from foldline.frontend.model import build_model
    from foldline.passes.registry import CompileUnit

    cfg = get_preset("gemma3-tiny").replace(max_context=1024)
    entries = export_model(build_model(cfg), 1, 16)
    unit = CompileUnit(cfg, {n: e.program for n, e in entries.items()}, entries["prefill"].state_specs,
                       options={"kv_lengths": [256]})
    run_pipeline(unit, None, progress=lambda _m: None)
    ring_bytes = min(s.nbytes for s in unit.state_specs)
    assert any(s.kind == "local_kv" for s in unit.state_specs) and any(s.kind == "global_kv" for s in unit.state_specs)
    # as for a CPU target: decode attention is the hand-written kernel (backends/attention_kernels.py)
    mlir, _ = expand_decode_attention_ops(import_programs(unit.programs.items(), decode_attention_kernel=True)[0])
    flags = cpu_target().flags
    converted = ireec.compile_str(mlir, input_type="torch", extra_args=[*flags, "--compile-to=input"]).decode()
    edited, _ = elide_inplace_aliases(converted)
    stream = ireec.compile_str(edited, extra_args=[*flags, "--compile-from=input", "--compile-to=stream"]).decode()
    decodes = [f for f in stream.split("util.func public @") if f.startswith(("decode$async", "decode_256$async"))]
    assert len(decodes) == 2
    for body in decodes:
        copies = [int(c) for c in re.findall(r"stream\.cmd\.copy [^\n]*?, %c(\d+) :", body)]
        assert not [c for c in copies if c >= ring_bytes], f"a decode step copies {max(copies)} bytes"
        assert len(re.findall(r"stream\.cmd\.execute", body)) == 1
        assert "stream.timepoint.await" not in body.split("stream.cmd.execute", 1)[0]
    functions = converted.split("util.func public @")
    input_decodes = [f for f in functions if f.startswith(("decode$async(", "decode_256$async("))]
    assert len(input_decodes) == 2 and all("iree_linalg_ext.scatter" not in f for f in input_decodes)
    prefill = next(f for f in functions if f.startswith("prefill$async("))
    assert "iree_linalg_ext.scatter" in prefill  # the check above can see a scatter


@pytest.mark.slow
def test_decode_never_copies_a_cache(tmp_path):
    """The compiled decode and prefill entry points update every global cache where it lies.

    Without the rewrite (or with a cache write that reads the cache), IREE copies each
    cache whole on every call: max_context slots per step. Checked on IREE's stream
    program: no copy and no allocation as large as one cache.
    """
    import iree.compiler as ireec

    from foldline.backends.attention_kernels import expand_decode_attention_ops
    from foldline.backends.build import compile_torch_module
    from foldline.backends.importer import import_programs
    from foldline.backends.targets import cpu_target
    from foldline.frontend.export import export_model
    from foldline.frontend.model import build_model
    from foldline.passes.registry import CompileUnit

    cfg = get_preset("llama-tiny").replace(max_context=2048)
    entries = export_model(build_model(cfg), 1, 16)
    unit = CompileUnit(cfg, {n: e.program for n, e in entries.items()}, entries["prefill"].state_specs,
                       options={"kv_lengths": [256]})
    run_pipeline(unit, None, progress=lambda _m: None)
    # as for a CPU target: decode attention is the hand-written kernel (backends/attention_kernels.py)
    mlir, _ = expand_decode_attention_ops(import_programs(unit.programs.items(), decode_attention_kernel=True)[0])
    cache_bytes = 2 * 2048 * 16 * 4  # one [1, Hkv=2, 2048, 16] f32 cache
    flags = cpu_target().flags
    converted = ireec.compile_str(mlir, input_type="torch", extra_args=[*flags, "--compile-to=input"]).decode()
    edited, report = elide_inplace_aliases(converted)
    assert report.elided == 2 * cfg.num_layers * len(unit.programs) and report.kept == 0
    stream = ireec.compile_str(edited, extra_args=[*flags, "--compile-from=input", "--compile-to=stream"]).decode()
    copies = re.findall(r"stream\.cmd\.copy [^\n]*?, %c(\d+) :", stream)
    assert not [c for c in copies if int(c) >= cache_bytes], "a cache is copied"
    # A decode step's scratch is a few rows; prefill's grows with its attention length (foldline plan).
    decode = "".join(f for f in stream.split("util.func public @") if f.startswith("decode"))
    allocs = [int(n) for n in re.findall(r"stream\.resource\.alloca[^\n]*?\{%c(\d+)\}", decode)]
    assert allocs and max(allocs) < cache_bytes, f"a decode step allocates {max(allocs)} bytes"
    # and the same module compiles to a vmfb
    vmfb, again = compile_torch_module(mlir, flags)
    assert len(vmfb) > 1000 and again == report


@pytest.mark.slow
@pytest.mark.parametrize(("preset", "kv_dtype"), [
    ("gemma3-tiny", "float16"), ("llama-tiny", "float32"),
    ("qwen35-tiny", "float32"), ("ripple-tiny", "float16"),
])
def test_compiled_length_variants_match_eager(bundle_factory, preset, kv_dtype):
    """Every tiny preset compiled with attention lengths 8/32/64 below its max_context 128 follows
    eager greedy decoding across all of them (sliding-window rings read in part below 8, then
    wrapping several times, GDN layers), with f32 or f16 caches."""
    from foldline.frontend.sources import load_model
    from foldline.runtime import Model
    from foldline.testing.parity import SCALED_TOL_FP32, run_parity

    bundle = bundle_factory(preset, kv_lengths=tuple(COMPILED_LENGTHS), kv_dtype=kv_dtype)
    model = Model.load(bundle)
    assert model.kv_lengths == COMPILED_LENGTHS
    assert {s.dtype for s in model.manifest.state if s.kind == "global_kv"} == {kv_dtype}
    assert [model.entry_point("decode", n) for n in (1, 8, 9, 32, 64, 65, 128)] == [
        "decode_8", "decode_8", "decode_32", "decode_32", "decode_64", "decode", "decode"]
    loaded = load_model(preset)
    ids = np.random.default_rng(0).integers(0, model.vocab_size, 40).tolist()
    with loaded.reconfigured(kv_dtype=kv_dtype):  # the eager reference holds the same cache type
        report = run_parity(loaded.module, model, ids, steps=80)
    assert report.steps == 81 and report.ok(SCALED_TOL_FP32), report.summary()


def test_unsupported_kv_dtype_is_a_clear_error(tmp_path):
    from foldline.backends.build import BuildOptions, compile_model
    from foldline.errors import FoldlineError
    from foldline.frontend.sources import load_model

    with pytest.raises(FoldlineError, match="K/V cache dtype 'float64' is not supported"):
        compile_model(load_model("llama-tiny"), tmp_path / "b", BuildOptions(kv_dtype="float64"))
    assert not (tmp_path / "b").exists()
