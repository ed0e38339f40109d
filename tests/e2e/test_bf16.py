"""bf16 (and f16) checkpoints end to end: the shared dtype table, the compute dtype option,
bf16 state buffers in the runtime, and bf16 `save_pretrained` checkpoints compiled and
compared with HF eager.

Most real checkpoints are stored in bf16. `--dtype auto` computes in float32 on the bf16
weights (widened exactly), so a compiled bundle must agree with HF eager run in float32
on those same weights to fp32 tolerance, and with HF eager in bf16 (what the checkpoint's
authors run) to bf16 tolerance.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from foldline import dtypes
from foldline.errors import FoldlineError
from foldline.testing.parity import SCALED_TOL_FP32, EagerRunner

transformers = pytest.importorskip("transformers")

from e2e.test_hf_parity import CHUNK, DECODE_STEPS, _prompt, _scaled, hf_reference, make_hf_dir  # noqa: E402

MAX_CONTEXT = 64

# HF eager in bf16 rounds every activation to 8 significant bits (unit roundoff 2^-9 = 2e-3)
# and re-rounds at each of the few layers of these models, while the bundle keeps float32
# activations: against the sum of the logit's term magnitudes the difference is a small
# multiple of 2^-9. 4e-2 leaves room above what the three families here give for
# another BLAS's summation order without letting a wrong weight or a wrong cast (errors of
# order 1) through.
SCALED_TOL_BF16 = 4e-2
# bf16 K/V caches against our eager module with the same caches: both round float32 K/V to bf16,
# but where the two float32 values (equal to ~1e-7) straddle a rounding boundary the cached
# element differs by one bf16 ulp (2^-8 relative). A few such elements per step keep the scaled
# error well under one ulp.
SCALED_TOL_BF16_CACHE = 2e-3


# ---- the table ---------------------------------------------------------------------------------


def test_dtype_table_agrees_with_torch_numpy_and_iree():
    """Every layer reads one table: its sizes and spellings must be the libraries' own."""
    import iree.runtime as rt

    from foldline.frontend.types import MLIR_ELEMENTS, TORCH_DTYPES

    for d in dtypes.DTYPES.values():
        tdt = getattr(torch, d.name)
        assert torch.empty((), dtype=tdt).element_size() == d.nbytes == d.numpy.itemsize, d.name
        assert rt.array_interop.map_dtype_to_element_type(d.numpy) == getattr(rt.HalElementType, d.hal), d.name
        assert MLIR_ELEMENTS[tdt] == d.mlir
    assert set(TORCH_DTYPES) == set(dtypes.FLOAT_DTYPES) == {"float32", "float16", "bfloat16"}
    assert dtypes.numpy_dtype("bfloat16").name == "bfloat16"  # ml_dtypes, not a uint16 stand-in
    assert dtypes.canonical("BF16") == "bfloat16" and dtypes.canonical("fp32") == "float32"
    with pytest.raises(dtypes.DTypeError, match="unknown floating dtype 'f8'"):
        dtypes.canonical("f8")
    with pytest.raises(FoldlineError, match="unknown dtype 'complex64'"):
        dtypes.get("complex64")


def test_bf16_host_values_are_torch_bf16_bits():
    """A bf16 buffer on the host holds torch's bf16 bit patterns (uploads and snapshots stay exact)."""
    t = torch.randn(64).to(torch.bfloat16)
    host = t.view(torch.int16).numpy().view(dtypes.numpy_dtype("bfloat16"))
    np.testing.assert_array_equal(host.astype(np.float32), t.float().numpy())


# ---- runtime buffers ---------------------------------------------------------------------------


def test_device_bf16_buffers_round_trip():
    """Zero-fill, upload and download of bf16 state buffers on the CPU device, bit for bit."""
    import iree.runtime as rt

    from foldline.runtime.device import DeviceContext

    config = rt.Config("local-sync")
    ctx = DeviceContext("cpu", config, config.device, module=None)
    bf16 = dtypes.numpy_dtype("bfloat16")
    zeros = ctx.to_host(ctx.zeros((2, 3, 5), bf16))
    assert zeros.dtype == bf16 and zeros.shape == (2, 3, 5) and not zeros.astype(np.float32).any()
    values = np.random.default_rng(0).standard_normal((4, 7)).astype(bf16)
    back = ctx.to_host(ctx.upload(values))
    assert back.dtype == bf16
    np.testing.assert_array_equal(back.view(np.uint16), values.view(np.uint16))
    refilled = ctx.to_host(ctx.fill_zero(ctx.upload(values)))
    assert not refilled.astype(np.float32).any()


