"""A damaged or mismatched bundle fails at load with a BundleError that names the problem.

Each test copies a compiled llama-tiny bundle, breaks one thing, and loads it.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from foldline.backends.targets import X86_ISA_FLAGS
from foldline.contract.manifest import FORMAT_VERSION, seal_manifest, sha256_file
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


def _write_manifest(bundle: Path, data: dict, seal: bool = True) -> None:
    """Write an edited manifest, sealed again (seal=True) so the load reaches the check under test."""
    (bundle / "manifest.json").write_text(json.dumps(seal_manifest(data) if seal else data, indent=2))


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


def _set_context(data: dict, context: int) -> None:
    """max_context and every cache length changed together: a manifest the rules accept."""
    data["model"]["max_context"] = context
    for s in data["state"]:
        s["shape"][2] = context
        s["nbytes"] = s["nbytes"] // 128 * context
    data["state_bytes"] = sum(s["nbytes"] for s in data["state"])


@pytest.mark.parametrize("edit", [
    lambda d: d["state"][0]["shape"].__setitem__(2, 64),
    lambda d: d["model"].update(vocab_size=1024),
    lambda d: d["model"].update(max_context=256),
    lambda d: d.update(prefill_chunk=32),
    lambda d: _set_context(d, 64),
], ids=["state-shape", "vocab-size", "max-context", "chunk", "consistent-context"])
@pytest.mark.parametrize("verify", [True, False])
def test_edited_manifest_is_refused(bundle, edit, verify):
    """Any hand edit breaks the seal, checked at every load (even without hashing the files)."""
    data = _manifest(bundle)
    edit(data)
    _write_manifest(bundle, data, seal=False)
    with pytest.raises(BundleError, match="manifest.json was edited or corrupted after compile"):
        Model.load(bundle, device="cpu", verify=verify)


def test_resealed_manifest_with_other_state_shapes_is_refused_by_the_module_signature(bundle):
    """Consistent with itself and sealed, but not what the module was compiled for: refused before any call."""
    original = _manifest(bundle)
    data = copy.deepcopy(original)
    assert data["model"]["max_context"] == 128
    _set_context(data, 256)
    _write_manifest(bundle, data)
    Manifest.load(bundle)  # the manifest alone is valid
    with pytest.raises(BundleError, match=r"model.cpu.vmfb: prefill takes state buffer 'layer0.k' as "
                                          r"float32\[1, 2, 128, 16\]; the manifest says float32\[1, 2, 256, 16\]"):
        Model.load(bundle, device="cpu", verify=False)
    # a one-tile context: the manifest implies a fixed kv_tiles, the module reads a tile count
    data = copy.deepcopy(original)
    _set_context(data, 64)
    _write_manifest(bundle, data)
    with pytest.raises(BundleError, match=r"prefill takes kv_tiles as int8\[0, -1\]; the manifest says int8\[0, 1\]"):
        Model.load(bundle, device="cpu", verify=False)


def test_resealed_manifest_with_another_chunk_is_refused_by_the_module_signature(bundle):
    data = _manifest(bundle)
    data["prefill_chunk"] = 32
    _write_manifest(bundle, data)
    with pytest.raises(BundleError, match=r"prefill takes tokens as int64\[1, 16\]; the manifest says int64\[1, 32\]"):
        Model.load(bundle, device="cpu")


def test_resealed_schema_violation_is_named(bundle):
    data = _manifest(bundle)
    data["state"][1]["nbytes"] = 1
    _write_manifest(bundle, data)
    with pytest.raises(BundleError, match=r"state\[1\].nbytes: 1 is not prod\(\[1, 2, 128, 16\]\) \* 4"):
        Model.load(bundle, device="cpu")


def test_compiled_module_declares_its_entry_points(bundle):
    """The compiler puts the signature the runtime checks into the module."""
    import iree.runtime as rt

    from foldline.contract.entry_points import DYNAMIC, declared_inputs

    module = rt.VmModule.mmap(rt.VmInstance(), str(bundle / "model.cpu.vmfb"))
    declaration = module.lookup_function("decode").reflection["iree.abi.declaration"]
    assert declared_inputs(declaration) == ([([1, 1], "int64"), ([1], "int64"), ([0, DYNAMIC], "int8")]
                                            + [([1, 2, 128, 16], "float32")] * 6)


def test_older_format_version_says_recompile(bundle):
    data = _manifest(bundle)
    data["format_version"] = FORMAT_VERSION - 1
    data.pop("manifest_sha256")
    _write_manifest(bundle, data, seal=False)
    with pytest.raises(BundleError, match=f"has format version {FORMAT_VERSION - 1}, this runtime reads "
                                          f"{FORMAT_VERSION}: recompile with foldline compile"):
        Model.load(bundle, device="cpu")


def test_tampered_tokenizer_is_refused_on_verify(bundle):
    """Same size, one vocabulary entry changed: only its sha256 tells."""
    tokenizer = bundle / "tokenizer.json"
    tokenizer.write_text(json.dumps({"model": {"vocab": {"hello": 0, "world": 1}}}))
    data = _manifest(bundle)
    data.update(tokenizer="tokenizer.json", tokenizer_sha256=sha256_file(tokenizer),
                tokenizer_size=tokenizer.stat().st_size)
    _write_manifest(bundle, data)
    Model.load(bundle, device="cpu").close()
    tokenizer.write_text(tokenizer.read_text().replace("world", "wOrld"))
    with pytest.raises(BundleError, match="tokenizer.json does not match the manifest's sha256"):
        Model.load(bundle, device="cpu")
    Model.load(bundle, device="cpu", verify=False).close()  # hashing is what verify buys


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
