"""IREE target presets: the iree-compile flags for each foldline target.

Facts about the pinned IREE (`IREE_VERSION`) that shape these presets (checked with iree-compile):

- Vulkan: there is no target called "generic". The default profile,
  `vp_android_baseline_2022`, has no 64-bit integer compute, and our modules
  index with i64 (token ids, positions, ring slots); with
  `--iree-input-demote-i64-to-i32` codegen then fails on indirect bindings.
  SPIR-V is specialized to the device's subgroup size, so a module for one GPU
  family can run wrong on another (an `ampere` module on lavapipe returns wrong
  logits). We therefore compile for a named device: `host` asks the local Vulkan
  driver which device is here (lavapipe -> `llvmpipe`).
- CUDA: sm_80/86/89/120 and product names compile without a GPU; sm_90 and
  sm_100 fail ("missing GPU target"). PTX built for sm_80 is JIT-compiled by
  the driver on newer GPUs, Hopper included.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

from ..contract.isa import ARCH_ISA_FLAGS, isa_flags
from ..errors import FoldlineError

# x86 ISA extensions (cpuinfo spelling) that LLVM may use when compiling for a named/host CPU;
# the runtime refuses a module whose recorded flags this CPU lacks.
X86_ISA_FLAGS = ARCH_ISA_FLAGS["x86_64"]
# The smallest module iree-compile resolves a CPU's target attributes for.
_PROBE_MLIR = """
func.func @probe(%a: tensor<4xf32>) -> tensor<4xf32> {
  %0 = arith.addf %a, %a : tensor<4xf32>
  return %0 : tensor<4xf32>
}
"""

# The IREE release foldline is built against: pyproject.toml pins iree-base-compiler and
# iree-base-runtime to it (tests/backends/test_targets.py checks the pins and the installed packages), and
# what the code and docs say IREE does or cannot do was found with it.
IREE_VERSION = "3.13"
ONNX_DEVICE = "onnxruntime"  # the runtime device that runs an ONNX module (runtime/onnx_device.py)
GENAI_TARGET = "onnx-genai"  # a model directory for ONNX Runtime GenAI, not a foldline bundle (docs/onnx.md)

DEFAULT_VULKAN_TARGET = "host"
DEFAULT_CUDA_ARCH = "sm_80"
# CUDA archs the pinned iree-compile rejects, with what to use instead.
UNSUPPORTED_CUDA_ARCHS = {
    "sm_90": "sm_80 (its PTX is JIT-compiled by the driver on Hopper)",
    "sm_90a": "sm_80 (its PTX is JIT-compiled by the driver on Hopper)",
    "sm_100": "sm_80 or sm_120",
    "sm_100a": "sm_80 or sm_120",
}
VULKAN_SUGGESTIONS = "llvmpipe (Mesa lavapipe), ampere / ada / rtx4090 (NVIDIA), rdna3 / rx7900xtx (AMD)"


class TargetError(FoldlineError, ValueError):
    """An unknown or unsupported compile target."""


@dataclass
class Target:
    """One compiled module of a bundle."""

    device: str  # cpu, vulkan, cuda, onnxruntime: the runtime device that runs it
    flags: list[str]
    description: str
    arch: str | None = None
    cpu_flags: list[str] = field(default_factory=list)
    cpu: str | None = None  # the --cpu name of a CPU module: names its file when a bundle holds several
    genai: bool = False  # an ONNX Runtime GenAI model directory instead of a bundle (--target onnx-genai)


def host_arch() -> str:
    from ..runtime.device import host_arch as runtime_host_arch

    return runtime_host_arch()


def normalize_triple_arch(triple: str) -> str:
    """The arch field of an LLVM triple in the runtime's spelling (arm64-apple-... -> aarch64)."""
    from ..runtime.device import normalize_arch

    return normalize_arch(triple.split("-")[0])


def _host_isa_flags() -> list[str]:
    """The ARCH_ISA_FLAGS of this arch this CPU has: what a --cpu host module may rely on."""
    from ..runtime.device import host_cpu_features

    have = host_cpu_features() or set()
    return [f for f in ARCH_ISA_FLAGS.get(host_arch(), ()) if f in have]


@functools.cache
def llvm_cpu_features(cpu: str, triple: str | None = None) -> str:
    """LLVM's feature string for a named CPU (`+avx,+avx2,...`), as iree-compile resolves it.

    Asks LLVM itself, with one tiny compile (docs/backends.md, "CPU"): no table of CPU
    names to keep up to date. An unknown x86 CPU name is a TargetError listing the
    names LLVM accepts.
    """
    import iree.compiler as ireec

    args = ["--iree-hal-target-backends=llvm-cpu", f"--iree-llvmcpu-target-cpu={cpu}", "--compile-to=preprocessing"]
    if triple:
        args.append(f"--iree-llvmcpu-target-triple={triple}")
    try:
        out = ireec.compile_str(_PROBE_MLIR, extra_args=args)
    except ireec.CompilerToolError as e:
        known = re.search(r"List of accepted CPUs: ([^\n]*)", str(e))
        if known:
            raise TargetError(f"unknown CPU {cpu!r} for {triple or host_arch()}; LLVM knows: {known.group(1)}") from e
        raise TargetError(f"iree-compile cannot target CPU {cpu!r}: {str(e).strip().splitlines()[-1]}") from e
    text = out.decode() if isinstance(out, bytes) else str(out)
    found = re.search(r'cpu_features = "([^"]*)"', text)
    return found.group(1) if found else ""


