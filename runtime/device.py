"""One IREE device with a bundle's module loaded: calls, uploads and downloads.

Data never crosses by importing host pointers. Uploads go through
device-allocated copies (`allocate_buffer_copy`); results come back by mapping
the buffer when the device exposes it to the host, else through a host-visible
staging buffer filled by a queue copy. Vulkan drivers such as Mesa lavapipe
reject imported host pointers that are not 4096-byte aligned, which is what
numpy arrays passed directly (and `DeviceArray.to_host`'s import path) produce.
"""

from __future__ import annotations

import logging
import os
import platform
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import iree.runtime as rt
import numpy as np
from iree.runtime._binding import create_hal_driver

from ..contract.errors import BundleError
from ..contract.isa import ARCH_ALIASES, CPUINFO_FEATURES_LINE
from ..contract.manifest import Manifest, ModuleEntry
from ..contract.vmfb import vmfb_info
from ..errors import InputError
from .cpu_select import fallback_notice, missing_flags, select_cpu_module
from .onnx_device import DEFAULT_PROVIDERS, OnnxContext, open_onnx
from .onnx_device import DEVICE as ONNX_DEVICE
from .waiter import Waiter, inline, wait_nice
from .worker_time import cpu_seconds, task_ids

# foldline device name -> IREE HAL driver
DRIVERS = {"cpu": "local-task", "vulkan": "vulkan", "cuda": "cuda"}
# Pretend the CPU has only these flags (cpuinfo spelling, comma- or space-separated): which CPU
# module a multi-ISA bundle loads, and which modules are refused, follow them.
CPU_FEATURES_ENV = "FOLDLINE_CPU_FEATURES"
# Where the fallback notice goes: with no logging set up, Python prints a warning's bare message on stderr.
log = logging.getLogger("foldline")
_notices_given: set[str] = set()  # each notice once per process, however often a bundle is loaded


def normalize_arch(name: str) -> str:
    """One spelling per architecture: platform.machine() and LLVM triples differ."""
    name = name.lower()
    return ARCH_ALIASES.get(name, name)


def host_arch() -> str:
    return normalize_arch(platform.machine())


def host_cpu_features() -> set[str] | None:
    """The CPU flags of this machine (Linux x86-64 and aarch64), or None where we cannot tell.

    Under qemu-user, /proc/cpuinfo is the host's: an aarch64 process finds no
    `Features` line there and gets None, as on any machine that does not say.
    """
    cpuinfo = Path("/proc/cpuinfo")
    key = CPUINFO_FEATURES_LINE.get(host_arch())  # each ISA family's (contract/isa/)
    if key is None or not cpuinfo.exists():
        return None
    for line in cpuinfo.read_text().splitlines():
        if line.split(":", 1)[0].strip() == key:
            return set(line.split(":", 1)[1].split())
    return None


def cpu_features(override: str | Iterable[str] | None = None) -> set[str] | None:
    """The CPU flags modules are checked against: `override`, else $FOLDLINE_CPU_FEATURES, else this CPU's.

    An override can only leave features out: naming one this CPU lacks is an error,
    since a module using it would die with SIGILL. Where the CPU's flags cannot be
    read (not Linux x86), the override is taken as it is.
    """
    detected = host_cpu_features()
    where = "cpu_features"
    if override is None:
        override, where = os.environ.get(CPU_FEATURES_ENV, "").strip() or None, f"${CPU_FEATURES_ENV}"
        if override is None:
            return detected
    names = set(override.replace(",", " ").split() if isinstance(override, str) else override)
    extra = sorted(names - detected) if detected is not None else []
    if extra:
        raise InputError(f"{where} names {', '.join(extra)}, which this CPU lacks: the override can only "
                         "leave features out (see /proc/cpuinfo for the flags this CPU has)")
    return names


