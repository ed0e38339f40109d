"""GGUF blocks as ONNX Runtime's MatMulNBits (backends/onnx/nbits.py), one product at a time.

Every block type foldline repacks becomes a placeholder product, is rewritten
to MatMulNBits and run by onnxruntime; the result is checked against x times
gguf-py's own dequantization of the same bytes: within float32 rounding with
float activations, within the int8-activation bound with int8 ones.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from onnx import TensorProto, helper, numpy_helper

from foldline.backends.onnx.nbits import (
    ACCURACY_LEVEL,
    ORT_DOMAIN,
    PLACEHOLDER_DOMAIN,
    MatMulNBitsError,
    to_matmul_nbits,
)
from foldline.frontend.quant import REPACKABLE, QuantizedTensor, repack_gguf

from frontend.test_quant import random_blocks

ort = pytest.importorskip("onnxruntime")

N, K = 48, 512
# int8 activations, per block of x: the error relative to the largest |output| stays below this
INT8_REL_TOL = 2e-2
# block types whose offset (module docstring) is zero in every group: MatMulNBits alone
NO_OFFSET = {GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q5_0,
             GGMLQuantizationType.Q6_K}


def _placeholder_model(qt: QuantizedTensor, x_shape: list, codes_as_input: bool = False) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(qt.scales, "w.scales")]
    if qt.mins is not None:
        inits.append(numpy_helper.from_array(qt.mins, "w.mins"))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)]
    if codes_as_input:
        inputs.append(helper.make_tensor_value_info("w.codes", TensorProto.UINT8, list(qt.codes.shape)))
    else:
        inits.append(numpy_helper.from_array(qt.codes, "w.codes"))
    node = helper.make_node("QLinear", ["x", "w.codes", "w.scales", "w.mins" if qt.mins is not None else ""],
                            ["y"], domain=PLACEHOLDER_DOMAIN, fmt=qt.format, group=qt.group)
    graph = helper.make_graph([node], "product", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*x_shape[:-1], qt.shape[0]])],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20),
                                                   helper.make_opsetid(PLACEHOLDER_DOMAIN, 1)])


@pytest.mark.parametrize("activations", ["f32", "int8"])
@pytest.mark.parametrize("qtype", REPACKABLE, ids=lambda q: q.name)
def test_matmul_nbits_multiplies_by_the_gguf_dequantization(qtype, activations):
    block = 256 if qtype.name.endswith("_K") else 32
    raw = random_blocks(qtype, N, K // block, seed=int(qtype))
    qt = repack_gguf(raw, qtype)
    want_w = gguf_dequantize(raw, qtype).reshape(N, K).astype(np.float64)
    x = np.random.default_rng(1).standard_normal((2, 3, K)).astype(np.float32)

    model = _placeholder_model(qt, [2, 3, K])
    assert to_matmul_nbits(model, ACCURACY_LEVEL[activations]) == 1
    onnx.checker.check_model(model, full_check=True)
    ops = [(n.domain, n.op_type) for n in model.graph.node]
    assert ops[0] == (ORT_DOMAIN, "MatMulNBits")
    assert (len(ops) == 1) == (qtype in NO_OFFSET), ops  # the offset's term only where there is an offset
    names = {t.name: t for t in model.graph.initializer}
    assert "w.codes" not in names  # the codes live on only as MatMulNBits' blocks
    b = numpy_helper.to_array(names["w.codes.nbits"])
    bits = 4 if qt.format == "q4" else 8
    assert b.dtype == np.uint8 and b.shape == (N, K // qt.group, qt.group * bits // 8)
    assert {o.domain for o in model.opset_import} == {"", ORT_DOMAIN}

    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    want = x.astype(np.float64) @ want_w.T
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert rel < (1e-6 if activations == "f32" else INT8_REL_TOL), f"{qtype.name} {activations}: {rel:.2e}"


def test_a_product_whose_codes_are_computed_is_refused_by_name():
    raw = random_blocks(GGMLQuantizationType.Q4_0, N, K // 32, seed=0)
    model = _placeholder_model(repack_gguf(raw, GGMLQuantizationType.Q4_0), [1, K], codes_as_input=True)
    with pytest.raises(MatMulNBitsError, match="codes 'w.codes' .* computed in the graph"):
        to_matmul_nbits(model, 0)


def test_an_unknown_block_format_is_refused_by_name():
    raw = random_blocks(GGMLQuantizationType.Q8_0, N, K // 32, seed=0)
    model = _placeholder_model(repack_gguf(raw, GGMLQuantizationType.Q8_0), [1, K])
    model.graph.node[0].attribute[0].CopyFrom(helper.make_attribute("fmt", "q3"))
    with pytest.raises(MatMulNBitsError, match="'q3' has no MatMulNBits form"):
        to_matmul_nbits(model, 0)
