"""How close a decode step comes to the host's memory wall: bytes read per token, the host's read
bandwidth measured in the same run, and the dispatches a step records.

A decode step of a small model is bound by what it reads (every weight the
step multiplies by, the cache entries attention reads) and by how many
dispatches it issues, each paying the task system's cost. `foldline bench`
prints, under its throughput table:

- dispatches per step: `hal.command_buffer.dispatch` calls in the module's
  one-row decode function, read from `iree-dump-module`'s disassembly (the
  step is straight-line VM code; a branch makes the count an upper bound);
- bytes read per token: the parameters the step reads (an untied embedding
  table is looked up one row at a time, so it does not count) plus one row's
  state held at the decode's middle position;
- the host's read bandwidth: glibc's `memchr` over a buffer larger than the
  caches, split over the same number of threads as the engine's best run
  (ctypes drops the GIL, so the threads read in parallel); numpy's `max`
  where there is no glibc. It is a floor on what the host reads, not a
  peak: the fraction printed can only be generous to the host.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..contract.entry_points import row_entry_name
from ..contract.manifest import Manifest
from ..runtime.session_file import held_nbytes

PROBE_BYTES = 1 << 30  # larger than any host's last-level cache
PROBE_REPEATS = 5


@dataclass(frozen=True)
class StepReads:
    """What one row's decode step reads, in bytes."""

    weights: int
    state: int
    held: int  # the position the state was sized at

    @property
    def total(self) -> int:
        return self.weights + self.state


def step_reads(manifest: Manifest, held: int) -> StepReads:
    """Bytes a one-row decode step reads with `held` tokens in the caches."""
    import iree.runtime as rt

    untied = not manifest.config.get("tie_word_embeddings", True)
    weights = 0
    for archive in manifest.params_files:
        index = rt.ParameterIndex()
        index.load(str(manifest.root / archive.file))
        for name, entry in index.items():
            if untied and name.startswith("embed_tokens."):
                continue  # looked up one row per token; the head has its own table
            weights += entry.length
    rows = manifest.batch
    state = held_nbytes(manifest.state, held) // rows
    return StepReads(weights, state, held)


@functools.cache
def dispatches_per_step(vmfb: Path, batch: int = 1) -> tuple[int, bool] | None:
    """(dispatches the one-row decode function records, whether it branches); None without iree-dump-module."""
    text = disassemble(vmfb)
    return None if text is None else count_dispatches(text, row_entry_name("decode", 1, batch) + "$async")


def disassemble(vmfb: Path) -> str | None:
    """`iree-dump-module --output=disassembly` of a module (it ships with iree-base-runtime); None without it."""
    tool = shutil.which("iree-dump-module") or _beside_python("iree-dump-module")
    if tool is None:
        return None
    return subprocess.run([tool, "--output=disassembly", str(vmfb)], capture_output=True, text=True,
                          check=True).stdout


def count_dispatches(disassembly: str, function: str) -> tuple[int, bool]:
    """Dispatch calls a call of `function` makes, from an `iree-dump-module --output=disassembly` text, and
    whether they branch (then the count is an upper bound).

    A step with no shape that depends on its inputs is recorded once: IREE builds its command buffer
    in the module's initializer and the function replays it (`hal.device.queue.execute.indirect`
    of a global); its dispatches are then those of the function that recorded it.
    """
    bodies = function_bodies(disassembly)
    if function not in bodies:
        raise ValueError(f"no function {function!r} in the module's disassembly")
    counted = [bodies[function]]
    for line in bodies[function]:
        replayed = _REPLAYED.match(line)
        if replayed:
            counted.append(bodies[_recorder(bodies, replayed.group(1))])
    calls = sum(" @hal.command_buffer.dispatch" in line for body in counted for line in body)
    branches = any(line.startswith(("vm.br ", "vm.cond_br ")) for body in counted for line in body)
    return calls, branches


_REPLAYED = re.compile(r"%r\d+ = vm\.global\.load\.ref \.refs\[(\d+)\] : !hal\.command_buffer")
_CALL = re.compile(r"%r(\d+) = vm\.call @module:(\d+)\(")


def function_bodies(disassembly: str) -> dict[str, list[str]]:
    """Each `vm.func`'s stripped body lines, by name, in the module's order (a function's ordinal)."""
    bodies: dict[str, list[str]] = {}
    body: list[str] | None = None
    for line in disassembly.splitlines():
        if line.startswith("vm.func @"):
            body = bodies.setdefault(line[len("vm.func @"):].split("(", 1)[0], [])
        elif line.startswith("}"):
            body = None
        elif body is not None:
            body.append(line.strip())
    return bodies