def _fixed_width(features: str) -> str:
    """An LLVM feature string less the aarch64 scalable extensions it turns on (SVE, SVE2, SME)."""
    return ",".join(f for f in features.split(",") if not f.startswith(("+sve", "+sme")))


def cpu_target(cpu: str = "host", triple: str | None = None) -> Target:
    """llvm-cpu for this machine (host), any CPU of the arch (generic), or a named LLVM CPU.

    The arch comes from the triple so the runtime can refuse a cross-compiled
    module. ISA flags (x86-64 and aarch64) are recorded for every CPU: `host`
    what this CPU has, a named CPU (skylake-avx512, znver4, x86-64-v3,
    cortex-a76, ...) what LLVM enables for it, `generic` none (the arch's
    baseline); the runtime refuses a module whose flags its CPU lacks instead of
    dying with SIGILL, and the int8 kernels follow them (kernels/select.py).
    """
    # Vectorized reductions: without it each reduction (the fused quantized matmuls above all)
    # lowers to a chain of scalar adds, several times slower (docs/quantization.md, "The kernels").
    # No constant-expression hoisting: it would move the prefill's per-call dequantization of
    # quantized weights into a load-time initializer, a float copy of every weight in memory.
    flags = ["--iree-hal-target-backends=llvm-cpu", "--iree-llvmcpu-reassociate-fp-reductions=true",
             "--iree-opt-const-expr-hoisting=false"]
    arch = host_arch()
    if triple:
        flags.append(f"--iree-llvmcpu-target-triple={triple}")
        arch = normalize_triple_arch(triple)
    cpu_flags: list[str] = []
    features = ""  # LLVM's feature string for the CPU, where the flags need it
    if cpu == "host":
        if triple and arch != host_arch():
            raise TargetError("--cpu host cannot be combined with a cross-compile --triple; name the CPU "
                              "(e.g. --cpu generic or --cpu cortex-a76)")
        cpu_flags = _host_isa_flags()
        if arch == "aarch64":
            features = llvm_cpu_features("host")
    elif cpu != "generic" and arch in ARCH_ISA_FLAGS:
        features = llvm_cpu_features(cpu, triple)
        cpu_flags = isa_flags(_fixed_width(features))
    if cpu != "generic":
        if _fixed_width(features) != features:
            # NEON (fixed-width) vectors on SVE cores too: foldline's kernels are NEON, and with SVE in the
            # target IREE's vectorizer runs out of memory bounding the scalable masks of SmolLM2's
            # dispatches (neoverse-v1). IREE reads SVE from the CPU name as well as from its features, so
            # the CPU's features go in by name, less SVE and SME, on the generic CPU.
            flags += ["--iree-llvmcpu-target-cpu=generic",
                      f"--iree-llvmcpu-target-cpu-features={_fixed_width(features)}"]
        else:
            flags.append(f"--iree-llvmcpu-target-cpu={cpu}")
    return Target("cpu", flags, f"llvm-cpu ({cpu}{', ' + triple if triple else ''})", arch, cpu_flags, cpu)


# Named sets of CPUs for --cpu: one module each, the runtime loads the best one the CPU runs.
# x86-all: every x86-64 CPU in use gets its best int8 kernels from one bundle.
# - x86-64-v2 (SSE4.2, CPUs since 2009): the float kernels, the baseline that runs anywhere;
# - x86-64-v3 (AVX2, FMA, F16C, BMI2: Haswell, Zen 1-3 and later): the AVX2 int8 decode and prefill kernels;
# - cascadelake: x86-64-v4 (AVX-512 F/BW/CD/DQ/VL) plus AVX-512 VNNI and nothing else (LLVM's
#   feature strings, targets.llvm_cpu_features), so the widest level every Intel Xeon with
#   AVX-512 VNNI (Cascade Lake onwards) and AMD Zen 4 / Zen 5 run: the VNNI decode and prefill kernels.
#   znver4 or icelake-server would add VBMI, BF16, GFNI..., which Cascade Lake lacks.
CPU_SETS = {"x86-all": ("x86-64-v2", "x86-64-v3", "cascadelake")}


def default_cpu(triple: str | None = None) -> str:
    """`foldline compile`'s --cpu when none is given: x86-all on an x86-64 machine compiling for itself
    (every x86-64 CPU runs the bundle with its best kernels), else host (a cross compile names its CPU)."""
    return "x86-all" if triple is None and host_arch() == "x86_64" else "host"


