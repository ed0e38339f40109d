"""The fused form's unmasked prefix attention and its log-sum-exp as one IREE online-attention op.

`fused_attention._prefix_and_tail` attends a chunk to the keys before it with
`aten.scaled_dot_product_attention` (no mask) and adds a masked tail, which
needs the prefix's log-sum-exp too (`foldline::attention_lse`). Imported as
they are, those would be two passes over the prefix keys. Here each pair (the
same queries and keys) becomes one call of a `util.func` around
`iree_linalg_ext.online_attention`, the op IREE's attention is tiled into: it
returns the unnormalised output, the running maximum and the sum (base 2, as
IREE's softmax is computed with exp2), from which the function gives the
normalised output and the natural log-sum-exp. Its scratch is a tile of keys
per workgroup, whatever the prefix's length; the f16 cache widening before it
fuses into its dispatch as it does into the attention op's.

Numerics: for an empty prefix (a chunk in the first two tiles) the output is
0 / 0 and the log-sum-exp -inf, which `_prefix_and_tail` weighs by exactly 0.
"""

from __future__ import annotations

import math

from iree.compiler import ir

from ...kernels.mlir import f32_bits
from ...kernels.sites import SiteError, builtin_tensor, constant, defining_op, torch_operators

LSE_OP = "torch.foldline.attention_lse"
SDPA_OP = "torch.aten.scaled_dot_product_attention"


def _dims(value: ir.Value) -> list[str]:
    """The dims of an f32 `!torch.vtensor<[1,2,?,16],f32>` value as MLIR spells them (? for a dynamic one)."""
    text = str(value.type)
    head, _, rest = text.partition("<[")
    dims, _, element = rest.partition("],")
    if head != "!torch.vtensor" or element != "f32>":
        raise SiteError(f"online attention takes f32 tensors, got {text}")
    return dims.split(",")


def _tensor(dims: list[str]) -> str:
    return "tensor<" + "x".join(dims) + "xf32>"


def online_attention_function(name: str, q_dims: list[str], k_dims: list[str], scale: float) -> str:
    """util.func @name(q [B,H,M,D], k [B,H,L,D], v [B,H,L,D]) -> (softmax(q k^T scale) v, log-sum-exp [B,H,M])."""
    q_t, k_t, row_t = _tensor(q_dims), _tensor(k_dims), _tensor(q_dims[:-1])
    ln2 = math.log(2.0)
    return f"""util.func private @{name}(%q: {q_t}, %k: {k_t}, %v: {k_t}) -> ({q_t}, {row_t}) {{
  %scale = arith.constant {scale!r} : f32
  %zero = arith.constant 0.0 : f32
  %lowest = arith.constant -1.0e+30 : f32
  %acc_e = tensor.empty() : {q_t}
  %row_e = tensor.empty() : {row_t}
  %acc0 = linalg.fill ins(%zero : f32) outs(%acc_e : {q_t}) -> {q_t}
  %max0 = linalg.fill ins(%lowest : f32) outs(%row_e : {row_t}) -> {row_t}
  %sum0 = linalg.fill ins(%zero : f32) outs(%row_e : {row_t}) -> {row_t}
  %r:3 = iree_linalg_ext.online_attention <{{indexing_maps = [
      affine_map<(b, h, m, k1, l, n) -> (b, h, m, k1)>,
      affine_map<(b, h, m, k1, l, n) -> (b, h, l, k1)>,
      affine_map<(b, h, m, k1, l, n) -> (b, h, l, n)>,
      affine_map<(b, h, m, k1, l, n) -> ()>,
      affine_map<(b, h, m, k1, l, n) -> (b, h, m, n)>,
      affine_map<(b, h, m, k1, l, n) -> (b, h, m)>,
      affine_map<(b, h, m, k1, l, n) -> (b, h, m)>]}}>
      ins(%q, %k, %v, %scale : {q_t}, {k_t}, {k_t}, f32) outs(%acc0, %max0, %sum0 : {q_t}, {row_t}, {row_t}) {{
    ^bb0(%score: f32):
      iree_linalg_ext.yield %score : f32
  }} -> {q_t}, {row_t}, {row_t}
  %out = linalg.generic {{indexing_maps = [affine_map<(b, h, m, n) -> (b, h, m, n)>,
      affine_map<(b, h, m, n) -> (b, h, m)>, affine_map<(b, h, m, n) -> (b, h, m, n)>],
      iterator_types = ["parallel", "parallel", "parallel", "parallel"]}}
      ins(%r#0, %r#2 : {q_t}, {row_t}) outs(%acc_e : {q_t}) {{
    ^bb0(%a: f32, %s: f32, %o: f32):
      %n = arith.divf %a, %s : f32
      linalg.yield %n : f32
  }} -> {q_t}
  %lse = linalg.generic {{indexing_maps = [affine_map<(b, h, m) -> (b, h, m)>,
      affine_map<(b, h, m) -> (b, h, m)>, affine_map<(b, h, m) -> (b, h, m)>],
      iterator_types = ["parallel", "parallel", "parallel"]}}
      ins(%r#1, %r#2 : {row_t}, {row_t}) outs(%row_e : {row_t}) {{
    ^bb0(%mx: f32, %s: f32, %o: f32):
      %l2 = math.log2 %s : f32
      %t = arith.addf %mx, %l2 : f32
      %ln2 = arith.constant {ln2!r} : f32
      %e = arith.mulf %t, %ln2 : f32
      linalg.yield %e : f32
  }} -> {row_t}
  util.return %out, %lse : {q_t}, {row_t}
}}"""


