"""Which CPU module of a bundle a machine loads: the best one its CPU runs.

A bundle compiled with `--cpu x86-all` (or a list of CPUs) holds one CPU module
per ISA level, all reading the same params.irpa. As llama.cpp's all-variants
build does, the runtime takes, among the modules whose recorded `cpu_flags` the
CPU has, the one with the best int8 kernels (the forms' rank in contract/isa/,
the one the compiler chose them by: AVX-512 VNNI > AVX-VNNI > AVX2 > float on
x86-64, NEON i8mm > NEON dotprod > float on aarch64), and among equals the one
compiled for more ISA extensions. Pure functions of the manifest and a feature
set, so the choice is testable on any machine; runtime/device.py supplies the
features (detected or overridden).
"""

from __future__ import annotations

from ..contract.errors import BundleError
from ..contract.isa import FLOAT, ISA_LEVELS, form_rank, kernel_ranking
from ..contract.manifest import Manifest, ModuleEntry

# The manifest's kernel_isa names of the forms foldline ships, worst first within each arch
# (modules of one arch compete); kernel_rank reads the registry itself, forms registered later included.
KERNEL_RANK = kernel_ranking()


def missing_flags(entry: ModuleEntry, have: set[str] | None) -> list[str]:
    """The module's cpu_flags a CPU with `have` lacks ([] where the features are unknown)."""
    if have is None:
        return []
    return [f for f in entry.cpu_flags if f not in have]


def kernel_rank(entry: ModuleEntry) -> tuple[int, int]:
    """How good a CPU module's kernels are: the rank of its decode and prefill kernels, then its ISA width."""
    isa = entry.kernel_isa or {}
    return sum(form_rank(isa.get(f, FLOAT)) for f in ("decode", "prefill")), len(entry.cpu_flags)


def isa_level(entry: ModuleEntry) -> str:
    """The widest notable extension a module uses (`avx512_vnni`, `avx2`, ...), or `baseline`."""
    flags = set(entry.cpu_flags)
    return next((level for level in ISA_LEVELS if level in flags), "baseline")


def _name(key: str, entry: ModuleEntry) -> str:
    return entry.cpu or key


def select_cpu_module(manifest: Manifest, have: set[str] | None, here: str, cpu: str | None = None) -> str:
    """The manifest key of the CPU module to load on a CPU with features `have` (None: unknown) and arch `here`.

    `cpu` pins the module compiled for that --cpu name. A bundle with one CPU module
    returns it; whether it runs here is checked on load (runtime/device.py), as before.
    Where the CPU's features are unknown, the most portable module (fewest cpu_flags).
    """
    keys = manifest.module_keys("cpu")
    if not keys:
        raise BundleError(f"bundle {manifest.root} has no module for device 'cpu' "
                          f"(it has: {', '.join(manifest.devices()) or 'none'}); recompile with --target cpu")
    if cpu is not None:
        pinned = [k for k in keys if cpu in (k, manifest.modules[k].cpu)]
        if not pinned:
            names = ", ".join(_name(k, manifest.modules[k]) for k in keys)
            raise BundleError(f"bundle {manifest.root} has no CPU module for --cpu {cpu} (it has: {names})")
        return pinned[0]
    if len(keys) == 1:
        return keys[0]
    if have is None:
        return min(keys, key=lambda k: len(manifest.modules[k].cpu_flags))
    fits, reasons = [], []
    for key in keys:
        entry = manifest.modules[key]
        arch, missing = entry.arch, missing_flags(entry, have)
        if arch and arch != here:
            reasons.append(f"{entry.file} is for {arch}")
        elif missing:
            reasons.append(f"{entry.file} needs {', '.join(missing)}")
        else:
            fits.append(key)
    if not fits:
        raise BundleError(f"none of the {len(keys)} CPU modules of bundle {manifest.root} runs on this CPU "
                          f"({here}): {'; '.join(reasons)}; recompile with --cpu host on this machine "
                          "or add --cpu generic to the list")
    return max(fits, key=lambda k: kernel_rank(manifest.modules[k]))


def fallback_notice(manifest: Manifest, key: str, have: set[str] | None, here: str) -> str | None:
    """One line for a host that loads a float CPU module while the bundle has a better one for its arch
    (kernel_rank: int8 kernels, or the same float kernels with FMA, F16C and AVX) that it cannot run,
    naming the CPU flags it lacks for the nearest of them. None otherwise, or where the CPU's features
    are unknown.

    The float modules (`x86-64-v2`, `generic`) decode several times slower than the int8 ones, and a
    host loads them without being asked: a VM whose CPU model hides AVX2 runs the bundle at a
    fraction of its speed, and this line is how its user learns why.
    """
    entry = manifest.modules[key]
    if have is None or (entry.kernel_isa or {}).get("decode", FLOAT) != FLOAT:
        return None
    better = [manifest.modules[k] for k in manifest.module_keys("cpu")
              if manifest.modules[k].arch in (None, "", here) and kernel_rank(manifest.modules[k]) > kernel_rank(entry)]
    lacking = [flags for flags in (missing_flags(other, have) for other in better) if flags]
    if not lacking:
        return None
    return (f"foldline: this CPU lacks {', '.join(min(lacking, key=len))}: loaded the {_name(key, entry)} module "
            "(float kernels, slower)")
