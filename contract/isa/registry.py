"""The int8 kernel forms foldline knows, as compiler and runtime both read them.

A `KernelForm` is one instruction-set form of the int8-activation kernels
(`int8-avx512vnni`, `int8-neon-dotprod`, ...): the name a module's manifest
records as its `kernel_isa`, the CPU it runs on, and its rank among the forms
of its arch. The compiler gives a target the best form of each kernel family
its CPU runs (kernels/select.py); the runtime loads the CPU module whose
recorded forms rank best (runtime/cpu_select.py). Both read the rank from
here, so they cannot disagree. An `IsaFamily` is everything else one ISA
family says about CPUs, as data: how its arch is spelled, where /proc/cpuinfo
lists its features, LLVM's names for them. Each family declares itself in one
module beside this one (x86.py, arm.py); the emitters of its forms live in
kernels/<family>/.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

FLOAT = "f32"  # the manifest's kernel_isa of a module with float-activation kernels: rank 0 on every arch
KERNEL_FAMILIES = ("decode", "prefill")  # the int8 kernels a module's kernel_isa names a form for


@dataclass(frozen=True)
class KernelForm:
    """One instruction-set form of the int8 kernels: its name, what it needs of a CPU, how good it is."""

    name: str  # the manifest's kernel_isa: "int8-avx512vnni", "int8-neon-dotprod"
    arch: str  # the arch it runs on, in the runtime's spelling ("x86_64", "aarch64")
    cpu_flags: frozenset[str]  # features the CPU must have (cpuinfo spelling)
    rank: int  # higher is better, among the forms of its arch (the float kernels rank 0)
    kernel_families: tuple[str, ...] = KERNEL_FAMILIES  # the int8 kernels written in this form

    def runs_on(self, cpu_flags: Iterable[str], arch: str) -> bool:
        """Whether a CPU of `arch` with these flags runs this form."""
        return arch == self.arch and self.cpu_flags <= set(cpu_flags)


@dataclass(frozen=True)
class IsaFamily:
    """What one ISA family says about CPUs, beside its kernel forms: the data, never the MLIR."""

    arch: str  # the runtime's spelling of its arch
    arch_aliases: tuple[str, ...]  # other spellings of it (platform.machine(), LLVM triples)
    cpuinfo_line: str  # the /proc/cpuinfo line (Linux) that lists a CPU's features
    # LLVM feature -> its /proc/cpuinfo flag: the ISA extensions a CPU module may rely on
    llvm_features: Mapping[str, str]
    isa_levels: tuple[str, ...]  # flags that name a module's ISA level in `foldline inspect`, widest first
    forms: tuple[KernelForm, ...]  # its int8 kernel forms (registered when contract.isa is imported)


_FORMS: dict[str, KernelForm] = {}


def register_form(form: KernelForm) -> KernelForm:
    """Make `form` known to the compiler's choice and the runtime's ranking; returns it.

    Its name must be new, its rank above the float kernels' and unlike any other form of its
    arch: the choice of each arch's forms is a strict order.
    """
    if form.name == FLOAT or form.name in _FORMS:
        raise ValueError(f"kernel form {form.name!r} is already known")
    if form.rank <= 0:
        raise ValueError(f"kernel form {form.name!r} ranks {form.rank}: the float kernels rank 0, a form above them")
    clash = next((f for f in _FORMS.values() if f.arch == form.arch and f.rank == form.rank), None)
    if clash is not None:
        raise ValueError(f"kernel form {form.name!r} ranks {form.rank} on {form.arch}, as {clash.name!r} does")
    unknown = set(form.kernel_families) - set(KERNEL_FAMILIES)
    if unknown or not form.kernel_families:
        raise ValueError(f"kernel form {form.name!r} names kernel families {sorted(form.kernel_families)}; "
                         f"expected some of {', '.join(KERNEL_FAMILIES)}")
    _FORMS[form.name] = form
    return form


def unregister_form(name: str) -> None:
    """Forget a form registered with `register_form` (a test's toy form, on teardown)."""
    del _FORMS[name]


def kernel_form(name: str) -> KernelForm:
    """The registered form of this manifest name (KeyError if none)."""
    return _FORMS[name]


def kernel_forms(arch: str | None = None, kernel_family: str | None = None) -> tuple[KernelForm, ...]:
    """The registered forms of `arch` written for `kernel_family` (None: any), best first."""
    forms = [f for f in _FORMS.values()
             if arch in (None, f.arch) and (kernel_family is None or kernel_family in f.kernel_families)]
    return tuple(sorted(forms, key=lambda f: (f.arch, -f.rank)))


def form_rank(name: str) -> int:
    """The rank of a manifest's kernel_isa name: its form's, 0 for the float kernels or a name not known here."""
    form = _FORMS.get(name)
    return form.rank if form else 0


def kernel_ranking() -> tuple[str, ...]:
    """Every kernel_isa name, worst first within each arch (the float kernels first of all); arches apart."""
    return (FLOAT, *(f.name for f in sorted(_FORMS.values(), key=lambda f: (f.arch, f.rank))))