def _recorder(bodies: dict[str, list[str]], slot: str) -> str:
    """The function whose result the initializer stores in command buffer global `slot`."""
    store = re.compile(rf"vm\.global\.store\.ref %[rR](\d+), \.refs\[{slot}\] : !hal\.command_buffer")
    names = list(bodies)
    for body in bodies.values():
        for i, line in enumerate(body):
            stored = store.match(line)
            if not stored:
                continue
            for earlier in reversed(body[:i]):
                call = _CALL.match(earlier)
                if call and call.group(1) == stored.group(1):
                    return names[int(call.group(2))]
    raise ValueError(f"no function records the command buffer in global {slot}")


def _beside_python(name: str) -> str | None:
    import sys

    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.is_file() else None


def _memchr_reader() -> Callable[[int, int], None] | None:
    """A read of `size` bytes at address `base` that releases the GIL (glibc memchr), or None."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    memchr = libc.memchr
    memchr.restype = ctypes.c_void_p
    memchr.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    return lambda base, size: memchr(base, 1, size)  # the buffer is zeros: memchr reads every byte


def host_read_gb_s(threads: int, nbytes: int = PROBE_BYTES, repeats: int = PROBE_REPEATS) -> list[float]:
    """GB/s read by `threads` threads over `nbytes` of memory, one figure per repeat."""
    buffer = np.zeros(nbytes, dtype=np.uint8)
    buffer[::4096] = 0  # touch every page before timing
    reader = _memchr_reader()
    size = nbytes // threads
    base = buffer.ctypes.data

    def read(i: int) -> None:
        if reader is not None:
            reader(base + i * size, size)
        else:
            buffer[i * size:(i + 1) * size].max()

    out = []
    for _ in range(repeats):
        workers = [threading.Thread(target=read, args=(i,)) for i in range(threads)]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        out.append(size * threads / (time.perf_counter() - t0) / 1e9)
    return out


@dataclass(frozen=True)
class MemoryWall:
    """foldline's decode against the host's read bandwidth, as printed and written to --json."""

    module: str
    dispatches: int | None
    branches: bool
    reads: StepReads
    decode_tok_s: float
    host_read_gb_s: list[float]
    threads: int

    @property
    def decode_gb_s(self) -> float:
        return self.reads.total * self.decode_tok_s / 1e9

    @property
    def fraction(self) -> float:
        """The decode's read rate over the best bandwidth the probe measured."""
        return self.decode_gb_s / max(self.host_read_gb_s)

    def lines(self) -> list[str]:
        if self.dispatches is None:
            steps = "dispatches per step: iree-dump-module not found"
        else:
            steps = f"{'at most ' if self.branches else ''}{self.dispatches} dispatches per decode step"
        r, bw = self.reads, self.host_read_gb_s
        return [
            f"foldline decode ({self.module}): {steps}; reads {r.total / 1e6:.1f} MB per token "
            f"(weights {r.weights / 1e6:.1f} MB, state {r.state / 1e6:.2f} MB at {r.held} held), "
            f"{self.decode_gb_s:.1f} GB/s at the median decode",
            f"host read bandwidth, {self.threads} thread(s): {max(bw):.1f} GB/s (best of {len(bw)}, "
            f"{min(bw):.1f}-{max(bw):.1f}); foldline's decode reads at {100 * self.fraction:.0f}% of it",
        ]

    def as_json(self) -> dict:
        return {"module": self.module, "dispatches_per_step": self.dispatches, "dispatches_upper_bound": self.branches,
                "weights_read_bytes": self.reads.weights, "state_read_bytes": self.reads.state, "held": self.reads.held,
                "decode_gb_s": self.decode_gb_s, "host_read_gb_s": self.host_read_gb_s, "threads": self.threads,
                "fraction": self.fraction}


def measure_wall(manifest: Manifest, module_key: str, decode_tok_s: float, held: int, threads: int,
                 bandwidth: list[float]) -> MemoryWall:
    """What the module's step reads beside `bandwidth`, the host's read rates measured with `threads` threads
    in this run (host_read_gb_s)."""
    counted = dispatches_per_step(manifest.root / manifest.modules[module_key].file, manifest.batch)
    calls, branches = counted if counted is not None else (None, False)
    return MemoryWall(module_key, calls, branches, step_reads(manifest, held), decode_tok_s, bandwidth, threads)