def check_host_compatible(module: ModuleEntry, device: str, have: set[str] | None = None,
                          vmfb: Path | None = None) -> None:
    """Refuse a CPU module built for another architecture or for features this CPU lacks
    (`have`: the CPU's flags; None: detect them).

    Running such a module would fail at load with an opaque IREE error or,
    worse, die with SIGILL in the middle of a call. With `vmfb`, the module's own
    executables are read too, whatever the manifest says: the arches first (the
    manifest's, then the executables'), then the features, so a manifest that
    claims this arch for another arch's module is refused for its arch.
    """
    if device != "cpu":
        return
    arch = module.arch
    here = host_arch()
    if arch and normalize_arch(arch) != here:
        raise BundleError(
            f"the cpu module {module.file} was compiled for {arch}; this machine is {here}: "
            f"run it on an {arch} machine or recompile with --target cpu (no --triple)"
        )
    info = vmfb_info(vmfb) if vmfb is not None else None
    if info is not None:
        _refuse_other_machine(vmfb, info.arches, here)
    have = host_cpu_features() if have is None else have
    missing = sorted(missing_flags(module, have))
    if missing:
        raise BundleError(
            f"the cpu module needs CPU features this machine lacks: {', '.join(missing)}; "
            f"{_recompile_hint(here)}"
        )
    if info is not None:
        _refuse_missing_features(vmfb, info.cpu_flags, have, here)


def _recompile_hint(arch: str) -> str:
    """What to compile instead for a CPU that lacks a module's features."""
    if arch == "x86_64":
        return ("recompile without --cpu (x86-all, the default on x86-64: a module for every x86-64 level, "
                "each loaded where it runs) or with --cpu host on this machine")
    return "recompile with --cpu generic, with this core's name (e.g. cortex-a55), or with --cpu host on this machine"


def _refuse_other_machine(vmfb: Path, arches: set[str], here: str) -> None:
    if arches and here not in arches:
        raise BundleError(
            f"{vmfb} holds executables for {', '.join(sorted(arches))}; this machine is {here}: "
            "the module was cross-compiled or copied from another bundle"
        )


def _refuse_missing_features(vmfb: Path, cpu_flags: list[str], have: set[str] | None, here: str) -> None:
    missing = [f for f in cpu_flags if have is not None and f not in have]
    if missing:
        raise BundleError(
            f"{vmfb} was compiled for CPU features this machine lacks: {', '.join(missing)}; "
            f"{_recompile_hint(here)}"
        )


def check_vmfb_arch(vmfb: Path, have: set[str] | None = None) -> None:
    """Refuse a CPU module whose embedded executables are for another arch or need CPU features
    this machine lacks (`have`; None: detect them), whatever the manifest says: the module's own
    target attributes decide."""
    info = vmfb_info(vmfb)
    here = host_arch()
    _refuse_other_machine(vmfb, info.arches, here)
    _refuse_missing_features(vmfb, info.cpu_flags, host_cpu_features() if have is None else have, here)


def available_devices(device: str) -> list[str]:
    """Names of the hardware devices the IREE driver for `device` sees; [] if none or no driver."""
    driver = DRIVERS.get(device)
    if driver is None:
        return []
    try:
        found = rt.get_driver(driver).query_available_devices()
    except Exception:  # the driver library (libvulkan, libcuda) is absent
        return []
    return [str(d.get("name", d.get("path", "?"))) for d in found]


def copy_to_host(device: rt.HalDevice, view: rt.HalBufferView, allow_map: bool = True) -> np.ndarray:
    """An owned numpy copy of a device buffer view, without importing host memory.

    Maps the buffer where the device lets the host see it; otherwise, or when
    mapping fails, copies it into a host-visible staging buffer on the device
    queue and reads that. `allow_map=False` forces the staging path (tests).
    """
    dtype = np.dtype(rt.HalElementType.map_to_dtype(view.element_type))
    shape = tuple(view.shape)
    buffer = view.get_buffer()
    mappable = (buffer.memory_type() & int(rt.MemoryType.HOST_VISIBLE)) and (
        buffer.allowed_usage() & int(rt.BufferUsage.MAPPING_SCOPED)
    )
    if mappable and allow_map:
        try:
            return np.array(view.map().asarray(shape, dtype), copy=True)
        except Exception:  # some drivers refuse to map device-local memory: stage instead
            pass
    staging = device.allocator.allocate_buffer(
        memory_type=int(rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE),
        allowed_usage=int(rt.BufferUsage.TRANSFER_TARGET | rt.BufferUsage.MAPPING_SCOPED),
        allocation_size=buffer.byte_length(),
    )
    sem = device.create_semaphore(0)
    device.queue_copy(
        buffer,
        staging,
        wait_semaphores=rt.HalFence.create_at(sem, 0),
        signal_semaphores=rt.HalFence.create_at(sem, 1),
    )
    rt.HalFence.create_at(sem, 1).wait()
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.array(staging.map().asarray((buffer.byte_length(),), np.dtype(np.uint8)), copy=True)
    return raw[:nbytes].view(dtype).reshape(shape)


