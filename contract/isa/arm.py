"""aarch64: its CPU features and its int8 kernel forms (emitters: kernels/arm/).

- NEON dotprod: `sdot` on 16 bytes, signed by signed, for decode and prefill.
- NEON i8mm: `smmla` on two rows by two channels, for the prefill GEMM only (one
  decode row has no pair, so decode keeps `sdot`).
"""

from __future__ import annotations

from .registry import IsaFamily, KernelForm

NEON_I8MM = KernelForm("int8-neon-i8mm", "aarch64", frozenset({"asimd", "asimddp", "i8mm"}), rank=2,
                       kernel_families=("prefill",))
NEON_DOTPROD = KernelForm("int8-neon-dotprod", "aarch64", frozenset({"asimd", "asimddp"}), rank=1)

FAMILY = IsaFamily(
    arch="aarch64",
    arch_aliases=("arm64",),
    cpuinfo_line="Features",
    llvm_features={
        "neon": "asimd", "fullfp16": "asimdhp", "dotprod": "asimddp", "i8mm": "i8mm", "sve": "sve", "sve2": "sve2",
    },
    isa_levels=("i8mm", "asimddp", "asimd"),
    forms=(NEON_I8MM, NEON_DOTPROD),
)
