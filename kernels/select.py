"""Which int8 kernels a target gets: per kernel family, the best registered form its CPU runs.

The forms, what each needs of a CPU and their rank live in the contract
(contract/isa/), which the runtime ranks CPU modules by as well; each ISA
family's folder (kernels/x86/, kernels/arm/) holds their emitters, listed here
by form name. A target gets, per kernel family (decode, prefill), the
highest-ranked form written for that family that its CPU runs (kernels/isa.py),
else that family's float kernels.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..contract.isa import KernelForm, kernel_forms, register_form, unregister_form
from .arm import EMITTERS as ARM_EMITTERS
from .isa import Int8Isa, Int8Kernels
from .x86 import EMITTERS as X86_EMITTERS

# Form name -> its emitter: every ISA family's, and any added with register_isa.
ISAS: dict[str, Int8Isa] = {isa.name: isa for isa in (*X86_EMITTERS, *ARM_EMITTERS)}


def register_isa(isa: Int8Isa) -> Int8Isa:
    """Register an emitter's form (contract.isa.register_form) and the emitter with it; returns it.

    The form is then chosen for CPUs that run it by its rank, here and in the runtime's choice of module.
    """
    if isa.name in ISAS:
        raise ValueError(f"kernel form {isa.name!r} already has an emitter")
    register_form(isa.form)
    ISAS[isa.name] = isa
    return isa


def unregister_isa(name: str) -> None:
    """Forget an emitter added with `register_isa`, and its form."""
    unregister_form(name)
    del ISAS[name]


def emitter(form: KernelForm) -> Int8Isa:
    """The emitter bound to a registered form."""
    isa = ISAS.get(form.name)
    if isa is None or isa.form != form:
        raise LookupError(f"kernel form {form.name!r} ({form.arch}) has no emitter in kernels/; "
                          "register one with kernels.select.register_isa")
    return isa


def best_isa(kernel_family: str, arch: str, cpu_flags: Iterable[str]) -> Int8Isa | None:
    """The emitter of the best form of `kernel_family` a CPU of `arch` with these flags runs, or None (float)."""
    flags = set(cpu_flags)
    form = next((f for f in kernel_forms(arch, kernel_family) if f.runs_on(flags, arch)), None)
    return emitter(form) if form else None


def choose_kernels(cpu_flags: Iterable[str], arch: str = "x86_64") -> Int8Kernels:
    """The best int8 kernels of each family a CPU of `arch` with these flags runs."""
    flags = set(cpu_flags)
    return Int8Kernels(best_isa("decode", arch, flags), best_isa("prefill", arch, flags))


def cpu_has_int8_dot(cpu_flags: Iterable[str], arch: str = "x86_64") -> bool:
    """Whether a CPU of `arch` with these flags runs one of the decode kernels' forms."""
    return best_isa("decode", arch, cpu_flags) is not None
