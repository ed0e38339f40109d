"""Which int8 kernels a target gets: the forms each kernel family is written for, best first.

Every ISA family's folder (kernels/x86/, kernels/arm/) lists its forms; a new family adds its
forms here. A target gets, per kernel family, the first form its CPU runs
(kernels/isa.py), else that family's float kernels.
"""

from __future__ import annotations

from collections.abc import Iterable

from .arm import DECODE_FORMS as ARM_DECODE
from .arm import PREFILL_FORMS as ARM_PREFILL
from .isa import Int8Isa, Int8Kernels
from .x86 import DECODE_FORMS as X86_DECODE
from .x86 import PREFILL_FORMS as X86_PREFILL

DECODE_ISAS: tuple[Int8Isa, ...] = (*X86_DECODE, *ARM_DECODE)
PREFILL_ISAS: tuple[Int8Isa, ...] = (*X86_PREFILL, *ARM_PREFILL)
ISAS = {isa.name: isa for isa in (*DECODE_ISAS, *PREFILL_ISAS)}


def best_isa(isas: Iterable[Int8Isa], arch: str, cpu_flags: Iterable[str]) -> Int8Isa | None:
    """The first of `isas` a CPU of `arch` with these flags runs, or None (the float kernels)."""
    flags = set(cpu_flags)
    return next((isa for isa in isas if isa.available(flags, arch)), None)


def choose_kernels(cpu_flags: Iterable[str], arch: str = "x86_64") -> Int8Kernels:
    """The best int8 kernels of each family a CPU of `arch` with these flags runs."""
    flags = set(cpu_flags)
    return Int8Kernels(best_isa(DECODE_ISAS, arch, flags), best_isa(PREFILL_ISAS, arch, flags))


def cpu_has_int8_dot(cpu_flags: Iterable[str], arch: str = "x86_64") -> bool:
    """Whether a CPU of `arch` with these flags runs one of the decode kernels' forms."""
    return best_isa(DECODE_ISAS, arch, cpu_flags) is not None
