"""One bundle for every x86 host: a CPU module per ISA level, the runtime loads the best one the CPU runs.

The selection rules run on manifests alone (no compile). One quantized
llama-tiny (q4 codes, MLP width 128 so every product takes an int8 kernel) is
compiled once with `--cpu x86-64-v2,x86-64-v3,cascadelake`; the runtime, with its CPU
features forced, must load the float module, the AVX2 one, the AVX-512 VNNI one, or refuse
with the missing features named; the two int8 modules must give the float32 eager
model's logits within the int8 bound (tests/kernels/test_avx2_kernels.py) and each
other's, the float one (no FMA, no F16C) within float32 rounding, and a host that
loads it is told once, in one line, which CPU flags it lacks.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from foldline.backends.iree.compile_pool import PEAK_BYTES, pool_size
from foldline.backends.targets import CPU_SETS, TargetError, cpu_names
from foldline.errors import InputError
from foldline.kernels.isa import FLOAT
from foldline.kernels.select import ISAS
from foldline.kernels.x86 import AVX2, AVX512_VNNI
from foldline.runtime import BundleError, Manifest, Model
from foldline.runtime import device as runtime_device
from foldline.runtime.cpu_select import KERNEL_RANK, fallback_notice, select_cpu_module
from foldline.runtime.device import CPU_FEATURES_ENV, cpu_features, host_cpu_features

from contract.test_manifest import CASCADELAKE, X86_V2, X86_V3, multi_isa_manifest
from kernels.test_avx2_kernels import SCALED_TOL_INT8
from kernels.test_fusion import _blocked, _eager_logits

HOST = host_cpu_features() or set()


def _manifest(cpus: list[str] | None = None) -> Manifest:
    return Manifest.from_json(multi_isa_manifest(cpus), Path("bundle"))


# ---- the choice, on manifests ---------------------------------------------------------------------

@pytest.mark.parametrize("have, expected", [
    (set(CASCADELAKE) | {"avx512_bf16"}, "cpu-cascadelake"),  # Zen 4, Cascade Lake and later Xeons
    (set(X86_V3) | {"avx_vnni"}, "cpu-x86-64-v3"),  # Zen 3, Haswell: AVX2, no AVX-512
    (set(CASCADELAKE) - {"avx512_vnni"}, "cpu-x86-64-v3"),  # Skylake-SP: AVX-512 without VNNI
    (set(X86_V2), "cpu-x86-64-v2"),  # no AVX
    (None, "cpu-x86-64-v2"),  # features unknown: the most portable module
])
def test_the_best_module_the_cpu_runs_is_chosen(have, expected):
    assert select_cpu_module(_manifest(), have, "x86_64") == expected
    # whatever order the manifest lists them in
    reordered = _manifest(["cascadelake", "x86-64-v3", "x86-64-v2"])
    assert select_cpu_module(reordered, have, "x86_64") == expected


def test_no_module_that_fits_is_refused_naming_what_is_missing():
    with pytest.raises(BundleError, match=r"none of the 2 CPU modules of bundle bundle runs on this CPU \(x86_64\): "
                                          r"model.cpu-x86-64-v3.vmfb needs avx2; model.cpu-cascadelake.vmfb needs "
                                          r"avx2, avx512_vnni; recompile with --cpu host"):
        select_cpu_module(_manifest(["x86-64-v3", "cascadelake"]), set(CASCADELAKE) - {"avx2", "avx512_vnni"},
                          "x86_64")
    with pytest.raises(BundleError, match="model.cpu-x86-64-v2.vmfb is for x86_64"):
        select_cpu_module(_manifest(), set(CASCADELAKE), "aarch64")


def test_a_pinned_cpu_loads_its_module_or_names_the_ones_there():
    assert select_cpu_module(_manifest(), set(CASCADELAKE), "x86_64", cpu="x86-64-v2") == "cpu-x86-64-v2"
    with pytest.raises(BundleError, match=r"no CPU module for --cpu znver4 \(it has: x86-64-v2, x86-64-v3, cascadelake\)"):
        select_cpu_module(_manifest(), set(CASCADELAKE), "x86_64", cpu="znver4")


def test_a_single_module_bundle_keeps_its_layout():
    """Bundles keyed by device alone (every bundle before multi-ISA ones) still name their one module."""
    data = multi_isa_manifest(["x86-64-v3"])
    entry = data["modules"].pop("cpu-x86-64-v3")
    for key in ("device", "cpu", "kernel_isa"):
        entry.pop(key)
    data["modules"]["cpu"] = entry
    manifest = Manifest.from_json(data, Path("bundle"))
    assert manifest.devices() == ["cpu"]
    assert select_cpu_module(manifest, set(X86_V2), "x86_64") == "cpu"  # refused later, on load, as before


def test_every_kernel_isa_the_compiler_records_is_ranked():
    assert set(KERNEL_RANK) == {FLOAT, *ISAS}
    assert KERNEL_RANK.index(AVX512_VNNI.name) > KERNEL_RANK.index(AVX2.name) > KERNEL_RANK.index(FLOAT)


def test_forced_features_come_from_the_argument_or_the_environment(monkeypatch):
    monkeypatch.setattr(runtime_device, "host_cpu_features", lambda: set(CASCADELAKE))
    monkeypatch.delenv(CPU_FEATURES_ENV, raising=False)
    assert cpu_features() == set(CASCADELAKE)
    monkeypatch.setenv(CPU_FEATURES_ENV, "sse4_2, avx2 fma")
    assert cpu_features() == {"sse4_2", "avx2", "fma"}
    assert cpu_features(["avx2"]) == {"avx2"}  # the argument wins over the environment
    with pytest.raises(InputError, match=r"\$FOLDLINE_CPU_FEATURES names amx_tile, which this CPU lacks"):
        monkeypatch.setenv(CPU_FEATURES_ENV, "avx2,amx_tile")
        cpu_features()
    monkeypatch.setattr(runtime_device, "host_cpu_features", lambda: None)
    assert cpu_features("avx2") == {"avx2"}  # nothing to check against where the CPU cannot be read


# ---- the compile side, without compiling --------------------------------------------------------

def test_cpu_lists_and_named_sets():
    assert cpu_names("host") == ["host"]
    assert cpu_names("x86-64-v3, znver4") == ["x86-64-v3", "znver4"]
    assert cpu_names("x86-all") == list(CPU_SETS["x86-all"]) == ["x86-64-v2", "x86-64-v3", "cascadelake"]
    with pytest.raises(TargetError, match="names x86-64-v3 more than once"):
        cpu_names("x86-all,x86-64-v3")
    with pytest.raises(TargetError, match="x86-all is a set of x86-64 CPUs; this target is aarch64"):
        cpu_names("x86-all", "aarch64-unknown-linux-gnu")
    with pytest.raises(TargetError, match="names no CPU"):
        cpu_names(",")


def test_the_default_cpu_is_every_x86_level_on_x86(monkeypatch):
    """`foldline compile` without --cpu: one module per x86 ISA level on x86-64, so the bundle runs at
    its best kernels on any x86 host; host on other machines; a cross compile names its CPU."""
    from foldline.backends import targets
    from foldline.tools.cli import build_parser
    from foldline.tools.compile_cmd import run

    monkeypatch.setattr(targets, "host_arch", lambda: "x86_64")
    assert targets.default_cpu() == "x86-all"
    assert targets.default_cpu("aarch64-unknown-linux-gnu") == "host"
    monkeypatch.setattr(targets, "host_arch", lambda: "aarch64")
    assert targets.default_cpu() == "host"
    assert build_parser().parse_args(["compile", "llama-tiny", "-o", "b"]).cpu is None  # resolved in run()
    assert run is not None


def test_concurrent_compiles_are_bounded_by_cores_and_memory():
    assert pool_size(3, cores=2, memory=20 * PEAK_BYTES).workers == 2
    assert pool_size(3, cores=16, memory=int(2.5 * PEAK_BYTES)).workers == 2
    assert pool_size(3, cores=16, memory=PEAK_BYTES // 2).workers == 1
    assert pool_size(1, cores=16, memory=20 * PEAK_BYTES).workers == 1
    assert pool_size(3, cores=2, memory=20 * PEAK_BYTES).describe(3) == "2 at a time (2 cores, memory for 20)"


# ---- one compiled bundle ------------------------------------------------------------------------

CPUS = "x86-64-v3,cascadelake"  # the int8 modules
FLOAT_CPU = "x86-64-v2"  # the float module: no AVX, FMA or F16C
FALLBACK_LINE = ("foldline: this CPU lacks avx, avx2, fma, f16c, bmi2: loaded the x86-64-v2 module "
                 "(float kernels, slower)")
needs_avx2 = pytest.mark.skipif(not AVX2.available(HOST), reason="this CPU has no AVX2")
needs_vnni = pytest.mark.skipif(not AVX512_VNNI.available(HOST), reason="this CPU has no AVX-512 VNNI")


@pytest.fixture(scope="module")
def multi_isa_bundle(tmp_path_factory):
    from foldline.backends.build import BuildOptions, compile_model
    from foldline.backends.targets import make_targets

    out = tmp_path_factory.mktemp("multi-isa") / "bundle"
    compile_model(_blocked("llama-tiny", "q4", 128), out,
                  BuildOptions(targets=make_targets("cpu", cpu=f"{FLOAT_CPU},{CPUS}"), weights="auto"),
                  progress=lambda _m: None)
    return out


@pytest.fixture(scope="module")
def eager():
    return _eager_logits("llama-tiny", "q4", 128)


def _run(bundle, **load) -> tuple[str, np.ndarray]:
    """(the module loaded, its logits of test_decode_fusion's prompt and decode steps)."""
    with Model.load(bundle, **load) as model:
        session = model.session()
        steps = [session.prefill(list(range(3, 23)))]
        for token in range(40, 64):
            steps.append(session.decode(token))
        return model.module_key, np.stack(steps)


@pytest.mark.slow
def test_each_cpu_gets_its_module_and_the_weights_are_shared(multi_isa_bundle):
    manifest = json.loads((multi_isa_bundle / "manifest.json").read_text())
    modules = manifest["modules"]
    assert list(modules) == ["cpu-x86-64-v2", "cpu-x86-64-v3", "cpu-cascadelake"]
    assert modules["cpu-x86-64-v2"]["kernel_isa"] == {"decode": FLOAT, "prefill": FLOAT}
    assert modules["cpu-x86-64-v3"]["kernel_isa"] == {"decode": "int8-avx2", "prefill": "int8-avx2"}
    assert modules["cpu-cascadelake"]["kernel_isa"] == {"decode": "int8-avx512vnni", "prefill": "int8-avx512vnni"}
    assert sorted(p.name for p in multi_isa_bundle.iterdir()) == [
        "manifest.json", "model.cpu-cascadelake.vmfb", "model.cpu-x86-64-v2.vmfb", "model.cpu-x86-64-v3.vmfb",
        "params.irpa"]
    assert {m["params_sha256"] for m in modules.values()} == {manifest["params"]["sha256"]}
    from foldline.contract.vmfb import vmfb_info

    v3 = vmfb_info(multi_isa_bundle / "model.cpu-x86-64-v3.vmfb").cpu_flags
    vnni = vmfb_info(multi_isa_bundle / "model.cpu-cascadelake.vmfb").cpu_flags
    assert "avx2" in v3 and not any(f.startswith("avx512") for f in v3), v3
    assert set(vnni) == set(CASCADELAKE), vnni


@pytest.mark.slow
@needs_avx2
def test_forced_features_pick_the_module(multi_isa_bundle, monkeypatch):
    avx2_host = [f for f in X86_V3 if f in HOST]
    assert Model.load(multi_isa_bundle, cpu_features=avx2_host).module_key == "cpu-x86-64-v3"
    monkeypatch.setenv(CPU_FEATURES_ENV, ",".join(avx2_host))
    assert Model.load(multi_isa_bundle).module_key == "cpu-x86-64-v3"
    with pytest.raises(BundleError, match=r"model.cpu-x86-64-v2.vmfb needs sse4_2; "
                                          r"model.cpu-x86-64-v3.vmfb needs sse4_2, avx, avx2, fma, f16c, bmi2; .*"
                                          rf"\(CPU features from \${CPU_FEATURES_ENV}=sse4_1\)"):
        monkeypatch.setenv(CPU_FEATURES_ENV, "sse4_1")
        Model.load(multi_isa_bundle)
    monkeypatch.delenv(CPU_FEATURES_ENV)
    with pytest.raises(BundleError, match=r"the cpu module needs CPU features this machine lacks: avx512_vnni"):
        Model.load(multi_isa_bundle, cpu="cascadelake", cpu_features=avx2_host)  # a pinned module is checked too


@pytest.mark.slow
@needs_vnni
def test_a_vnni_cpu_loads_the_vnni_module_unless_pinned(multi_isa_bundle):
    assert Model.load(multi_isa_bundle).module_key == "cpu-cascadelake"
    assert Model.load(multi_isa_bundle, cpu_features=CASCADELAKE).module_key == "cpu-cascadelake"
    assert Model.load(multi_isa_bundle, cpu="x86-64-v3").module_key == "cpu-x86-64-v3"


@pytest.mark.slow
@needs_vnni
def test_both_modules_match_eager_and_each_other(multi_isa_bundle, eager):
    results = {}
    for cpu in CPUS.split(","):
        key, got = _run(multi_isa_bundle, cpu=cpu)
        assert key == f"cpu-{cpu}"
        scaled = np.abs(got - eager).max(axis=1) / np.abs(eager).max(axis=1)
        assert scaled.max() < SCALED_TOL_INT8, f"{cpu}: worst scaled difference {scaled.max():.2e}"
        assert (got.argmax(axis=1) == eager.argmax(axis=1)).all(), f"{cpu}: top-1 token differs from eager"
        results[cpu] = got
    a, b = results.values()
    assert not np.array_equal(a, b)  # two kernels, not one module loaded twice
    assert (np.abs(a - b).max(axis=1) / np.abs(eager).max(axis=1)).max() < SCALED_TOL_INT8


def test_a_host_that_loads_the_float_module_is_told_which_flags_it_lacks():
    """Named after the nearest module it cannot run; nothing where it runs the best one, or nothing better
    is there, or its features are unknown."""
    manifest = _manifest()
    assert fallback_notice(manifest, "cpu-x86-64-v2", set(X86_V2), "x86_64") == FALLBACK_LINE
    assert fallback_notice(manifest, "cpu-x86-64-v2", set(X86_V2) | {"avx", "avx2"}, "x86_64") == (
        "foldline: this CPU lacks fma, f16c, bmi2: loaded the x86-64-v2 module (float kernels, slower)")
    assert fallback_notice(manifest, "cpu-x86-64-v3", set(X86_V3), "x86_64") is None  # int8 kernels: no notice
    assert fallback_notice(manifest, "cpu-x86-64-v2", None, "x86_64") is None
    assert fallback_notice(_manifest(["x86-64-v2"]), "cpu-x86-64-v2", set(X86_V2), "x86_64") is None


@pytest.mark.slow
def test_the_float_module_matches_eager_and_its_host_is_told_once(multi_isa_bundle, eager, monkeypatch, caplog):
    """x86-64-v2's kernels spell out FMA and the f16 conversion (kernels/mlir.FloatIsa): within float32
    rounding of eager. The Python API logs the line once and keeps it on the model; the CLI prints it
    once on stderr."""
    from foldline.testing.parity import SCALED_TOL_FP32

    monkeypatch.setenv(CPU_FEATURES_ENV, ",".join(X86_V2))
    monkeypatch.setattr(runtime_device, "_notices_given", set())
    with caplog.at_level(logging.WARNING, logger="foldline"):
        key, got = _run(multi_isa_bundle)
        with Model.load(multi_isa_bundle) as model:
            assert model.cpu_fallback == FALLBACK_LINE
    assert key == "cpu-x86-64-v2"
    assert [r.getMessage() for r in caplog.records if r.name == "foldline"] == [FALLBACK_LINE]
    scaled = np.abs(got - eager).max(axis=1) / np.abs(eager).max(axis=1)
    assert scaled.max() <= SCALED_TOL_FP32, f"worst scaled difference {scaled.max():.2e}"
    assert (got.argmax(axis=1) == eager.argmax(axis=1)).all()
    with Model.load(multi_isa_bundle, cpu=FLOAT_CPU, cpu_features=HOST) as pinned:
        assert pinned.cpu_fallback is None  # asked for: no notice
    out = subprocess.run([sys.executable, "-m", "foldline.tools.cli", "generate", str(multi_isa_bundle),
                          "--prompt-ids", "3,4,5", "--max-new-tokens", "2"], capture_output=True, text=True,
                         env={**os.environ, CPU_FEATURES_ENV: ",".join(X86_V2)})
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines().count(FALLBACK_LINE) == 1, out.stderr
