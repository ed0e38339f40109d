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

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import onnx

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
