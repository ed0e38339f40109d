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

`fuse_cache_attention` (the `onnx-gqa` target pass, which the export runs on
each one-row program through the pass manager) rewrites, in a one-row program (prefill or decode),
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
from dataclasses import dataclass

import onnx
import torch
from onnx import helper
from onnx.defs import OpSchema
from torch import Tensor
from torch.fx import GraphModule, Node
from torch.fx.passes.tools_common import legalize_graph

from ...contract.entry_points import INPLACE_STATE_KEY, NEXT_SUFFIX
from ...contract.state import RECENT_WINDOW_ORDER
from ...frontend.attention_ops import (
    CACHE_ATTENTION,
    KV_CACHE_WRITE,
    RING_ATTENTION,
    RING_DECODE_ATTENTION,
    RING_WRITE,
    RING_WRITE_TOKEN,
    _attend,
    cache_attention_impl,
    kv_cache_write_impl,
)
from ...frontend.op_registry import declare_op
from ...passes.graph_edit import copy_graph_module, rebuild, remove_dead_code
from ...passes.registry import CompileUnit, PassResult, register_pass
from .graph_rewrites import GraphSettings, register_graph_rewrite
from .rope import Rotated, match_rotated, normed_source, rope_tables, rotate_heads

PLACEHOLDER_DOMAIN = "foldline"
PLACEHOLDER = "DecodeAttention"
ROPE_PLACEHOLDER = "RopeAttention"  # DecodeAttention that also rotates q and k (do_rotary)
ORT_DOMAIN = "com.microsoft"
# GroupQueryAttention's input indices (ONNX Runtime 1.32)
COS_CACHE_INPUT, QUERY_SEQLENS_INPUT = 7, 16

ATTENTION_OPS = (CACHE_ATTENTION, RING_ATTENTION, RING_DECODE_ATTENTION)
WINDOW_ORDER = RECENT_WINDOW_ORDER  # the window_order of a module whose rings became window-ordered caches
RING_OPS = (RING_WRITE, RING_WRITE_TOKEN, RING_ATTENTION, RING_DECODE_ATTENTION)
GQA_PASS = "onnx-gqa"
GQA_GRAPH_REWRITE = "group-query-attention"
# The unit option that gives the pass the windowed layers' rings too, as window-ordered caches
# (export_module decides it for a whole module: its graphs share their state).
WINDOW_CACHES = "window_caches"


