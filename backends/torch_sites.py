"""Finding and rewriting op sites in torch-dialect MLIR (the FX importer's output).

The kernel generators (quant_kernels, attention_kernels) and the decode
fusion matcher read the imported module with IREE's MLIR Python bindings:
find the `torch.operator` ops foldline kept through the import, follow
values to the ops that made them, and hand `!torch.vtensor` values to
builtin-tensor code.
"""

from __future__ import annotations

from iree.compiler import ir


def defining_op(value: ir.Value) -> ir.Operation | None:
    """The operation that produced `value`, or None for a block argument."""
    owner = value.owner
    return getattr(owner, "operation", owner) if isinstance(owner, (ir.Operation, ir.OpView)) else None


def torch_operators(module: ir.Module, names: tuple[str, ...]) -> list[ir.Operation]:
    """Every `torch.operator` of the module named one of `names` (with or without `.default`), in order."""
    found: list[ir.Operation] = []

    def visit(op):
        if op.name == "torch.operator" and ir.StringAttr(op.attributes["name"]).value.removesuffix(
                ".default") in names:
            found.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return found


def builtin_tensor(value: ir.Value, want: str) -> ir.Value:
    """The builtin tensor (of type text `want`) behind a !torch.vtensor operand: a weight's
    util.global.load where it comes from one, else a new cast at the insertion point."""
    op = defining_op(value)
    if op is not None and op.name == "torch_c.from_builtin_tensor":
        return op.operands[0]
    return ir.Operation.create("torch_c.to_builtin_tensor", results=[ir.Type.parse(want)], operands=[value]).result
