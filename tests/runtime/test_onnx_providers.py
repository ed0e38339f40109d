"""The onnxruntime device's execution providers (`--ort-provider cuda,cpu`, `Model.load(ort_providers=...)`)."""

from __future__ import annotations

import numpy as np
import pytest

from foldline.errors import InputError
from foldline.runtime import Model
from foldline.runtime.onnx_device import execution_providers

KNOWN = ["CUDAExecutionProvider", "CPUExecutionProvider", "DmlExecutionProvider"]


def test_short_and_full_names_resolve_in_order():
    assert execution_providers(["cuda", "CPU"], KNOWN, KNOWN) == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert execution_providers(["CPUExecutionProvider"], KNOWN, KNOWN) == ["CPUExecutionProvider"]


def test_an_unknown_provider_is_refused_naming_what_there_is():
    with pytest.raises(InputError, match=r"unknown ONNX Runtime provider 'cdua'; this onnxruntime has: cuda, cpu"):
        execution_providers(["cdua"], KNOWN, KNOWN[:2])


def test_a_provider_this_build_lacks_is_refused():
    with pytest.raises(InputError, match=r"'dml' \(DmlExecutionProvider\) is not in this onnxruntime build"):
        execution_providers(["dml", "cpu"], KNOWN, KNOWN[1:2])


def test_no_provider_is_refused():
    with pytest.raises(InputError, match="no ONNX Runtime provider"):
        execution_providers([], KNOWN, KNOWN)


@pytest.mark.slow
def test_the_device_loads_on_the_providers_given(bundle_factory):
    bundle = bundle_factory("llama-tiny", target="onnx")
    with pytest.raises(InputError, match="unknown ONNX Runtime provider 'nope'"):
        Model.load(bundle, device="onnxruntime", ort_providers=["nope"])
    with pytest.raises(InputError, match="apply to the onnxruntime device"):
        Model.load(bundle, device="cpu", ort_providers=["cpu"])
    default = Model.load(bundle, device="onnxruntime").session().prefill([3, 4, 5])
    chosen = Model.load(bundle, device="onnxruntime", ort_providers=["cpu"])
    assert chosen.ctx.sessions["decode"].get_providers() == ["CPUExecutionProvider"]
    np.testing.assert_array_equal(chosen.session().prefill([3, 4, 5]), default)
