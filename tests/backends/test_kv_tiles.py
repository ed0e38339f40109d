"""Attention that reads the tokens held (prefill's kv_tiles, decode's position) and in-place cache updates."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

from foldline.backends.iree.inplace_state import elide_inplace_aliases
from foldline.contract.entry_points import kv_tile_count, kv_tile_size
from foldline.frontend.arch import get_preset
from foldline.frontend.export import kv_tiles_shape
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

CONTEXT = 256  # four tiles of 64 slots


def test_tile_size_and_count():
    assert kv_tile_size(8192) == 64 and kv_tile_size(256) == 64 and kv_tile_size(96) == 32
    assert kv_tile_size(100) == 4 and kv_tile_size(127) == 1
    # the tiles a chunk reads cover its last position, never fewer than one, never more than the cache
    assert [kv_tile_count(end, 256) for end in (0, 1, 64, 65, 128, 129, 256, 300)] == [1, 1, 1, 2, 2, 3, 4, 4]
    assert kv_tile_count(97, 100) == 25 and kv_tile_count(1, 127) == 1 and kv_tile_count(127, 127) == 127


class _FixedTiles:
    """Steps whose prefill reads every tile of the cache, whatever it holds: the reference for the cut."""

    def __init__(self, step, slots: int):
        self.step, self.slots = step, slots

    def args(self, slots: int):
        if self.step.entry != "prefill":
            return self.step.args(slots)
        return (*self.step.args(slots)[:3], kv_tiles_shape(slots // kv_tile_size(slots)))

    def __getattr__(self, name):
        return getattr(self.step, name)


def _unit(exported_unit, preset: str, batch: int = 2, context: int = CONTEXT):
    cfg = get_preset(preset).replace(max_context=context)
    unit = copy_unit(exported_unit(cfg, batch=batch, chunk=8))
    run_pipeline(unit, ["ring-buffer-swa"], progress=lambda _m: None)
    return cfg, unit


@pytest.mark.parametrize("preset", ["llama-tiny", "gemma3-tiny", "qwen35-tiny", "ripple-tiny"])
def test_reading_the_tiles_held_equals_reading_every_tile(preset, exported_unit):
    """Batch 2, rows at different positions (padded and empty chunks), crossing tiles: prefill cut to the
    tiles its furthest row holds gives what reading the whole cache gives; decode reads its row's tiles."""
    cfg, unit = _unit(exported_unit, preset)
    steps = make_steps([137, 21], 8, 40, cfg.vocab_size, seed=3)  # up to position 177: three of four tiles
    full, cut = UnitRunner(unit), UnitRunner(unit)
    counts = set()
    for i, step in enumerate(steps):
        if step.entry == "prefill":
            counts.add(int(step.args(CONTEXT)[3].shape[1]))
        want, scale = full.step(_FixedTiles(step, CONTEXT))
        got, _ = cut.step(step)
        rows = step.n_valid > 0 if step.n_valid is not None else torch.ones(got.shape[0], dtype=torch.bool)
        assert scaled_error(got[rows], want[rows], scale[rows]) < GOLDEN_TOL["float32"], f"step {i} ({step.entry})"
        for spec, a, b in zip(unit.state_specs, cut.state, full.state):
            if spec.kind == "global_kv":
                a, b = held_slots(a, step.end_pos), held_slots(b, step.end_pos)
            assert scaled_error(a, b, max(float(b.abs().max()), 1e-30)) < GOLDEN_TOL["float32"], (i, spec.name)
    assert counts == {1, 2, 3}


def test_a_cut_below_the_tokens_held_changes_the_logits(exported_unit):
    """The cut is real: reading one tile too few loses keys (the equality above is not vacuous)."""
    cfg, unit = _unit(exported_unit, "llama-tiny", batch=1)
    steps = make_steps([72], 8, 0, cfg.vocab_size, seed=1)
    right, short = UnitRunner(unit), UnitRunner(unit)
    for step in steps[:-1]:
        right.step(step), short.step(step)
    last = steps[-1]  # positions 64-71: the second tile
    short_step = dataclasses.replace(last)
    short_step.args = lambda slots: (*last.args(slots)[:3], kv_tiles_shape(1))
    assert not torch.allclose(right.step(last)[0], short.step(short_step)[0])


