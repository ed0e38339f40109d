"""Quantized tiny models compiled for x86-64-v3 (AVX2, no AVX-512): int8-activation decode with its fusions.

The kernels themselves are checked one by one against the int8 emulation in
tests/kernels/test_int8_decode.py (parametrized by ISA). Here a whole bundle is built
for `--cpu x86-64-v3` with the default activations, as for an AVX2-only CPU
(Zen 3, Haswell and later): it must pick the AVX2 int8-dot kernels, fuse the
norms and gated activations into them, hold no AVX-512 code, and give the
float32 eager model's logits within the int8 bound and its top-1 token. This
host runs x86-64-v3 code whatever its own ISA level.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from foldline.contract.vmfb import vmfb_info
from foldline.kernels.x86 import AVX2
from foldline.runtime.device import host_cpu_features

from kernels.test_fusion import _blocked, _eager_logits, _int8_dot_kernels, _logits

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not AVX2.available(host_cpu_features() or set()), reason="this CPU has no AVX2")]

# llama-tiny with an MLP width of 128 (its 160 is no multiple of 64) takes the norm, SwiGLU and residual
# fusions; gemma3-tiny (q8 codes, and 5-bit ones) the norm and GELU(tanh) ones (test_fusion.py).
MODELS = {"llama-tiny": ("llama-tiny", "q4", 128, {"_rms", "_swiglu", "_res"}),
          "gemma3-tiny": ("gemma3-tiny", "q8", None, {"_rms", "_geglu"}),
          "gemma3-tiny-q5": ("gemma3-tiny", "q5", None, {"_rms", "_geglu"})}
# Largest |bundle - eager| per step over the step's largest |eager| logit: 8-bit activations per group
# against float32 ones (test_fusion.py's bound for the same models on AVX-512 VNNI).
SCALED_TOL_INT8 = 3e-2


@pytest.fixture(scope="module")
def avx2_bundles(tmp_path_factory):
    from foldline.backends.build import BuildOptions, compile_model
    from foldline.backends.targets import make_target

    cache = {}

    def get(name: str):
        if name not in cache:
            preset, fmt, intermediate, _ = MODELS[name]
            out = tmp_path_factory.mktemp(f"{name}-avx2") / "bundle"
            compile_model(_blocked(preset, fmt, intermediate), out,
                          BuildOptions(targets=[make_target("cpu", cpu="x86-64-v3")], weights="auto"),
                          progress=lambda _m: None)
            cache[name] = out
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(MODELS))
def test_x86_64_v3_bundle_takes_the_avx2_int8_kernels(name, avx2_bundles):
    bundle = avx2_bundles(name)
    module = json.loads((bundle / "manifest.json").read_text())["modules"]["cpu"]
    assert module["activations"] == "int8"
    assert module["kernel_isa"] == {"decode": "int8-avx2", "prefill": "int8-avx2"}
    # what LLVM compiled the executables for: AVX2, nothing of AVX-512
    compiled = vmfb_info(bundle / module["file"]).cpu_flags
    assert "avx2" in compiled and not any(f.startswith("avx512") for f in compiled), compiled
    kernels = _int8_dot_kernels(bundle)
    assert kernels, "no int8-dot kernel in the module"
    assert all(k.startswith(f"foldline_i8dot_{MODELS[name][1]}") for k in kernels), kernels
    for marker in ("_rms", "_swiglu", "_geglu", "_res"):
        assert any(marker in k for k in kernels) == (marker in MODELS[name][3]), marker
    assert re.search(rb"foldline_i8gemm_", (bundle / module["file"]).read_bytes())  # prefill: the AVX2 int8 GEMM


@pytest.mark.parametrize("name", list(MODELS))
def test_x86_64_v3_bundle_matches_eager(name, avx2_bundles):
    preset, fmt, intermediate, _ = MODELS[name]
    got, eager = _logits(avx2_bundles(name)), _eager_logits(preset, fmt, intermediate)
    scaled = np.abs(got - eager).max(axis=1) / np.abs(eager).max(axis=1)
    assert scaled.max() < SCALED_TOL_INT8, f"worst scaled difference {scaled.max():.2e}"
    assert (got.argmax(axis=1) == eager.argmax(axis=1)).all(), "top-1 token differs from eager"
