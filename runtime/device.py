"""One IREE device with a bundle's module loaded: calls, uploads and downloads.

All data crosses to the device through device-allocated copies
(`allocate_buffer_copy`), never by importing host pointers: Vulkan drivers such
as Mesa lavapipe reject host pointers that are not 4096-byte aligned.
"""

from __future__ import annotations

import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import iree.runtime as rt
import numpy as np

from .bundle import BundleError, Manifest

# foldline device name -> IREE HAL driver
DRIVERS = {"cpu": "local-task", "vulkan": "vulkan", "cuda": "cuda"}
PARAM_SCOPE = "model"


def host_cpu_features() -> set[str] | None:
    """The CPU flags of this machine (Linux x86), or None where we cannot tell."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists() or platform.machine() not in ("x86_64", "AMD64"):
        return None
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return None


def check_host_compatible(module: dict, target: str) -> None:
    """Refuse a CPU module built for another architecture or for features this CPU lacks."""
    if target != "cpu":
        return
    arch = module.get("arch")
    machine = platform.machine().lower()
    if arch and arch not in (machine, {"amd64": "x86_64", "arm64": "aarch64"}.get(machine)):
        raise BundleError(f"the cpu module was compiled for {arch}; this machine is {machine}")
    required = set(module.get("cpu_flags", []))
    have = host_cpu_features()
    if required and have is not None:
        missing = sorted(required - have)
        if missing:
            raise BundleError(
                f"the cpu module needs CPU features this machine lacks: {', '.join(missing)}; "
                "recompile with --cpu generic or --cpu host on this machine"
            )


@dataclass
class DeviceContext:
    name: str
    config: rt.Config
    device: rt.HalDevice
    module: object  # the bound VM module (functions as attributes)

    def upload(self, array: np.ndarray) -> rt.DeviceArray:
        return rt.asdevicearray(self.device, np.ascontiguousarray(array))

    def zeros(self, shape: Sequence[int], dtype) -> rt.DeviceArray:
        return self.upload(np.zeros(tuple(shape), dtype=dtype))

    def to_host(self, array: rt.DeviceArray) -> np.ndarray:
        return np.array(array.to_host(), copy=True)

    def call(self, fn: str, inputs: list[np.ndarray], state: list[rt.DeviceArray]) -> np.ndarray:
        """Run an entry point; the state buffers are updated in place, the logits come back."""
        args = [self.upload(a) for a in inputs] + list(state)
        result = getattr(self.module, fn)(*args)
        if isinstance(result, (tuple, list)):
            raise BundleError(f"entry point {fn} returned {len(result)} values; expected logits only")
        return self.to_host(result)


def open_device(manifest: Manifest, device: str, verify: bool = True) -> DeviceContext:
    """Create the device, load params + module for it; clear errors for what is missing."""
    if device not in DRIVERS:
        raise BundleError(f"unknown device {device!r}; expected one of {', '.join(DRIVERS)}")
    if device not in manifest.modules:
        have = ", ".join(sorted(manifest.modules)) or "none"
        raise BundleError(
            f"bundle {manifest.root} has no module for device {device!r} (it has: {have}); "
            f"recompile with --target {device}"
        )
    entry = manifest.modules[device]
    check_host_compatible(entry, device)
    if verify:
        manifest.verify_module(device)
        manifest.verify_params()
    try:
        config = rt.Config(DRIVERS[device])
    except Exception as e:  # the driver or the hardware is absent
        raise BundleError(f"device {device!r} is not available here: {e}") from e
    instance = config.vm_instance
    modules = []
    params_path = manifest.params_path
    if params_path is not None:
        index = rt.ParameterIndex()
        index.load(str(params_path))  # mmapped
        modules.append(rt.create_io_parameters_module(instance, index.create_provider(scope=PARAM_SCOPE)))
    modules.append(rt.create_hal_module(instance, config.device))
    vmfb = manifest.root / entry["file"]
    modules.append(rt.VmModule.mmap(instance, str(vmfb)))
    try:
        loaded = rt.load_vm_modules(*modules, config=config)
    except Exception as e:
        raise BundleError(f"could not load {vmfb} on {device}: {e}") from e
    return DeviceContext(device, config, config.device, loaded[-1])
