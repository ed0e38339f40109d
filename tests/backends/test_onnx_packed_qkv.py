"""The packed-qkv ONNX graph rewrite: GroupQueryAttention fed the fused q/k/v product whole, with the outputs
ONNX Runtime gives the three slices; and the traces it must leave alone."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from foldline.backends.onnx.packed_qkv import pack_qkv

HEADS, KV_HEADS, DIM, SEQ, PAST = 4, 2, 8, 3, 16
Q, KV = HEADS * DIM, KV_HEADS * DIM


def _attention_model(v_perms=((0, 2, 1, 3), (0, 2, 1, 3)), ranges=((0, Q), (Q, Q + KV), (Q + KV, Q + 2 * KV)),
                     second_source: bool = False) -> onnx.ModelProto:
    """x [1, S, 32] times w gives [q | k | v]; q and k sliced, v sliced, split into heads, transposed twice and
    flattened back (the export's v path), into GroupQueryAttention over a 16-position cache."""
    rng = np.random.default_rng(0)
    width = Q + 2 * KV
    inits = [numpy_helper.from_array(rng.standard_normal((32, width)).astype(np.float32), "w"),
             numpy_helper.from_array(np.array([-1], np.int64), "last"),
             numpy_helper.from_array(np.array([1, SEQ, KV_HEADS, DIM], np.int64), "heads_shape"),
             numpy_helper.from_array(np.array([0, 0, -1], np.int64), "flat")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["qkv"])]
    if second_source:
        nodes.append(helper.make_node("Identity", ["qkv"], ["qkv2"]))
    for name, (start, end) in zip("qkv", ranges):
        inits += [numpy_helper.from_array(np.array([start], np.int64), f"{name}_start"),
                  numpy_helper.from_array(np.array([end], np.int64), f"{name}_end")]
        source = "qkv2" if second_source and name == "v" else "qkv"
        nodes.append(helper.make_node("Slice", [source, f"{name}_start", f"{name}_end", "last"], [f"{name}_slice"]))
    nodes += [helper.make_node("Reshape", ["v_slice", "heads_shape"], ["v_heads"]),
              helper.make_node("Transpose", ["v_heads"], ["v_bhsd"], perm=list(v_perms[0])),
              helper.make_node("Transpose", ["v_bhsd"], ["v_bshd"], perm=list(v_perms[1])),
              helper.make_node("Reshape", ["v_bshd", "flat"], ["v"]),
              helper.make_node("GroupQueryAttention", ["q_slice", "k_slice", "v", "past_k", "past_v", "seqlens_k",
                                                       "total"], ["out", "present_k", "present_v"],
                               domain="com.microsoft", num_heads=HEADS, kv_num_heads=KV_HEADS)]
    cache = [1, KV_HEADS, PAST, DIM]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, SEQ, 32]),
         helper.make_tensor_value_info("past_k", TensorProto.FLOAT, cache),
         helper.make_tensor_value_info("past_v", TensorProto.FLOAT, cache),
         helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
         helper.make_tensor_value_info("total", TensorProto.INT32, [])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("out", "present_k", "present_v")],
        inits,
        value_info=[helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in (
            ("qkv", [1, SEQ, width]), ("qkv2", [1, SEQ, width]), ("q_slice", [1, SEQ, Q]),
            ("k_slice", [1, SEQ, KV]), ("v_slice", [1, SEQ, KV]), ("v_heads", [1, SEQ, KV_HEADS, DIM]))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("com.microsoft", 1)])


def _run(model: onnx.ModelProto) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    held = 5  # positions already in the caches
    past = [np.zeros((1, KV_HEADS, PAST, DIM), np.float32) for _ in range(2)]
    for cache in past:
        cache[:, :, :held] = rng.standard_normal((1, KV_HEADS, held, DIM))
    feeds = {"x": rng.standard_normal((1, SEQ, 32)).astype(np.float32), "past_k": past[0], "past_v": past[1],
             "seqlens_k": np.array([held + SEQ - 1], np.int32), "total": np.array(held + SEQ, np.int32)}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def test_the_three_slices_become_one_packed_input_with_the_same_outputs():
    model = _attention_model()
    before = _run(model)
    assert pack_qkv(model) == 1
    attention, = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert list(attention.input[:3]) == ["qkv", "", ""]
    assert {n.op_type for n in model.graph.node} == {"MatMul", "GroupQueryAttention"}  # the slices and v's trace gone
    for got, want in zip(_run(model), before):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["transposes that do not cancel", "k and v swapped", "v from another tensor",
                                  "a gap between q and k"])
def test_what_is_not_the_three_slices_in_order_is_left(case):
    model = {
        "transposes that do not cancel": lambda: _attention_model(v_perms=((0, 2, 1, 3), (0, 1, 3, 2))),
        "k and v swapped": lambda: _attention_model(ranges=((0, Q), (Q + KV, Q + 2 * KV), (Q, Q + KV))),
        "v from another tensor": lambda: _attention_model(second_source=True),
        "a gap between q and k": lambda: _attention_model(ranges=((0, Q - DIM), (Q, Q + KV), (Q + KV, Q + 2 * KV))),
    }[case]()
    count = len(model.graph.node)
    assert pack_qkv(model) == 0
    assert len(model.graph.node) == count
