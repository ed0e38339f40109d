"""Target presets: flags, recorded arch, and the clear refusals; the IREE release the compiler is built
against; what importing the compiler loads (no model compile here)."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from foldline.backends.targets import (
    IREE_VERSION,
    X86_ISA_FLAGS,
    TargetError,
    cpu_target,
    cuda_target,
    llvm_cpu_features,
    make_target,
    vulkan_target,
    vulkan_target_for_device,
)
from foldline.contract.errors import BundleError
from foldline.contract.isa import isa_flags
from foldline.contract.manifest import ModuleEntry
from foldline.runtime.device import (
    check_host_compatible,
    host_arch,
    host_cpu_features,
    normalize_arch,
)

TINY_MLIR = """
func.func @add(%a: tensor<4xf32>, %b: tensor<4xf32>) -> tensor<4xf32> {
  %0 = arith.addf %a, %b : tensor<4xf32>
  return %0 : tensor<4xf32>
}
"""


def test_cpu_host_records_arch_and_isa_flags():
    t = cpu_target("host")
    assert t.device == "cpu"
    assert "--iree-llvmcpu-target-cpu=host" in t.flags
    assert t.arch == host_arch()
    have = host_cpu_features()
    if have is not None:
        assert set(t.cpu_flags) <= have
        assert "sse4_2" in t.cpu_flags  # every x86-64 CPU that runs IREE has it


def test_cpu_cross_target_records_triple_arch_and_its_arch_flags():
    t = cpu_target("cortex-a76", "aarch64-unknown-linux-gnu")
    assert t.arch == "aarch64"
    assert t.cpu_flags == ["asimd", "asimdhp", "asimddp"]  # NEON, fp16 arithmetic, dotprod: no x86 flag
    assert "--iree-llvmcpu-target-triple=aarch64-unknown-linux-gnu" in t.flags
    assert "--iree-llvmcpu-target-cpu=cortex-a76" in t.flags
    generic = cpu_target("generic", "arm64-apple-darwin")
    assert generic.arch == "aarch64"
    assert not any(f.startswith("--iree-llvmcpu-target-cpu") for f in generic.flags)


# The masked attention scores of SmolLM2's prefill (9 query heads, 64 rows, a dynamic key count), as IREE
# forms the dispatch. With SVE in the target, IREE's vectorizer bounds its scalable masks by Fourier-Motzkin
# elimination and runs out of memory (1.1 GB resident, then abort under a 4 GB address-space cap).
MASKED_SCORES = """
func.func @scores(%q: tensor<9x64x64xf32>, %k: tensor<9x64x?xf32>, %kpos: tensor<?xi64>,
                  %qpos: tensor<64xi64>) -> tensor<9x64x?xf32> {
  %c2 = arith.constant 2 : index
  %zero = arith.constant 0.0 : f32
  %scale = arith.constant 0.125 : f32
  %neg = arith.constant -1.0e+30 : f32
  %n = tensor.dim %k, %c2 : tensor<9x64x?xf32>
  %empty = tensor.empty(%n) : tensor<9x64x?xf32>
  %filled = linalg.fill ins(%zero : f32) outs(%empty : tensor<9x64x?xf32>) -> tensor<9x64x?xf32>
  %s = linalg.batch_matmul ins(%q, %k : tensor<9x64x64xf32>, tensor<9x64x?xf32>)
                           outs(%filled : tensor<9x64x?xf32>) -> tensor<9x64x?xf32>
  %masked = linalg.generic {indexing_maps = [affine_map<(d0, d1, d2) -> (d2)>, affine_map<(d0, d1, d2) -> (d1)>,
                                             affine_map<(d0, d1, d2) -> (d0, d1, d2)>,
                                             affine_map<(d0, d1, d2) -> (d0, d1, d2)>],
                            iterator_types = ["parallel", "parallel", "parallel"]}
      ins(%kpos, %qpos, %s : tensor<?xi64>, tensor<64xi64>, tensor<9x64x?xf32>) outs(%empty : tensor<9x64x?xf32>) {
  ^bb0(%kp: i64, %qp: i64, %v: f32, %out: f32):
    %scaled = arith.mulf %v, %scale : f32
    %keep = arith.cmpi sle, %kp, %qp : i64
    %r = arith.select %keep, %scaled, %neg : f32
    linalg.yield %r : f32
  } -> tensor<9x64x?xf32>
  return %masked : tensor<9x64x?xf32>
}
"""


def test_sve_cpu_compiles_with_neon_vectors(tmp_path):
    """An SVE core (neoverse-v1) gets its features less SVE on the generic CPU: the masked scores that
    exhaust memory with SVE on compile in well under a second, and the module still records i8mm."""
    from iree.compiler.tools.binaries import find_tool

    t = cpu_target("neoverse-v1", "aarch64-unknown-linux-gnu")
    assert "--iree-llvmcpu-target-cpu=generic" in t.flags
    features = next(f for f in t.flags if f.startswith("--iree-llvmcpu-target-cpu-features="))
    assert "+i8mm" in features and "+dotprod" in features and "sve" not in features
    assert t.cpu_flags == ["asimd", "asimdhp", "asimddp", "i8mm"] and t.cpu == "neoverse-v1"
    (tmp_path / "scores.mlir").write_text(MASKED_SCORES)
    capped = ["prlimit", f"--as={4 << 30}", "timeout", "120", find_tool("iree-compile")]
    done = subprocess.run([*capped, str(tmp_path / "scores.mlir"), *t.flags, "-o", str(tmp_path / "scores.vmfb")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("cpu, has, lacks", [
    ("x86-64-v3", {"avx2", "fma", "f16c", "bmi2"}, {"avx512f"}),
    ("skylake-avx512", {"avx2", "avx512f", "avx512bw", "avx512vl"}, {"avx512_bf16", "amx_tile"}),
    ("znver4", {"avx512f", "avx512_bf16", "avx512_vnni"}, {"amx_tile", "avx512_fp16"}),
    ("sapphirerapids", {"avx512_fp16", "amx_tile", "amx_int8", "amx_bf16"}, set()),
])
def test_cpu_named_x86_records_the_features_llvm_enables(cpu, has, lacks):
    """A module for a named CPU may use its whole ISA: the runtime must know it to refuse a smaller CPU."""
    t = cpu_target(cpu, "x86_64-unknown-linux-gnu")
    assert f"--iree-llvmcpu-target-cpu={cpu}" in t.flags
    assert has <= set(t.cpu_flags) and not lacks & set(t.cpu_flags)
    assert set(t.cpu_flags) <= set(X86_ISA_FLAGS)


def test_cpu_generic_records_only_the_x86_64_baseline():
    assert cpu_target("generic", "x86_64-unknown-linux-gnu").cpu_flags == []
    assert isa_flags(llvm_cpu_features("generic", "x86_64-unknown-linux-gnu")) == []


def test_unknown_x86_cpu_name_lists_the_known_ones():
    with pytest.raises(TargetError, match=r"unknown CPU 'skylake-avx513' .* LLVM knows: .*skylake-avx512.*znver4"):
        cpu_target("skylake-avx513", "x86_64-unknown-linux-gnu")


def test_cpu_host_with_foreign_triple_is_refused():
    with pytest.raises(TargetError, match="name the CPU"):
        cpu_target("host", "aarch64-unknown-linux-gnu")


def test_vulkan_generic_is_refused_with_alternatives():
    with pytest.raises(TargetError, match="llvmpipe"):
        vulkan_target("generic")


def test_vulkan_named_target_passes_through():
    t = vulkan_target("rdna3")
    assert t.flags == ["--iree-hal-target-backends=vulkan-spirv", "--iree-vulkan-target=rdna3"]
    assert t.arch == "rdna3"


@pytest.mark.parametrize("name, expected", [
    ("llvmpipe (LLVM 15.0.6, 256 bits) (llvmpipe Mesa 22.3.6 (LLVM 15.0.6))", "llvmpipe"),
    ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ("NVIDIA GeForce RTX 3080 Ti", "rtx3080ti"),
    ("AMD Radeon RX 7900 XTX (RADV NAVI31)", "rx7900xtx"),
    ("Some Unknown GPU", None),
])
def test_vulkan_target_for_device_names(name, expected):
    assert vulkan_target_for_device(name) == expected


def test_vulkan_host_detects_the_local_device_or_says_why():
    from foldline.runtime.device import available_devices

    if available_devices("vulkan"):
        t = make_target("vulkan")
        assert t.arch and t.arch != "host"
    else:
        with pytest.raises(TargetError, match="no Vulkan device"):
            make_target("vulkan")


def test_cuda_targets():
    assert cuda_target().flags == ["--iree-hal-target-backends=cuda", "--iree-cuda-target=sm_80"]
    assert make_target("cuda", cuda_arch="sm_86").arch == "sm_86"
    with pytest.raises(TargetError, match="sm_80"):
        cuda_target("sm_90")


def test_unknown_target():
    with pytest.raises(TargetError, match="expected cpu, vulkan, cuda or onnx"):
        make_target("tpu")


@pytest.mark.parametrize("arch, ok", [("sm_80", True), ("sm_89", True), ("sm_90", False)])
def test_iree_cuda_arch_support_matches_our_refusals(tmp_path: Path, arch: str, ok: bool):
    """The pinned iree-compile compiles sm_80/sm_89 but not sm_90; when that changes, lift the refusal."""
    import iree.compiler as ireec

    args = ["--iree-hal-target-backends=cuda", f"--iree-cuda-target={arch}"]
    if ok:
        assert len(ireec.compile_str(TINY_MLIR, extra_args=args)) > 1000
    else:
        with pytest.raises(ireec.CompilerToolError, match="missing GPU target"):
            ireec.compile_str(TINY_MLIR, extra_args=args)


def test_iree_vulkan_has_no_generic_target():
    import iree.compiler as ireec

    with pytest.raises(ireec.CompilerToolError, match="Unknown Vulkan target 'generic'"):
        ireec.compile_str(TINY_MLIR, extra_args=["--iree-hal-target-backends=vulkan-spirv",
                                                 "--iree-vulkan-target=generic"])


def test_arch_spellings():
    assert normalize_arch("AMD64") == "x86_64"
    assert normalize_arch("arm64") == "aarch64"


HEX = "ab" * 32


def test_host_compatibility_checks():
    other = "aarch64" if host_arch() != "aarch64" else "x86_64"
    with pytest.raises(BundleError, match=f"compiled for {other}"):
        check_host_compatible(ModuleEntry("m.vmfb", HEX, arch=other), "cpu")
    check_host_compatible(ModuleEntry("m.vmfb", HEX, arch=host_arch()), "cpu")
    check_host_compatible(ModuleEntry("m.vmfb", HEX, arch="sm_80"), "cuda")  # only CPU modules are checked against the host


@pytest.mark.parametrize("device", ["cpu", "vulkan"])
@pytest.mark.parametrize("allow_map", [True, False])
def test_copy_to_host_map_and_staging_paths(device, allow_map):
    """Both read-back paths return an owned, exact copy (the staging one is lavapipe's)."""
    import iree.runtime as rt
    import numpy as np

    from foldline.runtime.device import DRIVERS, available_devices, copy_to_host

    if device != "cpu" and not available_devices(device):
        pytest.skip(f"no {device} device here")
    dev = rt.get_driver(DRIVERS[device]).create_default_device()
    for src in (np.arange(12, dtype=np.float32).reshape(3, 4) / 7, np.array([[-3, 5, 1 << 40]], np.int64)):
        arr = rt.asdevicearray(dev, src)
        out = copy_to_host(dev, arr._buffer_view, allow_map=allow_map)
        np.testing.assert_array_equal(out, src)
        assert out.dtype == src.dtype and out.flags.writeable
        out[...] = 0  # an owned copy: the device buffer is untouched
        np.testing.assert_array_equal(copy_to_host(dev, arr._buffer_view), src)


def test_iree_version_names_the_installed_and_pinned_release():
    """IREE_VERSION is the one spelling of the IREE release: the installed compiler and runtime are that
    release, and pyproject.toml pins both packages to it."""
    for package in ("iree-base-compiler", "iree-base-runtime"):
        assert metadata.version(package).startswith(IREE_VERSION + "."), package
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    pins = dict(re.findall(r'"(iree-base-(?:compiler|runtime))==([^"]+)"', pyproject))
    assert set(pins) == {"iree-base-compiler", "iree-base-runtime"}
    assert all(v.startswith(IREE_VERSION + ".") for v in pins.values()), pins


def test_importing_the_compiler_loads_no_onnx_exporter():
    """The ONNX exporter (onnx, onnxscript and backends/onnx/) loads only for an ONNX target:
    a fresh process that imports backends.build has none of it."""
    probe = ("import sys, foldline.backends.build; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('onnx', 'onnxscript', 'onnxruntime') "
             "or m.startswith('foldline.backends.onnx')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