# ---- compile options ---------------------------------------------------------------------------


def test_bf16_checkpoint_defaults_to_float32_compute(tmp_path):
    """`--dtype auto` on a bf16 checkpoint: float32 compute and caches; explicit choices pass through."""
    from foldline.backends.options import BuildOptions
    from foldline.backends.policy import resolve_dtypes
    from foldline.frontend.hf_loader import load_hf_dir

    path, _ = make_hf_dir("llama", tmp_path, dtype=torch.bfloat16)
    loaded = load_hf_dir(path, max_context=MAX_CONTEXT)
    assert loaded.config.dtype == "bfloat16"
    assert resolve_dtypes(loaded, BuildOptions()) == ("float32", "float32")
    assert resolve_dtypes(loaded, BuildOptions(kv_dtype="bfloat16")) == ("float32", "bfloat16")
    assert resolve_dtypes(loaded, BuildOptions(dtype="float16")) == ("float16", "float16")
    f16_path, _ = make_hf_dir("llama", tmp_path, dtype=torch.float16)
    f16 = load_hf_dir(f16_path, max_context=MAX_CONTEXT)
    assert f16.config.dtype == "float16"
    assert resolve_dtypes(f16, BuildOptions()) == ("float32", "float32")


def test_plan_counts_what_compile_builds_for_a_bf16_checkpoint(tmp_path, capsys):
    """`foldline plan` on a bf16 checkpoint plans float32 caches, as `compile --dtype auto` builds."""
    import re

    from foldline.tools.cli import main

    path, _ = make_hf_dir("llama", tmp_path, dtype=torch.bfloat16)

    def total(*argv: str) -> int:
        assert main(["plan", str(path), "--summary", "--context", "64", *argv]) == 0
        return int(re.search(r"total: .*?\(([\d,]+) bytes\)", capsys.readouterr().out).group(1).replace(",", ""))

    # 3 layers x K and V x 2 kv heads x 64 positions x head_dim 16
    assert total() == 3 * 2 * 2 * 64 * 16 * 4
    assert total("--kv-dtype", "bf16") == total("--dtype", "bf16") == 3 * 2 * 2 * 64 * 16 * 2


def test_reconfigured_dtype_casts_and_restores_the_weights(tmp_path):
    """A narrowing compute dtype for one build leaves the loaded model exactly as it was."""
    from foldline.frontend.sources import load_model

    loaded = load_model("llama-tiny", max_context=MAX_CONTEXT)
    before = {n: p.detach().clone() for n, p in loaded.module.named_parameters()}
    with loaded.reconfigured(dtype="float16") as cfg:
        assert cfg.dtype == "float16" and loaded.module.cfg is cfg
        assert {p.dtype for p in loaded.module.parameters()} == {torch.float16}
    assert loaded.config.dtype == "float32"
    for name, p in loaded.module.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, before[name]), name


def test_bf16_compute_on_cpu_is_refused_with_the_reason(tmp_path, capsys):
    """IREE's llvm-cpu cannot compile bf16 arithmetic: refuse before exporting, and say what to use."""
    from foldline.tools.cli import main

    path, _ = make_hf_dir("llama", tmp_path, dtype=torch.bfloat16)
    assert main(["compile", str(path), "-o", str(tmp_path / "b"), "--dtype", "bf16"]) == 2
    err = capsys.readouterr().err
    assert "llvm-cpu" in err and "--dtype f32" in err
    assert not (tmp_path / "b" / "manifest.json").exists()


# ---- compiled bf16 checkpoints vs HF eager -----------------------------------------------------

# family -> K/V cache dtype of its bundle: gemma3 keeps bf16 caches (ring and global), so the
# runtime's bf16 state buffers are exercised; the others take the default (float32).
KV_DTYPE = {"llama": "auto", "qwen35": "auto", "gemma3": "bfloat16"}


@pytest.fixture(scope="session")
def bf16_bundles(tmp_path_factory) -> dict[str, tuple[Path, Path, torch.nn.Module]]:
    """family -> (bf16 HF dir, bundle, HF model in bf16), each compiled once: tiny configs, one
    prefill chunk length, no attention-length variants."""
    from foldline.backends.build import BuildOptions, compile_model
    from foldline.frontend.hf_loader import load_hf_dir

    out = {}
    root = tmp_path_factory.mktemp("bf16")
    for family, kv_dtype in KV_DTYPE.items():
        path, hf = make_hf_dir(family, root, dtype=torch.bfloat16)
        bundle = root / f"bundle-{family}"
        options = BuildOptions(chunk=CHUNK, kv_dtype=kv_dtype)
        compile_model(load_hf_dir(path, max_context=MAX_CONTEXT), bundle, options, progress=lambda _m: None)
        out[family] = (path, bundle, hf)
    return out


