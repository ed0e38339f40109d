"""Bundles for hardware this machine is not: aarch64 CPUs and NVIDIA GPUs.

Both compile here; the tests read the compiled module itself (ELF machine,
executable format, PTX target) and check that the runtime refuses to run them
here with a clear error rather than crashing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from foldline.contract.manifest import seal_manifest
from foldline.contract.vmfb import vmfb_info
from foldline.runtime import BundleError, Model
from foldline.runtime.device import available_devices, host_arch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def aarch64_bundle(cli_bundle) -> Path:
    return cli_bundle("llama-tiny", "--target", "cpu", "--triple", "aarch64-unknown-linux-gnu",
                      "--cpu", "cortex-a76")


def test_aarch64_bundle_targets_aarch64(aarch64_bundle):
    manifest = json.loads((aarch64_bundle / "manifest.json").read_text())
    entry = manifest["modules"]["cpu"]
    assert entry["arch"] == "aarch64"
    assert entry["cpu_flags"] == ["asimd", "asimdhp", "asimddp"]  # what LLVM enables for the core: NEON, fp16, dotprod
    assert "--iree-llvmcpu-target-cpu=cortex-a76" in entry["flags"]
    info = vmfb_info(aarch64_bundle / entry["file"])
    assert info.formats == ["embedded-elf-arm_64"]
    assert info.elf_machines == ["aarch64"]  # e_machine 183 in every embedded executable
    assert entry["executable_formats"] == info.formats


def test_aarch64_bundle_is_refused_on_this_machine(aarch64_bundle):
    if host_arch() == "aarch64":
        pytest.skip("this machine is aarch64: the bundle is native here")
    with pytest.raises(BundleError, match=f"compiled for aarch64; this machine is {host_arch()}"):
        Model.load(aarch64_bundle, device="cpu")


def test_aarch64_vmfb_is_refused_even_when_the_manifest_claims_this_arch(aarch64_bundle, tmp_path):
    """The manifest can lie (hand edits, copied files); the embedded ELF machine cannot."""
    if host_arch() == "aarch64":
        pytest.skip("this machine is aarch64")
    import shutil

    bundle = tmp_path / "bundle"
    shutil.copytree(aarch64_bundle, bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["modules"]["cpu"]["arch"] = host_arch()
    (bundle / "manifest.json").write_text(json.dumps(seal_manifest(manifest)))
    with pytest.raises(BundleError, match=f"holds executables for aarch64; this machine is {host_arch()}"):
        Model.load(bundle, device="cpu")


def test_cuda_bundle_compiles_without_a_gpu(other_weights_bundle):
    manifest = json.loads((other_weights_bundle / "manifest.json").read_text())
    entry = manifest["modules"]["cuda"]
    assert entry["arch"] == "sm_80"
    assert entry["flags"] == ["--iree-hal-target-backends=cuda", "--iree-cuda-target=sm_80"]
    assert entry["params_sha256"] == manifest["params"]["sha256"] == manifest["modules"]["cpu"]["params_sha256"]
    vmfb = other_weights_bundle / entry["file"]
    assert vmfb.stat().st_size == entry["size"] > 20_000  # PTX for every dispatch, not an empty shell
    info = vmfb_info(vmfb)
    assert info.formats == ["cuda-nvptx-fb"]
    assert info.ptx_targets == ["sm_80"]
    assert info.elf_machines == []


def test_cuda_bundle_without_a_gpu_is_a_clear_error(other_weights_bundle):
    if available_devices("cuda"):
        pytest.skip("this machine has a CUDA device; tests/backends/run_cuda_checks.py runs the bundle")
    with pytest.raises(BundleError, match="device 'cuda' is not available here"):
        Model.load(other_weights_bundle, device="cuda")


def test_cuda_bundle_cpu_module_still_runs(other_weights_bundle):
    """A bundle with a module for a device that is absent still serves the devices that are here."""
    model = Model.load(other_weights_bundle, device="cpu")
    logits = model.session().prefill([1, 2, 3])
    assert logits.shape == (512,)