def _attention_of(lse: ir.Operation) -> ir.Operation:
    """The unmasked scaled_dot_product_attention of the same queries and keys, before `lse` in its block."""
    q, k = lse.operands[0], lse.operands[1]
    for use in q.uses:
        op = use.owner.operation
        if (op.name == SDPA_OP and op.operands[1] == k and op.block == lse.block
                and op.is_before_in_block(lse)):
            mask = defining_op(op.operands[3])
            if mask is None or mask.name != "torch.constant.none":
                raise SiteError("the prefix attention beside an attention_lse must take no mask")
            return op
    raise SiteError("an attention_lse without the unmasked attention of its queries and keys before it")


def expand_online_attention(mlir: str) -> tuple[str, int]:
    """Replace each attention_lse and its unmasked attention by one online-attention call; how many."""
    if LSE_OP not in mlir:
        return mlir, 0
    with ir.Context() as ctx:
        ctx.allow_unregistered_dialects = True
        module = ir.Module.parse(mlir)
        symbols = ir.SymbolTable(module.operation)
        count = 0
        for lse in torch_operators(module, (LSE_OP,)):
            sdpa = _attention_of(lse)
            q, k, v = sdpa.operands[0], sdpa.operands[1], sdpa.operands[2]
            q_dims, k_dims = _dims(q), _dims(k)
            scale = float(constant(lse.operands[2]))
            name = (f"foldline_online_attention_{'x'.join(d.replace('?', 'D') for d in q_dims)}"
                    f"_l{'x'.join(d.replace('?', 'D') for d in k_dims)}_sc{f32_bits(scale)}")
            with ir.InsertionPoint(sdpa), sdpa.location:
                operands = [builtin_tensor(q, _tensor(q_dims)), builtin_tensor(k, _tensor(k_dims)),
                            builtin_tensor(v, _tensor(k_dims))]
                call = ir.Operation.create(
                    "util.call", results=[ir.Type.parse(_tensor(q_dims)), ir.Type.parse(_tensor(q_dims[:-1]))],
                    operands=operands, attributes={"callee": ir.FlatSymbolRefAttr.get(name)})
                out = ir.Operation.create("torch_c.from_builtin_tensor", results=[sdpa.results[0].type],
                                          operands=[call.results[0]])
                total = ir.Operation.create("torch_c.from_builtin_tensor", results=[lse.results[0].type],
                                            operands=[call.results[1]])
            sdpa.results[0].replace_all_uses_with(out.result)
            lse.results[0].replace_all_uses_with(total.result)
            lse.erase()
            sdpa.erase()
            if name not in symbols:
                func = ir.Operation.parse(online_attention_function(name, q_dims, k_dims, scale))
                ir.InsertionPoint(module.body).insert(func)
                symbols.insert(func)
            count += 1
        return str(module), count
