"""The RMSNorm and residual add taken into the int8-dot decode kernels (kernels/fusion.py).

The matcher reads torch-dialect MLIR as the FX importer writes it; the compiled
check builds the same quantized tiny models with and without the fusion and
requires the same logits (and the fused kernels in the module).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from iree.compiler import ir

from foldline.kernels import fusion as decode_fusion
from foldline.kernels import qlinear as quant_kernels
from foldline.kernels.int8_decode import RowNorm
from foldline.kernels.select import cpu_has_int8_dot
from foldline.runtime.device import host_cpu_features

# One RMSNorm, a projection and the residual add, as torch-mlir imports a llama layer's decode.
LAYER = """
func.func @step(%h: !torch.vtensor<[1,1,64],f32>, %w: !torch.vtensor<[64],f32>, %y: !torch.vtensor<[1,1,64],f32>)
    -> (!torch.vtensor<[1,1,64],f32>, !torch.vtensor<[1,1,64],f32>) {
  %int2 = torch.constant.int POWER
  %0 = torch.aten.pow.Tensor_Scalar %h, %int2 : !torch.vtensor<[1,1,64],f32>, !torch.int -> !torch.vtensor<[1,1,64],f32>
  %int-1 = torch.constant.int MEAN_DIM
  %1 = torch.prim.ListConstruct %int-1 : (!torch.int) -> !torch.list<int>
  %true = torch.constant.bool true
  %none = torch.constant.none
  %2 = torch.aten.mean.dim %0, %1, %true, %none : !torch.vtensor<[1,1,64],f32>, !torch.list<int>, !torch.bool, !torch.none -> !torch.vtensor<[1,1,1],f32>
  %eps = torch.constant.float 1.000000e-05
  %int1 = torch.constant.int 1
  %3 = torch.aten.add.Scalar %2, %eps, %int1 : !torch.vtensor<[1,1,1],f32>, !torch.float, !torch.int -> !torch.vtensor<[1,1,1],f32>
  %4 = torch.aten.rsqrt %3 : !torch.vtensor<[1,1,1],f32> -> !torch.vtensor<[1,1,1],f32>
  %5 = torch.aten.mul.Tensor %h, %4 : !torch.vtensor<[1,1,64],f32>, !torch.vtensor<[1,1,1],f32> -> !torch.vtensor<[1,1,64],f32>
  %offset = torch.constant.float 1.000000e+00
  %6 = torch.aten.add.Scalar %w, %offset, %int1 : !torch.vtensor<[64],f32>, !torch.float, !torch.int -> !torch.vtensor<[64],f32>
  %x = torch.aten.mul.Tensor %5, %6 : !torch.vtensor<[1,1,64],f32>, !torch.vtensor<[64],f32> -> !torch.vtensor<[1,1,64],f32>
  %alpha = torch.constant.int ALPHA
  %sum = torch.aten.add.Tensor %h, %y, %alpha : !torch.vtensor<[1,1,64],f32>, !torch.vtensor<[1,1,64],f32>, !torch.int -> !torch.vtensor<[1,1,64],f32>
  return %x, %sum : !torch.vtensor<[1,1,64],f32>, !torch.vtensor<[1,1,64],f32>
}
"""


def _parse(power: int = 2, mean_dim: int = -1, alpha: int = 1):
    text = LAYER.replace("POWER", str(power)).replace("MEAN_DIM", str(mean_dim)).replace("ALPHA", str(alpha))
    ctx = ir.Context()
    ctx.allow_unregistered_dialects = True
    with ctx:
        module = ir.Module.parse(text)
    func = module.body.operations[0]
    ret = func.regions[0].blocks[0].operations[-1]
    return ctx, module, func.regions[0].blocks[0].arguments, ret.operands


def test_the_norm_and_the_residual_add_are_found():
    ctx, _module, (h, w, y), (x, _sum) = _parse()
    with ctx:
        norm = decode_fusion.match_norm(x, 64)
        assert norm is not None and norm.h == h and norm.weight == w
        assert norm.norm == RowNorm(eps=pytest.approx(1e-5), offset=1.0)
        residual = decode_fusion.match_residual(y)
        assert residual is not None and residual.residual == h


@pytest.mark.parametrize("change", [{"power": 3}, {"mean_dim": 1}])
def test_anything_but_an_rms_norm_is_left_alone(change):
    ctx, _module, _args, (x, _sum) = _parse(**change)
    with ctx:
        assert decode_fusion.match_norm(x, 64) is None
        assert decode_fusion.match_norm(x, 32) is None  # not a row of K


SWIGLU = """
func.func @mlp(%gu: !torch.vtensor<[1,1,256],f32>) -> !torch.vtensor<[1,1,128],f32> {
  %dim = torch.constant.int -1
  %int0 = torch.constant.int 0
  %int128 = torch.constant.int 128
  %int256 = torch.constant.int UP_END
  %int1 = torch.constant.int 1
  %g = torch.aten.slice.Tensor %gu, %dim, %int0, %int128, %int1 : !torch.vtensor<[1,1,256],f32>, !torch.int, !torch.int, !torch.int, !torch.int -> !torch.vtensor<[1,1,128],f32>
  %u = torch.aten.slice.Tensor %gu, %dim, %int128, %int256, %int1 : !torch.vtensor<[1,1,256],f32>, !torch.int, !torch.int, !torch.int, !torch.int -> !torch.vtensor<[1,1,128],f32>
  %s = torch.aten.sigmoid %g : !torch.vtensor<[1,1,128],f32> -> !torch.vtensor<[1,1,128],f32>
  %a = torch.aten.mul.Tensor %g, %s : !torch.vtensor<[1,1,128],f32>, !torch.vtensor<[1,1,128],f32> -> !torch.vtensor<[1,1,128],f32>
  %x = torch.aten.mul.Tensor %a, %u : !torch.vtensor<[1,1,128],f32>, !torch.vtensor<[1,1,128],f32> -> !torch.vtensor<[1,1,128],f32>
  return %x : !torch.vtensor<[1,1,128],f32>
}
"""


# GeGLU as Gemma's MLP exports it: gelu(g, approximate="tanh") * u
GEGLU = SWIGLU.replace(
    "  %s = torch.aten.sigmoid %g : !torch.vtensor<[1,1,128],f32> -> !torch.vtensor<[1,1,128],f32>\n"
    "  %a = torch.aten.mul.Tensor %g, %s : !torch.vtensor<[1,1,128],f32>, !torch.vtensor<[1,1,128],f32> "
    "-> !torch.vtensor<[1,1,128],f32>\n",
    '  %mode = torch.constant.str "MODE"\n'
    "  %a = torch.aten.gelu %g, %mode : !torch.vtensor<[1,1,128],f32>, !torch.str -> !torch.vtensor<[1,1,128],f32>\n")


@pytest.mark.parametrize("text,up_end,activation", [
    (SWIGLU, 256, "silu"), (SWIGLU, 255, None),
    (GEGLU.replace("MODE", "tanh"), 256, "gelu_tanh"), (GEGLU.replace("MODE", "tanh"), 255, None),
    (GEGLU.replace("MODE", "none"), 256, None),  # the exact (erf) GELU is another function
], ids=["swiglu", "swiglu-wrong-half", "geglu-tanh", "geglu-wrong-half", "gelu-erf"])
def test_a_gated_activation_of_the_gate_up_halves_is_found(text, up_end, activation):
    assert "%a = " in text
    ctx = ir.Context()
    ctx.allow_unregistered_dialects = True
    with ctx:
        module = ir.Module.parse(text.replace("UP_END", str(up_end)))
        block = module.body.operations[0].regions[0].blocks[0]
        x = block.operations[-1].operands[0]
        match = decode_fusion.match_gate(x, 128)
        assert (match.activation if match else None) == activation
        if match:
            assert match.gate_up == block.arguments[0]


def test_a_scaled_add_is_no_residual():
    ctx, _module, (_h, _w, y), _ = _parse(alpha=2)
    with ctx:
        assert decode_fusion.match_residual(y) is None


needs_vnni = pytest.mark.skipif(not cpu_has_int8_dot(host_cpu_features() or set()),
                                reason="this CPU has neither AVX2 nor AVX-512 VNNI: no int8-dot kernels to fuse into")


def _blocked(preset: str, fmt: str, intermediate: int | None):
    """The preset with block-exact weights (test_quant_compile._blocked), its MLP width changed if asked:
    llama-tiny's 160 is no multiple of 64, so its down projection takes no int8-dot kernel."""
    import dataclasses

    from foldline.frontend import arch

    from kernels import test_quant_compile

    if intermediate is None:
        return test_quant_compile._blocked(preset, fmt)
    cfg = dataclasses.replace(arch.get_preset(preset), intermediate_size=intermediate)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(test_quant_compile, "get_preset", lambda _name: cfg)
        return test_quant_compile._blocked(preset, fmt)


