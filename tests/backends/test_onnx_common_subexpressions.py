"""The common-subexpressions ONNX graph rewrite: equal constants and equal nodes computed once, and what it
must leave alone (graph outputs, random ops, large initializers, graphs with subgraphs)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from foldline.backends.onnx.common_subexpressions import (
    SMALL_INITIALIZER_BYTES,
    merge_common_subexpressions,
)


def _model(nodes, outputs, initializers=(), shape=(2, 6)):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, shape) for o in outputs],
                              list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def _run(model, x):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


def _per_layer_copies():
    """Two 'layers' that each reshape x by their own constant of the same value and cast it, as the exporter
    writes a value that depends on the step's inputs alone, then use it."""
    nodes = []
    for layer in range(2):
        nodes += [helper.make_node("Constant", [], [f"shape{layer}"],  # its tensor named as the layer's
                                   value=numpy_helper.from_array(np.array([3, 4], np.int64), f"shape{layer}")),
                  helper.make_node("Reshape", ["x", f"shape{layer}"], [f"r{layer}"]),
                  helper.make_node("Relu", [f"r{layer}"], [f"y{layer}"]),
                  helper.make_node("Mul", [f"y{layer}", f"scale{layer}"], [f"out{layer}"])]
    scales = [numpy_helper.from_array(np.array(2.0, np.float32), f"scale{i}") for i in range(2)]
    return _model(nodes, ["out0", "out1"], scales, shape=(3, 4))


def test_equal_constants_and_the_nodes_over_them_are_computed_once():
    model = _per_layer_copies()
    x = np.arange(12, dtype=np.float32).reshape(2, 6) - 6
    before = _run(model, x)
    removed = merge_common_subexpressions(model)
    ops = [n.op_type for n in model.graph.node]
    # one Constant, Reshape and Relu; both Muls kept (each makes a graph output); one of the equal scales
    assert ops == ["Constant", "Reshape", "Relu", "Mul", "Mul"]
    assert removed == 4  # a Constant, a Reshape, a Relu and an initializer
    assert [i.name for i in model.graph.initializer] == ["scale0"]
    assert [o.name for o in model.graph.output] == ["out0", "out1"]
    onnx.checker.check_model(model, full_check=True)
    for got, want in zip(_run(model, x), before):
        np.testing.assert_array_equal(got, want)


def test_random_ops_large_initializers_and_different_attributes_stay():
    big = np.ones(SMALL_INITIALIZER_BYTES // 4 + 1, np.float32)
    nodes = [helper.make_node("RandomNormalLike", ["x"], ["n0"], seed=1.0),
             helper.make_node("RandomNormalLike", ["x"], ["n1"], seed=1.0),
             helper.make_node("LeakyRelu", ["x"], ["l0"], alpha=0.1),
             helper.make_node("LeakyRelu", ["x"], ["l1"], alpha=0.2),
             helper.make_node("Add", ["n0", "n1"], ["a"]), helper.make_node("Add", ["l0", "l1"], ["b"]),
             helper.make_node("Sum", ["big0", "big1"], ["c"])]
    model = _model(nodes, ["a", "b", "c"], [numpy_helper.from_array(big, "big0"), numpy_helper.from_array(big, "big1")])
    assert merge_common_subexpressions(model) == 0
    assert len(model.graph.node) == 7 and len(model.graph.initializer) == 2


def test_a_graph_with_a_subgraph_is_left_as_it_is():
    branch = helper.make_graph([helper.make_node("Identity", ["x"], ["z"])], "branch", [],
                               [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)])
    model = _per_layer_copies()
    model.graph.node.append(helper.make_node("Constant", [], ["flag"], value=numpy_helper.from_array(np.array(True))))
    model.graph.node.append(helper.make_node("If", ["flag"], ["w"], then_branch=branch, else_branch=branch))
    count = len(model.graph.node)
    assert merge_common_subexpressions(model) == 0
    assert len(model.graph.node) == count
