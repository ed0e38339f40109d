"""Quantized weights through IREE: compiled vs eager, no float copy of a weight, quantized bytes on disk."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from foldline.frontend.arch import get_preset
from foldline.frontend.model import build_model
from foldline.frontend.quant import quantize
from foldline.frontend.types import LoadedModel

pytestmark = pytest.mark.slow


def _blocked(preset: str, fmt: str) -> LoadedModel:
    """A preset whose linear and embedding weights are exactly their blocks' dequantization (as from a GGUF)."""
    cfg = get_preset(preset)
    model = build_model(cfg, seed=0)
    blocks = {}
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            b = quantize(module.weight.detach().numpy(), fmt)
            with torch.no_grad():
                module.weight.copy_(torch.from_numpy(b.dequantize()))
            blocks[f"{name}.weight"] = b
    return LoadedModel(cfg, model, source=f"preset:{preset}", source_blocks=blocks)


@pytest.fixture(scope="module")
def blocked_bundles(tmp_path_factory):
    from foldline.backends.build import BuildOptions, compile_model

    cache = {}

    def get(preset: str, fmt: str):
        if (preset, fmt) not in cache:
            loaded = _blocked(preset, fmt)
            out = tmp_path_factory.mktemp(f"{preset}-{fmt}") / "bundle"
            # float32 caches and float32 activations: the claim here is that the weight repack is
            # lossless, so the bundle must match the float32 eager reference within fp32 tolerance
            # (auto would pick f16 caches, and int8 activations on a CPU with VNNI).
            compile_model(loaded, out, BuildOptions(weights="auto", keep_mlir=True, kv_dtype="float32",
                                                    activations="f32"),
                          progress=lambda _m: None)
            cache[preset, fmt] = (loaded, out)
        return cache[preset, fmt]

    return get


# llama: untied head; gemma3: a q8 table tied to the head, sliding windows; qwen35: GDN projections.
# gemma3 in 5-bit blocks: float activations, so the codes are widened to bytes at compile time.
@pytest.mark.parametrize("preset,fmt", [("llama-tiny", "q4"), ("gemma3-tiny", "q8"), ("qwen35-tiny", "q4"),
                                        ("gemma3-tiny", "q5")])
def test_lossless_blocks_compile_and_match_eager(preset, fmt, blocked_bundles):
    from foldline.runtime import Model
    from foldline.testing.parity import SCALED_TOL_FP32, run_parity

    loaded, bundle = blocked_bundles(preset, fmt)
    report = run_parity(loaded.module, Model.load(bundle), list(range(3, 43)), steps=24)
    assert report.ok(SCALED_TOL_FP32), report.summary()
    assert report.tokens_agree
    notes = _quantize_notes(bundle)
    assert "(0 requantized)" in notes
    stored = "q8" if fmt == "q5" else fmt
    assert re.search(rf"formats: \d+ {stored}\b", notes) and len(re.findall(r"\d+ q\d\b", notes)) == 1, notes
    assert ("widened to q8" in notes) == (fmt == "q5"), notes


def test_a_float_module_beside_an_int8_one_reads_5_bit_codes_widened(tmp_path):
    """A bundle with an int8 CPU module keeps 5-bit codes; its baseline module (x86-64-v2: float kernels)
    reads them through the widening copy (kernels/templates/qlinear_widen_q5.mlir) and matches eager in fp32."""
    from foldline.backends.build import BuildOptions, compile_model
    from foldline.backends.targets import cpu_target, make_target
    from foldline.kernels.select import cpu_has_int8_dot
    from foldline.runtime import Model
    from foldline.runtime.device import host_cpu_features
    from foldline.testing.parity import SCALED_TOL_FP32, run_parity

    if not cpu_has_int8_dot(host_cpu_features() or set()):
        pytest.skip("this CPU runs no int8 module")
    loaded = _blocked("gemma3-tiny", "q5")
    targets = [make_target("cpu", cpu="x86-64-v2"), make_target("cpu", cpu="host")]
    compile_model(loaded, tmp_path, BuildOptions(targets=targets, kv_dtype="float32"), progress=lambda _m: None)
    notes = _quantize_notes(tmp_path)
    assert re.search(r"formats: \d+ q5\b", notes) and "widened" not in notes, notes
    model = Model.load(tmp_path, cpu_features=cpu_target("x86-64-v2").cpu_flags)
    assert model.module_key == "cpu-x86-64-v2" and model.manifest.modules[model.module_key].activations == "f32"
    report = run_parity(loaded.module, model, list(range(3, 43)), steps=24)
    assert report.ok(SCALED_TOL_FP32), report.summary()
    assert report.tokens_agree