def cpu_names(spec: str, triple: str | None = None) -> list[str]:
    """The CPUs of a --cpu value: one name, a comma-separated list, or a named set (CPU_SETS)."""
    names: list[str] = []
    for word in (w.strip() for w in spec.split(",")):
        if not word:
            continue
        if word in CPU_SETS:
            arch = normalize_triple_arch(triple) if triple else host_arch()
            if arch != "x86_64":
                raise TargetError(f"--cpu {word} is a set of x86-64 CPUs; this target is {arch}: name its CPUs")
            names += CPU_SETS[word]
        else:
            names.append(word)
    if not names:
        raise TargetError(f"--cpu {spec!r} names no CPU; expected host, generic, an LLVM CPU name, "
                          f"a comma-separated list of them or {', '.join(CPU_SETS)}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise TargetError(f"--cpu {spec!r} names {', '.join(repeated)} more than once")
    return names


def vulkan_target_for_device(name: str) -> str | None:
    """The IREE Vulkan target for a device name as the Vulkan driver reports it, if we know one."""
    low = name.lower()
    if "llvmpipe" in low or "lavapipe" in low:
        return "llvmpipe"
    # IREE accepts product names such as rtx4090, rx7900xtx: the marketing name without spaces.
    m = re.search(r"\b(rtx|rx)\s*(\d{4})\s*(ti|xtx|xt)?\b", low)
    if m:
        return "".join(p for p in m.groups() if p)
    if "a100" in low:
        return "a100"
    return None


def detect_vulkan_target() -> str:
    """The Vulkan target for the first device of this machine's Vulkan driver."""
    from ..runtime.device import available_devices

    devices = available_devices("vulkan")
    if not devices:
        raise TargetError(
            "--vulkan-target host: this machine has no Vulkan device to compile for; "
            f"name the target with --vulkan-target, e.g. {VULKAN_SUGGESTIONS}"
        )
    target = vulkan_target_for_device(devices[0])
    if target is None:
        raise TargetError(
            f"--vulkan-target host: no known IREE target for Vulkan device {devices[0]!r}; "
            f"name it with --vulkan-target, e.g. {VULKAN_SUGGESTIONS}"
        )
    return target


def vulkan_target(name: str = DEFAULT_VULKAN_TARGET) -> Target:
    """SPIR-V for one named Vulkan device family (`host`: the device on this machine)."""
    if name == "generic":
        raise TargetError(
            f"iree-compile {IREE_VERSION} has no portable Vulkan target that compiles these models "
            "(its baseline profile lacks 64-bit integers); "
            f"name the device family with --vulkan-target: host, {VULKAN_SUGGESTIONS}"
        )
    resolved = detect_vulkan_target() if name == "host" else name
    flags = ["--iree-hal-target-backends=vulkan-spirv", f"--iree-vulkan-target={resolved}"]
    return Target("vulkan", flags, f"vulkan-spirv ({resolved})", arch=resolved)


def cuda_target(arch: str = DEFAULT_CUDA_ARCH) -> Target:
    """PTX for one SM architecture; compiles without a GPU or a CUDA toolkit."""
    if arch in UNSUPPORTED_CUDA_ARCHS:
        raise TargetError(
            f"iree-compile {IREE_VERSION} cannot compile for {arch} (missing GPU target); "
            f"use --cuda-arch {UNSUPPORTED_CUDA_ARCHS[arch]}"
        )
    flags = ["--iree-hal-target-backends=cuda", f"--iree-cuda-target={arch}"]
    return Target("cuda", flags, f"cuda ({arch})", arch=arch)


def make_target(name: str, cpu: str = "host", triple: str | None = None,
                vulkan: str = DEFAULT_VULKAN_TARGET, cuda_arch: str = DEFAULT_CUDA_ARCH) -> Target:
    """The Target for a --target name and the per-backend options (`cpu`: one CPU name)."""
    if name == "cpu":
        return cpu_target(cpu, triple)
    if name == "vulkan":
        return vulkan_target(vulkan)
    if name == "cuda":
        return cuda_target(cuda_arch)
    if name == "onnx":
        return Target(ONNX_DEVICE, [], "ONNX for ONNX Runtime (backends/onnx/export.py)")
    if name == GENAI_TARGET:
        return Target(ONNX_DEVICE, [], "ONNX Runtime GenAI model (backends/onnx/genai.py)", genai=True)
    raise TargetError(f"unknown target {name!r}; expected cpu, vulkan, cuda or onnx, or {GENAI_TARGET} for an ONNX "
                      "Runtime GenAI model")


def make_targets(name: str, cpu: str = "host", triple: str | None = None,
                 vulkan: str = DEFAULT_VULKAN_TARGET, cuda_arch: str = DEFAULT_CUDA_ARCH) -> list[Target]:
    """The Targets for a --target name: one per CPU of a --cpu list for cpu, else one."""
    if name == "cpu":
        return [cpu_target(c, triple) for c in cpu_names(cpu, triple)]
    return [make_target(name, cpu, triple, vulkan, cuda_arch)]
