"""RMS norms fused into single ONNX nodes (backends/onnx/norms.py), checked against the unfused graph
run by ONNX Runtime. The graphs are written as torch's exporter writes foldline's RMSNorm: the
reduction's axes reshaped from a constant, 1 / sqrt as Reciprocal(Sqrt)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from foldline.backends.onnx.norms import fuse_rms_norms

HIDDEN = 8
SHAPE = [1, 3, HIDDEN]


def _norm(nodes: list, x: str, gamma: str, out: str, eps: float = 1e-6, exponent: float = 2.0) -> None:
    """foldline's RMSNorm as the exporter writes it, appended to `nodes`."""
    nodes += [
        helper.make_node("Constant", [], [f"{out}.two"], value=numpy_helper.from_array(np.array(exponent, np.float32))),
        helper.make_node("Pow", [x, f"{out}.two"], [f"{out}.sq"]),
        helper.make_node("Constant", [], [f"{out}.axes0"], value=numpy_helper.from_array(np.array([-1], np.int64))),
        helper.make_node("Constant", [], [f"{out}.shape"], value=numpy_helper.from_array(np.array([1], np.int64))),
        helper.make_node("Reshape", [f"{out}.axes0", f"{out}.shape"], [f"{out}.axes"]),
        helper.make_node("ReduceMean", [f"{out}.sq", f"{out}.axes"], [f"{out}.mean"], keepdims=1),
        helper.make_node("Constant", [], [f"{out}.eps"], value=numpy_helper.from_array(np.array(eps, np.float32))),
        helper.make_node("Add", [f"{out}.mean", f"{out}.eps"], [f"{out}.var"]),
        helper.make_node("Sqrt", [f"{out}.var"], [f"{out}.std"]),
        helper.make_node("Reciprocal", [f"{out}.std"], [f"{out}.inv"]),
        helper.make_node("Mul", [x, f"{out}.inv"], [f"{out}.normed"]),
        helper.make_node("Mul", [f"{out}.normed", gamma], [out]),
    ]