@dataclass
class DeviceContext:
    name: str
    config: rt.Config
    device: rt.HalDevice
    module: Any  # the bound VM module (functions as attributes)
    module_key: str = ""  # the manifest's key of the loaded module: `cpu`, `cpu-x86-64-v3`, `vulkan`, ...
    # A bundle compiled for several devices (--devices N): all of them, `device` first.
    devices: list[rt.HalDevice] = field(default_factory=list)
    # The thread module calls wait on (runtime/waiter.py): a lower-priority one for the CPU task driver.
    waiter: Waiter = field(default_factory=inline)
    # Why this CPU runs a float module where the bundle has faster ones (cpu_select.fallback_notice).
    cpu_fallback: str | None = None
    # A bundle for several CPU devices: the thread ids of each device's own executor (runtime/worker_time.py).
    device_threads: list[frozenset[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.devices:
            self.devices = [self.device]

    def worker_seconds(self) -> list[float] | None:
        """CPU seconds each device's workers have computed so far; None where the devices' workers are not
        told apart (one device, GPU devices, no /proc)."""
        if not self.device_threads or not any(self.device_threads):
            return None
        return [cpu_seconds(tids) for tids in self.device_threads]

    def upload(self, array: np.ndarray) -> rt.DeviceArray:
        """A device-local copy of `array` (never an import of the host pointer)."""
        return rt.asdevicearray(self.device, np.ascontiguousarray(array))

    def zeros(self, shape: Sequence[int], dtype: Any, device: int = 0) -> rt.DeviceArray:
        """A zero-filled buffer on device `device` (of a bundle for several), filled in place where the
        device allows (no host copy).

        A long-context bundle's caches are hundreds of MB: staging them through a
        host array would hold them twice at the peak.
        """
        if (owner := self._on(self.devices[device])) is not self:
            return owner.zeros(shape, dtype)
        dtype = np.dtype(dtype)
        shape = tuple(int(d) for d in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        element_type = rt.array_interop.map_dtype_to_element_type(dtype)
        if nbytes == 0 or element_type is None:
            return self.upload(np.zeros(shape, dtype=dtype))
        try:
            buffer = self.device.allocator.allocate_buffer(
                memory_type=int(rt.MemoryType.DEVICE_LOCAL),
                allowed_usage=int(rt.BufferUsage.DEFAULT),
                allocation_size=nbytes,
            )
            buffer.fill_zero(0, nbytes)
        except RuntimeError:  # not host-fillable here (some Vulkan drivers): upload zeros instead
            return self.upload(np.zeros(shape, dtype=dtype))
        return rt.DeviceArray(self.device, rt.HalBufferView(buffer, shape, element_type), override_dtype=dtype)

    def _owner(self, array: rt.DeviceArray) -> DeviceContext:
        """The context of the device `array` lives on (another device of a bundle for several)."""
        return self._on(getattr(array, "_device", self.device))

    def _on(self, device: rt.HalDevice) -> DeviceContext:
        """This context for `device`: itself, or a sibling sharing its module (another device of the bundle)."""
        return self if device is self.device else DeviceContext(self.name, self.config, device, self.module,
                                                                 waiter=self.waiter)

    def fill_zero(self, array: rt.DeviceArray) -> rt.DeviceArray:
        """Zero `array` in place where possible; otherwise a fresh zero buffer of its shape."""
        if (owner := self._owner(array)) is not self:
            return owner.fill_zero(array)
        buffer = array._buffer_view.get_buffer()
        try:
            buffer.fill_zero(0, buffer.byte_length())
            return array
        except RuntimeError:
            return self.zeros(array.shape, array.dtype)

    def fill_zero_range(self, array: rt.DeviceArray, offset: int, length: int) -> rt.DeviceArray:
        """Zero `length` bytes of `array` from byte `offset` (one batch row of a state buffer).

        In place where the device allows; otherwise a fresh buffer with that range zeroed.
        """
        if (owner := self._owner(array)) is not self:
            return owner.fill_zero_range(array, offset, length)
        buffer = array._buffer_view.get_buffer()
        try:
            buffer.fill_zero(offset, length)
            return array
        except RuntimeError:  # not host-fillable here (some Vulkan drivers): round trip through the host
            host = self.to_host(array)
            host.reshape(-1).view(np.uint8)[offset : offset + length] = 0
            return self.upload(host)

    def read_range(self, array: rt.DeviceArray, offset: int, length: int) -> np.ndarray:
        """An owned host copy of `length` bytes of `array` from byte `offset` (one batch row of a state
        buffer), as uint8: only that range crosses, through a host-visible staging buffer."""
        if length == 0:
            return np.zeros(0, np.uint8)
        if (owner := self._owner(array)) is not self:
            return owner.read_range(array, offset, length)
        buffer = array._buffer_view.get_buffer()
        try:
            staging = self.device.allocator.allocate_buffer(
                memory_type=int(rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE),
                allowed_usage=int(rt.BufferUsage.TRANSFER_TARGET | rt.BufferUsage.MAPPING_SCOPED),
                allocation_size=length,
            )
            self._copy_range(buffer, staging, offset, 0, length)
            return np.array(staging.map().asarray((length,), np.dtype(np.uint8)), copy=True)
        except RuntimeError:  # no queue copies of a range here: the whole buffer crosses instead
            return self.to_host(array).reshape(-1).view(np.uint8)[offset : offset + length].copy()

    def write_range(self, array: rt.DeviceArray, offset: int, data: np.ndarray) -> rt.DeviceArray:
        """Write the bytes of `data` into `array` from byte `offset` (one batch row of a state buffer).

        In place where the device allows (a queue copy from a device copy of `data`), so the other
        rows are never read or written; otherwise a fresh buffer with that range replaced.
        """
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if raw.size == 0:
            return array
        if (owner := self._owner(array)) is not self:
            return owner.write_range(array, offset, data)
        buffer = array._buffer_view.get_buffer()
        try:
            source = self.device.allocator.allocate_buffer_copy(
                memory_type=int(rt.MemoryType.DEVICE_LOCAL), allowed_usage=int(rt.BufferUsage.DEFAULT),
                device=self.device, buffer=raw)
            self._copy_range(source, buffer, 0, offset, raw.size)
            return array
        except RuntimeError:  # round trip through the host
            host = self.to_host(array)
            host.reshape(-1).view(np.uint8)[offset : offset + raw.size] = raw
            return self.upload(host)

    def _copy_range(self, source: rt.HalBuffer, target: rt.HalBuffer, source_offset: int, target_offset: int,
                    length: int) -> None:
        """Copy `length` bytes between device buffers on the queue and wait for it."""
        commands = rt.HalCommandBuffer(self.device)
        commands.copy(source, target, source_offset, target_offset, length, end=True)
        sem = self.device.create_semaphore(0)
        self.device.queue_execute(commands, wait_semaphores=rt.HalFence.create_at(sem, 0),
                                  signal_semaphores=rt.HalFence.create_at(sem, 1))
        rt.HalFence.create_at(sem, 1).wait()

    def first_rows(self, array: rt.DeviceArray, rows: int) -> rt.DeviceArray:
        """A view of the first `rows` rows of a state buffer (the same device memory), for an entry
        point compiled for fewer rows than the buffer holds: rows are its outermost dimension."""
        if rows == array.shape[0]:
            return array
        view = array._buffer_view
        shape = (rows, *array.shape[1:])
        return rt.DeviceArray(self._owner(array).device, rt.HalBufferView(view.get_buffer(), shape, view.element_type),
                              override_dtype=array.dtype)

    def to_host(self, array: rt.DeviceArray) -> np.ndarray:
        """An owned host copy; safe on drivers that cannot import or map host memory."""
        # DeviceArray.to_host would import a numpy allocation into the device
        # (rejected by lavapipe); the buffer view is the only handle to the data.
        return copy_to_host(self._owner(array).device, array._buffer_view)

    def call(self, fn: str, inputs: list[np.ndarray], state: list[rt.DeviceArray]) -> np.ndarray:
        """Run an entry point; the state buffers are updated in place, the logits come back."""
        args = [self.upload(a) for a in inputs] + list(state)
        try:
            entry = getattr(self.module, fn)
        except AttributeError as e:
            raise BundleError(f"the {self.name} module has no entry point {fn!r}") from e

        def invoke() -> np.ndarray:
            result = entry(*args)
            if isinstance(result, (tuple, list)):
                raise BundleError(f"entry point {fn} returned {len(result)} values; expected logits only")
            return self.to_host(result)

        return self.waiter.run(invoke)

    def close(self) -> None:
        """Stop the waiting thread (after a call in progress). Idempotent."""
        self.waiter.close()


# IREE creates its CPU task driver (and its worker threads) once per process, from flags
# read at that moment: the first CPU load fixes the thread count for the process.
_cpu_task_threads: int | None = None
_cpu_task_created = False
# Models may be loaded from several threads at once: the check of the count fixed so far and the
# setting of it are one step, or two first loads could each set their own count.
_cpu_task_lock = threading.Lock()


def _cpu_driver(threads: int | None) -> str:
    """The IREE driver for `threads` CPU threads: local-sync for 1 (runs on the caller's thread), else local-task."""
    with _cpu_task_lock:
        return _cpu_driver_locked(threads)


def _cpu_driver_locked(threads: int | None) -> str:
    global _cpu_task_threads, _cpu_task_created
    if threads is None and _cpu_task_created:
        threads = _cpu_task_threads
    elif threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise InputError(f"threads must be a positive integer, got {threads!r}")
    if threads == 1:
        return "local-sync"
    if _cpu_task_created and threads != _cpu_task_threads:
        raise InputError(
            f"this process already runs CPU models on {_cpu_task_threads or 'the default number of'} threads; "
            f"IREE fixes the CPU thread count at the first load, so threads={threads} needs a new process"
        )
    if not _cpu_task_created:
        if threads is not None:
            rt.flags.parse_flags(f"--task_topology_max_group_count={threads}")
        _cpu_task_threads, _cpu_task_created = threads, True
    return "local-task"


def _create_config(device: str, threads: int | None = None) -> rt.Config:
    """The IREE device for `device`, or a BundleError that says what is absent."""
    if device != "cpu" and not available_devices(device):
        raise BundleError(
            f"device {device!r} is not available here: the IREE {DRIVERS[device]!r} driver finds no device "
            f"({'install a Vulkan driver such as mesa-vulkan-drivers' if device == 'vulkan' else 'no NVIDIA GPU or libcuda'})"
        )
    cpu_driver = _cpu_driver(threads) if device == "cpu" else None  # a bad thread count is the caller's error
    try:
        if cpu_driver is not None:
            return rt.Config(cpu_driver)
        # A GPU device of its own, not IREE's process-wide cached one: it goes when the model goes. An idle
        # Vulkan device keeps two IREE threads waiting on its semaphores, and on Mesa's lavapipe (a CPU Vulkan)
        # those waits poll, a core each, for as long as the device lives.
        return rt.Config(device=rt.get_device(DRIVERS[device], cache=False))
    except Exception as e:
        raise BundleError(f"device {device!r} is not available here: {e}") from e


def _more_devices(device: str, count: int) -> list[rt.HalDevice]:
    """GPU devices 1..count of a bundle compiled for several: the driver's next GPUs in its order, one GPU
    each (IREE will not make one GPU two devices of a group)."""
    driver = rt.get_driver(DRIVERS[device])
    found = [d["device_id"] for d in driver.query_available_devices()]
    if len(found) <= count:
        raise BundleError(f"the bundle runs on {count + 1} {device} devices, one GPU each; this machine has "
                          f"{len(found)} ({DRIVERS[device]} driver): run it where there are as many GPUs, or "
                          f"compile it with fewer --devices")
    try:
        return [driver.create_device(found[j + 1]) for j in range(count)]
    except Exception as e:
        raise BundleError(f"could not open {count + 1} {device} devices: {e}") from e


# IREE's own default of --task_topology_max_group_count: the cap on one worker per physical core.
_IREE_DEFAULT_MAX_WORKERS = 64


def physical_cores() -> int:
    """This host's physical cores (/proc/cpuinfo's distinct physical id and core id pairs), as IREE counts
    them for its default worker count; the logical CPU count where cpuinfo does not say."""
    cores = set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        package = core = None
        for line in cpuinfo.read_text().splitlines() + [""]:
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "physical id":
                package = value.strip()
            elif key == "core id":
                core = value.strip()
            elif not line.strip():
                if core is not None:
                    cores.add((package, core))
                package = core = None
    return len(cores) or os.cpu_count() or 1


def workers_per_device(threads: int | None, count: int) -> list[int]:
    """Each device's worker count when a bundle runs on `count` CPU devices: `threads` each (None: one per
    physical core).

    The devices of one host share its cores, and a device waits on another at every hand-over. Measured on
    a 2-core host (SmolLM2, 2 devices, tensor split; docs/scaling.md), each device with workers for every
    core decoded faster than one shared pool, and one shared pool faster than the cores divided between
    the devices, whose workers idle while their device waits.
    """
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise InputError(f"threads must be a positive integer, got {threads!r}")
    return [threads or physical_cores()] * count


def _own_cpu_devices(threads: int | None, count: int) -> tuple[list[rt.HalDevice], list[frozenset[int]]]:
    """`count` CPU devices, each with a task executor and worker threads of its own, so that what the
    module runs on one device never waits for a worker busy with another's; and each one's thread ids.

    IREE reads the worker count from its flags when a driver is created; each device gets a driver of
    its own, and the flag is put back to what the process-wide CPU driver reads (`_cpu_driver`). The
    executor starts its threads as the device is created: the ids that appear then are the device's.
    """
    workers = workers_per_device(threads, count)
    devices, threads_of = [], []
    with _cpu_task_lock:
        try:
            for n in workers:
                rt.flags.parse_flags(f"--task_topology_max_group_count={n}")
                before = task_ids()
                devices.append(create_hal_driver("local-task").create_default_device())
                threads_of.append(frozenset(task_ids() - before))
        except Exception as e:
            raise BundleError(f"could not open {count} cpu devices: {e}") from e
        finally:
            rt.flags.parse_flags(f"--task_topology_max_group_count={_cpu_task_threads or _IREE_DEFAULT_MAX_WORKERS}")
    return devices, threads_of


def _reflection(module: rt.VmModule, name: str) -> dict[str, str] | None:
    """An exported function's reflection attributes, or None when the module lacks the function."""
    function = module.lookup_function(name)
    return None if function is None else dict(function.reflection)


def open_device(manifest: Manifest, device: str, verify: bool = True, threads: int | None = None,
                cpu: str | None = None, features: str | Iterable[str] | None = None,
                ort_providers: Sequence[str] | None = None) -> DeviceContext | OnnxContext:
    """Create the device, load params + module for it; clear errors for what is missing.

    threads: CPU worker threads (None: IREE's default, one per physical core; 1: the caller's thread).
    cpu: pin the CPU module compiled for that --cpu name (else the best one this CPU runs,
    runtime/cpu_select.py); features: the CPU flags to assume (cpu_features).
    ort_providers: the onnxruntime device's execution providers, in order of preference (default: cpu).
    """
    if device not in (*DRIVERS, ONNX_DEVICE):
        raise BundleError(f"unknown device {device!r}; expected one of {', '.join((*DRIVERS, ONNX_DEVICE))}")
    if ort_providers is not None and device != ONNX_DEVICE:
        raise InputError(f"ONNX Runtime providers apply to the {ONNX_DEVICE} device, not {device!r}")
    if device not in manifest.devices():
        raise BundleError(
            f"bundle {manifest.root} has no module for device {device!r} (it has: {', '.join(manifest.devices())}); "
            f"recompile with --target {device}"
        )
    if (cpu is not None or features is not None) and device != "cpu":
        raise InputError(f"cpu and cpu_features apply to the cpu device, not {device!r}")
    if device == ONNX_DEVICE:
        return open_onnx(manifest, verify, threads, DEFAULT_PROVIDERS if ort_providers is None else ort_providers)
    nice = wait_nice()  # a bad $FOLDLINE_WAIT_NICE is refused before any file is read
    have = cpu_features(features) if device == "cpu" else None
    try:
        key = select_cpu_module(manifest, have, host_arch(), cpu) if device == "cpu" else manifest.module_keys(device)[0]
        entry = manifest.modules[key]
        check_host_compatible(entry, device, have, manifest.root / entry.file if device == "cpu" else None)
    except BundleError as e:
        if features is None and os.environ.get(CPU_FEATURES_ENV, "").strip():
            raise BundleError(f"{e} (CPU features from ${CPU_FEATURES_ENV}={os.environ[CPU_FEATURES_ENV]})") from None
        raise
    manifest.check_sizes(key)
    if verify:
        manifest.verify_module(key)
        manifest.verify_params()
        manifest.verify_tokenizer()
    if threads is not None and device != "cpu":
        raise InputError(f"threads applies to the cpu device, not {device!r}")
    own_cpu_devices = device == "cpu" and manifest.device_count > 1
    if own_cpu_devices:  # a bundle compiled with --devices N for the CPU: N devices, each with its own workers
        devices, device_threads = _own_cpu_devices(threads, manifest.device_count)
        config = rt.Config(device=devices[0])
    else:
        config = _create_config(device, threads)
        devices, device_threads = [config.device], []
    instance = config.vm_instance
    modules = []
    providers = []
    for archive in manifest.params_files:  # params.irpa, then each further device's own archive
        path = manifest.root / archive.file
        index = rt.ParameterIndex()
        try:
            index.load(str(path))  # mmapped
        except Exception as e:
            raise BundleError(f"could not read parameters {path}: {e}") from e
        providers.append(index.create_provider(scope=archive.scope))
    if providers:
        modules.append(rt.create_io_parameters_module(instance, *providers))
    if manifest.device_count > 1:  # a bundle compiled with --devices N: N devices of the same driver, in order
        if not own_cpu_devices:
            devices += _more_devices(device, manifest.device_count - 1)
        config.default_vm_modules = ()  # the HAL module below is the only one, over every device
    modules.append(rt.create_hal_module(instance, devices=devices) if len(devices) > 1
                   else rt.create_hal_module(instance, config.device))
    vmfb = manifest.root / entry.file
    try:
        vm_module = rt.VmModule.mmap(instance, str(vmfb))
    except Exception as e:
        raise BundleError(f"could not load {vmfb} on {device}: {e}") from e
    manifest.check_entry_points(key, lambda name: _reflection(vm_module, name))
    modules.append(vm_module)
    try:
        loaded = rt.load_vm_modules(*modules, config=config)
    except Exception as e:
        raise BundleError(f"could not load {vmfb} on {device}: {e}") from e
    # local-task runs calls on its worker threads while this side waits: wait at a lower priority
    waiter = Waiter(nice) if device == "cpu" and str(config.device) != "local-sync" else inline()
    notice = fallback_notice(manifest, key, have, host_arch()) if device == "cpu" and cpu is None else None
    if notice is not None and notice not in _notices_given:
        _notices_given.add(notice)
        log.warning(notice)
    return DeviceContext(device, config, config.device, loaded[-1], key, devices, waiter, notice, device_threads)
