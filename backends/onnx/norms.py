"""RMS norms as single ONNX operators: a decode step's small nodes cost as much as its products.

The exporter writes foldline's RMSNorm (frontend/layers.py) as seven
elementwise nodes, x * 1 / sqrt(mean(x^2) + eps) * gamma, and ONNX Runtime's
own fusion does not take that form (it looks for a Div). At one token a node
costs a few microseconds whatever it computes, and SmolLM2's decode step held
about 2,100 of them against ONNX Runtime GenAI's 341 (docs/onnx.md).
`fuse_rms_norms` rewrites each norm into one node:

- `com.microsoft.SkipSimplifiedLayerNormalization` where the norm's input is a
  residual sum `a + b` of two tensors of its shape: the add and the norm in one
  kernel, the sum (its fourth output) taken by the add's other readers;
- the standard `RMSNormalization` (opset 23) otherwise, where the export may
  raise the graph to opset 23 (`foldline compile --onnx-opset`, the default);
  below it such a norm stays as the exporter wrote it: ONNX Runtime's own
  `SimplifiedLayerNormalization` is no ONNX operator (`onnx.checker` refuses
  it), and DirectML registers no kernel for RMSNormalization, nor the opset 23
  versions of Reshape, Cast and the like (docs/onnx.md).

Both compute x / sqrt(mean(x^2) + eps) * gamma in float over the last axis;
gamma may be any tensor of the hidden size (a Gemma norm's 1 + w too).
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from .graph_rewrites import GraphIndex, GraphSettings, register_graph_rewrite

NORMS_GRAPH_REWRITE = "rms-norms"
ORT_DOMAIN = "com.microsoft"
RMS_NORM_OPSET = 23  # the first opset with RMSNormalization


def _match(g: GraphIndex, scaled: onnx.NodeProto) -> tuple[str, str, float, list[onnx.NodeProto]] | None:
    """(x, gamma, eps, the nodes of the norm) if `scaled` is Mul(Mul(x, 1 / sqrt(mean(x^2) + eps)), gamma)."""
    for normed_name, gamma in ((scaled.input[0], scaled.input[1]), (scaled.input[1], scaled.input[0])):
        normed = g.made_by(normed_name, "Mul")
        if normed is None or not g.only_read_by(normed_name, scaled):
            continue
        for x, inv_name in ((normed.input[0], normed.input[1]), (normed.input[1], normed.input[0])):
            chain = _inverse_rms(g, x, inv_name, normed)
            if chain is not None:
                eps, nodes = chain
                return x, gamma, eps, [*nodes, normed, scaled]
    return None


def _inverse_rms(g: GraphIndex, x: str, name: str, reader: onnx.NodeProto) -> tuple[float, list[onnx.NodeProto]] | None:
    """(eps, nodes) if `name` is Reciprocal(Sqrt(Add(ReduceMean(Pow(x, 2), [-1], keepdims), eps)))."""
    nodes = []
    for op in ("Reciprocal", "Sqrt", "Add", "ReduceMean", "Pow"):
        node = g.made_by(name, op)
        if node is None or not g.only_read_by(name, reader):
            return None
        nodes.append(node)
        reader = node
        if op == "Add":
            eps = g.constant(node.input[1])
            if eps is None or eps.size != 1:
                return None
        if op == "ReduceMean" and not _reduces_last_axis(g, node, x):
            return None
        name = node.input[0]
    power = nodes[-1]
    exponent = g.constant(power.input[1])
    if power.input[0] != x or exponent is None or exponent.size != 1 or float(exponent[0]) != 2.0:
        return None
    return float(eps[0]), nodes


def _reduces_last_axis(g: GraphIndex, node: onnx.NodeProto, x: str) -> bool:
    keepdims = next((a.i for a in node.attribute if a.name == "keepdims"), 1)
    axes = g.constant(node.input[1]) if len(node.input) > 1 else None
    if keepdims != 1 or axes is None or axes.size != 1:
        return False
    axis = int(axes[0])
    rank = g.rank(x)
    return axis == -1 or (rank is not None and axis == rank - 1)


def _cast_to(node: onnx.NodeProto) -> int | None:
    return next((a.i for a in node.attribute if a.name == "to"), None)


def _cast_into_norm(g: GraphIndex, x: str, nodes: list[onnx.NodeProto]) -> onnx.NodeProto | None:
    """The Cast that makes the norm's input x, where only the norm's nodes read x; else None."""
    cast = g.made_by(x, "Cast")
    if cast is None or x in g.outputs or not all(any(r is n for n in nodes) for r in g.readers[x]):
        return None
    return cast


def _in_float16(g: GraphIndex, x: str, out: str, nodes: list[onnx.NodeProto]) -> tuple[str, str, list] | None:
    """(x16, out16, the two casts) where the norm computes in float32 between casts from and back to
    float16 (float16 compute; frontend/layers.RMSNorm): x = Cast(x16), read by the norm alone, and `out`
    read by one Cast to float16. The fused node then takes x16 and makes out16 itself, computing in
    float32 inside (RMSNormalization's stash_type, SkipSimplifiedLayerNormalization's float kernel)."""
    widen = _cast_into_norm(g, x, nodes)
    if widen is None or _cast_to(widen) != TensorProto.FLOAT or g.types.get(widen.input[0]) != TensorProto.FLOAT16:
        return None
    readers = g.readers[out]
    if out in g.outputs or len(readers) != 1:
        return None
    narrow = readers[0]
    if narrow.op_type != "Cast" or _cast_to(narrow) != TensorProto.FLOAT16:
        return None
    return widen.input[0], narrow.output[0], [widen, narrow]


def _unconverted(g: GraphIndex, x: str, nodes: list[onnx.NodeProto]) -> tuple[str, list] | None:
    """(x0, [cast]) where x is a Cast of x0 to the type x0 already has, read by the norm alone (float16
    compute over a float32 residual stream: RMSNorm's x.float()); the norm then reads x0 itself."""
    cast = _cast_into_norm(g, x, nodes)
    if cast is None or _cast_to(cast) is None or _cast_to(cast) != g.types.get(cast.input[0]):
        return None
    return cast.input[0], [cast]


def _residual(g: GraphIndex, x: str) -> onnx.NodeProto | None:
    """The Add that makes `x` from two tensors of x's shape (a residual sum), else None."""
    add = g.made_by(x, "Add")
    if add is None or any(g.constant(i) is not None for i in add.input):
        return None
    shapes = [g.dims.get(i) for i in (*add.input, x)]
    return add if shapes[0] is not None and len(shapes[0]) == 3 and shapes[0] == shapes[1] == shapes[2] else None


def fuse_rms_norms(model: onnx.ModelProto, opset: int = RMS_NORM_OPSET) -> int:
    """Rewrite (in place) every RMS norm of `model` into one node; how many. Raises the default
    opset to 23 where a plain RMSNormalization is used, which takes an `opset` of 23: below it,
    only the norms after a residual add are fused."""
    g = GraphIndex(model)
    replaced: dict[int, list[onnx.NodeProto]] = {}  # id of the norm's last node -> its new nodes
    dropped: set[int] = set()
    plain = 0
    for node in list(model.graph.node):
        if node.op_type != "Mul" or node.domain not in ("", "ai.onnx") or id(node) in dropped:
            continue
        found = _match(g, node)
        if found is None:
            continue
        x, gamma, eps, nodes = found
        out = node.output[0]
        new_nodes = []
        half = _in_float16(g, x, out, nodes)
        if half is not None:  # the norm's own casts leave with it; gamma is taken in float16
            x, out, casts = half
            nodes = [*nodes, *casts]
            gamma16 = f"{out}.gamma16"
            new_nodes.append(helper.make_node("Cast", [gamma], [gamma16], to=TensorProto.FLOAT16, name=gamma16))
            gamma = gamma16
        else:
            same = _unconverted(g, x, nodes)
            if same is not None:
                x, cast = same
                nodes = [*nodes, *cast]
        add = _residual(g, x)
        if add is None and opset < RMS_NORM_OPSET:
            continue
        if add is not None:
            fused = helper.make_node("SkipSimplifiedLayerNormalization", [add.input[0], add.input[1], gamma],
                                     [out, "", "", x], domain=ORT_DOMAIN, epsilon=eps, name=f"{out}.skip_rms_norm")
            dropped.add(id(add))
        else:
            fused = helper.make_node("RMSNormalization", [x, gamma], [out], axis=-1, epsilon=eps,
                                     name=f"{out}.rms_norm")
            plain += 1
        dropped.update(id(n) for n in nodes)
        replaced[id(node)] = [*new_nodes, fused]
    if not replaced:
        return 0
    kept = []
    for node in model.graph.node:
        if id(node) in replaced:
            kept.extend(replaced[id(node)])
        elif id(node) not in dropped:
            kept.append(node)
    # a fused norm stands where its last node stood; the residual sum it now makes may be read
    # earlier (by the nodes that stood between the add and the norm): put it before its readers
    del model.graph.node[:]
    model.graph.node.extend(_sorted(kept, model))
    if plain:
        _raise_default_opset(model, RMS_NORM_OPSET)
    if any(n.domain == ORT_DOMAIN for n in model.graph.node) and not any(
            o.domain == ORT_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(ORT_DOMAIN, 1))
    return len(replaced)


@register_graph_rewrite(NORMS_GRAPH_REWRITE, "each RMS norm as one RMSNormalization, or with the residual add before "
                        "it as one com.microsoft.SkipSimplifiedLayerNormalization")
def rms_norms(model: onnx.ModelProto, settings: GraphSettings) -> int:
    """`fuse_rms_norms` as a graph rewrite, under the settings' opset."""
    return fuse_rms_norms(model, settings.opset)


def _sorted(nodes: list[onnx.NodeProto], model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """`nodes` in an order where each reads only what is made before it (stable otherwise)."""
    ready = {i.name for i in model.graph.input} | {t.name for t in model.graph.initializer} | {""}
    made_by = {out: n for n in nodes for out in n.output if out}
    order, placed = [], set()

    def place(node):
        stack = [(node, False)]
        while stack:
            current, expanded = stack.pop()
            if id(current) in placed:
                continue
            if expanded:
                placed.add(id(current))
                order.append(current)
                continue
            stack.append((current, True))
            for name in current.input:
                producer = made_by.get(name)
                if name not in ready and producer is not None and id(producer) not in placed:
                    stack.append((producer, False))

    for node in nodes:
        place(node)
    return order


def _raise_default_opset(model: onnx.ModelProto, version: int) -> None:
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx") and opset.version < version:
            opset.version = version