def window_rows_held(total: int, capacity: int, window: int) -> int:
    """How many positions a window-ordered cache holds after `total` tokens: GroupQueryAttention's
    L(T) for `sliding_window_cache` (it frees capacity - window + 1 rows at once)."""
    if total <= capacity:
        return total
    freed = capacity - window + 1
    return total - freed * -(-(total - capacity) // freed)


def _window_cache_attention(q: Tensor, k_new: Tensor, v_new: Tensor, k_cache: Tensor, v_cache: Tensor,
                            start_pos: Tensor, n_valid: Tensor, scale: float,
                            window: int) -> tuple[Tensor, Tensor, Tensor]:
    """gqa_attention over window-ordered caches (one row): rows [0, L) hold the L most recent positions
    in order, L = window_rows_held(position); padded query rows give zeros."""
    start, valid, capacity = int(start_pos[0]), int(n_valid[0]), k_cache.shape[2]
    held = window_rows_held(start, capacity, window)
    keys = torch.cat([k_cache[:, :, :held], k_new[:, :, :valid].to(k_cache.dtype)], dim=2)
    values = torch.cat([v_cache[:, :, :held], v_new[:, :, :valid].to(v_cache.dtype)], dim=2)
    kpos = torch.arange(start - held, start + valid)[None, None, :]
    qpos = (start + torch.arange(q.shape[2]))[None, :, None]
    allowed = (kpos <= qpos) & (qpos - kpos < window)
    out = _attend(q, keys, values, allowed, scale, "blocked")
    out = torch.where((torch.arange(q.shape[2]) < valid)[None, None, :, None], out, torch.zeros_like(out))
    kept = window_rows_held(start + valid, capacity, window)

    def following(cache: Tensor, joined: Tensor) -> Tensor:
        rows = torch.zeros_like(cache)
        rows[:, :, :kept] = joined[:, :, joined.shape[2] - kept:]
        return rows

    return out, following(k_cache, keys), following(v_cache, values)


def gqa_attention_impl(q: Tensor, k_new: Tensor, v_new: Tensor, k_cache: Tensor, v_cache: Tensor,
                       start_pos: Tensor, n_valid: Tensor, scale: float, window: int = 0,
                       window_cache: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """A chunk's cache writes and its attention over the full cache (window > 0: the last `window`
    positions only; window_cache: caches of `window` rows in window order, a windowed layer's):
    (output, next k cache, next v cache)."""
    if window_cache:
        return _window_cache_attention(q, k_new, v_new, k_cache, v_cache, start_pos, n_valid, scale, window)
    k_next = kv_cache_write_impl(k_cache, k_new, start_pos, n_valid)
    v_next = kv_cache_write_impl(v_cache, v_new, start_pos, n_valid)
    out = cache_attention_impl(q, k_next, v_next, start_pos, window, scale, "blocked", k_cache.shape[2])
    return out, k_next, v_next


def gqa_rope_attention_impl(q: Tensor, k_new: Tensor, v_new: Tensor, k_cache: Tensor, v_cache: Tensor,
                            start_pos: Tensor, n_valid: Tensor, cos: Tensor, sin: Tensor, scale: float, window: int,
                            interleaved: bool, window_cache: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """gqa_attention of q [B, C, H x D] and k_new [B, C, KV x D] before their heads are split and
    rotated by the tables cos and sin [positions, D / 2] at each row's position:
    (output [B, H, C, D], next k cache, next v cache)."""
    dim = v_new.shape[-1]
    positions = (start_pos[:, None] + torch.arange(q.shape[1], device=q.device)).clamp(max=cos.shape[0] - 1)
    q_heads, k_heads = (rotate_heads(x.unflatten(-1, (-1, dim)).transpose(1, 2), cos, sin, positions, interleaved)
                        for x in (q, k_new))
    return gqa_attention_impl(q_heads, k_heads, v_new, k_cache, v_cache, start_pos, n_valid, scale, window,
                              window_cache)


def _gqa_rope_attention_shape(q: Tensor, k_new: Tensor, v_new: Tensor, k_cache: Tensor, v_cache: Tensor,
                              *_: object, **__: object) -> tuple[Tensor, Tensor, Tensor]:
    b, chunk, _ = q.shape
    dim = v_new.shape[-1]
    return (q.new_empty((b, q.shape[-1] // dim, chunk, dim)), k_cache.new_empty(k_cache.shape),
            v_cache.new_empty(v_cache.shape))


# Kept as nodes of their own: the ONNX exporter writes each as one GroupQueryAttention.
GQA_ATTENTION = declare_op("gqa_attention", gqa_attention_impl, ["q", "k_cache", "v_cache"], decompose=False)
GQA_ROPE_ATTENTION = declare_op("gqa_rope_attention", gqa_rope_attention_impl, _gqa_rope_attention_shape,
                                decompose=False)


@dataclass(frozen=True)
class _Triple:
    """A layer's two cache writes and the attention that reads them, as GroupQueryAttention's inputs."""

    attention: Node
    k_write: Node
    v_write: Node
    q: Node
    k_new: Node
    v_new: Node
    k_cache: Node
    v_cache: Node
    start_pos: Node
    n_valid: Node
    scale: float
    window: int
    window_cache: bool  # the caches are a windowed layer's rings, held in window order instead


def _one_row_float(q: Node, kv_mapping: str) -> bool:
    """One row of float32 or float16 queries (GroupQueryAttention's CPU kernel takes both; CUDA's float16)."""
    return (kv_mapping == "blocked" and q.meta["val"].shape[0] == 1
            and q.meta["val"].dtype in (torch.float32, torch.float16))


def _written_state(writes: tuple[Node, Node], target, start_pos: Node) -> bool:
    """Both writes are `target` into a state input, at `start_pos`, with one count of valid tokens."""
    k, v = writes
    if not all(isinstance(w, Node) and w.target == target for w in writes):
        return False
    if any(w.args[0].op != "placeholder" or w.args[2] is not start_pos for w in writes):
        return False
    return k.args[3] is v.args[3]


def _fusable(attention: Node, window_caches: bool) -> _Triple | None:
    """The write-write-attend triple around a one-row attention, if the three can become one
    GroupQueryAttention: a global layer's; a windowed layer's holding a full cache (a bundle compiled
    without ring-buffer-swa); with window_caches, a windowed layer's rings, in window order."""
    if attention.target == CACHE_ATTENTION:
        q, k, v, pos, window, scale, kv_mapping, _length = attention.args
        if not _one_row_float(q, kv_mapping) or not _written_state((k, v), KV_CACHE_WRITE, pos):
            return None
        return _Triple(attention, k, v, q, k.args[1], v.args[1], k.args[0], v.args[0], pos, k.args[3], scale, window,
                       False)
    if not window_caches:
        return None
    if attention.target == RING_DECODE_ATTENTION:
        q, k, v, pos, window, scale, kv_mapping, *_length = attention.args
        if not _one_row_float(q, kv_mapping) or not _written_state((k, v), RING_WRITE_TOKEN, pos):
            return None
        return _Triple(attention, k, v, q, k.args[1], v.args[1], k.args[0], v.args[0], pos, k.args[3], scale, window,
                       True)
    if attention.target == RING_ATTENTION:
        q, ring_k, ring_v, k_new, v_new, pos, n_valid, window, scale, kv_mapping, *_length = attention.args
        writes = []
        for ring, new in ((ring_k, k_new), (ring_v, v_new)):
            found = [u for u in ring.users if u.target == RING_WRITE and u.args[1] is new and u.args[3] is n_valid]
            writes.append(found[0] if len(found) == 1 else None)
        if not _one_row_float(q, kv_mapping) or not _written_state(tuple(writes), RING_WRITE, pos):
            return None
        return _Triple(attention, writes[0], writes[1], q, k_new, v_new, ring_k, ring_v, pos, n_valid, scale, window,
                       True)
    return None


def fuse_cache_attention(gm: GraphModule, max_positions: int, window_caches: bool = False) -> int:
    """Rewrite (in place) each fusable write-write-attend triple of `gm` into foldline::gqa_attention,
    or into foldline::gqa_rope_attention where q and k are normed and rotated as GroupQueryAttention can
    (backends/onnx/rope.py; its tables cover `max_positions`). window_caches: the windowed layers'
    rings too, which then hold their window in window order (GroupQueryAttention's
    `sliding_window_cache`), not by position modulo the window."""
    count = 0
    tables: dict[tuple, tuple[Node, Node]] = {}  # one cos and sin table per rotation
    attentions = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ATTENTION_OPS]
    for t in filter(None, (_fusable(a, window_caches) for a in attentions)):
        rotated = _rotated_pair(t.q, t.k_new)
        with gm.graph.inserting_before(t.attention):
            if rotated is None:
                fused = gm.graph.call_function(GQA_ATTENTION, (t.q, t.k_new, t.v_new, t.k_cache, t.v_cache, t.start_pos,
                                                               t.n_valid, t.scale, t.window, t.window_cache))
            else:
                rq, rk, freq = rotated
                dtype = t.k_cache.meta["val"].dtype  # the op's element type: the tables are made in it, once
                key = (freq.numpy().tobytes(), rq.pos_scale, dtype)
                if key not in tables:
                    tables[key] = rope_tables(gm.graph, rq, max_positions, t.q, dtype)
                cos, sin = tables[key]
                fused = gm.graph.call_function(GQA_ROPE_ATTENTION,
                                               (normed_source(gm.graph, rq, t.q), normed_source(gm.graph, rk, t.q),
                                                t.v_new, t.k_cache, t.v_cache, t.start_pos, t.n_valid, cos, sin,
                                                t.scale, t.window, rq.interleaved, t.window_cache))
            replaced = (t.attention, t.k_write, t.v_write)
            fused.meta["val"] = tuple(old.meta["val"] for old in replaced)
            parts = []
            for i, old in enumerate(replaced):
                part = gm.graph.call_function(operator.getitem, (fused, i))
                part.meta["val"] = old.meta["val"]
                parts.append(part)
        for old, part in zip(replaced, parts):
            old.replace_all_uses_with(part)
        for old in replaced:
            gm.graph.erase_node(old)
        count += 1
    if count:
        legalize_graph(gm)  # the state's copy-back may precede the attention: sort the users after the fused node
        remove_dead_code(gm)  # the rotations GroupQueryAttention now does
        gm.recompile()
    return count


@register_pass(GQA_PASS, "each one-row layer's cache writes and attention as one GroupQueryAttention, q and k "
               "rotated by it where their rotation is its own (rope.py)", target="onnx")
def group_query_attention(unit: CompileUnit) -> PassResult:
    """`fuse_cache_attention` on each program, its rotation tables over the context; a new program for
    each it changes. The unit's WINDOW_CACHES option (default off) takes in the rings."""
    sites = 0
    for name, program in list(unit.programs.items()):
        gm = copy_graph_module(program)
        fused = fuse_cache_attention(gm, unit.config.max_context, unit.options.get(WINDOW_CACHES, False))
        if fused:
            unit.programs[name] = rebuild(program, gm)
            sites += fused
    return PassResult(changed=sites > 0, sites=sites)


def _rotated_pair(q: Node, k: Node) -> tuple[Rotated, Rotated, Tensor] | None:
    """q and k as GroupQueryAttention can rotate them, by the same rotation, and its frequencies' values."""
    rq, rk = match_rotated(q), match_rotated(k)
    if rq is None or rk is None or (rq.pos_scale, rq.interleaved) != (rk.pos_scale, rk.interleaved):
        return None
    freq = _constant(rq.inv_freq)
    return (rq, rk, freq) if torch.equal(freq, _constant(rk.inv_freq)) else None


def _constant(node: Node) -> Tensor:
    """The value of a node that reads no input (match_rotated checks it), computed eagerly."""
    def value(arg):
        return _constant(arg) if isinstance(arg, Node) else arg
    args = [[value(a) for a in arg] if isinstance(arg, (list, tuple)) else value(arg) for arg in node.args]
    return node.target(*args, **{k: value(v) for k, v in node.kwargs.items()})


def register_placeholder() -> None:
    """`foldline.DecodeAttention`: GroupQueryAttention's first seven inputs, query_seqlens, its three
    outputs, once."""
    if onnx.defs.has(PLACEHOLDER, PLACEHOLDER_DOMAIN):
        return
    param = OpSchema.FormalParameter
    inputs = ([param(n, "T") for n in ("query", "key", "value", "past_key", "past_value")]
              + [param("seqlens_k", "I"), param("total_sequence_length", "I"), param("query_seqlens", "I")])
    attributes = [OpSchema.Attribute("num_heads", OpSchema.AttrType.INT, ""),
                  OpSchema.Attribute("kv_num_heads", OpSchema.AttrType.INT, ""),
                  OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, ""),
                  OpSchema.Attribute("local_window_size", OpSchema.AttrType.INT, ""),
                  OpSchema.Attribute("sliding_window_cache", OpSchema.AttrType.INT, "")]
    types = [("T", ["tensor(float)", "tensor(float16)"], ""), ("I", ["tensor(int32)"], "")]
    outputs = [param(n, "T") for n in ("output", "present_key", "present_value")]
    onnx.defs.register_schema(OpSchema(PLACEHOLDER, PLACEHOLDER_DOMAIN, 1, inputs=inputs, outputs=outputs,
                                       type_constraints=types, attributes=attributes))
    onnx.defs.register_schema(OpSchema(
        ROPE_PLACEHOLDER, PLACEHOLDER_DOMAIN, 1,
        inputs=[*inputs, param("cos_cache", "T"), param("sin_cache", "T")],
        outputs=outputs, type_constraints=types,
        attributes=[*attributes, OpSchema.Attribute("rotary_interleaved", OpSchema.AttrType.INT, "")],
    ))


def local_window(window: int) -> int:
    """GroupQueryAttention's `local_window_size` for foldline's window (-1: none).

    Both count the keys a query sees, its own position included: position p attends to
    p - W + 1 .. p (HF's sliding_window). W - 1 fails the golden test (tests/backends/test_onnx.py).
    """
    return window if window > 0 else -1


def translation():
    """The exporter's translations of foldline::gqa_attention and foldline::gqa_rope_attention into the
    placeholders, in BSH layout: {op: translation}."""
    import onnxscript

    register_placeholder()
    ops = onnxscript.values.Opset(PLACEHOLDER_DOMAIN, 1)
    op = onnxscript.opset20
    int32, f16, f32 = onnx.TensorProto.INT32, onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT

    def attend(placeholder, q, k_new, v_new, k_cache, v_cache, start_pos, n_valid, chunk: int | None, heads: int,
               extra: list, **attributes):
        """The placeholder over q and k in BSH and v in BHSD; the output back in BHSD, padded rows zero.
        chunk: the static chunk length, or None where it varies from call to call (the step function's, whose
        n_valid is always its token count: genai.to_genai_graph computes it so)."""
        dim = k_cache.shape[3]
        # the op takes one element type: float32 compute over float16 caches meets them in float16
        narrow = k_cache.dtype == onnxscript.ir.DataType.FLOAT16 and v_new.dtype != onnxscript.ir.DataType.FLOAT16
        to_cache = (lambda x: op.Cast(x, to=f16)) if narrow else (lambda x: x)  # noqa: E731
        flat = op.Constant(value_ints=[0, 0 if chunk is None else chunk, -1])
        v_bsh = op.Reshape(op.Transpose(v_new, perm=[0, 2, 1, 3]), flat)
        end = op.Add(start_pos, n_valid)
        seqlens = op.Cast(op.Sub(end, op.Constant(value_int=1)), to=int32)
        # an upper bound of every row's end, at least the chunk (the op requires it of a full cache); one
        # row's end as it is (CUDA registers no kernel for ReduceMax's opset 20 form: each would run on the CPU)
        one_row = k_cache.shape[0] == 1
        latest = op.Reshape(end, op.Constant(value_ints=[])) if one_row else op.ReduceMax(end, keepdims=0)
        # a length that varies is the step function's, whose n_valid is its token count (genai.py): its end is
        # past its last row already, and it has no padded rows
        total = op.Cast(latest if chunk is None else op.Max(latest, op.Constant(value_int=chunk)), to=int32)
        out, k_next, v_next = placeholder(to_cache(q), to_cache(k_new), to_cache(v_bsh), k_cache, v_cache, seqlens,
                                          total, op.Cast(n_valid, to=int32), *extra,
                                          num_heads=heads, kv_num_heads=int(k_cache.shape[1]), **attributes)
        out = op.Cast(out, to=f32) if narrow else out
        if chunk is not None and chunk > 1:  # padded rows: unspecified by the op, zero here
            rows = op.Range(op.Constant(value_int=0), op.Constant(value_int=chunk), op.Constant(value_int=1))
            valid = op.Less(op.Unsqueeze(rows, op.Constant(value_ints=[0])), op.Unsqueeze(n_valid, op.Constant(value_ints=[1])))
            out = op.Where(op.Unsqueeze(valid, op.Constant(value_ints=[2])), out, op.CastLike(op.Constant(value_float=0.0), out))
        out = op.Transpose(op.Reshape(out, op.Constant(value_ints=[0, 0 if chunk is None else chunk, heads, int(dim)])),
                           perm=[0, 2, 1, 3])
        return out, k_next, v_next

    def static(length) -> int | None:
        """A chunk length as an int, or None where the graph's is symbolic (one graph for every length)."""
        return length if isinstance(length, int) else None

    def translate(q, k_new, v_new, k_cache, v_cache, start_pos, n_valid, scale: float, window: int = 0,
                  window_cache: bool = False):
        _b, heads, chunk, _dim = q.shape
        chunk = static(chunk)
        flat = op.Constant(value_ints=[0, 0 if chunk is None else chunk, -1])

        def bsh(x):  # [B, H, C, D] -> [B, C, H x D]
            return op.Reshape(op.Transpose(x, perm=[0, 2, 1, 3]), flat)

        return attend(ops.DecodeAttention, bsh(q), bsh(k_new), v_new, k_cache, v_cache, start_pos, n_valid,
                      chunk, int(heads), [], scale=scale, local_window_size=local_window(window),
                      sliding_window_cache=int(window_cache))

    def translate_rope(q, k_new, v_new, k_cache, v_cache, start_pos, n_valid, cos, sin, scale: float, window: int,
                       interleaved: bool, window_cache: bool = False):
        _b, chunk, width = q.shape
        heads = int(width) // int(k_cache.shape[3])
        return attend(ops.RopeAttention, q, k_new, v_new, k_cache, v_cache, start_pos, n_valid, static(chunk), heads,
                      [cos, sin], scale=scale, local_window_size=local_window(window),
                      rotary_interleaved=int(interleaved), sliding_window_cache=int(window_cache))

    return {GQA_ATTENTION: translate, GQA_ROPE_ATTENTION: translate_rope}


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
        if node.domain != PLACEHOLDER_DOMAIN or node.op_type not in (PLACEHOLDER, ROPE_PLACEHOLDER):
            continue
        rope = node.op_type == ROPE_PLACEHOLDER
        node.domain, node.op_type = ORT_DOMAIN, "GroupQueryAttention"
        query_seqlens, *tables = node.input[COS_CACHE_INPUT:]  # the tables, if any, are cos_cache and sin_cache
        del node.input[COS_CACHE_INPUT:]
        node.input.extend([*tables, *[""] * (QUERY_SEQLENS_INPUT - COS_CACHE_INPUT - len(tables)), query_seqlens])
        if rope:
            node.attribute.append(helper.make_attribute("do_rotary", 1))
        for i, past in ((1, node.input[3]), (2, node.input[4])):
            following = past + NEXT_SUFFIX
            if past in inputs and following in outputs and _present_as_output(model, node, i, following):
                inplace.append(past)
    if any(n.domain == ORT_DOMAIN for n in model.graph.node):
        _use_ort_domain(model)
    if inplace:
        helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props}, INPLACE_STATE_KEY: ",".join(inplace)})
    return inplace


@register_graph_rewrite(GQA_GRAPH_REWRITE, "onnx-gqa's placeholder nodes as com.microsoft.GroupQueryAttention, "
                        "their caches updated in place")
def group_query_attention_nodes(model: onnx.ModelProto, _settings: GraphSettings) -> int:
    """`to_group_query_attention` as a graph rewrite: how many nodes it renamed."""
    placeholders = sum(n.domain == PLACEHOLDER_DOMAIN and n.op_type in (PLACEHOLDER, ROPE_PLACEHOLDER)
                       for n in model.graph.node)
    to_group_query_attention(model)
    return placeholders


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
