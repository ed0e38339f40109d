"""CPU feature names: LLVM's (what a module was compiled for) and /proc/cpuinfo's (what a CPU has).

The compiler records each CPU module's features in cpuinfo spelling; the
runtime compares them with the running CPU's flags and refuses a module that
needs one the CPU lacks.
"""

from __future__ import annotations

# LLVM x86 feature -> its /proc/cpuinfo flag: the ISA extensions a CPU module may rely on.
X86_LLVM_FEATURES = {
    "sse4.1": "sse4_1", "sse4.2": "sse4_2", "avx": "avx", "avx2": "avx2", "fma": "fma", "f16c": "f16c",
    "bmi2": "bmi2", "avx512f": "avx512f", "avx512dq": "avx512dq", "avx512cd": "avx512cd",
    "avx512bw": "avx512bw", "avx512vl": "avx512vl", "avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16",
    "avx512fp16": "avx512_fp16", "amx-tile": "amx_tile", "amx-int8": "amx_int8", "amx-bf16": "amx_bf16",
    "avx512vbmi": "avx512vbmi", "avx512vbmi2": "avx512_vbmi2", "avx512ifma": "avx512ifma",
    "avx512vpopcntdq": "avx512_vpopcntdq", "avx512bitalg": "avx512_bitalg", "avxvnni": "avx_vnni",
    "gfni": "gfni", "vaes": "vaes", "vpclmulqdq": "vpclmulqdq",
}
# The same for aarch64 (the `Features` line of its /proc/cpuinfo).
AARCH64_LLVM_FEATURES = {
    "neon": "asimd", "fullfp16": "asimdhp", "dotprod": "asimddp", "i8mm": "i8mm", "sve": "sve", "sve2": "sve2",
}
LLVM_FEATURE_FLAGS = {**X86_LLVM_FEATURES, **AARCH64_LLVM_FEATURES}  # no name is both arches'
# Per arch, the flags a CPU module of that arch may record, in the tables' order.
ARCH_ISA_FLAGS = {"x86_64": tuple(X86_LLVM_FEATURES.values()), "aarch64": tuple(AARCH64_LLVM_FEATURES.values())}


def isa_flags(llvm_features: str) -> list[str]:
    """The LLVM_FEATURE_FLAGS an LLVM feature string enables, in cpuinfo spelling.

    LLVM reads `+a,-a` left to right, the last word wins: a host CPU's string
    lists its model's features, then what the CPU reports (e.g. `-amx-tile`).
    """
    enabled: dict[str, bool] = {}
    for word in llvm_features.split(","):
        word = word.strip()
        if word[:1] in "+-" and word[1:] in LLVM_FEATURE_FLAGS:
            enabled[word[1:]] = word[0] == "+"
    return [flag for name, flag in LLVM_FEATURE_FLAGS.items() if enabled.get(name)]
