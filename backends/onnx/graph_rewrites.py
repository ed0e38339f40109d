"""The ONNX graph rewrites: ONNX Runtime's operators put into each exported graph, by name.

Another IR level than the passes (passes/registry.py): these take the ONNX
model torch's exporter writes from a lowered program and rewrite it in place,
the foldline placeholders and decomposed patterns into ONNX Runtime's fused
operators. Each module registers its own with `register_graph_rewrite`; the
export runs them in its order (export.GRAPH_REWRITE_ORDER) on every function's
graph. `foldline passes` lists them under "onnx graph", reading the
registrations from the source as it does the passes'.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ...errors import FoldlineError
from ..options import BuildOptions

MAX_OPSET = BuildOptions.onnx_opset  # the default ceiling: RMSNormalization's opset (norms.py)


@dataclass(frozen=True)
class GraphSettings:
    """What every rewrite of one export is told."""

    activations: str = "f32"  # "int8" or "f32": what MatMulNBits multiplies the codes by (nbits.py)
    opset: int = MAX_OPSET  # the highest default-domain opset the graph may be raised to


def declared_tensors(model: onnx.ModelProto) -> dict[str, onnx.TypeProto.Tensor]:
    """Each value's tensor type as the exporter declared it (value_info, inputs, outputs): its element type
    and, where given, its shape. The rewrites read types and ranks off these rather than inferring them."""
    return {info.name: info.type.tensor_type
            for info in [*model.graph.value_info, *model.graph.input, *model.graph.output]}


class GraphIndex:
    """Producers, readers, constants and declared types and shapes of an ONNX graph, for matching node
    patterns. Built once per rewrite: it does not follow the rewrite's own edits."""

    CONSTANT_ATTRIBUTES = {"value_int": np.int64, "value_ints": np.int64,
                           "value_float": np.float32, "value_floats": np.float32}

    def __init__(self, model: onnx.ModelProto):
        self.producer = {out: n for n in model.graph.node for out in n.output if out}
        self.readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for n in model.graph.node:
            for name in n.input:
                self.readers[name].append(n)
        self.initializers = {t.name: t for t in model.graph.initializer}
        self.outputs = {o.name for o in model.graph.output}
        declared = declared_tensors(model)
        self.dims = {name: [d.dim_value or d.dim_param for d in t.shape.dim]
                     for name, t in declared.items() if t.HasField("shape")}
        self.types = {name: t.elem_type for name, t in declared.items()}

    def made_by(self, name: str, op_type: str) -> onnx.NodeProto | None:
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx") else None

    def constant(self, name: str) -> np.ndarray | None:
        """The values (flattened) of an initializer, a Constant node's output, or of one reshaped or
        cast, as the exporter writes a reduction's axes or a slice's bounds; else None."""
        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name]).reshape(-1)
        node = self.producer.get(name)
        if node is None or node.domain not in ("", "ai.onnx"):
            return None
        if node.op_type == "Constant":
            attr = node.attribute[0]
            if attr.name == "value":
                return numpy_helper.to_array(attr.t).reshape(-1)
            kind = self.CONSTANT_ATTRIBUTES.get(attr.name)
            return None if kind is None else np.array(helper.get_attribute_value(attr), kind).reshape(-1)
        if node.op_type in ("Reshape", "Identity", "Squeeze", "Unsqueeze"):
            return self.constant(node.input[0])
        if node.op_type == "Cast":
            value = self.constant(node.input[0])
            return None if value is None else value.astype(helper.tensor_dtype_to_np_dtype(node.attribute[0].i))
        return None

    def only_read_by(self, name: str, node: onnx.NodeProto) -> bool:
        return name not in self.outputs and all(r is node for r in self.readers[name])

    def rank(self, name: str) -> int | None:
        dims = self.dims.get(name)
        return None if dims is None else len(dims)

    def shape(self, name: str) -> tuple | None:
        """The declared shape, each dim its value or its symbol; None where it or any of its dims is not
        declared."""
        dims = self.dims.get(name)
        return None if dims is None or "" in dims or 0 in dims else tuple(dims)


# (model, settings) -> how many sites it rewrote, the model edited in place
RewriteFn = Callable[[onnx.ModelProto, GraphSettings], int]


@dataclass(frozen=True)
class GraphRewrite:
    name: str
    description: str
    run: RewriteFn


GRAPH_REWRITES: dict[str, GraphRewrite] = {}


class GraphRewriteError(FoldlineError, ValueError):
    """An unknown ONNX graph rewrite."""


def register_graph_rewrite(name: str, description: str) -> Callable[[RewriteFn], RewriteFn]:
    def wrap(fn: RewriteFn) -> RewriteFn:
        GRAPH_REWRITES[name] = GraphRewrite(name, description, fn)
        return fn

    return wrap


def run_graph_rewrites(model: onnx.ModelProto, names: Sequence[str], settings: GraphSettings) -> dict[str, int]:
    """Run the named rewrites in order on `model` (in place); the sites each rewrote."""
    unknown = [n for n in names if n not in GRAPH_REWRITES]
    if unknown:
        raise GraphRewriteError(f"unknown ONNX graph rewrite {', '.join(unknown)}; known: "
                                f"{', '.join(sorted(GRAPH_REWRITES)) or 'none'}")
    return {name: GRAPH_REWRITES[name].run(model, settings) for name in names}
