"""Rotated checkpoints compiled through IREE CPU (fold and online) match the unrotated originals."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from foldline.frontend.arch import get_preset
from foldline.frontend.model import build_model
from foldline.frontend.types import LoadedModel
from foldline.runtime import Model
from foldline.testing.parity import SCALED_TOL_FP32, run_parity

MODES = ["fold", "online"]


@pytest.fixture(scope="session")
def hadamard_bundle(tmp_path_factory) -> Callable[..., Path]:
    """compile(key, make_loaded, mode, chunk) -> bundle dir; each (key, mode) compiled once per session."""
    from foldline.backends.build import BuildOptions, compile_model
    from foldline.backends.targets import make_target

    cache: dict[tuple, Path] = {}

    def compile_bundle(key: str, make_loaded: Callable[[], LoadedModel], mode: str, chunk: int = 16) -> Path:
        if (key, mode, chunk) not in cache:
            out = tmp_path_factory.mktemp(f"{key}-{mode}") / "bundle"
            # float32 activations: the claim is an exact rotation, within fp32 tolerance.
            options = BuildOptions(targets=[make_target("cpu")], chunk=chunk, hadamard=mode, activations="f32")
            compile_model(make_loaded(), out, options, progress=lambda _msg: None)
            cache[(key, mode, chunk)] = out
        return cache[(key, mode, chunk)]

    return compile_bundle


@pytest.fixture(scope="session")
def rotated_llama_gguf(tmp_path_factory) -> Path:
    from helpers.rotated_gguf import rotate_gguf, write_llama_gguf

    d = tmp_path_factory.mktemp("rotated-llama")
    plain = write_llama_gguf(build_model(get_preset("llama-tiny"), seed=0), d / "llama-tiny.gguf")
    rotate_gguf(plain, d / "llama-tiny-rotated.gguf", block_size=32, seed=21)
    return d / "llama-tiny-rotated.gguf"


def _pass_report(bundle: Path) -> dict:
    manifest = json.loads((bundle / "manifest.json").read_text())
    return next(p for p in manifest["passes"] if p["name"] == "fuse-hadamard")


def _check(reference, bundle_dir: Path, mode: str, prompt_len: int = 24, steps: int = 24) -> None:
    bundle = Model.load(bundle_dir)
    prompt = np.random.default_rng(5).integers(0, reference.cfg.vocab_size, size=prompt_len).tolist()
    report = run_parity(reference, bundle, prompt, steps)
    print(f"{mode}: {report.summary()}")
    assert report.tokens_agree, report.summary()
    assert report.worst_scaled_error < SCALED_TOL_FP32, report.summary()
    notes = " ".join(_pass_report(bundle_dir)["notes"])
    if mode == "fold":
        assert "left online 0" in notes and "folded 0" not in notes, notes
    else:
        assert "folded 0" in notes and "left online 0" not in notes, notes


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_rotated_llama_tiny_gguf_matches_unrotated(hadamard_bundle, rotated_llama_gguf, mode):
    from foldline.frontend.gguf_loader import load_gguf

    reference = build_model(get_preset("llama-tiny"), seed=0)
    bundle = hadamard_bundle("llama-tiny-rotated", lambda: load_gguf(rotated_llama_gguf), mode)
    _check(reference, bundle, mode, prompt_len=40, steps=40)


def _qwen_pair():
    from helpers.rotated_gguf import rotated_model

    cfg = get_preset("qwen35-tiny").replace(gdn_num_v_heads=6, gdn_kv_mapping="interleaved")
    reference = build_model(cfg, seed=3)
    rotated, _ = rotated_model(reference, block_size=32, seed=7)
    return reference, rotated


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_rotated_qwen35_tiny_matches_unrotated(hadamard_bundle, mode):
    """GDN ssm_out with the tiled->grouped permutation, attention o_proj without, untied head."""
    reference, rotated = _qwen_pair()
    bundle = hadamard_bundle(
        "qwen35-tiny-rotated", lambda: LoadedModel(rotated.cfg, rotated, source="rotated qwen35-tiny"), mode
    )
    _check(reference, bundle, mode)


@pytest.fixture(scope="session")
def smollm2_pair(tmp_path_factory):
    """(unrotated SmolLM2-135M path, rotated copy path): rotated once per session (it takes minutes)."""
    from foldline.frontend.shipped import ShippedModelError, locate_shipped

    from helpers.rotated_gguf import rotate_gguf

    try:
        plain = locate_shipped("smollm2-135m")
    except ShippedModelError as e:
        pytest.skip(str(e))
    rotated = tmp_path_factory.mktemp("smollm2-rotated") / "smollm2-135m-rotated.gguf"
    rotate_gguf(plain, rotated, seed=0)
    return plain, rotated


@pytest.mark.slow
@pytest.mark.realmodel
@pytest.mark.parametrize("mode", MODES)
def test_rotated_smollm2_matches_unrotated(hadamard_bundle, smollm2_pair, mode):
    from foldline.frontend.gguf_loader import load_gguf

    plain, rotated = smollm2_pair
    reference = load_gguf(plain, max_context=64).module
    bundle = hadamard_bundle("smollm2-rotated", lambda: load_gguf(rotated, max_context=64), mode)
    _check(reference, bundle, mode, prompt_len=20, steps=12)
