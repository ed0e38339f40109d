"""Attention over full caches as ONNX Runtime's GroupQueryAttention, its caches updated in place.

Decomposed into standard ONNX ops, a call's cache write makes each full
cache's next value as a new tensor and the runtime copies it back: a step
costs what the bundle's context holds, not what the sequence has reached
(docs/onnx.md). `com.microsoft.GroupQueryAttention` takes the cache before
the call (`past_key`, BNSH, the layout of foldline's caches), writes the
chunk's valid keys and values from its start position (`seqlens_k` + 1 is
where they end, `query_seqlens` how many there are: right-padded chunks, as
foldline's) and attends causally over the positions up to each. When its
`present_key` output is bound to the same buffer as `past_key`, it writes
those slots in place and reads only the positions held.

`fuse_cache_attention` rewrites, in a one-row program (prefill or decode),
each layer's pair of `kv_cache_write`s into a full cache and the
`cache_attention` that reads them (a global layer, or a windowed one holding a
full cache, whose window becomes `local_window_size`) into one
`foldline::gqa_attention`; the export emits it as a
placeholder node that `to_group_query_attention` renames into
GroupQueryAttention. The graph records which state buffers it updates in
place (`INPLACE_STATE_KEY` in the model's metadata) so that the runtime binds them
(runtime/onnx_device.py); a plain `session.run` still gives the right caches,
copied. A padded chunk row's output, which ONNX Runtime leaves unspecified,
is zeroed, so that no later layer (a GDN recurrence) meets a NaN.

Left decomposed: windowed full caches and rings (their keys are few),
batched programs (a fresh idle row has no cached position, which the op
requires), interleaved head mappings.
"""

from __future__ import annotations

import operator

import onnx
import torch
from onnx import helper
from onnx.defs import OpSchema
from torch import Tensor
from torch.fx import GraphModule, Node
from torch.fx.passes.tools_common import legalize_graph

from ..contract.entry_points import INPLACE_STATE_KEY, NEXT_SUFFIX
from ..frontend.ops import cache_attention_impl, kv_cache_write_impl

PLACEHOLDER_DOMAIN = "foldline"
PLACEHOLDER = "DecodeAttention"
ORT_DOMAIN = "com.microsoft"
QUERY_SEQLENS_INPUT = 16  # GroupQueryAttention's input index of query_seqlens (ONNX Runtime 1.32)

CACHE_WRITE = torch.ops.foldline.kv_cache_write.default
CACHE_ATTENTION = torch.ops.foldline.cache_attention.default


