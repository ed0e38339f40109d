"""What foldline knows about CPU instruction sets, one module per ISA family.

Each family (x86.py, arm.py) declares, as data, its arch's spellings, the
/proc/cpuinfo line of its features, LLVM's names for them, the flags that name
a module's ISA level, and its int8 kernel forms with their ranks
(registry.py). Importing this package registers every family's forms; the
tables below join the families for the compiler (which flags a module records)
and the runtime (which module a CPU loads, what it reads of the host).
"""

from __future__ import annotations

from . import arm, x86
from .registry import (
    FLOAT,
    KERNEL_FAMILIES,
    IsaFamily,
    KernelForm,
    form_rank,
    kernel_form,
    kernel_forms,
    kernel_ranking,
    register_form,
    unregister_form,
)

FAMILIES: tuple[IsaFamily, ...] = (x86.FAMILY, arm.FAMILY)
for _family in FAMILIES:
    for _form in _family.forms:
        register_form(_form)

# LLVM feature -> /proc/cpuinfo flag, every family's (no name is two arches').
LLVM_FEATURE_FLAGS = {name: flag for family in FAMILIES for name, flag in family.llvm_features.items()}
# Per arch, the flags a CPU module of that arch may record, in its family's order.
ARCH_ISA_FLAGS = {family.arch: tuple(family.llvm_features.values()) for family in FAMILIES}
# Other spellings of an arch -> the runtime's.
ARCH_ALIASES = {alias: family.arch for family in FAMILIES for alias in family.arch_aliases}
# Per arch, the /proc/cpuinfo line that lists a CPU's features (Linux).
CPUINFO_FEATURES_LINE = {family.arch: family.cpuinfo_line for family in FAMILIES}
# cpu_flags that name a module's ISA level in `foldline inspect`, widest first (an arch's flags are its own).
ISA_LEVELS = tuple(level for family in FAMILIES for level in family.isa_levels)


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


__all__ = [
    "ARCH_ALIASES", "ARCH_ISA_FLAGS", "CPUINFO_FEATURES_LINE", "FAMILIES", "FLOAT", "ISA_LEVELS", "KERNEL_FAMILIES",
    "LLVM_FEATURE_FLAGS", "IsaFamily", "KernelForm", "form_rank", "isa_flags", "kernel_form", "kernel_forms",
    "kernel_ranking", "register_form", "unregister_form",
]
