"""What a compile is asked for (`BuildOptions`) and where an earlier identical compile lies in the cache.

Torch-free on purpose: `foldline compile` answers an unchanged compile from the
compile cache (backends/compile_cache.py) without importing torch or the
compiler stages, which take seconds to import.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputError
from .compile_cache import CompileCache, cache_key
from .targets import Target, make_target

Progress = Callable[[str], None]


@dataclass
class BuildOptions:
    targets: list[Target] = field(default_factory=lambda: [make_target("cpu")])
    passes: list[str] | None = None  # None: the default pipeline
    chunk: int | None = None  # prefill chunk; None: policy.default_chunk()
    batch: int = 1
    rows: tuple[int, ...] | None = None  # row counts below batch with entry points of their own; None: (1,) if batch > 1
    max_context: int | None = None
    dump_after: dict[str, Path] = field(default_factory=dict)
    keep_mlir: bool = False
    hadamard: str = "fold"  # fuse-hadamard mode: "fold" rotations into float weights, or keep them "online"
    weights: str = "auto"  # quantize-weights mode: auto (the checkpoint's blocks), f32, int8, int4
    group: int = 32  # quantization group for requantized weights
    kv_dtype: str = "auto"  # attention cache element type: auto (policy.default_kv_dtype), float32, float16, bfloat16
    dtype: str = "auto"  # compute dtype: auto (policy.default_compute_dtype), float32, float16, bfloat16
    activations: str = "auto"  # quantized products: auto (int8 where the CPU has AVX2 or VNNI), int8, f32
    attention: str = "auto"  # prefill attention: auto, fused (one flash-style op), decomposed (backends/iree/fused_attention.py)
    devices: int = 1  # devices the model is placed on (passes/place_devices.py, backends/iree/multi_device.py)
    scheme: str = "pipeline"  # with devices > 1: "pipeline" (runs of layers) or "tensor" (heads and features)
    onnx_opset: int = 23  # ONNX targets: the highest opset the graphs may use, one of ONNX_OPSETS


# What --onnx-opset takes: torch's exporter writes opset 20, and the norm fusion's RMSNormalization
# raises the graphs to 23, the default (backends/onnx/norms.py).
ONNX_OPSETS = (20, 21, 22, 23)


def check_onnx_opset(options: BuildOptions) -> None:
    """--onnx-opset: one of ONNX_OPSETS."""
    if options.onnx_opset not in ONNX_OPSETS:
        raise InputError(f"--onnx-opset takes {', '.join(map(str, ONNX_OPSETS))}, not {options.onnx_opset!r}")


def row_counts(options: BuildOptions) -> list[int]:
    """The row counts with entry points of their own, ascending, ending with the batch.

    A batched module computes every row it is given; the runtime calls the smallest
    variant that covers the rows in use (runtime/batch.py), so one stream on a batch-8
    bundle costs one row. Default: the powers of two below the batch, then the batch
    (1, 2, 4, 8 for 8): a stream on row 1 then costs two rows, not eight.
    """
    powers = tuple(1 << i for i in range(options.batch.bit_length()) if 1 << i < options.batch)
    below = powers if options.rows is None else options.rows
    bad = [k for k in below if not 1 <= k < options.batch]
    if bad:
        raise InputError(f"row counts must be between 1 and --batch {options.batch} (exclusive), got {bad}")
    return sorted(set(below)) + [options.batch]


MULTI_DEVICE_TARGETS = ("cpu", "vulkan", "cuda")  # the IREE targets compiled for several devices
DEVICE_SCHEMES = ("pipeline", "tensor")  # passes/shard_plan.SCHEMES, without importing the passes


def check_devices(options: BuildOptions) -> None:
    """--devices N: a positive count; several devices are devices of IREE targets (CPU, Vulkan, CUDA)."""
    if isinstance(options.devices, bool) or not isinstance(options.devices, int) or options.devices < 1:
        raise InputError(f"--devices must be a positive integer, got {options.devices!r}")
    if options.scheme not in DEVICE_SCHEMES:
        raise InputError(f"--scheme {options.scheme!r}: expected one of {', '.join(DEVICE_SCHEMES)}")
    others = sorted({t.device for t in options.targets if t.device not in MULTI_DEVICE_TARGETS})
    if options.devices > 1 and others:
        raise InputError(f"--devices {options.devices} places layers on several devices of an IREE target "
                         f"({', '.join(MULTI_DEVICE_TARGETS)}); it does not apply to {', '.join(others)}")


def build_cache_key(fingerprint: dict | None, options: BuildOptions) -> str | None:
    """The compile cache's key for a checkpoint and options; None when the result must not be cached
    (a model built by hand has no fingerprint; --dump-after writes files beside the bundle)."""
    if fingerprint is None or options.dump_after:
        return None
    fields = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)
              if f.name not in ("targets", "dump_after")}
    return cache_key(fingerprint, fields, [dataclasses.asdict(t) for t in options.targets])


def claimed(cache: CompileCache | None, key: str | None, progress: Progress) -> AbstractContextManager:
    """The cache's lock on `key` for a compile that asks it and may store into it (nothing without a cache):
    a second compile of the same inputs waits, then reuses the first's bundle."""
    if cache is None or key is None:
        return nullcontext()
    return cache.claimed(key, lambda: progress("another compile of the same inputs is running: waiting for it, "
                                               "then reusing its bundle from the compile cache"))


def from_cache(cache: CompileCache | None, key: str | None, out_dir: str | Path, progress: Progress) -> bool:
    """Copy the cached bundle for `key` into out_dir, saying so; False when the cache has none."""
    if cache is None or key is None:
        return False
    t0 = time.perf_counter()
    if not cache.fetch(key, Path(out_dir)):
        return False
    progress(f"unchanged inputs: bundle reused from the compile cache ({cache.root / key[:16]}...) "
             f"into {out_dir} in {time.perf_counter() - t0:.1f} s (--no-cache compiles again)")
    return True
