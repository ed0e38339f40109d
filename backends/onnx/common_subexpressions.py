"""Each value computed once: equal constants and equal nodes over the same inputs merged.

The exporter translates each layer's ops on their own, so every layer gets its
own copy of what depends only on the step's inputs (GroupQueryAttention's
total length, a shape constant) under a new name. ONNX Runtime's own
common-subexpression pass compares inputs by name, so copies that read
equal constants of different names stay: 30 layers ran the same Reshape and
Cast 30 times. This rewrite gives equal small initializers and Constant
nodes one name, then keeps the first of the nodes that do the same thing to
the same inputs, in graph order (which is topological).
"""

from __future__ import annotations

import onnx

from .graph_rewrites import GraphSettings, register_graph_rewrite

COMMON_SUBEXPRESSIONS_GRAPH_REWRITE = "common-subexpressions"
SMALL_INITIALIZER_BYTES = 1024  # shape vectors, axes, scalars; weights are never compared
# ops whose every run may differ, and ops holding a graph of their own: never merged
UNMERGED_OPS = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
                "Bernoulli", "Dropout", "If", "Loop", "Scan"}


def _attributes_key(node: onnx.NodeProto) -> tuple:
    """A node's attributes as comparable bytes; a tensor attribute's own name (a Constant's) left out."""
    key = []
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.TENSOR and attribute.t.name:
            attribute = onnx.AttributeProto.FromString(attribute.SerializeToString())
            attribute.t.name = ""
        key.append((attribute.name, attribute.SerializeToString(deterministic=True)))
    return tuple(sorted(key))


def merge_common_subexpressions(model: onnx.ModelProto) -> int:
    """Merge (in place) equal small initializers, equal Constant nodes and equal nodes over equal inputs of
    `model`'s graph; how many initializers and nodes it removed. Graph outputs keep their names."""
    graph = model.graph
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in graph.node for a in n.attribute):
        return 0  # a subgraph may read any outer name: left as it is
    kept_names = {o.name for o in graph.output} | {i.name for i in graph.input}
    alias: dict[str, str] = {}
    first_initializer: dict[tuple, str] = {}
    initializers = []
    for init in graph.initializer:
        small = not init.external_data and init.ByteSize() <= SMALL_INITIALIZER_BYTES
        key = (init.data_type, tuple(init.dims), _values(init)) if small else None
        if key is not None and init.name not in kept_names and key in first_initializer:
            alias[init.name] = first_initializer[key]
            continue
        if key is not None:
            first_initializer.setdefault(key, init.name)
        initializers.append(init)
    removed = len(graph.initializer) - len(initializers)
    first_node: dict[tuple, list[str]] = {}
    nodes = []
    for node in graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = alias.get(name, name)
        key = None
        if node.op_type not in UNMERGED_OPS and not any(o in kept_names for o in node.output):
            key = (node.domain, node.op_type, tuple(node.input), len(node.output), _attributes_key(node))
        if key is not None and key in first_node:
            for mine, theirs in zip(node.output, first_node[key]):
                if mine:
                    alias[mine] = theirs
            removed += 1
            continue
        if key is not None:
            first_node[key] = list(node.output)
        nodes.append(node)
    if removed:
        del graph.initializer[:]
        graph.initializer.extend(initializers)
        del graph.node[:]
        graph.node.extend(nodes)
        merged = set(alias)
        kept_info = [v for v in graph.value_info if v.name not in merged]
        del graph.value_info[:]
        graph.value_info.extend(kept_info)
    return removed


def _values(init: onnx.TensorProto) -> bytes:
    """An initializer's values as bytes, however the exporter stored them (raw_data or a typed field)."""
    return onnx.numpy_helper.to_array(init).tobytes()


@register_graph_rewrite(COMMON_SUBEXPRESSIONS_GRAPH_REWRITE, "equal small constants and equal nodes over the same "
                        "inputs computed once (the per-layer copies of what depends on the step's inputs alone)")
def common_subexpressions(model: onnx.ModelProto, _settings: GraphSettings) -> int:
    """`merge_common_subexpressions` as a graph rewrite."""
    return merge_common_subexpressions(model)
