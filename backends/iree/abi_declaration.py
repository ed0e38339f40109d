"""Declare each entry point's tensor signature in the module, for the runtime to check at load.

Plain `func.func` inputs get an `iree.abi.declaration` from IREE; the torch
input path does not (its functions take `!hal.buffer_view`s and import them
inside). This pass over the input-level module puts a declaration on each
synchronous entry point `@name` (the `iree.abi.stub` that calls `@name$async`),
which the runtime reads back (`VmFunction.reflection`) to compare with the
manifest before the first call. The inputs come from the torch-dialect function
the module was compiled from (every argument, read or not: IREE imports only
the arguments a function reads, yet the caller passes them all); the outputs
from the `@name$async` body's `hal.tensor.export`s. Both modules are read and
the declaration attached through IREE's MLIR bindings.
"""

from __future__ import annotations

from iree.compiler import ir
from iree.compiler.dialects import hal

from ...contract.entry_points import DECLARATION_KEY

ASYNC_SUFFIX = "$async"
STUB = "iree.abi.stub"  # on every function IREE's ABI wraps, the synchronous entry point among them
REFLECTION = "iree.reflection"
_TORCH_TENSORS = ("!torch.vtensor<[", "!torch.tensor<[")
_DIMS = frozenset("-0123456789,?")


def _symbol(op: ir.Operation) -> str:
    return ir.StringAttr(op.attributes["sym_name"]).value


def _is_public(op: ir.Operation) -> bool:
    return "sym_visibility" not in op.attributes or ir.StringAttr(op.attributes["sym_visibility"]).value == "public"


def torch_tensor_type(torch_type: ir.Type) -> str | None:
    """`!torch.vtensor<[1,?],si64>` (or a `!torch.tensor`) as IREE spells it, `1x?xi64`; None for another type.

    The bindings have no class for torch types: the type's own spelling is what there is to read.
    """
    spelled = str(torch_type)
    prefix = next((p for p in _TORCH_TENSORS if spelled.startswith(p) and spelled.endswith(">")), None)
    if prefix is None:
        return None
    dims, _, element = spelled[len(prefix):-1].partition("],")
    if not set(dims) <= _DIMS or not element or not all(c.isalnum() or c == "_" for c in element):
        return None
    shape = ["?" if d in ("?", "-1") else d for d in dims.split(",") if d]
    if element[:2] in ("si", "ui") and element[2:].isdigit():
        element = element[1:]  # torch's si64 is IREE's i64
    return "x".join([*shape, element])


def torch_inputs(torch_mlir: str) -> dict[str, list[str]]:
    """function name -> the tensor type of each argument (`1x2x128x16xf32`, `0x?xi8`), from torch-dialect MLIR."""
    out = {}
    with ir.Context():
        module = ir.Module.parse(torch_mlir)
        for op in module.body.operations:
            op = op.operation
            if op.name != "func.func" or not _is_public(op):
                continue
            function_type = ir.FunctionType(ir.TypeAttr(op.attributes["function_type"]).value)
            out[_symbol(op)] = [t for t in map(torch_tensor_type, function_type.inputs) if t is not None]
    return out


def _tensor_type(encoding: ir.Type) -> str:
    """`tensor<1x?x512xf32>`'s inside, `1x?x512xf32`."""
    ranked = ir.RankedTensorType(encoding)
    dims = ["?" if ranked.is_dynamic_dim(i) else str(d) for i, d in enumerate(ranked.shape)]
    return "x".join([*dims, str(ranked.element_type)])


def _exported_types(function: ir.Operation) -> list[str]:
    """The tensor type of each `hal.tensor.export` in `function`, in order: the entry point's results."""
    found: list[str] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name == hal.TensorExportOp.OPERATION_NAME:
            found.append(_tensor_type(ir.TypeAttr(op.attributes["source_encoding"]).value))
        return ir.WalkResult.ADVANCE

    function.walk(visit, ir.WalkOrder.PRE_ORDER)
    return found


def _declare(function: ir.Operation, declaration: str) -> None:
    """Add `declaration` to `function`'s reflection (keeping any entries it has)."""
    entries: dict[str, ir.Attribute] = {}
    if REFLECTION in function.attributes:
        reflection = ir.DictAttr(function.attributes[REFLECTION])
        entries = {reflection[i].name: reflection[i].attr for i in range(len(reflection))}
    entries[DECLARATION_KEY] = ir.StringAttr.get(declaration)
    function.attributes[REFLECTION] = ir.DictAttr.get(entries)


def declare_signatures(module: ir.Module, inputs_of: dict[str, list[str]]) -> list[str]:
    """Put a declaration on every synchronous entry point of `module` (`inputs_of`: `torch_inputs`); their names."""
    functions = {_symbol(op.operation): op.operation for op in module.body.operations
                 if op.operation.name == "util.func" and _is_public(op.operation)}
    declared = []
    for name, function in functions.items():
        if not name.endswith(ASYNC_SUFFIX):
            continue
        sync = name[: -len(ASYNC_SUFFIX)]
        inputs = inputs_of.get(sync)
        if sync not in functions or not inputs or STUB not in functions[sync].attributes:
            continue
        args = ", ".join(f"%input{i}: tensor<{t}>" for i, t in enumerate(inputs))
        results = ", ".join(f"%output{i}: tensor<{t}>" for i, t in enumerate(_exported_types(function)))
        _declare(functions[sync], f"sync func @{sync}({args}) -> ({results})")
        declared.append(sync)
    return declared