def test_the_exported_lengths_are_symbolic(exported_unit):
    """prefill's attention length comes from kv_tiles and decode's from its position: no length is a
    constant of the traced example."""
    cfg, unit = _unit(exported_unit, "llama-tiny", batch=1)
    for name, program in unit.programs.items():
        lengths = [n.args[7] for n in program.graph.nodes if n.target == torch.ops.foldline.cache_attention.default]
        assert len(lengths) == cfg.num_layers and all(isinstance(n, torch.fx.Node) for n in lengths), name
        assert "64*" in str(lengths[0].meta["val"]), (name, lengths[0].meta["val"])


# ---- in-place cache updates in the compiled module ----------------------------------------------

_SCATTER_INTO = """iree_linalg_ext.scatter dimension_map = [0] unique_indices(false) ins(%u, %i : tensor<1x8xf32>, tensor<1x1xi64>) outs({dest} : tensor<4x8xf32>) {{
    ^bb0(%a: f32, %b: f32):
      iree_linalg_ext.yield %a : f32
    }} -> tensor<4x8xf32>"""
_SLICE_INTO = "tensor.insert_slice %row into {dest}[%c2, 0] [1, 8] [1, 1] : tensor<1x8xf32> into tensor<4x8xf32>"


def _function(name: str = "f", first: str = _SCATTER_INTO.format(dest="%0"),
              second: str = _SCATTER_INTO.format(dest="%1")) -> str:
    """An input-level entry point as IREE's torch input conversion writes it: %2 updates arg0's import (its
    only user); %3 updates arg1's import, which %4 reads too; %4 is a fresh result put into arg1."""
    return f"""
  util.func public @{name}$async(%arg0: !hal.buffer_view, %arg1: !hal.buffer_view, %arg2: !hal.fence, %arg3: !hal.fence) -> !hal.buffer_view {{
    %u = arith.constant dense<1.0> : tensor<1x8xf32>
    %row = arith.constant dense<1.0> : tensor<1x8xf32>
    %i = arith.constant dense<2> : tensor<1x1xi64>
    %c2 = arith.constant 2 : index
    %0 = hal.tensor.import wait(%arg2) => %arg0 : !hal.buffer_view -> tensor<4x8xf32>
    %1 = hal.tensor.import wait(%arg2) => %arg1 : !hal.buffer_view -> tensor<4x8xf32>
    %2 = {first}
    %3 = {second}
    %4 = arith.negf %1 : tensor<4x8xf32>
    %5 = hal.tensor.alias wait(%arg2) => %2 : tensor<4x8xf32> to %arg0 : !hal.buffer_view
    %6 = hal.tensor.alias wait(%arg2) => %3 : tensor<4x8xf32> to %arg1 : !hal.buffer_view
    %7 = hal.tensor.alias wait(%arg2) => %4 : tensor<4x8xf32> to %arg1 : !hal.buffer_view
    %8:3 = hal.tensor.barrier join(%5, %6, %7 : tensor<4x8xf32>, tensor<4x8xf32>, tensor<4x8xf32>) => %arg3 : !hal.fence
    %9 = hal.tensor.export %8#0 : tensor<4x8xf32> -> !hal.buffer_view
    util.return %9 : !hal.buffer_view
  }}"""


def _module(*functions: str) -> str:
    return "module {" + "".join(functions) + "\n}\n"


def _joined(mlir: str) -> list[list[tuple]]:
    """Per barrier, what each value it joins is: (op,) for an update left unaliased, or ("hal.tensor.alias",
    the op whose result it puts back, the argument it puts it into)."""
    from iree.compiler import ir

    barriers: list[list[tuple]] = []

    def describe(value) -> tuple:
        op = value.owner
        if op.name != "hal.tensor.alias":
            return (op.name,)
        return op.name, op.operands[0].owner.name, ir.BlockArgument(op.operands[1]).arg_number

    def visit(op):
        if op.name == "hal.tensor.barrier":
            barriers.append([describe(v) for v in list(op.operands)[:-1]])  # the last operand: the fence
        return ir.WalkResult.ADVANCE

    with ir.Context():
        ir.Module.parse(mlir).operation.walk(visit)
    return barriers