@torch.library.custom_op("foldline::gqa_attention", mutates_args=())
def gqa_attention(q: Tensor, k_new: Tensor, v_new: Tensor, k_cache: Tensor, v_cache: Tensor, start_pos: Tensor,
                  n_valid: Tensor, scale: float, window: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """A chunk's cache writes and its attention over the full cache (window > 0: the last `window`
    positions only): (output, next k cache, next v cache)."""
    k_next = kv_cache_write_impl(k_cache, k_new, start_pos, n_valid)
    v_next = kv_cache_write_impl(v_cache, v_new, start_pos, n_valid)
    out = cache_attention_impl(q, k_next, v_next, start_pos, window, scale, "blocked", k_cache.shape[2])
    return out, k_next, v_next


@gqa_attention.register_fake
def _(q, k_new, v_new, k_cache, v_cache, start_pos, n_valid, scale, window=0):
    return q.new_empty(q.shape), k_cache.new_empty(k_cache.shape), v_cache.new_empty(v_cache.shape)


def _fusable(attention: Node) -> tuple[Node, Node] | None:
    """The two cache writes a one-row cache_attention reads, if the three can become one GQA: a global
    layer's, or a windowed layer's that holds a full cache (a bundle compiled without ring-buffer-swa)."""
    q, k, v, _pos, _window, _scale, kv_mapping, _length = attention.args
    if kv_mapping != "blocked" or q.meta["val"].shape[0] != 1:
        return None
    if not all(isinstance(w, Node) and w.target == CACHE_WRITE for w in (k, v)):
        return None
    if any(w.args[0].op != "placeholder" or w.args[2] is not attention.args[3] for w in (k, v)):
        return None  # the writes must take the state inputs themselves, at the attention's position
    if k.args[3] is not v.args[3]:
        return None  # one count of valid tokens for both writes
    if q.meta["val"].dtype != torch.float32:
        return None
    return k, v


def fuse_cache_attention(gm: GraphModule) -> int:
    """Rewrite (in place) each fusable write-write-attend triple of `gm` into foldline::gqa_attention."""
    count = 0
    for attention in [n for n in gm.graph.nodes if n.op == "call_function" and n.target == CACHE_ATTENTION]:
        pair = _fusable(attention)
        if pair is None:
            continue
        k_write, v_write = pair
        q, _k, _v, pos, window, scale, _mapping, _length = attention.args
        with gm.graph.inserting_before(attention):
            fused = gm.graph.call_function(torch.ops.foldline.gqa_attention.default,
                                           (q, k_write.args[1], v_write.args[1], k_write.args[0], v_write.args[0],
                                            pos, k_write.args[3], scale, window))
            fused.meta["val"] = (attention.meta["val"], k_write.meta["val"], v_write.meta["val"])
            parts = []
            for i, old in enumerate((attention, k_write, v_write)):
                part = gm.graph.call_function(operator.getitem, (fused, i))
                part.meta["val"] = old.meta["val"]
                parts.append(part)
        for old, part in zip((attention, k_write, v_write), parts):
            old.replace_all_uses_with(part)
        for old in (attention, k_write, v_write):
            gm.graph.erase_node(old)
        count += 1
    if count:
        legalize_graph(gm)  # the state's copy-back may precede the attention: sort the users after the fused node
        gm.recompile()
    return count


def register_placeholder() -> None:
    """`foldline.DecodeAttention`: GroupQueryAttention's first seven inputs, query_seqlens, its three
    outputs, once."""
    if onnx.defs.has(PLACEHOLDER, PLACEHOLDER_DOMAIN):
        return
    param = OpSchema.FormalParameter
    onnx.defs.register_schema(OpSchema(
        PLACEHOLDER, PLACEHOLDER_DOMAIN, 1,
        inputs=[param(n, "T") for n in ("query", "key", "value", "past_key", "past_value")]
        + [param("seqlens_k", "I"), param("total_sequence_length", "I"), param("query_seqlens", "I")],
        outputs=[param(n, "T") for n in ("output", "present_key", "present_value")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], ""), ("I", ["tensor(int32)"], "")],
        attributes=[OpSchema.Attribute("num_heads", OpSchema.AttrType.INT, ""),
                    OpSchema.Attribute("kv_num_heads", OpSchema.AttrType.INT, ""),
                    OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, ""),
                    OpSchema.Attribute("local_window_size", OpSchema.AttrType.INT, "")],
    ))


def local_window(window: int) -> int:
    """GroupQueryAttention's `local_window_size` for foldline's window (-1: none).

    Both count the keys a query sees, its own position included: position p attends to
    p - W + 1 .. p (HF's sliding_window). W - 1 fails the golden test (tests/test_onnx.py).
    """
    return window if window > 0 else -1