def _compiled_logits(bundle: Path, prompt: list[int], tokens: list[int]) -> list[np.ndarray]:
    from foldline.runtime import Model

    with Model.load(bundle) as model, model.session() as session:
        logits = [session.prefill(prompt)]
        logits += [session.decode(t) for t in tokens]
    return logits


@pytest.mark.slow
@pytest.mark.parametrize("family", list(KV_DTYPE))
def test_bf16_checkpoint_compiled_matches_hf(bf16_bundles, family):
    """The bundle vs HF eager on the same bf16 weights: in float32 to fp32 tolerance (float32
    caches), and in bf16 (the checkpoint's own dtype) to bf16 tolerance."""
    from foldline.frontend.hf_loader import load_hf_dir
    from foldline.runtime import Manifest

    path, bundle, hf_bf16 = bf16_bundles[family]
    manifest = Manifest.load(bundle)
    assert manifest.config["dtype"] == "float32"
    kv = {s.dtype for s in manifest.state if s.kind.endswith("_kv")}
    assert kv == {"float32" if KV_DTYPE[family] == "auto" else KV_DTYPE[family]}

    prompt = _prompt(manifest.vocab_size)
    hf_f32 = type(hf_bf16)(hf_bf16.config).eval()
    hf_f32.load_state_dict({k: v.float() for k, v in hf_bf16.state_dict().items()})
    ref32, tokens = hf_reference(hf_f32, prompt, DECODE_STEPS)
    ref16, _ = hf_reference(hf_bf16, prompt, 0)
    compiled = _compiled_logits(bundle, prompt, tokens)

    loaded = load_hf_dir(path, max_context=MAX_CONTEXT)
    cache = None if KV_DTYPE[family] == "auto" else KV_DTYPE[family]
    with loaded.reconfigured(dtype="float32", kv_dtype=cache):
        runner = EagerRunner(loaded.module, CHUNK)  # our eager reference: the same dtypes as the bundle
        eager = [runner.prefill(prompt)]
        scales = [runner.term_scale()]
        for t in tokens:
            eager.append(runner.decode(t))
            scales.append(runner.term_scale())

    vs_eager = max(_scaled(c, e, s) for c, e, s in zip(compiled, eager, scales))
    vs_hf_bf16 = _scaled(compiled[0], ref16[0], scales[0])
    print(f"{family} bf16 checkpoint: compiled vs eager {vs_eager:.2e}, vs HF bf16 {vs_hf_bf16:.2e}")
    assert vs_eager < (SCALED_TOL_FP32 if cache is None else SCALED_TOL_BF16_CACHE)
    assert vs_hf_bf16 < SCALED_TOL_BF16
    if cache is None:  # float32 caches: HF float32 eager is the same computation
        vs_hf = max(_scaled(c, r, s) for c, r, s in zip(compiled, ref32, scales))
        assert vs_hf < SCALED_TOL_FP32, vs_hf
        assert [int(np.argmax(x)) for x in compiled[:-1]] == tokens
    assert np.ptp(ref32[0]) > 0.5  # the comparison is not trivially satisfied


@pytest.mark.slow
def test_bf16_cache_session_snapshot_restore(bf16_bundles):
    """A session with bf16 K/V caches: allocation, snapshot and restore give identical steps.

    Before the runtime knew bfloat16, `model.session()` on such a bundle raised KeyError."""
    from foldline.runtime import Model

    _, bundle, _ = bf16_bundles["gemma3"]
    bf16 = dtypes.numpy_dtype("bfloat16")
    with Model.load(bundle) as model, model.session() as session:
        assert {b.dtype for b in session.buffers} == {bf16}
        assert session.allocated_bytes == model.manifest.state_bytes
        session.prefill(list(range(1, 21)))
        snap = session.snapshot()
        assert all(b.dtype == bf16 for b in snap.buffers) and any(b.astype(np.float32).any() for b in snap.buffers)
        first = [session.decode(t) for t in (5, 6, 7)]
        session.restore(snap)
        again = session.snapshot()
        for a, b in zip(snap.buffers, again.buffers):
            np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
        second = [session.decode(t) for t in (5, 6, 7)]
        for a, b in zip(first, second):
            assert a.dtype == np.float32  # logits reach the user as float32
            np.testing.assert_array_equal(a, b)
        wrong = [b.astype(np.float32) for b in snap.buffers]
        with pytest.raises(FoldlineError, match="snapshot buffer"):
            session.restore(type(snap)(snap.position, wrong, snap.tokens))