_KEPT = [("hal.tensor.alias", "iree_linalg_ext.scatter", 1), ("hal.tensor.alias", "arith.negf", 1)]


def test_elide_drops_only_aliases_of_sole_in_place_scatters():
    assert _joined(_module(_function())) == [[("hal.tensor.alias", "iree_linalg_ext.scatter", 0), *_KEPT]]
    edited, report = elide_inplace_aliases(_module(_function()))
    # %2 scatters into the sole use of arg0's import: elided, the barrier joins the scatter itself. %3's
    # import is also read by %4: IREE would copy it before scattering, so the alias must stay; %4 is a
    # fresh result: stays.
    assert (report.elided, report.kept) == (1, 2)
    assert _joined(edited) == [[("iree_linalg_ext.scatter",), *_KEPT]]


def test_elide_drops_aliases_of_sole_in_place_slice_updates():
    """A one-token decode write is a slice update at the step's slot: in place like a scatter."""
    edited, report = elide_inplace_aliases(_module(_function(first=_SLICE_INTO.format(dest="%0"))))
    assert (report.elided, report.kept) == (1, 2)
    assert _joined(edited) == [[("tensor.insert_slice",), *_KEPT]]


def test_elide_is_scoped_to_each_function():
    two = _module(_function("f"), _function("g", second=_SCATTER_INTO.format(dest="%0")))
    edited, report = elide_inplace_aliases(two)
    # in @g both scatters update arg0's import: it has two users, so no alias of it goes
    assert (report.elided, report.kept) == (1, 2 + 3)
    assert _joined(edited)[0] == [("iree_linalg_ext.scatter",), *_KEPT]


def test_elide_reads_the_module_not_its_spelling():
    """The same module spelled otherwise (MLIR's generic form, other value names and indentation, an
    alias placed on a device with no wait) is edited the same: the rewrite follows values, not lines."""
    from iree.compiler import ir

    with ir.Context():
        generic = ir.Module.parse(_module(_function())).operation.get_asm(print_generic_op_form=True)
    assert "hal.tensor.alias wait(" not in generic  # a line-by-line match would find no alias here
    edited, report = elide_inplace_aliases(generic)
    assert (report.elided, report.kept) == (1, 2)
    assert _joined(edited) == [[("iree_linalg_ext.scatter",), *_KEPT]]

    placed = _module(_function()).replace(
        "    %5 = hal.tensor.alias wait(%arg2) => %2 :",
        "\n        %5 = hal.tensor.alias on(#hal.device.promise<@__device_0>) %2 :")
    edited, report = elide_inplace_aliases(placed)
    assert (report.elided, report.kept) == (1, 2)
    assert _joined(edited) == [[("iree_linalg_ext.scatter",), *_KEPT]]