def translation():
    """The exporter's translation of foldline::gqa_attention into the placeholder, in BSH layout."""
    import onnxscript

    register_placeholder()
    ops = onnxscript.values.Opset(PLACEHOLDER_DOMAIN, 1)
    op = onnxscript.opset20
    int32, f16, f32 = onnx.TensorProto.INT32, onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT

    def translate(q, k_new, v_new, k_cache, v_cache, start_pos, n_valid, scale: float, window: int = 0):
        _b, heads, chunk, dim = q.shape
        kv_heads = k_cache.shape[1]
        half = k_cache.dtype == onnxscript.ir.DataType.FLOAT16
        flat = op.Constant(value_ints=[0, int(chunk), -1])

        def bsh(x):  # [B, H, C, D] -> [B, C, H x D], in the cache's type
            x = op.Reshape(op.Transpose(x, perm=[0, 2, 1, 3]), flat)
            return op.Cast(x, to=f16) if half else x

        end = op.Add(start_pos, n_valid)
        seqlens = op.Cast(op.Sub(end, op.Constant(value_int=1)), to=int32)
        # an upper bound of every row's end, at least the chunk (the op requires it of a full cache)
        total = op.Cast(op.Max(op.ReduceMax(end, keepdims=0), op.Constant(value_int=int(chunk))), to=int32)
        out, k_next, v_next = ops.DecodeAttention(bsh(q), bsh(k_new), bsh(v_new), k_cache, v_cache, seqlens, total,
                                                  op.Cast(n_valid, to=int32), num_heads=int(heads),
                                                  kv_num_heads=int(kv_heads), scale=scale,
                                                  local_window_size=local_window(window))
        out = op.Cast(out, to=f32) if half else out
        if int(chunk) > 1:  # padded rows: unspecified by the op, zero here
            rows = op.Range(op.Constant(value_int=0), op.Constant(value_int=int(chunk)), op.Constant(value_int=1))
            valid = op.Less(op.Unsqueeze(rows, op.Constant(value_ints=[0])), op.Unsqueeze(n_valid, op.Constant(value_ints=[1])))
            out = op.Where(op.Unsqueeze(valid, op.Constant(value_ints=[2])), out, op.CastLike(op.Constant(value_float=0.0), out))
        out = op.Transpose(op.Reshape(out, op.Constant(value_ints=[0, int(chunk), int(heads), int(dim)])),
                           perm=[0, 2, 1, 3])
        return out, k_next, v_next

    return translate


def to_group_query_attention(model: onnx.ModelProto) -> list[str]:
    """Rename every placeholder into GroupQueryAttention (in place); the state inputs updated in place.

    A state is in place when a GroupQueryAttention reads it as a graph input and its
    present output is that state's next-value graph output; the list is also written to
    the model's metadata under INPLACE_STATE_KEY.
    """
    inputs = {i.name for i in model.graph.input}
    outputs = {o.name for o in model.graph.output}
    inplace = []
    for node in model.graph.node:
        if node.domain != PLACEHOLDER_DOMAIN or node.op_type != PLACEHOLDER:
            continue
        node.domain, node.op_type = ORT_DOMAIN, "GroupQueryAttention"
        query_seqlens = node.input[7]
        del node.input[7:]
        node.input.extend([""] * (QUERY_SEQLENS_INPUT - 7) + [query_seqlens])
        for i, past in ((1, node.input[3]), (2, node.input[4])):
            following = past + NEXT_SUFFIX
            if past in inputs and following in outputs and _present_as_output(model, node, i, following):
                inplace.append(past)
    if any(n.domain == ORT_DOMAIN for n in model.graph.node):
        _use_ort_domain(model)
    if inplace:
        helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props}, INPLACE_STATE_KEY: ",".join(inplace)})
    return inplace


def _present_as_output(model: onnx.ModelProto, node: onnx.NodeProto, index: int, output: str) -> bool:
    """Make `node`'s output `index` the graph output `output` itself (in place), dropping the CastLike
    or Identity to the same type that the export puts between a state update and its output."""
    present = node.output[index]
    if present == output:
        return True
    between = [n for n in model.graph.node if output in n.output]
    if len(between) != 1 or between[0].op_type not in ("CastLike", "Identity") or between[0].input[0] != present:
        return False
    if between[0].op_type == "CastLike" and between[0].input[1] != node.input[2 + index]:
        return False  # cast to the type of something other than the cache it came from
    model.graph.node.remove(between[0])
    node.output[index] = output
    for other in model.graph.node:
        for j, name in enumerate(other.input):
            if name == present:
                other.input[j] = output
    return True


def _use_ort_domain(model: onnx.ModelProto) -> None:
    """The placeholder domain's import dropped once no node uses it; com.microsoft's imported once."""
    used = {n.domain for n in model.graph.node}
    imports = [o for o in model.opset_import if o.domain != ORT_DOMAIN
               and (o.domain != PLACEHOLDER_DOMAIN or PLACEHOLDER_DOMAIN in used)]
    del model.opset_import[:]
    model.opset_import.extend([*imports, helper.make_opsetid(ORT_DOMAIN, 1)])
