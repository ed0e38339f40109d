"""In-place cache updates (backends/iree/inplace_state.py): which state aliases are elided, and compiled
decode steps that write rings and caches in place, never copying a cache."""

from __future__ import annotations

import re

import pytest

from foldline.backends.iree.inplace_state import elide_inplace_aliases
from foldline.frontend.arch import get_preset
from foldline.passes.manager import run_pipeline

pytestmark = pytest.mark.usefixtures("torch_one_thread")

_SCATTER_INTO = """iree_linalg_ext.scatter dimension_map = [0] unique_indices(false) ins(%u, %i : tensor<1x8xf32>, tensor<1x1xi64>) outs({dest} : tensor<4x8xf32>) {{
    ^bb0(%a: f32, %b: f32):
      iree_linalg_ext.yield %a : f32
    }} -> tensor<4x8xf32>"""
_SLICE_INTO = "tensor.insert_slice %row into {dest}[%c2, 0] [1, 8] [1, 1] : tensor<1x8xf32> into tensor<4x8xf32>"
_DISPATCH_INTO = "flow.dispatch @ex::@entry(%row, {dest}) : (tensor<1x8xf32>, tensor<4x8xf32>) -> {result}"


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


def test_elide_drops_aliases_of_kernels_that_update_in_place():
    """A decode attention kernel that writes the step's token (kernels/attention.py) returns the cache as a
    result tied to its argument: in place like a scatter. An untied result is a fresh tensor: kept."""
    tied = _DISPATCH_INTO.format(dest="%0", result="%0")
    edited, report = elide_inplace_aliases(_module(_function(first=tied)))
    assert (report.elided, report.kept) == (1, 2)
    assert _joined(edited) == [[("flow.dispatch",), *_KEPT]]
    fresh = _DISPATCH_INTO.format(dest="%0", result="tensor<4x8xf32>")
    edited, report = elide_inplace_aliases(_module(_function(first=fresh)))
    assert (report.elided, report.kept) == (0, 3)
    assert _joined(edited) == [[("hal.tensor.alias", "flow.dispatch", 0), *_KEPT]]


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
