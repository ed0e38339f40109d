"""Vulkan for real (Mesa lavapipe here): parity with torch eager, multi-target bundles, device choice.

Skipped, with the reason, only where the IREE vulkan driver finds no device.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from foldline.runtime import BundleError, Model

pytestmark = pytest.mark.slow

PRESETS = ["llama-tiny", "ripple-tiny", "gemma3-tiny"]


@pytest.fixture(scope="module")
def multi_bundle(cli_bundle, vulkan_device) -> Path:
    """One bundle, two modules: cpu and vulkan (the target the local device needs)."""
    return cli_bundle("llama-tiny", "--target", "cpu", "--target", "vulkan")


@pytest.mark.parametrize("preset", PRESETS)
def test_vulkan_parity_with_eager(preset, bundle_factory, vulkan_device):
    """`foldline verify PRESET --target vulkan`: greedy tokens and scaled logit error.

    With the default pass pipeline (ring buffers included), against the eager
    reference without passes; the same bundle is compared with the CPU module below.
    """
    from foldline.frontend.sources import load_model
    from foldline.testing.parity import SCALED_TOL_FP32, run_parity

    bundle = bundle_factory(preset, "vulkan")
    model = Model.load(bundle, device="vulkan")
    assert model.ctx.name == "vulkan"
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.vocab_size, size=40).tolist()  # 3 prefill chunks, the last padded
    report = run_parity(load_model(preset).module, model, prompt, steps=24)
    assert report.steps == 25
    assert report.tokens_agree, report.summary()
    assert report.worst_scaled_error <= SCALED_TOL_FP32, report.summary()


@pytest.mark.parametrize("preset", ["ripple-tiny", "gemma3-tiny"])  # llama-tiny: the multi-target bundle
def test_vulkan_matches_cpu(preset, bundle_factory, vulkan_device):
    """With the default pass pipeline, the Vulkan module computes what the CPU module computes."""
    prompt = list(np.random.default_rng(1).integers(0, 512, size=40))
    logits = {}
    for device in ("cpu", "vulkan"):
        session = Model.load(bundle_factory(preset, device), device=device).session()
        steps = [session.prefill(prompt)]
        for _ in range(8):
            steps.append(session.decode(int(np.argmax(steps[-1]))))
        logits[device] = np.stack(steps)
    scale = np.abs(logits["cpu"]).max()
    np.testing.assert_allclose(logits["vulkan"], logits["cpu"], rtol=0, atol=1e-4 * scale)


def test_multi_target_bundle_shares_one_params_file(multi_bundle):
    """Every module (one per x86 level on x86-64 by default, and Vulkan) reads the one params file."""
    manifest = json.loads((multi_bundle / "manifest.json").read_text())
    modules = manifest["modules"]
    assert {entry.get("device", key) for key, entry in modules.items()} == {"cpu", "vulkan"}
    assert sorted(p.name for p in multi_bundle.glob("*.irpa")) == ["params.irpa"]
    for key, entry in modules.items():
        assert entry["params_sha256"] == manifest["params"]["sha256"]
        assert (multi_bundle / entry["file"]).stat().st_size == entry["size"]
        assert entry["file"] == f"model.{key}.vmfb"
        if entry.get("device", key) == "cpu":
            assert entry["executable_formats"][0].startswith("embedded-elf-")
    assert modules["vulkan"]["executable_formats"] == ["vulkan-spirv-fb"]


def test_runtime_picks_module_by_device_and_both_agree(multi_bundle):
    prompt = list(range(3, 23))
    results = {}
    for device in ("cpu", "vulkan"):
        model = Model.load(multi_bundle, device=device)
        assert model.ctx.name == device
        session = model.session()
        logits = [session.prefill(prompt)] + [session.decode(t) for t in (7, 11, 13)]
        results[device] = np.stack(logits)
    assert results["cpu"].shape == (4, 512)
    np.testing.assert_allclose(results["vulkan"], results["cpu"], rtol=0, atol=1e-3)


def test_bundle_without_the_device_module_says_so(multi_bundle):
    with pytest.raises(BundleError, match=r"no module for device 'cuda' \(it has: cpu, vulkan\)"):
        Model.load(multi_bundle, device="cuda")


def test_vulkan_state_stays_on_device_and_snapshot_restores(multi_bundle):
    model = Model.load(multi_bundle, device="vulkan")
    session = model.session()
    session.prefill([5, 6, 7, 8, 9])
    snap = session.snapshot()
    assert any(np.abs(b).sum() > 0 for b in snap.buffers)  # the module wrote the K/V into our buffers
    first = session.decode(42)
    session.decode(43)
    session.restore(snap)
    assert session.position == 5
    np.testing.assert_array_equal(session.decode(42), first)


def test_generate_cli_device_flag(multi_bundle, capsys):
    from foldline.tools.cli import main

    outputs = {}
    for device in ("cpu", "vulkan"):
        rc = main(["generate", str(multi_bundle), "--prompt-ids", "1,2,3,4", "--max-new-tokens", "6",
                   "--device", device])
        assert rc == 0
        outputs[device] = capsys.readouterr().out.strip().splitlines()[-1]
    assert len(outputs["cpu"].split(",")) == 6
    assert outputs["vulkan"] == outputs["cpu"]


def test_generate_cli_missing_device_is_one_clear_line(multi_bundle, capsys):
    from foldline.tools.cli import main

    rc = main(["generate", str(multi_bundle), "--prompt-ids", "1,2", "--device", "cuda"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "no module for device 'cuda'" in err
    assert "Traceback" not in err


def test_a_dropped_vulkan_model_releases_its_device(bundle_factory, vulkan_device):
    """The device goes with the model: on lavapipe an idle Vulkan device's semaphore waits poll a core
    each for as long as it lives, which a process-wide cached device would do for the process's life."""
    import gc
    import os
    import time

    def cpu_seconds() -> float:
        t = os.times()
        return t.user + t.system

    def idle_cpu(seconds: float = 1.5) -> float:
        start = cpu_seconds()
        time.sleep(seconds)
        return cpu_seconds() - start

    session = Model.load(bundle_factory("llama-tiny", "vulkan"), device="vulkan").session()
    session.prefill([1, 2, 3])
    session.decode(4)
    held = idle_cpu()
    del session
    gc.collect()
    released = idle_cpu()
    assert released < 0.3, f"{released:.2f} s of CPU in 1.5 s idle after the model was dropped ({held:.2f} s held)"