def _compile(preset: str, fmt: str, intermediate: int | None, out, fuse: bool, monkeypatch):
    from foldline.backends.build import BuildOptions, compile_model

    with monkeypatch.context() as m:
        if not fuse:
            m.setattr(quant_kernels, "match_norm", lambda x, k: None)
            m.setattr(quant_kernels, "match_gate", lambda x, k: None)
            m.setattr(quant_kernels, "match_residual", lambda y: None)
        compile_model(_blocked(preset, fmt, intermediate), out,
                      BuildOptions(weights="auto", activations="int8"), progress=lambda _m: None)
    return out


def _int8_dot_kernels(bundle) -> set[str]:
    return {m.decode() for m in re.findall(rb"foldline_i8dot_\w+", (bundle / "model.cpu.vmfb").read_bytes())}


def _logits(bundle) -> np.ndarray:
    from foldline.runtime import Model

    with Model.load(bundle) as model:
        session = model.session()
        steps = [session.prefill(list(range(3, 23)))]
        for token in range(40, 64):
            steps.append(session.decode(token))
    return np.stack(steps)


# llama (MLP width 128): norms before q/k/v, gate/up and the head, SwiGLU into the down projection,
# residual adds after o and down; gemma3: norms, GELU(tanh) into the down projection, and post-norms
# between each projection and its residual add, so no residual add.
@pytest.mark.slow
@needs_vnni
@pytest.mark.parametrize("preset,fmt,intermediate,fusions", [
    ("llama-tiny", "q4", 128, {"_rms", "_swiglu", "_res"}),
    ("gemma3-tiny", "q8", None, {"_rms", "_geglu"}),
    ("gemma3-tiny", "q5", None, {"_rms", "_geglu"}),  # 5-bit codes read as they lie (kernels/int8_decode.py)
])
def test_fused_decode_matches_the_unfused_kernels(preset, fmt, intermediate, fusions, tmp_path, monkeypatch):
    fused = _compile(preset, fmt, intermediate, tmp_path / "fused", True, monkeypatch)
    plain = _compile(preset, fmt, intermediate, tmp_path / "plain", False, monkeypatch)
    fused_kernels, plain_kernels = _int8_dot_kernels(fused), _int8_dot_kernels(plain)
    assert all(k.startswith(f"foldline_i8dot_{fmt}") for k in fused_kernels | plain_kernels), fused_kernels
    for marker in ("_rms", "_swiglu", "_geglu", "_res"):
        assert any(marker in k for k in fused_kernels) == (marker in fusions), marker
        assert not any(marker in k for k in plain_kernels), marker
    a, b = _logits(fused), _logits(plain)
    if "_geglu" not in fusions:
        # The same int8 products; only the norm's sum of squares is added in another order.
        scaled = np.abs(a - b).max(axis=1) / np.abs(b).max(axis=1)
        assert scaled.max() < 1e-3, f"worst scaled difference {scaled.max():.2e}"
        assert (a.argmax(axis=1) == b.argmax(axis=1)).all()
        return
    # IREE's lowering of aten.gelu(tanh) takes sqrt(2 / pi) with pi = 22/7 (0.797724 for 0.797885);
    # the fused kernel uses torch's constant. The int8 rounding of the two activations then differs
    # here and there, so each bundle is held to the float32 eager reference of the same weights,
    # and the fused one must be no further from it.
    eager = _eager_logits(preset, fmt, intermediate)
    err_fused = np.abs(a - eager).max(axis=1) / np.abs(eager).max(axis=1)
    err_plain = np.abs(b - eager).max(axis=1) / np.abs(eager).max(axis=1)
    # The worst step within the int8 bound, and over all steps about as close to eager: the two
    # bundles round different activations to int8, so each error is one draw of that rounding
    # (a fused kernel that computed the activation wrong would be off by several times).
    assert err_fused.max() < 3e-2 and err_fused.mean() <= 1.2 * err_plain.mean(), (err_fused, err_plain)
    assert (a.argmax(axis=1) == eager.argmax(axis=1)).mean() >= (b.argmax(axis=1) == eager.argmax(axis=1)).mean()


def _eager_logits(preset: str, fmt: str, intermediate: int | None) -> np.ndarray:
    from foldline.testing.parity import EagerRunner

    runner = EagerRunner(_blocked(preset, fmt, intermediate).module, 16)
    steps = [runner.prefill(list(range(3, 23)))]
    for token in range(40, 64):
        steps.append(runner.decode(token))
    return np.stack([np.asarray(s).reshape(-1) for s in steps])