def _quantize_notes(bundle) -> str:
    passes = json.loads((bundle / "manifest.json").read_text())["passes"]
    return " ".join(next(p for p in passes if p["name"] == "quantize-weights")["notes"])


def test_decode_reads_only_codes_and_no_float_weight_outlives_a_prefill_call(blocked_bundles, tmp_path):
    """decode: every quantized weight is read as codes by a contraction, never as floats.
    prefill: each weight is dequantized into a float tile inside the call (the faster form for
    chunks); no initializer keeps a float copy of any weight."""
    import iree.compiler as ireec

    from foldline.backends.targets import make_target
    from foldline.kernels.attention import expand_decode_attention_ops
    from foldline.kernels.qlinear import expand_qlinear_ops

    from kernels.dispatches import (
        contractions_reading_codes,
        float_copies_of,
        read_dispatches,
    )

    loaded, bundle = blocked_bundles("llama-tiny", "q4")
    mlir, sites = expand_qlinear_ops((bundle / "model.mlir").read_text(), cpu_tiles=True)
    assert sum(sites.values()) > 0 and set(sites) <= {"qlinear decode f32", "qlinear prefill f32", "qlinear rows f32"}
    # model.mlir is the CPU import: its decode attention ops become the hand-written kernel, as in the build
    mlir, attention_sites = expand_decode_attention_ops(mlir)
    assert attention_sites["attention decode + cache write"] > 0 and "kv_cache_write" not in mlir
    dump = tmp_path / "dispatches"
    flags = [*make_target("cpu").flags, f"--iree-hal-dump-executable-sources-to={dump}"]
    ireec.compile_str(mlir, input_type="torch", extra_args=flags)
    dispatches = read_dispatches(dump)
    decode = [d for d in dispatches if "_decode$" in d.file]
    prefill = [d for d in dispatches if "_prefill$" in d.file]
    others = [d for d in dispatches if d not in decode and d not in prefill]
    assert decode and prefill
    # fuse-sibling-qlinears concatenates q/k/v and gate/up: their codes are read as one [sum N, K] weight
    import json

    from foldline.frontend.export import parameter_target

    report = json.loads((bundle / "manifest.json").read_text())["passes"]
    groups = next(r for r in report if r["name"] == "fuse-sibling-qlinears")["details"]["groups"]
    fused_into = {member: members for members in groups.values() for member in members}
    assert fused_into, "q/k/v and gate/up were fused"
    checked = 0
    for name, blocks in loaded.source_blocks.items():
        n, k = blocks.shape
        members = fused_into.get(parameter_target(name).removesuffix(".weight"))
        if members is not None:
            shapes = {parameter_target(s): b.shape for s, b in loaded.source_blocks.items()}
            n = sum(shapes[m + ".weight"][0] for m in members)
        assert float_copies_of(decode + others, n, k, blocks.group) == [], name
        # IREE shares identical executables between entry points (the head's matvec is the same in
        # prefill and decode), so the contraction reading the codes may carry either name.
        assert contractions_reading_codes(dispatches, n, k, blocks.format), f"{name}: no contraction reads its codes"
        if "embed_tokens" not in name:  # the lookup only gathers rows; the tied head reads codes at decode
            assert float_copies_of(prefill, n, k, blocks.group), f"{name}: prefill should dequantize per call"
        checked += 1
    # 7 projections in each of 3 layers, and the table the lookup gathers from and the tied head reads
    assert checked == 3 * 7 + 1


