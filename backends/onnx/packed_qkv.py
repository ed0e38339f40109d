"""GroupQueryAttention fed the fused q/k/v product whole, as its packed input, not three slices of it.

foldline's sibling fusion (passes/) makes a layer's q, k and v projections one
product, [q | k | v] along the last axis; the export then slices it into three,
reshapes and transposes k and v into heads and back, and hands the three to
GroupQueryAttention. The op also takes them packed: query = [B, S, (H + 2 KV)
x D] with key and value left empty, which is what ONNX Runtime GenAI's builder
emits. Per layer that drops a Split (three slices in one copy, after ONNX
Runtime's own fusions) and the reshapes around v.

An input is traced back through Reshape and Transpose nodes only; the trace is
taken where its transposes cancel in adjacent pairs (reshapes alone never move
an element in row-major order) and the declared shapes at both of its ends are
equal, so the input is the slice itself, element for element. The three slices
must read one tensor on its last axis, q then k then v, contiguous and covering
it, k as wide as v, q num_heads / kv_num_heads times as wide.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx

from .graph_rewrites import GraphIndex, GraphSettings, register_graph_rewrite

PACKED_QKV_GRAPH_REWRITE = "packed-qkv"


def _slice_source(graph: GraphIndex, name: str) -> str | None:
    """The slice output `name` equals element for element through its Reshape / Transpose trace, if any."""
    trace = []
    current = name
    while (node := graph.producer.get(current)) is not None and node.op_type in ("Reshape", "Transpose"):
        trace.append(node)
        current = node.input[0]
    if node is None or node.op_type != "Slice" or (shape := graph.shape(current)) is None:
        return None
    open_perm: list[int] | None = None  # a transpose waiting for the one that undoes it
    for node in reversed(trace):  # from the slice forward, each node's output shape
        if node.op_type == "Transpose":
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), list(range(len(shape)))[::-1])
            shape = tuple(shape[p] for p in perm)
            if open_perm is None:
                open_perm = perm
            elif [open_perm[p] for p in perm] == list(range(len(perm))):
                open_perm = None
            else:
                return None
        elif open_perm is not None or (shape := _reshaped(graph, shape, node)) is None:
            return None  # a reshape between two transposes, or a shape not known
    return current if open_perm is None and shape == graph.shape(current) else None


def _reshaped(graph: GraphIndex, shape: tuple, node: onnx.NodeProto) -> tuple | None:
    """The output shape of Reshape `node` over an input of `shape` (its 0s and -1 resolved, symbols kept)."""
    target = graph.constant(node.input[1])
    if target is None:
        return graph.shape(node.output[0])
    dims = [shape[i] if t == 0 else int(t) for i, t in enumerate(target.tolist())]
    if -1 not in dims:
        return tuple(dims)
    (number, symbols), (known, known_symbols) = _product(shape), _product(d for d in dims if d != -1)
    if known == 0 or number % known or known_symbols - symbols:
        return None
    number, symbols = number // known, symbols - known_symbols
    if symbols.total() == 0:
        return tuple(number if d == -1 else d for d in dims)
    if symbols.total() == 1 and number == 1:
        return tuple(next(iter(symbols)) if d == -1 else d for d in dims)
    return None


def _slice_range(graph: GraphIndex, name: str) -> tuple[str, int, int] | None:
    """(the sliced tensor, start, end) of a unit-step Slice of `name`'s producer on the last axis."""
    node = graph.producer[name]
    source = node.input[0]
    starts, ends, axes, steps = (graph.constant(i) if i else None for i in (list(node.input) + [""] * 5)[1:5])
    shape = graph.shape(source)
    if shape is None or not isinstance(shape[-1], int) or starts is None or ends is None:
        return None
    if axes is not None and [int(a) % len(shape) for a in axes] != [len(shape) - 1]:
        return None
    if axes is None and len(shape) != 1 or steps is not None and steps.tolist() != [1]:
        return None
    width = shape[-1]
    start, end = (int(np.clip(v[0] + (width if v[0] < 0 else 0), 0, width)) for v in (starts, ends))
    return source, start, end


def _product(dims) -> tuple[int, Counter]:
    """A shape's element count as (number, the symbols multiplied in)."""
    number, symbols = 1, Counter()
    for d in dims:
        if isinstance(d, int):
            number *= d
        else:
            symbols[d] += 1
    return number, symbols


def pack_qkv(model: onnx.ModelProto) -> int:
    """Feed each GroupQueryAttention whose q, k and v are the slices of one product that product (in place);
    the nodes left unused are removed. How many it packed."""
    graph = GraphIndex(model)
    packed = 0
    for node in model.graph.node:
        if node.op_type != "GroupQueryAttention" or len(node.input) < 3 or not all(node.input[:3]):
            continue
        ranges = []
        for name in node.input[:3]:
            source = _slice_source(graph, name)
            ranges.append(None if source is None else _slice_range(graph, source))
        if None in ranges or len({r[0] for r in ranges}) != 1:
            continue
        (fused, q0, q1), (_, k0, k1), (_, v0, v1) = ranges
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        heads, kv_heads = attrs["num_heads"], attrs["kv_num_heads"]
        width = graph.shape(fused)[-1]
        if (q0, q1, v1) != (0, k0, width) or k1 != v0 or k1 - k0 != v1 - v0 or (q1 - q0) * kv_heads != (k1 - k0) * heads:
            continue
        node.input[0], node.input[1], node.input[2] = fused, "", ""
        packed += 1
    if packed:
        _remove_unused(model)
    return packed


def _remove_unused(model: onnx.ModelProto) -> None:
    """Drop nodes none of whose outputs is read or is a graph output, until none is left."""
    outputs = {o.name for o in model.graph.output}
    while True:
        read = {name for node in model.graph.node for name in node.input} | outputs
        kept = [n for n in model.graph.node if any(o in read for o in n.output if o)]
        if len(kept) == len(model.graph.node):
            return
        del model.graph.node[:]
        model.graph.node.extend(kept)


@register_graph_rewrite(PACKED_QKV_GRAPH_REWRITE, "GroupQueryAttention fed the fused q/k/v product as its packed "
                        "input where its q, k and v are that product's three slices")
def packed_qkv(model: onnx.ModelProto, _settings: GraphSettings) -> int:
    """`pack_qkv` as a graph rewrite."""
    return pack_qkv(model)
