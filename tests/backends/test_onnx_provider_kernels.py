"""Which nodes of an ONNX graph each execution provider has a kernel for (backends/onnx/providers.py), from
ONNX Runtime's kernel table; the table's parser (scripts/ort_provider_kernels.py). The exported bundles'
gaps are checked in test_onnx.py, against graphs ONNX Runtime ran."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from foldline.backends.onnx.providers import (
    _element_types,
    kernel_table,
    parse_versions,
    provider_gaps,
)
from foldline.runtime.onnx_device import fallback_notice

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ort_provider_kernels.py"


def _graph(nodes, inputs, opset: int = 23) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info(nodes[-1].output[0],
                                                                                  TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                   helper.make_opsetid("com.microsoft", 1)])


def _float(name: str):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, [2, 4])


def test_versions_and_types_read_as_the_table_writes_them():
    assert parse_versions("13+") == (13, None)
    assert parse_versions("[6, 12]") == (6, 12)
    assert parse_versions("23") == (23, 23)


def test_element_types_follow_casts_comparisons_and_shapes():
    nodes = [helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16),
             helper.make_node("Add", ["h", "h"], ["s"]),
             helper.make_node("Less", ["x", "x"], ["m"]),
             helper.make_node("Shape", ["s"], ["n"]),
             helper.make_node("Where", ["m", "x", "x"], ["y"])]
    types = _element_types(_graph(nodes, [_float("x")]))
    assert {k: types[k] for k in "hsmny"} == {"h": "float16", "s": "float16", "m": "bool", "n": "int64",
                                              "y": "float"}


def test_a_node_no_kernel_takes_is_a_gap_and_one_every_provider_takes_is_not():
    nodes = [helper.make_node("Add", ["x", "x"], ["a"]),  # every provider, float, opset 14+
             helper.make_node("Sigmoid", ["a"], ["b"]),
             helper.make_node("NoSuchOp", ["b"], ["c"], domain="com.example"),  # in no table
             helper.make_node("Add", ["s", "s"], ["t"])]  # Add on strings: no provider registers it
    model = _graph(nodes, [_float("x"), helper.make_tensor_value_info("s", TensorProto.STRING, [2])])
    for provider in ("cpu", "cuda", "dml"):
        assert provider_gaps(model, provider) == {"NoSuchOp (float)": 1, "Add (string)": 1}, provider


def test_an_opset_no_row_covers_is_a_gap():
    """RMSNormalization is an opset 23 operator: a graph importing opset 22 has no kernel for it anywhere."""
    nodes = [helper.make_node("RMSNormalization", ["x", "w"], ["y"])]
    inputs = [_float("x"), helper.make_tensor_value_info("w", TensorProto.FLOAT, [4])]
    assert not provider_gaps(_graph(nodes, inputs, opset=23), "cpu")
    assert provider_gaps(_graph(nodes, inputs, opset=22), "cpu") == {"RMSNormalization (float)": 1}


def test_the_table_has_the_ops_the_exporter_emits_for_each_provider():
    table = kernel_table()
    for provider in ("cpu", "cuda", "dml"):
        for op in (("ai.onnx", "MatMul"), ("ai.onnx", "Reshape"), ("ai.onnx", "Softmax")):
            assert any(k.takes(13) and k.allows("T", "float") for k in table[provider][op].kernels), (provider, op)
    for op in ("MatMulNBits", "GroupQueryAttention", "SkipSimplifiedLayerNormalization"):
        assert table["cpu"][("com.microsoft", op)].kernels, op
    assert table["cpu"][("ai.onnx", "Reshape")].inputs == ("T", "tensor(int64)")


def test_a_kernel_is_chosen_by_every_input_type_not_the_first_alone():
    """CUDA's GroupQueryAttention takes float16 and bfloat16 queries; its float scale input does not make
    a float32 query one it takes. Where's first input is its bool mask: its data type is its second's."""
    query, key = (helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 1, 64]) for n in ("q", "k"))
    node = helper.make_node("GroupQueryAttention", ["q", "k", "k"], ["y"], domain="com.microsoft", num_heads=4,
                            kv_num_heads=1)
    model = _graph([node], [query, key])
    assert provider_gaps(model, "cuda") == {"GroupQueryAttention (float)": 1}
    assert not provider_gaps(model, "cpu")
    where = helper.make_node("Where", ["m", "x", "x"], ["y"])
    mask = helper.make_tensor_value_info("m", TensorProto.BOOL, [2, 4])
    assert not provider_gaps(_graph([where], [mask, _float("x")]), "cuda")


def test_an_input_past_the_tables_list_is_unconstrained_unless_the_op_repeats_its_last():
    """GroupQueryAttention's query_seqlens (input 16) came after the table's 14 inputs: its int32 is not
    held against the last listed constraint (the float KV scales), which made CUDA's float16 kernel look
    absent. Concat's inputs repeat: each extra one is still checked against its constraint."""
    half = [helper.make_tensor_value_info(n, TensorProto.FLOAT16, [1, 1, 64]) for n in ("q", "k")]
    cache = [helper.make_tensor_value_info(n, TensorProto.FLOAT16, [1, 1, 8, 64]) for n in ("pk", "pv")]
    counts = [helper.make_tensor_value_info(n, TensorProto.INT32, [1]) for n in ("s", "t", "qs")]
    node = helper.make_node("GroupQueryAttention", ["q", "k", "k", "pk", "pv", "s", "t", *[""] * 9, "qs"],
                            ["y", "pk_next", "pv_next"], domain="com.microsoft", num_heads=4, kv_num_heads=1)
    assert not provider_gaps(_graph([node], [*half, *cache, *counts]), "cuda")
    table = kernel_table()["cuda"]
    assert table[("com.microsoft", "GroupQueryAttention")].constraint(16) is None
    assert table[("ai.onnx", "Concat")].constraint(5) == table[("ai.onnx", "Concat")].constraint(0) == "T"
    concat = helper.make_node("Concat", ["x", "x", "x", "s8"], ["y"], axis=0)
    strings = helper.make_tensor_value_info("s8", TensorProto.STRING, [2, 4])
    assert provider_gaps(_graph([concat], [_float("x"), strings]), "dml") == {"Concat (float)": 1}