def test_the_parameter_archive_holds_the_quantized_bytes(blocked_bundles):
    import json

    loaded, bundle = blocked_bundles("llama-tiny", "q4")
    quantized = sum(b.nbytes for b in loaded.source_blocks.values())
    float_rest = sum(p.numel() * 4 for n, p in loaded.module.named_parameters()
                     if n not in loaded.source_blocks)
    size = (bundle / "params.irpa").stat().st_size
    assert size < 1.05 * (quantized + float_rest) + 64 * 1024  # the blocks plus norms, plus alignment
    report = json.loads((bundle / "manifest.json").read_text())["passes"]
    step = next(r for r in report if r["name"] == "quantize-weights")
    assert step["changed"]


class _OneQLinear(torch.nn.Module):
    def __init__(self, n: int, k: int):
        super().__init__()
        b = quantize(np.random.default_rng(0).standard_normal((n, k)).astype(np.float32), "q4")
        self.blocks = b
        self.codes = torch.nn.Parameter(torch.from_numpy(b.codes), requires_grad=False)
        self.scales = torch.nn.Parameter(torch.from_numpy(b.scales), requires_grad=False)
        self.mins = torch.nn.Parameter(torch.from_numpy(b.mins), requires_grad=False)

    def forward(self, x):
        return torch.ops.foldline.qlinear(x, self.codes, self.scales, self.mins, "q4", 32)


@pytest.mark.parametrize("kept", [True, False], ids=["fused-kernel", "aten-decomposition"])
def test_the_dispatch_check_tells_a_fused_kernel_from_a_materialised_weight(kept, tmp_path, monkeypatch):
    """The same qlinear, lowered by the kernel generator or decomposed to aten (nibble shifts in the graph)."""
    import iree.compiler as ireec

    from foldline.backends import lowering
    from foldline.backends.iree import importer
    from foldline.backends.targets import make_target
    from foldline.kernels.qlinear import expand_qlinear_ops

    from kernels.dispatches import (
        contractions_reading_codes,
        float_copies_of,
        read_dispatches,
    )

    n, k = 256, 128
    module = _OneQLinear(n, k).eval()
    with torch.no_grad():
        program = torch.export.export(module, (torch.randn(1, k),), strict=False)
    if not kept:
        monkeypatch.setattr(lowering, "KEPT_OPS", ())
    mlir, _ = importer.import_programs([("main", program)])
    mlir, sites = expand_qlinear_ops(mlir, cpu_tiles=True)
    assert sum(sites.values()) == (1 if kept else 0)
    dump = tmp_path / "dump"
    ireec.compile_str(mlir, input_type="torch",
                      extra_args=[*make_target("cpu").flags, f"--iree-hal-dump-executable-sources-to={dump}"])
    dispatches = read_dispatches(dump)
    fused = not float_copies_of(dispatches, n, k, 32) and bool(contractions_reading_codes(dispatches, n, k, "q4"))
    assert fused == kept


def test_quantized_bundle_runs_on_vulkan(vulkan_device, tmp_path):
    """GPU targets get the portable kernel (dequantize, then matmul): same logits as eager."""
    from foldline.backends.build import BuildOptions, compile_model
    from foldline.backends.targets import make_target
    from foldline.runtime import Model
    from foldline.testing.parity import SCALED_TOL_FP32, run_parity

    loaded = _blocked("llama-tiny", "q4")
    out = compile_model(loaded, tmp_path / "b", BuildOptions(targets=[make_target("vulkan")]),
                        progress=lambda _m: None)
    report = run_parity(loaded.module, Model.load(out, device="vulkan"), list(range(3, 43)), steps=16)
    assert report.ok(SCALED_TOL_FP32), report.summary()
    assert report.tokens_agree