def _model(exponent: float = 2.0) -> onnx.ModelProto:
    """x = a + b; n1 = norm(x); proj = n1 @ W; y = x + proj (x read again: the residual);
    n2 = norm(proj), a MatMul's output (no residual add: a plain RMSNormalization); out = y + n2."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(HIDDEN).astype(np.float32), "g1"),
             numpy_helper.from_array(rng.standard_normal(HIDDEN).astype(np.float32), "g2"),
             numpy_helper.from_array(rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32), "W")]
    nodes = [helper.make_node("Add", ["a", "b"], ["x"])]
    _norm(nodes, "x", "g1", "n1", exponent=exponent)
    nodes += [helper.make_node("MatMul", ["n1", "W"], ["proj"]), helper.make_node("Add", ["x", "proj"], ["y"])]
    _norm(nodes, "proj", "g2", "n2", eps=1e-5)
    nodes += [helper.make_node("Add", ["y", "n2"], ["out"])]
    info = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, SHAPE)  # noqa: E731
    graph = helper.make_graph(nodes, "norms", [info("a"), info("b")], [info("out")], inits,
                              value_info=[info("x")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def _run(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def test_norms_become_single_nodes_with_the_same_outputs():
    model = _model()
    rng = np.random.default_rng(1)
    feeds = {n: rng.standard_normal(SHAPE).astype(np.float32) for n in ("a", "b")}
    expected = _run(model, feeds)

    fused = onnx.ModelProto()
    fused.CopyFrom(model)
    assert fuse_rms_norms(fused) == 2
    onnx.checker.check_model(fused, full_check=True)
    ops = [n.op_type for n in fused.graph.node]
    # the residual sum a + b and the first norm in one node; its sum output feeds y's add
    assert ops.count("SkipSimplifiedLayerNormalization") == 1 and ops.count("RMSNormalization") == 1
    assert not {"Pow", "ReduceMean", "Sqrt", "Reciprocal"} & set(ops)
    assert ops.count("Add") == 2  # y = x + proj and the output's: a + b went into the fused node
    assert next(o.version for o in fused.opset_import if o.domain == "") == 23
    np.testing.assert_allclose(_run(fused, feeds), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("opset", [20, 21, 22])
def test_below_opset_23_only_the_norms_after_a_residual_add_are_fused(opset):
    """RMSNormalization is an opset 23 operator: under a lower ceiling the plain norm keeps its ops and the
    graph its opset; the norm after a + b still becomes com.microsoft's SkipSimplifiedLayerNormalization."""
    model = _model()
    feeds = {n: np.random.default_rng(3).standard_normal(SHAPE).astype(np.float32) for n in ("a", "b")}
    before = next(o.version for o in model.opset_import if o.domain == "")
    fused = onnx.ModelProto()
    fused.CopyFrom(model)
    assert fuse_rms_norms(fused, opset) == 1
    onnx.checker.check_model(fused, full_check=True)
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("SkipSimplifiedLayerNormalization") == 1 and "RMSNormalization" not in ops
    assert ops.count("ReduceMean") == 1, "the plain norm stays as it was written"
    assert next(o.version for o in fused.opset_import if o.domain == "") == before < 23
    np.testing.assert_allclose(_run(fused, feeds), _run(model, feeds), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change", ["exponent", "other_reader"])
def test_what_is_not_a_norm_is_left_alone(change):
    model = _model(exponent=3.0 if change == "exponent" else 2.0)
    if change == "other_reader":  # the normalised x read by another node too: the chain must stay
        model.graph.node.append(helper.make_node("Identity", ["n1.normed"], ["seen"]))
        model.graph.output.append(helper.make_tensor_value_info("seen", TensorProto.FLOAT, SHAPE))
    before = [n.op_type for n in model.graph.node]
    fused = fuse_rms_norms(model)
    assert fused == 1  # only the second norm
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Pow") == before.count("Pow") - 1
    assert "SkipSimplifiedLayerNormalization" not in ops


def test_the_registered_graph_rewrite_fuses_the_norms():
    """rms-norms, as the export runs it (by name, through backends/onnx/graph_rewrites.py), against the unfused
    graph in ONNX Runtime."""
    from foldline.backends.onnx.graph_rewrites import (
        GraphRewriteError,
        GraphSettings,
        run_graph_rewrites,
    )
    from foldline.backends.onnx.norms import NORMS_GRAPH_REWRITE

    model = _model()
    feeds = {n: np.random.default_rng(2).standard_normal(SHAPE).astype(np.float32) for n in ("a", "b")}
    fused = onnx.ModelProto()
    fused.CopyFrom(model)
    assert run_graph_rewrites(fused, [NORMS_GRAPH_REWRITE], GraphSettings("f32")) == {NORMS_GRAPH_REWRITE: 2}
    assert "ReduceMean" not in {n.op_type for n in fused.graph.node}
    np.testing.assert_allclose(_run(fused, feeds), _run(model, feeds), rtol=1e-5, atol=1e-5)
    with pytest.raises(GraphRewriteError, match="unknown ONNX graph rewrite rms-norm;"):
        run_graph_rewrites(fused, ["rms-norm"], GraphSettings("f32"))


@pytest.mark.parametrize("residual", ["float16", "float32"])
def test_float16_compute_fuses_the_norm_with_its_casts(residual):
    """Float16 compute (`--dtype f16`) writes the norm in float32 between casts: a float16 residual sum is
    widened (x.float()) and the norm's output narrowed back, or, over a float32 residual stream, x.float()
    is a Cast to the type x has. Either way the sum, its casts and the norm become one
    SkipSimplifiedLayerNormalization on the sum's own type, gamma taken in float16 where the sum is, and
    the graph gives the unfused one's outputs within float16's rounding."""
    half = residual == "float16"
    wide, narrow = TensorProto.FLOAT, TensorProto.FLOAT16
    kind = TensorProto.FLOAT16 if half else TensorProto.FLOAT
    rng = np.random.default_rng(4)
    nodes = [helper.make_node("Add", ["a", "b"], ["x"]),
             helper.make_node("Cast", ["x"], ["xf"], to=wide)]
    _norm(nodes, "xf", "g", "n")
    nodes += [helper.make_node("Cast", ["n"], ["out"], to=narrow)]
    info = lambda name, t: helper.make_tensor_value_info(name, t, SHAPE)  # noqa: E731
    gamma = numpy_helper.from_array(rng.standard_normal(HIDDEN).astype(np.float32), "g")
    graph = helper.make_graph(nodes, "norm16", [info("a", kind), info("b", kind)],
                              [info("out", narrow), info("x", kind)], [gamma], value_info=[info("xf", wide)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    feeds = {n: rng.standard_normal(SHAPE).astype(np.float16 if half else np.float32) for n in ("a", "b")}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = session.run(None, feeds)

    assert fuse_rms_norms(model) == 1
    onnx.checker.check_model(model, full_check=True)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("SkipSimplifiedLayerNormalization") == 1 and "Add" not in ops and "ReduceMean" not in ops
    casts = [n for n in model.graph.node if n.op_type == "Cast"]
    if half:  # both of the norm's casts gone; gamma taken in float16
        assert [(c.input[0], c.attribute[0].i) for c in casts] == [("g", TensorProto.FLOAT16)]
    else:  # the no-op widening gone; the narrowing to the float16 products kept
        assert [(c.output[0], c.attribute[0].i) for c in casts] == [("out", TensorProto.FLOAT16)]
    skip = next(n for n in model.graph.node if n.op_type == "SkipSimplifiedLayerNormalization")
    assert list(skip.input[:2]) == ["a", "b"] and skip.output[3] == "x"
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, feeds)
    np.testing.assert_allclose(got[0].astype(np.float32), expected[0].astype(np.float32), rtol=4e-3, atol=4e-3)
    np.testing.assert_array_equal(got[1], expected[1])  # the residual sum itself