@pytest.mark.slow
def test_decode_writes_rings_and_caches_in_place():
    """gemma3-tiny (rings and a global cache): a decode step copies no cache or ring, scatters into
    none (each write is a slice update at a slot computed on the host from pos_shape), and runs as
    one command buffer with no wait inside (a read of the position from device memory would add a
    wait and a second command buffer; a host check between the layers' writes would split the step
    into one submission per layer)."""
    import iree.compiler as ireec

    from foldline.backends.iree.importer import import_programs
    from foldline.backends.targets import cpu_target
    from foldline.frontend.export import export_model
    from foldline.frontend.model import build_model
    from foldline.kernels.attention import expand_decode_attention_ops
    from foldline.passes.registry import CompileUnit

    cfg = get_preset("gemma3-tiny").replace(max_context=1024)
    entries = export_model(build_model(cfg), 1, 16)
    unit = CompileUnit(cfg, {n: e.program for n, e in entries.items()}, entries["prefill"].state_specs)
    run_pipeline(unit, None, progress=lambda _m: None)
    ring_bytes = min(s.nbytes for s in unit.state_specs)
    assert any(s.kind == "local_kv" for s in unit.state_specs) and any(s.kind == "global_kv" for s in unit.state_specs)
    # as for a CPU target: decode attention is the hand-written kernel (kernels/attention.py)
    mlir, _ = expand_decode_attention_ops(import_programs(unit.programs.items(), decode_attention_kernel=True)[0])
    flags = cpu_target().flags
    converted = ireec.compile_str(mlir, input_type="torch", extra_args=[*flags, "--compile-to=input"]).decode()
    edited, _ = elide_inplace_aliases(converted)
    stream = ireec.compile_str(edited, extra_args=[*flags, "--compile-from=input", "--compile-to=stream"]).decode()
    decodes = [f for f in stream.split("util.func public @") if f.startswith("decode$async")]
    assert len(decodes) == 1
    for body in decodes:
        copies = [int(c) for c in re.findall(r"stream\.cmd\.copy [^\n]*?, %c(\d+) :", body)]
        assert not [c for c in copies if c >= ring_bytes], f"a decode step copies {max(copies)} bytes"
        assert len(re.findall(r"stream\.cmd\.execute", body)) == 1
        assert "stream.timepoint.await" not in body.split("stream.cmd.execute", 1)[0]
    functions = converted.split("util.func public @")
    input_decodes = [f for f in functions if f.startswith("decode$async(")]
    assert len(input_decodes) == 1 and all("iree_linalg_ext.scatter" not in f for f in input_decodes)
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

    from foldline.backends.build import compile_torch_module
    from foldline.backends.iree.importer import import_programs
    from foldline.backends.targets import cpu_target
    from foldline.frontend.export import export_model
    from foldline.frontend.model import build_model
    from foldline.kernels.attention import expand_decode_attention_ops
    from foldline.passes.registry import CompileUnit

    cfg = get_preset("llama-tiny").replace(max_context=2048)
    entries = export_model(build_model(cfg), 1, 16)
    unit = CompileUnit(cfg, {n: e.program for n, e in entries.items()}, entries["prefill"].state_specs)
    run_pipeline(unit, None, progress=lambda _m: None)
    # as for a CPU target: decode attention is the hand-written kernel (kernels/attention.py)
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
def test_compiled_tiles_match_eager(bundle_factory, preset, kv_dtype):
    """Every tiny preset compiled for 256 positions (four 64-slot tiles) follows eager greedy decoding
    from a prompt that fills two tiles through decodes into the fourth (sliding-window rings wrapping
    many times, GDN layers), with f32 or f16 caches: each call reads only the tiles it holds."""
    from foldline.frontend.sources import load_model
    from foldline.runtime import Model
    from foldline.testing.parity import SCALED_TOL_FP32, run_parity

    bundle = bundle_factory(preset, max_context=CONTEXT, kv_dtype=kv_dtype)
    model = Model.load(bundle)
    assert model.manifest.kv_tile == 64 and model.max_context == CONTEXT
    assert {s.dtype for s in model.manifest.state if s.kind == "global_kv"} == {kv_dtype}
    loaded = load_model(preset, max_context=CONTEXT)
    ids = np.random.default_rng(0).integers(0, model.vocab_size, 100).tolist()
    with loaded.reconfigured(kv_dtype=kv_dtype):  # the eager reference holds the same cache type
        report = run_parity(loaded.module, model, ids, steps=100)
    assert report.steps == 101 and report.ok(SCALED_TOL_FP32), report.summary()


def test_unsupported_kv_dtype_is_a_clear_error(tmp_path):
    from foldline.backends.build import BuildOptions, compile_model
    from foldline.errors import FoldlineError
    from foldline.frontend.sources import load_model

    with pytest.raises(FoldlineError, match="K/V cache dtype 'float64' is not supported"):
        compile_model(load_model("llama-tiny"), tmp_path / "b", BuildOptions(kv_dtype="float64"))
    assert not (tmp_path / "b").exists()
