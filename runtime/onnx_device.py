"""The `onnxruntime` device: a bundle's ONNX graphs (`foldline compile --target onnx`) run by ONNX Runtime.

It offers what sessions and batches use of a device (runtime/device.py's
`DeviceContext`): zeroed state buffers, row ranges, views of the first rows and
a call per function. Here the state buffers are host arrays: each call feeds
them to the function's graph and writes the next state it returns back into
them, so `Session`, `Batch`, snapshots and the server work unchanged. The
caches a graph updates in place (its GroupQueryAttention's, listed in the
graph's metadata: backends/onnx/gqa.py) are bound as both input and output
over the same array, so ONNX Runtime writes their one new slot there; the
other state is copied back (docs/onnx.md).

Imports onnxruntime only: no torch, no onnx.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..contract.entry_points import DYNAMIC, INPLACE_STATE_KEY, NEXT_SUFFIX
from ..contract.errors import BundleError
from ..contract.manifest import Manifest
from ..errors import InputError

DEVICE = "onnxruntime"
PROVIDER_SUFFIX = "ExecutionProvider"  # CUDAExecutionProvider: the short name is "cuda"
DEFAULT_PROVIDERS = ("cpu",)
# ONNX Runtime's type names of the dtypes a bundle's inputs use.
ORT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(int8)": "int8", "tensor(int64)": "int64"}

log = logging.getLogger("foldline")


@dataclass
class OnnxContext:
    """ONNX Runtime sessions, one per function of the module, over host state buffers."""

    sessions: dict[str, Any]  # function -> onnxruntime.InferenceSession
    module_key: str = DEVICE
    name: str = DEVICE
    input_names: dict[str, list[str]] = field(default_factory=dict)
    inplace: dict[str, frozenset[str]] = field(default_factory=dict)  # function -> state inputs it updates in place
    # function -> (the state arrays, their IO binding): kept while the same arrays come back, as a
    # session's do step after step; binding every cache anew would add to each decode step (docs/onnx.md)
    _bindings: dict[str, tuple[list[np.ndarray], Any]] = field(default_factory=dict, repr=False)

    def close(self) -> None:
        """Drop the sessions and their bindings (the model is closed). Idempotent."""
        self.sessions = {}
        self._bindings.clear()

    def zeros(self, shape: Sequence[int], dtype: Any, device: int = 0) -> np.ndarray:
        """Host arrays: ONNX Runtime's CPU session has one device (`device` is always 0)."""
        return np.zeros(tuple(int(d) for d in shape), dtype=np.dtype(dtype))

    def upload(self, array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(array).copy()

    @staticmethod
    def _bytes(array: np.ndarray) -> np.ndarray:
        return array.reshape(-1).view(np.uint8)

    def fill_zero_range(self, array: np.ndarray, offset: int, length: int) -> np.ndarray:
        self._bytes(array)[offset : offset + length] = 0
        return array

    def read_range(self, array: np.ndarray, offset: int, length: int) -> np.ndarray:
        return self._bytes(array)[offset : offset + length].copy()

    def write_range(self, array: np.ndarray, offset: int, data: np.ndarray) -> np.ndarray:
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        self._bytes(array)[offset : offset + raw.size] = raw
        return array

    def first_rows(self, array: np.ndarray, rows: int) -> np.ndarray:
        return array[:rows]  # rows are the outermost dimension: a contiguous view

    def to_host(self, array: np.ndarray) -> np.ndarray:
        return array.copy()

    def call(self, fn: str, inputs: list[np.ndarray], state: list[np.ndarray]) -> np.ndarray:
        """Run `fn`; its next state is written into `state`, the logits come back."""
        session = self.sessions.get(fn)
        if session is None:
            raise BundleError(f"the onnxruntime module has no function {fn!r}")
        names = self.input_names[fn]
        inplace = self.inplace.get(fn)
        if not inplace:
            outputs = session.run(None, dict(zip(names, [*inputs, *state])))
            for buffer, new in zip(state, outputs[: len(state)]):
                np.copyto(buffer, new)
            return outputs[-1]
        binding = self._binding(fn, state)
        for name, array in zip(names, inputs):
            binding.bind_cpu_input(name, np.ascontiguousarray(array))
        bound: list[np.ndarray | None] = []  # per bound output, in order: the buffer to copy it into, or None
        for name, buffer in zip(names[len(inputs):], state):
            if name in inplace:  # bound once, in _binding
                bound.append(None)
            else:
                binding.bind_cpu_input(name, buffer)
                binding.bind_output(name + NEXT_SUFFIX)
                bound.append(buffer)
        binding.bind_output("logits")
        session.run_with_iobinding(binding)
        outputs = binding.get_outputs()  # OrtValues, in binding order: no copy of the in-place caches
        for buffer, value in zip(bound, outputs):
            if buffer is not None:
                np.copyto(buffer, value.numpy())
        return outputs[-1].numpy()

    def _binding(self, fn: str, state: list[np.ndarray]) -> Any:
        """`fn`'s IO binding over these state arrays, each in-place cache bound as its own input and
        output (ONNX Runtime writes its new slots there); made again when the arrays change.

        Every output is bound here, in the graph's order, so that `get_outputs` keeps that order
        when `call` binds the others again (a name bound again keeps its place)."""
        cached = self._bindings.get(fn)
        if cached is not None and len(cached[0]) == len(state) and all(a is b for a, b in zip(cached[0], state)):
            return cached[1]
        import onnxruntime as ort

        binding = self.sessions[fn].io_binding()
        names = self.input_names[fn][len(self.input_names[fn]) - len(state):]
        for name, buffer in zip(names, state):
            if name in self.inplace[fn]:
                value = ort.OrtValue.ortvalue_from_numpy(buffer)
                binding.bind_ortvalue_input(name, value)
                binding.bind_ortvalue_output(name + NEXT_SUFFIX, value)
            else:
                binding.bind_output(name + NEXT_SUFFIX)
        binding.bind_output("logits")
        self._bindings[fn] = (list(state), binding)  # holds the arrays: their ids stay theirs
        return binding


def _check_inputs(manifest: Manifest, fn: str, session: Any, want: list[tuple[list[int], str, str]]) -> None:
    """The graph takes what the manifest implies, in order: checked before the first call."""
    have = session.get_inputs()
    graph = manifest.modules[DEVICE].parts[fn].file
    if len(have) != len(want):
        raise BundleError(f"{graph} takes {len(have)} inputs, the manifest implies {len(want)}: "
                          "graph and manifest are from different builds")
    for arg, (shape, dtype, what) in zip(have, want):
        dims = [d if isinstance(d, int) else DYNAMIC for d in arg.shape]
        if (dims, ORT_TYPES.get(arg.type, arg.type)) != (shape, dtype):
            raise BundleError(f"{graph} takes {what} as {ORT_TYPES.get(arg.type, arg.type)}{dims}; the manifest "
                              f"says {dtype}{shape}: graph and manifest are from different builds")


def short_provider_name(provider: str) -> str:
    """ONNX Runtime's provider name as the command line spells it: CUDAExecutionProvider -> cuda."""
    return provider.removesuffix(PROVIDER_SUFFIX).lower()


def execution_providers(names: Sequence[str], known: Sequence[str], available: Sequence[str]) -> list[str]:
    """ONNX Runtime's names of the providers asked for, in order of preference (`cuda`, `cpu`, or the full
    `CUDAExecutionProvider`); InputError for a name ONNX Runtime does not know, or one this build lacks.

    known: every provider ONNX Runtime names (get_all_providers); available: those this build has."""
    by_name = {short_provider_name(p): p for p in known} | {p.lower(): p for p in known}
    have = ", ".join(short_provider_name(p) for p in available)
    resolved = []
    for name in names:
        provider = by_name.get(name.strip().lower())
        if provider is None:
            raise InputError(f"unknown ONNX Runtime provider {name!r}; this onnxruntime has: {have} "
                             f"(ONNX Runtime knows: {', '.join(sorted(short_provider_name(p) for p in known))})")
        if provider not in available:
            raise InputError(f"ONNX Runtime provider {name!r} ({provider}) is not in this onnxruntime build, which "
                             f"has: {have} (a GPU provider needs its own package, e.g. onnxruntime-gpu for cuda)")
        resolved.append(provider)
    if not resolved:
        raise InputError("no ONNX Runtime provider given; e.g. cpu, or cuda,cpu")
    return resolved


def fallback_notice(gaps: dict[str, dict[str, int]] | None, chosen: Sequence[str]) -> str | None:
    """What a user naming GPU providers should know: the nodes of the graphs a chosen provider (not the last)
    has no kernel for, which ONNX Runtime runs on the next one, copying across (the compile's check, kept
    in the manifest: backends/onnx/providers.py). None when every node has a kernel, or nothing was checked."""
    lines = []
    for provider, later in zip(chosen, chosen[1:]):
        ops = (gaps or {}).get(short_provider_name(provider))
        if ops:
            lines.append(f"{sum(ops.values())} nodes of this bundle's ONNX graphs have no {short_provider_name(provider)} "
                         f"kernel and run on {short_provider_name(later)}: "
                         + ", ".join(f"{n} {op}" for op, n in ops.items()))
    return "; ".join(lines) or None


def open_onnx(manifest: Manifest, verify: bool = True, threads: int | None = None,
              providers: Sequence[str] = DEFAULT_PROVIDERS) -> OnnxContext:
    """ONNX Runtime sessions for every function of the bundle's ONNX module, on `providers` (short or full
    names, in order of preference; each node runs on the first that takes it)."""
    try:
        import onnxruntime as ort
    except ImportError:
        raise BundleError("the onnxruntime device needs ONNX Runtime: pip install 'foldline[onnx]'") from None
    chosen = execution_providers(providers, ort.get_all_providers(), ort.get_available_providers())
    if DEVICE not in manifest.modules:
        raise BundleError(f"bundle {manifest.root} has no ONNX module (it has: {', '.join(manifest.devices())}); "
                          "recompile with --target onnx")
    manifest.check_sizes(DEVICE)
    if verify:
        manifest.verify_module(DEVICE)
        manifest.verify_tokenizer()
    for buf in manifest.state:
        if buf.dtype not in ("float32", "float16"):
            raise BundleError(f"state buffer {buf.name!r} is {buf.dtype}; the onnxruntime device takes float32 "
                              f"and float16 state (recompile with --kv-dtype f16)")
    notice = fallback_notice(manifest.modules[DEVICE].provider_gaps, chosen)
    if notice is not None:
        log.warning(notice)
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: its constant folding warns of ops it leaves to run time
    if threads is not None:
        options.intra_op_num_threads = threads
    wanted = manifest.entry_point_inputs()
    sessions, names, inplace = {}, {}, {}
    for fn, part in manifest.modules[DEVICE].parts.items():
        if fn not in wanted:
            raise BundleError(f"the ONNX module has a graph for {fn!r}, which the manifest does not imply")
        try:
            session = ort.InferenceSession(str(manifest.root / part.file), options, providers=chosen)
        except Exception as e:
            raise BundleError(f"ONNX Runtime could not load {manifest.root / part.file}: {e}") from e
        _check_inputs(manifest, fn, session, wanted[fn])
        sessions[fn], names[fn] = session, [i.name for i in session.get_inputs()]
        listed = session.get_modelmeta().custom_metadata_map.get(INPLACE_STATE_KEY, "")
        inplace[fn] = frozenset(n for n in listed.split(",") if n) & {b.name for b in manifest.state}
    missing = sorted(set(wanted) - set(sessions))
    if missing:
        raise BundleError(f"the ONNX module has no graph for {', '.join(missing)}: recompile the bundle")
    return OnnxContext(sessions, input_names=names, inplace=inplace)
