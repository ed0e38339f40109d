"""Finding and rewriting op sites in torch-dialect MLIR (the FX importer's output).

The kernels read the imported module with IREE's MLIR Python bindings: find
the `torch.operator` ops foldline kept through the import, read their shapes
and constant arguments, follow values to the ops that made them, and replace
each site by a call of its kernel. `rewrite_sites` is the one loop that does
the replacing for every kernel family: the family says, per site, which
kernel it takes (a `KernelCall`), the loop makes the call and adds each
kernel's code to the module once.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from iree.compiler import ir

_VTENSOR = re.compile(r"!torch\.vtensor<\[([0-9,]*)\],(\w+)>")


class SiteError(ValueError):
    """A kept op whose operands no kernel of its family can take (a bug in what reached the importer)."""


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


def shape_and_type(value: ir.Value) -> tuple[tuple[int, ...], str]:
    """(static shape, element type) of a `!torch.vtensor` value."""
    m = _VTENSOR.match(str(value.type))
    if m is None:
        raise SiteError(f"an operand of unsupported type {value.type}")
    return tuple(int(d) for d in m.group(1).split(",") if d), m.group(2)


def constant(value: ir.Value) -> int | float | str | bool | None:
    """The Python value of a `torch.constant.{int,float,str,bool,none}` operand."""
    op = defining_op(value)
    if op is None or not op.name.startswith("torch.constant."):
        raise SiteError(f"a constant was expected here, got {value}")
    if op.name == "torch.constant.none":
        return None
    attr = op.attributes["value"]
    if op.name == "torch.constant.int":
        return ir.IntegerAttr(attr).value
    if op.name == "torch.constant.float":
        return ir.FloatAttr(attr).value
    if op.name == "torch.constant.bool":
        return bool(ir.BoolAttr(attr).value)
    return ir.StringAttr(attr).value


def is_constant(value: ir.Value, kind: str) -> bool:
    """Whether `value` is a `torch.constant.<kind>` (int, none, ...)."""
    op = defining_op(value)
    return op is not None and op.name == f"torch.constant.{kind}"


def builtin_tensor(value: ir.Value, want: str) -> ir.Value:
    """The builtin tensor (of type text `want`) behind a !torch.vtensor operand: a weight's
    util.global.load where it comes from one, else a new cast at the insertion point."""
    op = defining_op(value)
    if op is not None and op.name == "torch_c.from_builtin_tensor":
        return op.operands[0]
    return ir.Operation.create("torch_c.to_builtin_tensor", results=[ir.Type.parse(want)], operands=[value]).result


@dataclass
class KernelCall:
    """How one site becomes a call of a kernel's `util.func`.

    at: where the call goes (every operand is defined before it); operands: made there
    (builtin tensors); replaces: the ops whose first result the call stands for, erased
    after it (the site itself last); more_results: further results of the call (type text) and the
    op whose first result each stands for, erased after `replaces` (an update the kernel makes
    itself); code: the executables and util.func the callee needs,
    added to the module once per symbol; kind: the kernel the site got, counted for the
    manifest ("qlinear decode int8-avx2", "attention decode", ...).
    """

    at: ir.InsertionPoint
    callee: str
    operands: Callable[[], list[ir.Value]]
    result_type: str
    replaces: list[ir.Operation]
    code: Callable[[], list[str]]
    kind: str
    more_results: list[tuple[str, ir.Operation]] = field(default_factory=list)


def rewrite_sites(mlir: str, names: tuple[str, ...], plan: Callable[[ir.Operation], KernelCall]
                  ) -> tuple[str, Counter[str]]:
    """Replace every `torch.operator` named one of `names` by the call `plan` gives it.

    Returns the new module text and how many sites took each kind of kernel.
    """
    kinds: Counter[str] = Counter()
    if not any(name in mlir for name in names):
        return mlir, kinds
    with ir.Context() as ctx:
        ctx.allow_unregistered_dialects = True
        module = ir.Module.parse(mlir)
        code: dict[str, Callable[[], list[str]]] = {}
        for op in torch_operators(module, names):
            call = plan(op)
            with call.at, op.location:
                types = [call.result_type, *(text for text, _ in call.more_results)]
                made = ir.Operation.create("util.call", results=[ir.Type.parse(text) for text in types],
                                           operands=call.operands(),
                                           attributes={"callee": ir.FlatSymbolRefAttr.get(call.callee)})
                # per result of the call: the ops it stands for, and their torch type
                stands_for = [(call.replaces, op.results[0].type),
                              *(([old], old.results[0].type) for _, old in call.more_results)]
                backs = [(ir.Operation.create("torch_c.from_builtin_tensor", results=[torch_type],
                                              operands=[result]).result, olds)
                         for result, (olds, torch_type) in zip(made.results, stands_for)]
            for back, olds in backs:
                for replaced in olds:
                    replaced.results[0].replace_all_uses_with(back)
            for _, olds in backs:
                for replaced in olds:
                    replaced.erase()
            code.setdefault(call.callee, call.code)
            kinds[call.kind] += 1
        _add_once(module, (text for make in code.values() for text in make()))
        return str(module), kinds


def _add_once(module: ir.Module, texts: Iterable[str]) -> None:
    """Append each op of `texts` (executables, util.funcs) to the module unless its symbol is already there.

    Kernels share symbols (the kernels of one K share a quantize dispatch): the module's symbol table
    says which are there. An op is placed with an insertion point, which hands it to the module, then
    entered in the table (MLIR's SymbolTable.insert takes an op already in its block).
    """
    symbols = ir.SymbolTable(module.operation)
    for text in texts:
        op = ir.Operation.parse(text)
        if ir.SymbolTable.get_symbol_name(op).value in symbols:
            continue  # the parsed duplicate is dropped with its Python handle
        ir.InsertionPoint(module.body).insert(op)
        symbols.insert(op)
