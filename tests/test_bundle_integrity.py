"""A damaged or mismatched bundle fails at load with a BundleError that names the problem.

Each test copies a compiled llama-tiny bundle, breaks one thing, and loads it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from foldline.backends.targets import X86_ISA_FLAGS
from foldline.runtime import BundleError, Manifest, Model
from foldline.runtime.device import host_cpu_features

pytestmark = pytest.mark.slow


@pytest.fixture
def bundle(bundle_factory, tmp_path) -> Path:
    """A private copy of the session's llama-tiny cpu bundle, free to damage."""
    out = tmp_path / "bundle"
    shutil.copytree(bundle_factory("llama-tiny"), out)
    return out


def _manifest(bundle: Path) -> dict:
    return json.loads((bundle / "manifest.json").read_text())


def _write_manifest(bundle: Path, data: dict) -> None:
    (bundle / "manifest.json").write_text(json.dumps(data, indent=2))


def test_intact_copy_loads_and_runs(bundle):
    model = Model.load(bundle, device="cpu")
    assert model.session().prefill([1, 2, 3]).shape == (512,)


def test_missing_device_module(bundle):
    with pytest.raises(BundleError, match=r"no module for device 'vulkan' \(it has: cpu\); recompile with --target vulkan"):
        Model.load(bundle, device="vulkan")


def test_unknown_device(bundle):
    with pytest.raises(BundleError, match="unknown device 'tpu'"):
        Model.load(bundle, device="tpu")


@pytest.mark.parametrize("verify", [True, False])
def test_truncated_params(bundle, verify):
    """Caught by size even with verify=False: IREE mmaps the archive and would SIGBUS past its end."""
    irpa = bundle / "params.irpa"
    data = irpa.read_bytes()
    irpa.write_bytes(data[: len(data) // 2])
    with pytest.raises(BundleError, match=r"params.irpa is \d+ bytes, the manifest says \d+: truncated"):
        Model.load(bundle, device="cpu", verify=verify)


def test_params_from_another_build(bundle, other_weights_bundle):
    """Same shapes, same size, other weights: only the hash tells them apart."""
    shutil.copy(other_weights_bundle / "params.irpa", bundle / "params.irpa")
    assert (bundle / "params.irpa").stat().st_size == _manifest(bundle)["params"]["size"]
    with pytest.raises(BundleError, match="params.irpa does not match the manifest's sha256"):
        Model.load(bundle, device="cpu")


def test_module_compiled_against_other_params(bundle, other_weights_bundle):
    """The module entry (and file) of a build with other weights, dropped into this bundle."""
    other = _manifest(other_weights_bundle)["modules"]["cpu"]
    shutil.copy(other_weights_bundle / other["file"], bundle / other["file"])
    data = _manifest(bundle)
    data["modules"]["cpu"] = other
    _write_manifest(bundle, data)
    with pytest.raises(BundleError, match="was compiled against other parameters than params.irpa"):
        Model.load(bundle, device="cpu")


def test_corrupted_vmfb(bundle):
    vmfb = bundle / "model.cpu.vmfb"
    data = bytearray(vmfb.read_bytes())
    data[len(data) // 2] ^= 0xFF
    vmfb.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="model.cpu.vmfb does not match the manifest's sha256"):
        Model.load(bundle, device="cpu")


def test_cpu_features_this_machine_lacks(bundle):
    have = host_cpu_features()
    if have is None:
        pytest.skip("CPU features are only read on Linux x86")
    lacking = [f for f in X86_ISA_FLAGS if f not in have]
    if not lacking:
        pytest.skip("this CPU has every ISA flag foldline records")
    data = _manifest(bundle)
    data["modules"]["cpu"]["cpu_flags"] = [*data["modules"]["cpu"]["cpu_flags"], lacking[-1]]
    _write_manifest(bundle, data)
    with pytest.raises(BundleError, match=f"needs CPU features this machine lacks: {lacking[-1]}; recompile"):
        Model.load(bundle, device="cpu")


@pytest.mark.parametrize("name", ["model.cpu.vmfb", "params.irpa", "manifest.json"])
def test_missing_file(bundle, name):
    (bundle / name).unlink()
    with pytest.raises(BundleError, match=f"is missing {name}|has no {name}"):
        Model.load(bundle, device="cpu")


def test_missing_bundle_dir(tmp_path):
    with pytest.raises(BundleError, match="does not exist"):
        Model.load(tmp_path / "nowhere")


def test_corrupted_manifest_json(bundle):
    text = (bundle / "manifest.json").read_text()
    (bundle / "manifest.json").write_text(text[: len(text) // 3])
    with pytest.raises(BundleError, match="manifest.json is not valid JSON"):
        Model.load(bundle, device="cpu")


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("modules"), "lacks modules"),
    (lambda d: d["modules"]["cpu"].pop("sha256"), "module 'cpu' lacks sha256"),
    (lambda d: d.update(params={"file": "params.irpa"}), "'params' must name a file and its sha256"),
    (lambda d: d.update(format="something-else"), "is not a foldline bundle manifest"),
    (lambda d: d.update(format_version=99), "has format version 99"),
])
def test_manifest_with_wrong_structure(bundle, edit, message):
    data = _manifest(bundle)
    edit(data)
    _write_manifest(bundle, data)
    with pytest.raises(BundleError, match=message):
        Manifest.load(bundle)


def test_manifest_that_is_not_an_object(bundle):
    (bundle / "manifest.json").write_text("[1, 2, 3]")
    with pytest.raises(BundleError, match="not"):
        Model.load(bundle, device="cpu")


def test_cli_reports_a_damaged_bundle_in_one_line(bundle, capsys):
    from foldline.tools.cli import main

    (bundle / "params.irpa").write_bytes(b"")
    rc = main(["generate", str(bundle), "--prompt-ids", "1,2,3", "--max-new-tokens", "2"])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("foldline generate: error:") and "truncated" in err
    assert "Traceback" not in err
