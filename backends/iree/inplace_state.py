"""Keep in-place state updates in place: drop `hal.tensor.alias` where the update already is.

IREE's torch input conversion ends every function that mutates an argument with

    %t   = hal.tensor.import %arg               (at entry)
    %new = iree_linalg_ext.scatter ... outs(%t)  (the KV-cache write: in place on %t;
                                                  a decode step's ring write:
                                                  tensor.insert_slice ... into %t[...];
                                                  a decode attention kernel that writes
                                                  the step's token: flow.dispatch (..., %t)
                                                  -> (..., %t), kernels/attention.py)
    %a   = hal.tensor.alias %new to %arg         (put the result in the caller's buffer)
    hal.tensor.barrier join(%a, ...)

The scatter already writes into the caller's buffer (its result is tied to the
imported %t), but the alias re-imports %arg as a separate resource, which the pinned
IREE (targets.IREE_VERSION) cannot prove is the same buffer: it copies the whole cache on every call.
For a global layer that copy is max_context slots per step, the largest cost
of a decode step in a long-context bundle (docs/architecture.md, "Attention that
reads the tokens held").

Run between `--compile-to=input` and `--compile-from=input`, this rewrite drops
exactly those aliases whose value is a scatter, a slice update or a tied dispatch result into the
import of the same argument, and passes the updated value to the barrier
instead. Every other alias (a prefill chunk's ring write, GDN state: fresh
results IREE places into the argument) stays. The module is edited through
IREE's MLIR bindings (values and their uses, not their printed names). The
parity tests check that the updated caches are the ones the next call reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from iree.compiler import ir
from iree.compiler.dialects import hal, tensor

from ...kernels.sites import defining_op
from .input_ir import module_text

SCATTER = "iree_linalg_ext.scatter"  # ins(updates, indices) outs(original): its result is `original` updated
DISPATCH = "flow.dispatch"  # a kernel's dispatch: a result tied to an argument is that argument updated


@dataclass
class ElideReport:
    elided: int  # aliases dropped: updates already in the caller's buffer
    kept: int  # aliases left for IREE to place


def _updated_in_place(value: ir.Value) -> ir.Value | None:
    """The tensor a scatter or slice update wrote `value` into (its destination); None for any other value."""
    op = defining_op(value)
    if op is None:
        return None
    if op.name == SCATTER:
        return op.operands[len(op.operands) - 1]  # the one `outs` operand
    if op.name == tensor.InsertSliceOp.OPERATION_NAME:
        return op.opview.dest
    if op.name == DISPATCH:
        return _tied_operand(op, ir.OpResult(value).result_number)
    return None


def _tied_operand(dispatch: ir.Operation, result: int) -> ir.Value | None:
    """The argument a `flow.dispatch` result is tied to (the dispatch wrote it in place), or None."""
    tied = [ir.IntegerAttr(a).value for a in ir.ArrayAttr(dispatch.attributes["tied_operands"])] \
        if "tied_operands" in dispatch.attributes else []
    if result >= len(tied) or tied[result] < 0:
        return None
    workload = ir.DenseI32ArrayAttr(dispatch.attributes["operandSegmentSizes"])[0]
    return dispatch.operands[workload + tied[result]]


def _elidable(alias: hal.TensorAliasOp) -> bool:
    """Whether `alias` puts a scatter, slice update or kernel's tied result back into the argument it already
    wrote in place."""
    target = _updated_in_place(alias.source)
    imported = defining_op(target) if target is not None else None
    if imported is None or imported.name != hal.TensorImportOp.OPERATION_NAME:
        return False
    # Only when the update is the imported tensor's sole user: IREE then updates it in place (a second
    # reader would make it copy the tensor first, and drop the update).
    return imported.opview.source == alias.storage and len(list(target.uses)) == 1


def elide_aliases_in(module: ir.Module) -> ElideReport:
    """Drop, in `module`, the aliases of in-place updates into their own argument (see the module docstring)."""
    aliases: list[hal.TensorAliasOp] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name == hal.TensorAliasOp.OPERATION_NAME:
            aliases.append(op.opview)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    elided = [alias for alias in aliases if _elidable(alias)]
    for alias in elided:  # uses of a dropped alias (the barrier) read the in-place result
        alias.result.replace_all_uses_with(alias.source)
        alias.operation.erase()
    return ElideReport(len(elided), len(aliases) - len(elided))


def elide_inplace_aliases(mlir: str) -> tuple[str, ElideReport]:
    """The input-level module `mlir` without the aliases of in-place updates; and the counts."""
    with ir.Context():
        module = ir.Module.parse(mlir)
        report = elide_aliases_in(module)
        return module_text(module), report