def test_a_session_naming_a_gpu_provider_is_told_what_falls_back():
    gaps = {"cuda": {"GroupQueryAttention (float)": 4, "RMSNormalization (float)": 10}, "dml": {}}
    notice = fallback_notice(gaps, ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert notice == ("14 nodes of this bundle's ONNX graphs have no cuda kernel and run on cpu: "
                      "4 GroupQueryAttention (float), 10 RMSNormalization (float)")
    assert fallback_notice(gaps, ["DmlExecutionProvider", "CPUExecutionProvider"]) is None
    assert fallback_notice(gaps, ["CUDAExecutionProvider"]) is None  # nothing after it to fall back to
    assert fallback_notice(None, ["CUDAExecutionProvider", "CPUExecutionProvider"]) is None  # an older bundle


def test_the_script_reads_operator_kernels_markdown(tmp_path):
    spec = importlib.util.spec_from_file_location("ort_provider_kernels", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    markdown = """## Operators implemented by CPUExecutionProvider

| Op Name | Parameters | OpSet Version | Types Supported |
|---------|------------|---------------|-----------------|
|**Operator Domain:** *ai.onnx*||||
|Add|*in* A:**T**<br> *out* C:**T**|14+|**T** = tensor(double), tensor(float)|
|||[7, 12]|**T** = tensor(float)|
|**Operator Domain:** *ai.onnx.ml*||||
|ArrayFeatureExtractor|*in* X:**T**|1+|**T** = tensor(float)|
|**Operator Domain:** *com.microsoft*||||
|MatMulNBits|*in* A:**T1**|1+|**T1** = tensor(float)<br/> **T2** = tensor(uint8)|

## Operators implemented by CUDAExecutionProvider

| Op Name | Parameters | OpSet Version | Types Supported |
|---------|------------|---------------|-----------------|
|**Operator Domain:** *ai.onnx*||||
|Add|*in* A:**T**|14+|**T** = tensor(float16)|
"""
    assert script.parse(markdown) == {
        "CPUExecutionProvider": {
            "ai.onnx/Add": {"inputs": ["T"], "registrations": [{"versions": "14+", "types": {"T": ["double", "float"]}},
                                                         {"versions": "[7, 12]", "types": {"T": ["float"]}}]},
            "com.microsoft/MatMulNBits": {"inputs": ["T1"], "registrations": [
                {"versions": "1+", "types": {"T1": ["float"], "T2": ["uint8"]}}]}},
        "CUDAExecutionProvider": {"ai.onnx/Add": {"inputs": ["T"], "registrations": [
            {"versions": "14+", "types": {"T": ["float16"]}}]}},
    }
