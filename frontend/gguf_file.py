"""GGUF files (llama.cpp's format): a memory-mapped reader of metadata, tensor directory and bytes.

Metadata and tensor directory are parsed here with numpy (gguf's own
GGUFReader builds a Python object per array element, far too slow for a
262k-token vocabulary: docs/models.md, "Loading"); the format's enums and the
dequantization kernels are gguf's (`gguf.quants.dequantize`). Nothing here
knows an architecture: `frontend/arch/` says what the tensors mean.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize as gguf_dequantize

from ..errors import FoldlineError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
# Smallest encodings, to refuse counts the file cannot hold before looping over them:
# a key (length + type + a 1-byte value), a tensor entry (name length + n_dims + type + offset).
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_BYTES = 8 + 4 + 4 + 8

# Quantization types we load; each has a tested path through gguf.quants.dequantize.
SUPPORTED_QUANTS = (
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
)

class GGUFError(FoldlineError, ValueError):
    """A GGUF file foldline cannot turn into a model."""


class UnsupportedArchitectureError(GGUFError):
    """general.architecture names a family foldline does not map."""


class UnsupportedQuantError(GGUFError):
    """A tensor is stored in a quantization type foldline does not dequantize."""


class MissingTensorError(GGUFError):
    """A tensor the architecture needs is absent from the file."""


# ---------------------------------------------------------------------------
# Reading the file
# ---------------------------------------------------------------------------

_QUANT_TYPES = frozenset(int(q) for q in GGML_QUANT_SIZES)

_SCALAR_DTYPES: dict[int, np.dtype] = {
    GGUFValueType.UINT8: np.dtype("<u1"),
    GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.BOOL: np.dtype("<u1"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor directory; `shape` is numpy order (outermost first)."""

    name: str
    shape: tuple[int, ...]
    qtype: int
    offset: int  # absolute byte offset in the file

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.qtype).name
        except ValueError:
            return f"type {self.qtype}"

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.qtype)]
        return math.prod(self.shape) // block * size


