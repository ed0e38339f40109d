"""What a one-row qlinear can take into its int8-dot kernel: the norm or gated activation before it, the add after it.

A decode step of a small model is mostly dispatches, not bytes: each costs
IREE's task system as much as the smaller projections' own work
(docs/quantization.md, "What the decode kernel takes in around it"). Three
patterns around the projections are small dispatches of their own that the
int8-dot kernel (int8_decode.py) can do on the way in or out:

- the RMSNorm in front (a sum-of-squares dispatch and a scaling dispatch):
  `x = (h * rsqrt(mean(h^2, -1) + eps)) * (w + offset)`, as RMSNorm in
  frontend/layers.py exports it;
- a gated MLP's `act(g) * u` in front of the down projection (one
  dispatch), when g and u are the two halves of one row (the fused gate/up
  output): SwiGLU's silu, or GeGLU's tanh-approximated GELU (Gemma);
- the residual add behind (`h + qlinear(x)`), where nothing sits between the
  projection and the add (Gemma's post-norms do, and stay).

These functions read the torch-dialect MLIR (the FX importer's output) around
a `torch.foldline.qlinear` op and say what matched; qlinear.py rewrites the
site. A pattern that does not match exactly is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from iree.compiler import ir

from .int8_decode import RowNorm
from .sites import defining_op

_ASSERT = "torch.aten._assert_tensor_metadata"  # a check with no effect on values; never a real use


@dataclass
class NormMatch:
    """x = (h * rsqrt(mean(h^2) + eps)) * (weight [+ offset])."""

    h: ir.Value
    weight: ir.Value
    norm: RowNorm


@dataclass
class GateMatch:
    """x = act(g) * u with g, u the two halves of one row (the fused gate/up projection's output).

    activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU with the tanh approximation, Gemma's).
    """

    gate_up: ir.Value
    activation: str = "silu"


@dataclass
class ResidualMatch:
    """The add consuming the qlinear's result, and the other operand (the residual row)."""

    add: ir.Operation
    residual: ir.Value


def _op_named(value: ir.Value, name: str) -> ir.Operation | None:
    op = defining_op(value)
    return op if op is not None and op.name == name else None


def _number(value: ir.Value) -> float | int | None:
    """A torch.constant.int / float operand's value, else None."""
    op = defining_op(value)
    if op is None:
        return None
    if op.name == "torch.constant.int":
        return ir.IntegerAttr(op.attributes["value"]).value
    if op.name == "torch.constant.float":
        return ir.FloatAttr(op.attributes["value"]).value
    return None


def _int_list(value: ir.Value) -> list[int] | None:
    op = _op_named(value, "torch.prim.ListConstruct")
    if op is None:
        return None
    items = [_number(v) for v in op.operands]
    return None if any(not isinstance(i, int) for i in items) else items


def _same(a: ir.Value, b: ir.Value) -> bool:
    return a == b


def _rsqrt_of_mean_square(r: ir.Value, h: ir.Value, rank: int) -> float | None:
    """eps when r = rsqrt(mean(h^2, -1, keepdim) + eps), else None."""
    rsqrt = _op_named(r, "torch.aten.rsqrt")
    add = rsqrt and _op_named(rsqrt.operands[0], "torch.aten.add.Scalar")
    if add is None or _number(add.operands[2]) != 1:
        return None
    eps = _number(add.operands[1])
    mean = _op_named(add.operands[0], "torch.aten.mean.dim")
    if mean is None or not isinstance(eps, float):
        return None
    dims, keepdim = _int_list(mean.operands[1]), defining_op(mean.operands[2])
    if dims not in ([-1], [rank - 1]) or keepdim is None or keepdim.name != "torch.constant.bool":
        return None
    if not ir.BoolAttr(keepdim.attributes["value"]).value or _op_named(mean.operands[3], "torch.constant.none") is None:
        return None
    power = _op_named(mean.operands[0], "torch.aten.pow.Tensor_Scalar")
    if power is None or _number(power.operands[1]) != 2 or not _same(power.operands[0], h):
        return None
    return eps


def match_norm(x: ir.Value, k: int) -> NormMatch | None:
    """The RMSNorm producing x [..., K], or None."""
    outer = _op_named(x, "torch.aten.mul.Tensor")
    if outer is None:
        return None
    dims = _f32_dims(x)
    if dims is None:
        return None
    for scaled, weight in (outer.operands, reversed(list(outer.operands))):
        inner = _op_named(scaled, "torch.aten.mul.Tensor")
        if inner is None or str(scaled.type) != str(x.type) or not _is_vector(weight, k):
            continue
        h, r = inner.operands
        if str(h.type) != str(x.type):
            continue
        eps = _rsqrt_of_mean_square(r, h, len(dims))
        if eps is None:
            continue
        offset_add = _op_named(weight, "torch.aten.add.Scalar")
        if offset_add is not None and _number(offset_add.operands[2]) == 1 and isinstance(
                _number(offset_add.operands[1]), (int, float)) and _is_vector(offset_add.operands[0], k):
            return NormMatch(h, offset_add.operands[0], RowNorm(eps, float(_number(offset_add.operands[1]))))
        return NormMatch(h, weight, RowNorm(eps, None))
    return None


def _half(value: ir.Value, k: int, rank: int) -> tuple[ir.Value, int] | None:
    """(source, start) when value = source[..., start:start + K] of a source row of 2K values."""
    op = _op_named(value, "torch.aten.slice.Tensor")
    if op is None:
        return None
    source, dim, start, end, step = op.operands
    dims = _f32_dims(source)
    if dims is None or dims[-1] != 2 * k or _number(dim) not in (-1, rank - 1) or _number(step) != 1:
        return None
    begin = _number(start)
    return (source, begin) if begin in (0, k) and _number(end) == begin + k else None


def _activated_gates(activated: ir.Value) -> list[tuple[ir.Value, str]]:
    """(g, activation) for each way `activated` is silu(g) = g * sigmoid(g) or gelu(g, "tanh")."""
    gelu = _op_named(activated, "torch.aten.gelu")
    if gelu is not None:
        mode = defining_op(gelu.operands[1])
        if mode is not None and mode.name == "torch.constant.str" and ir.StringAttr(
                mode.attributes["value"]).value == "tanh":
            return [(gelu.operands[0], "gelu_tanh")]
        return []
    silu = _op_named(activated, "torch.aten.mul.Tensor")
    if silu is None:
        return []
    found = []
    for gate, sig in (silu.operands, reversed(list(silu.operands))):
        sigmoid = _op_named(sig, "torch.aten.sigmoid")
        if sigmoid is not None and _same(sigmoid.operands[0], gate):
            found.append((gate, "silu"))
    return found


def match_gate(x: ir.Value, k: int) -> GateMatch | None:
    """A gated MLP's `act(g) * u` producing x [..., K] from one [..., 2K] row [g, u], or None.

    act: SwiGLU's `g * sigmoid(g)` or GeGLU's `gelu(g, approximate="tanh")`.
    """
    outer = _op_named(x, "torch.aten.mul.Tensor")
    dims = _f32_dims(x)
    if outer is None or dims is None or dims[-1] != k:
        return None
    for activated, up in (outer.operands, reversed(list(outer.operands))):
        for gate, activation in _activated_gates(activated):
            g, u = _half(gate, k, len(dims)), _half(up, k, len(dims))
            if g is not None and u is not None and _same(g[0], u[0]) and (g[1], u[1]) == (0, k):
                return GateMatch(g[0], activation)
    return None


def match_residual(y: ir.Value) -> ResidualMatch | None:
    """The `add.Tensor(r, y, 1)` (or `(y, r)`) that is y's only use, with r of y's type, or None."""
    users = [use.owner for use in y.uses]
    real = [u for u in users if getattr(u, "operation", u).name != _ASSERT]
    if len(real) != 1:
        return None
    add = getattr(real[0], "operation", real[0])
    if add.name != "torch.aten.add.Tensor" or _number(add.operands[2]) != 1:
        return None
    a, b = add.operands[0], add.operands[1]
    residual = b if _same(a, y) else a
    if _same(a, b) or str(residual.type) != str(y.type) or str(add.results[0].type) != str(y.type):
        return None
    return ResidualMatch(add, residual)


def _f32_dims(value: ir.Value) -> list[int] | None:
    """The static shape of a `!torch.vtensor<[...],f32>`, else None."""
    text = str(value.type)
    if not text.startswith("!torch.vtensor<[") or not text.endswith("],f32>"):
        return None
    dims = text[len("!torch.vtensor<["):-len("],f32>")]
    if not dims or "?" in dims:
        return None
    return [int(d) for d in dims.split(",")]


def _is_vector(value: ir.Value, k: int) -> bool:
    return str(value.type) == f"!torch.vtensor<[{k}],f32>"