class GGUFFile:
    """A memory-mapped GGUF file: metadata dict, tensor directory, raw tensor bytes."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # an empty file cannot be mapped
                raise GGUFError(f"{self.path} is not a GGUF file: {e}") from e
        self._buf = memoryview(self._map)
        self._pos = 0
        try:
            self._parse()
        except (IndexError, ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: nested arrays
            if isinstance(e, GGUFError):
                raise
            raise GGUFError(f"{self.path} is not a readable GGUF file: {e}") from e

    # -- primitive reads ---------------------------------------------------
    def _read(self, dtype: np.dtype, count: int = 1) -> np.ndarray:
        n = dtype.itemsize * count
        if self._pos + n > len(self._buf):
            raise GGUFError(f"{self.path} is truncated (needs {n} bytes at offset {self._pos})")
        out = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._pos)
        self._pos += n
        return out

    def _u32(self) -> int:
        return int(self._read(np.dtype("<u4"))[0])

    def _u64(self) -> int:
        return int(self._read(np.dtype("<u8"))[0])

    def _count(self, count: int, min_bytes: int, what: str) -> int:
        """A count read from the file, refused when the bytes left cannot hold that many items."""
        if count * min_bytes > len(self._buf) - self._pos:
            raise GGUFError(f"{self.path}: {count} {what} cannot fit in the {len(self._buf) - self._pos} "
                            f"bytes left at offset {self._pos}: corrupted or truncated")
        return count

    def _string(self) -> str:
        n = self._count(self._u64(), 1, "string bytes")
        raw = bytes(self._buf[self._pos : self._pos + n])
        self._pos += n
        return raw.decode("utf-8", errors="surrogateescape")

    def _value(self, vtype: int) -> Any:
        if vtype == GGUFValueType.STRING:
            return self._string()
        if vtype == GGUFValueType.ARRAY:
            etype = self._u32()
            count = self._count(self._u64(), _SCALAR_DTYPES[etype].itemsize if etype in _SCALAR_DTYPES else 8,
                                "array elements")
            if etype == GGUFValueType.STRING:
                return [self._string() for _ in range(count)]
            if etype == GGUFValueType.ARRAY:
                return [self._value(GGUFValueType.ARRAY) for _ in range(count)]
            if etype not in _SCALAR_DTYPES:
                raise GGUFError(f"{self.path}: unknown array element type {etype}")
            arr = self._read(_SCALAR_DTYPES[etype], count)
            return arr.astype(bool).tolist() if etype == GGUFValueType.BOOL else arr.tolist()
        if vtype not in _SCALAR_DTYPES:
            raise GGUFError(f"{self.path}: unknown metadata value type {vtype}")
        value = self._read(_SCALAR_DTYPES[vtype])[0].item()
        return bool(value) if vtype == GGUFValueType.BOOL else value

    def _parse(self) -> None:
        if bytes(self._buf[:4]) != GGUF_MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file (bad magic {bytes(self._buf[:4])!r})")
        self._pos = 4
        self.version = self._u32()
        if self.version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {self.version} is not supported (big-endian or too new?)")
        n_tensors, n_kv = self._u64(), self._u64()
        self._count(n_tensors * _MIN_TENSOR_BYTES + n_kv * _MIN_KV_BYTES, 1, "bytes of tensors and metadata")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._u32())
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._u32()
            if n_dims > MAX_DIMS:
                raise GGUFError(f"{self.path}: tensor {name!r} has {n_dims} dimensions; GGUF allows at most {MAX_DIMS}")
            dims = [self._u64() for _ in range(n_dims)]
            qtype, offset = self._u32(), self._u64()
            infos.append((name, tuple(reversed(dims)), qtype, offset))
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(align) is not int or align <= 0 or align & (align - 1):
            raise GGUFError(f"{self.path}: general.alignment {align!r} is not a positive power of two")
        data_start = (self._pos + align - 1) // align * align
        self.tensors: dict[str, TensorInfo] = {
            name: TensorInfo(name, shape, qtype, data_start + off) for name, shape, qtype, off in infos
        }
        if len(self.tensors) != len(infos):
            raise GGUFError(f"{self.path}: the tensor directory lists a name twice")
        self._check_extents(infos, align)

    def _check_extents(self, infos: list[tuple[str, tuple[int, ...], int, int]], align: int) -> None:
        """Every tensor lies inside the file, aligned, apart from the others: no read can leave the map."""
        spans = []
        for name, _shape, _qtype, off in infos:
            info = self.tensors[name]
            if off % align:
                raise GGUFError(f"{self.path}: tensor {name!r} offset {off} is not a multiple of the alignment {align}")
            known = info.qtype in _QUANT_TYPES
            size = info.nbytes if known else 0  # an unknown type is refused when the tensor is read
            if known and info.shape and info.shape[-1] % GGML_QUANT_SIZES[GGMLQuantizationType(info.qtype)][0]:
                continue  # raw() names the row length that does not fit the block
            if info.offset + size > len(self._buf):
                what = "too large for the file" if size > len(self._buf) else "past the end of the file"
                raise GGUFError(f"{self.path}: tensor {name!r} ({info.type_name}{list(info.shape)}, {size} bytes at "
                                f"offset {info.offset}) lies {what} ({len(self._buf)} bytes): corrupted or truncated")
            spans.append((info.offset, info.offset + size, name))
        spans.sort()
        for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
            if start < end:
                raise GGUFError(f"{self.path}: the data of tensors {first!r} and {second!r} overlap")

    # -- access -------------------------------------------------------------
    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path} has no general.architecture")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch_key(self, key: str, default: Any = None) -> Any:
        """`<arch>.<key>` metadata, e.g. arch_key("block_count")."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def require(self, key: str) -> Any:
        full = f"{self.architecture}.{key}"
        if full not in self.metadata:
            raise GGUFError(f"{self.path} lacks metadata key {full!r}")
        return self.metadata[full]

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as uint8 [..., row_bytes]: the layout gguf.quants expects."""
        info = self.info(name)
        qtype = self._check_qtype(info)
        block, size = GGML_QUANT_SIZES[qtype]
        row = info.shape[-1]
        if row % block:
            raise GGUFError(f"tensor {name!r}: row length {row} is not a multiple of the {qtype.name} block {block}")
        byte_shape = (*info.shape[:-1], row // block * size)
        return np.frombuffer(self._buf, dtype=np.uint8, count=info.nbytes, offset=info.offset).reshape(byte_shape)

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise MissingTensorError(f"{self.path} has no tensor {name!r} ({self.architecture} needs it)")
        return self.tensors[name]

    def _check_qtype(self, info: TensorInfo) -> GGMLQuantizationType:
        if info.qtype not in [int(q) for q in SUPPORTED_QUANTS]:
            supported = ", ".join(q.name for q in SUPPORTED_QUANTS)
            raise UnsupportedQuantError(
                f"tensor {info.name!r} in {self.path} is stored as {info.type_name}; foldline dequantizes {supported}"
            )
        return GGMLQuantizationType(info.qtype)

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 in numpy order, e.g. [out, in] for a linear weight."""
        info = self.info(name)
        qtype = self._check_qtype(info)
        if math.prod(info.shape) == 0:
            return np.zeros(info.shape, dtype=np.float32)
        out = gguf_dequantize(self.raw(name), qtype)
        return np.array(out, dtype=np.float32, copy=True).reshape(info.shape)

    def close(self) -> None:
        try:
            self._buf.release()
            self._map.close()
        except BufferError:
            pass  # a caller still holds a view of raw bytes; the map closes when it is collected

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
