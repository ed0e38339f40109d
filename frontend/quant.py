"""Block-quantized weights: foldline's two formats, exact repacking from GGUF blocks, and quantization.

Two formats cover every GGUF block type foldline reads, each exactly:

- `q8`: signed int8 codes [N, K], one scale per group of `group` codes along K,
  optionally one min per group: w = scale * q (+ min).
- `q4`: unsigned 4-bit codes [N, K] packed two per byte, ggml's order: byte b
  of a group of g codes holds element b in its low nibble and element b + g/2
  in its high one. A GGUF Q4_0 / Q4_1 block is this layout as it stands, and
  the decode kernel splits a byte into two codes that meet the two halves of
  the activation group, each a contiguous vector (kernels/qlinear.py).
  One scale and one min per group: w = scale * q + min.
- `q5`: unsigned 5-bit codes [N, K] as two planes in one byte array per row,
  [N, K/2 + K/8]: the low four bits as q4 lays them out (ggml's nibble order),
  then the fifth bits, bit t of byte j the fifth bit of code 8j + t in k
  order. A GGUF Q5 block's qh holds the same bits per block; one plane per
  row lets a kernel read 64 codes' fifth bits as 8 contiguous bytes beside
  their 32 nibble bytes. One scale and one min per group, as q4:
  6 bits per code with f16 scales and mins of groups of 32, against the
  8.5 bits of the same codes as q8 (5.5 in a GGUF Q5_0 block).

Scales and mins are float16 where the GGUF block stores them as float16
(Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: bytes unchanged) and float32 where the block
stores a product (K-quants: d * sub-block scale, exact in float32). Every
product and sum below is exact or rounds exactly as `gguf.quants.dequantize`
does, so `dequantize(repack(block))` equals gguf's float32 output bit for bit
(tests/frontend/test_quant.py), but for the sign of zero: Q4_0's d * (q - 8) is -0
where d < 0 and q = 8, our d * q + (-8 d) is +0.

| GGUF type | format | codes | group | scale / min |
| --- | --- | --- | --- | --- |
| Q8_0 | q8 | q | 32 | d (f16) |
| Q5_0 | q5 | q | 32 | d, -16 d (f16) |
| Q5_1 | q5 | q | 32 | d, m (f16) |
| Q6_K | q8 | q - 32 | 16 | d * sc (f32) |
| Q5_K | q5 | q | 32 | d * sc, -dmin * m (f32) |
| Q4_0 | q4 | q | 32 | d, -8 d (f16) |
| Q4_1 | q4 | q | 32 | d, m (f16) |
| Q4_K | q4 | q | 32 | d * sc, -dmin * m (f32) |
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K
from torch import Tensor

from ..contract.block_formats import FORMATS, codes_dims, row_length
from ..errors import FoldlineError
from .op_registry import declare_op


class QuantError(FoldlineError, ValueError):
    """A tensor that cannot be put in a foldline block format."""


@dataclass
class QuantizedTensor:
    """A [N, K] weight in a foldline block format (numpy arrays, ready for the parameter archive)."""

    format: str  # "q8", "q4" or "q5"
    shape: tuple[int, int]  # logical [N, K]
    group: int
    codes: np.ndarray  # q8: int8 [N, K]; q4: uint8 [N, K // 2] (two codes per byte); q5: uint8 [N, K // 2 + K // 8]
    scales: np.ndarray  # [N, K // group], float16 or float32
    mins: np.ndarray | None = None  # same shape and dtype as scales; required for q4 and q5

    def __post_init__(self) -> None:
        n, k = self.shape
        if self.format not in FORMATS:
            raise QuantError(f"unknown block format {self.format!r}; expected one of {FORMATS}")
        if k % self.group:
            raise QuantError(f"row length {k} is not a multiple of the group {self.group}")
        if self.format == "q5" and self.group % 16:
            raise QuantError(f"q5 groups hold whole bytes of fifth bits per half: group {self.group} is not a "
                             "multiple of 16")
        want = codes_dims(self.format, n, k)
        if self.codes.shape != want:
            raise QuantError(f"{self.format} codes have shape {self.codes.shape}, expected {want}")
        if self.scales.shape != (n, k // self.group):
            raise QuantError(f"scales have shape {self.scales.shape}, expected {(n, k // self.group)}")
        if self.format in ("q4", "q5") and self.mins is None:
            raise QuantError(f"{self.format} needs a min per group")

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.codes, self.scales, self.mins) if a is not None)

    def unpacked_codes(self) -> np.ndarray:
        """int codes [N, K] as int16 (q4 and q5 unpacked from their planes)."""
        if self.format == "q8":
            return self.codes.astype(np.int16)
        n, k = self.shape
        if self.format == "q5":
            return unpack_q5(self.codes, self.group).astype(np.int16)
        return unpack_q4(self.codes, self.group).reshape(n, k).astype(np.int16)

    def as_q8(self) -> QuantizedTensor:
        """The same weight as q8 blocks, exactly: q5 codes (0..31) fit a signed byte.

        Q5_0's min of -16 d becomes the codes' offset (q - 16, no min), as a Q5_0 block means it:
        a product with int8 activations then takes the whole weight in its integer sum.
        """
        if self.format != "q5":
            raise QuantError(f"only q5 blocks widen to q8 exactly, not {self.format}")
        q = self.unpacked_codes()
        scales = self.scales.astype(np.float32)
        if np.array_equal(self.mins.astype(np.float32), np.float32(-16) * scales):
            return QuantizedTensor("q8", self.shape, self.group, (q - 16).astype(np.int8), self.scales)
        return QuantizedTensor("q8", self.shape, self.group, q.astype(np.int8), self.scales, self.mins)

    def take_rows(self, rows: np.ndarray) -> QuantizedTensor:
        """The weight's rows `rows` (output features), in that order: the same blocks, fewer of them."""
        pick = lambda a: None if a is None else np.ascontiguousarray(a[rows])  # noqa: E731
        return QuantizedTensor(self.format, (len(rows), self.shape[1]), self.group, pick(self.codes),
                               pick(self.scales), pick(self.mins))

    def take_columns(self, columns: np.ndarray) -> QuantizedTensor | None:
        """The weight's columns `columns` (input features), in that order, or None when they are not
        whole groups: the blocks of a group are kept or dropped together."""
        n, k = self.shape
        g = self.group
        columns = np.asarray(columns)
        if len(columns) % g:
            return None
        starts = columns.reshape(-1, g)
        if np.any(starts[:, 0] % g) or np.any(starts - starts[:, :1] != np.arange(g)):
            return None
        groups = starts[:, 0] // g
        if self.format == "q5":  # two planes: the nibbles (g / 2 bytes a group), then the fifth bits (g / 8)
            low = self.codes[:, : k // 2].reshape(n, k // g, g // 2)[:, groups]
            high = self.codes[:, k // 2 :].reshape(n, k // g, g // 8)[:, groups]
            codes = np.concatenate([low.reshape(n, -1), high.reshape(n, -1)], axis=1)
        else:
            width = self.codes.shape[1] // (k // g)  # bytes of one group's codes
            codes = self.codes.reshape(n, k // g, width)[:, groups].reshape(n, -1)
        pick = lambda a: None if a is None else np.ascontiguousarray(a[:, groups])  # noqa: E731
        return QuantizedTensor(self.format, (n, len(columns)), g, np.ascontiguousarray(codes), pick(self.scales),
                               pick(self.mins))

    def dequantize(self) -> np.ndarray:
        """float32 [N, K]: scale * q (+ min), in float32, the formula the compiled kernel uses."""
        n, k = self.shape
        q = self.unpacked_codes().astype(np.float32).reshape(n, k // self.group, self.group)
        w = self.scales.astype(np.float32)[..., None] * q
        if self.mins is not None:
            w = w + self.mins.astype(np.float32)[..., None]
        return w.reshape(n, k)


# ---------------------------------------------------------------------------
# Exact repacking of GGUF blocks
# ---------------------------------------------------------------------------

REPACKABLE = (
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q6_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q4_K,
)


def _blocks(raw: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, int, int]:
    """raw bytes [N, row_bytes] -> blocks [N * nb, block_bytes], N, K."""
    block, size = GGML_QUANT_SIZES[qtype]
    if raw.ndim != 2 or raw.shape[1] % size:
        raise QuantError(f"{qtype.name} tensor bytes of shape {raw.shape} are not rows of {size}-byte blocks")
    n = raw.shape[0]
    k = raw.shape[1] // size * block
    return np.ascontiguousarray(raw).reshape(-1, size), n, k


def _high_bits_32(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 4-byte qh (little-endian bit i = element i) -> [..., 32] of 0/1."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _pack_q4(codes: np.ndarray, group: int) -> np.ndarray:
    """uint8 codes [N, K] in 0..15 -> [N, K // 2]: in each group, byte b = element b | element b + group/2 << 4."""
    n, k = codes.shape
    halves = codes.reshape(n, k // group, 2, group // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).astype(np.uint8).reshape(n, k // 2)


def unpack_q4(packed: np.ndarray, group: int) -> np.ndarray:
    """The inverse of `_pack_q4`: [N, K // 2] bytes -> uint8 codes [N, K // group, group] (also how
    ggml's Q4 and Q5 blocks hold their low nibbles)."""
    n = packed.shape[0]
    b = packed.view(np.uint8).reshape(n, -1, group // 2)
    return np.concatenate([b & 0x0F, b >> 4], axis=-1)


def pack_q5(codes: np.ndarray, group: int) -> np.ndarray:
    """uint8 codes [N, K] in 0..31 -> [N, K // 2 + K // 8]: the low nibbles as q4, then the fifth bits in k order."""
    n, k = codes.shape
    low = _pack_q4((codes & 0x0F).astype(np.uint8), group)
    high = np.packbits((codes >> 4).astype(np.uint8) & 1, axis=-1, bitorder="little")
    return np.concatenate([low, high], axis=-1)


def unpack_q5(packed: np.ndarray, group: int) -> np.ndarray:
    """The inverse of `pack_q5`: uint8 codes [N, K]."""
    n, width = packed.shape
    k = row_length("q5", width)
    low = unpack_q4(packed[:, : k // 2], group).reshape(n, k)
    high = np.unpackbits(packed[:, k // 2 :].view(np.uint8), axis=-1, bitorder="little")
    return low | (high << 4)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)


def repack_gguf(raw: np.ndarray, qtype: int) -> QuantizedTensor:
    """Exact foldline blocks for a GGUF tensor's raw bytes [N, row_bytes] (see the module table)."""
    qtype = GGMLQuantizationType(qtype)
    if qtype not in REPACKABLE:
        raise QuantError(f"{qtype.name} has no foldline block format")
    blocks, n, k = _blocks(raw, qtype)
    nb = blocks.shape[0]
    if qtype == GGMLQuantizationType.Q8_0:
        d, qs = blocks[:, :2], blocks[:, 2:]
        return QuantizedTensor("q8", (n, k), 32, qs.view(np.int8).reshape(n, k).copy(), _f16(d).reshape(n, -1))
    if qtype in (GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1):
        has_min = qtype == GGMLQuantizationType.Q5_1
        d = _f16(blocks[:, :2])
        m = _f16(blocks[:, 2:4]) if has_min else None
        off = 4 if has_min else 2
        qh, qs = blocks[:, off : off + 4], blocks[:, off + 4 :]
        if not has_min:
            m = (d * np.float16(-16)).astype(np.float16)  # exact: a power-of-two multiple (d * (q - 16) = d q - 16 d)
        if has_min or np.isfinite(m).all():
            low = np.ascontiguousarray(qs).reshape(n, k // 2)  # already ggml's order
            high = np.ascontiguousarray(qh).reshape(n, k // 8)  # bit i of a block's qh: its element i
            return QuantizedTensor("q5", (n, k), 32, np.concatenate([low, high], axis=-1), d.reshape(n, -1),
                                   m.reshape(n, -1))
        # -16 d overflows float16 (|d| > 4095): the codes as q8, q - 16, with no min
        q = (unpack_q4(qs, 32)[:, 0] | (_high_bits_32(qh) << 4)).astype(np.int16)
        return QuantizedTensor("q8", (n, k), 32, (q - 16).astype(np.int8).reshape(n, k), d.reshape(n, -1))
    if qtype in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1):
        d = _f16(blocks[:, :2])
        if qtype == GGMLQuantizationType.Q4_1:
            m, qs = _f16(blocks[:, 2:4]), blocks[:, 4:]
        else:
            m, qs = (d * np.float16(-8)).astype(np.float16), blocks[:, 2:]  # exact: a power-of-two multiple
        codes = np.ascontiguousarray(qs).reshape(n, k // 2)  # already ggml's order
        return QuantizedTensor("q4", (n, k), 32, codes, d.reshape(n, -1), m.reshape(n, -1))
    if qtype in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K):
        d = _f16(blocks[:, :2]).astype(np.float32)
        dmin = _f16(blocks[:, 2:4]).astype(np.float32)
        sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])
        scale = (d * sc.astype(np.float32)).reshape(n, -1)
        minus = (-(dmin * mn.astype(np.float32))).reshape(n, -1)
        if qtype == GGMLQuantizationType.Q4_K:
            qs = blocks[:, 16:].reshape(nb, 4, 32)  # 4 chunks of 64: low nibbles sub-block 2j, high 2j+1
            q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, k)
            return QuantizedTensor("q4", (n, k), 32, _pack_q4(q, 32), scale, minus)
        qh, qs = blocks[:, 16:48], blocks[:, 48:].reshape(nb, 4, 32)
        ql = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(nb, 8, 32)
        high = ((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1).reshape(nb, 8, 32)
        q = (ql | (high << 4)).astype(np.uint8).reshape(n, k)
        return QuantizedTensor("q5", (n, k), 32, pack_q5(q, 32), scale, minus)
    # Q6_K: 256 codes per block in 16 groups of 16, q - 32 in [-32, 31].
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(blocks[:, 208:210]).astype(np.float32)
    low = np.stack([ql.reshape(nb, 2, 64) & 0x0F, ql.reshape(nb, 2, 64) >> 4], axis=2).reshape(nb, 2, 4, 32)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]
    high = (qh.reshape(nb, 2, 1, 32) >> shifts) & 0x03
    q = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, k)
    return QuantizedTensor("q8", (n, k), 16, q, (d * sc).reshape(n, -1))


# ---------------------------------------------------------------------------
# Quantizing float weights (HF checkpoints, GGUF float tensors)
# ---------------------------------------------------------------------------


def quantize(w: np.ndarray, fmt: str, group: int = 32) -> QuantizedTensor:
    """Groupwise round-to-nearest: q8 symmetric (scale = max|w| / 127), q4 and q5 asymmetric (min and 15 or
    31 steps).

    Scales and mins are float16, like GGUF's Q8_0 / Q4_1 blocks.
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise QuantError(f"only 2-D weights are quantized, got shape {w.shape}")
    n, k = w.shape
    if k % group:
        raise QuantError(f"row length {k} is not a multiple of the group {group}")
    g = w.reshape(n, k // group, group)
    if fmt == "q8":
        scale = (np.abs(g).max(-1) / 127).astype(np.float16)
        s32 = scale.astype(np.float32)[..., None]
        q = np.where(s32 > 0, np.rint(g / np.where(s32 > 0, s32, 1)), 0).clip(-127, 127)
        return QuantizedTensor("q8", (n, k), group, q.astype(np.int8).reshape(n, k), scale)
    if fmt in ("q4", "q5"):
        top = 15 if fmt == "q4" else 31
        lo, hi = g.min(-1), g.max(-1)
        scale = ((hi - lo) / top).astype(np.float16)
        mins = lo.astype(np.float16)
        s32, m32 = scale.astype(np.float32)[..., None], mins.astype(np.float32)[..., None]
        q = np.where(s32 > 0, np.rint((g - m32) / np.where(s32 > 0, s32, 1)), 0).clip(0, top)
        q = q.astype(np.uint8).reshape(n, k)
        codes = _pack_q4(q, group) if fmt == "q4" else pack_q5(q, group)
        return QuantizedTensor(fmt, (n, k), group, codes, scale, mins)
    raise QuantError(f"unknown block format {fmt!r}; expected one of {FORMATS}")


def dequantize_torch(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, fmt: str,
                     group: int) -> torch.Tensor:
    """The eager reference of the compiled dequantization: float32 [N, K]."""
    if fmt in ("q4", "q5"):  # ggml's order: byte b of a group holds elements b and b + group / 2
        n = codes.shape[0]
        k = row_length(fmt, codes.shape[1])
        # The nibbles in float32 arithmetic, exact for bytes 0..255: it exports to plain ONNX ops
        # that ONNX Runtime folds at load (aten's uint8 shift exports to a mistyped emulation).
        b = codes[:, : k // 2].reshape(n, -1, group // 2).float()
        high = torch.floor(b / 16)
        q = torch.cat([b - 16 * high, high], dim=-1).reshape(n, -1)
        if fmt == "q5":  # bit t of fifth-bit byte j: code 8j + t
            weights = torch.exp2(torch.arange(8, dtype=torch.float32, device=codes.device))
            bits = codes[:, k // 2 :].float()[..., None] / weights
            fifth = torch.floor(bits) - 2 * torch.floor(bits / 2)
            q = q + 16 * fifth.reshape(n, k)
    else:
        q = codes
    n, k = q.shape
    w = scales.float()[..., None] * q.float().reshape(n, k // group, group)
    if mins is not None:
        w = w + mins.float()[..., None]
    return w.reshape(n, k)


# ---------------------------------------------------------------------------
# Custom ops: the anchors a backend lowers to a fused dequantize + matmul
# ---------------------------------------------------------------------------


def qlinear_impl(x: Tensor, codes: Tensor, scales: Tensor, mins: Tensor | None, fmt: str, group: int) -> Tensor:
    """x @ dequantize(W)^T, in x's dtype (float32 math for the weight)."""
    w = dequantize_torch(codes, scales, mins, fmt, group)
    return F.linear(x, w.to(x.dtype))


def qembedding_impl(codes: Tensor, scales: Tensor, mins: Tensor | None, ids: Tensor, fmt: str,
                    group: int) -> Tensor:
    """Rows `ids` of dequantize(W): only the looked-up rows are dequantized."""
    rows_mins = None if mins is None else mins[ids.reshape(-1)]
    rows = dequantize_torch(codes[ids.reshape(-1)], scales[ids.reshape(-1)], rows_mins, fmt, group)
    return rows.reshape(*ids.shape, rows.shape[-1])


def _qlinear_shape(x: Tensor, codes: Tensor, scales: Tensor, mins: Tensor | None, fmt: str, group: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], codes.shape[0]))


def _qembedding_shape(codes: Tensor, scales: Tensor, mins: Tensor | None, ids: Tensor, fmt: str,
                      group: int) -> Tensor:
    return torch.empty((*ids.shape, row_length(fmt, codes.shape[1])), dtype=torch.float32, device=codes.device)


QLINEAR = declare_op("qlinear", qlinear_impl, _qlinear_shape)
QEMBEDDING = declare_op("qembedding", qembedding_impl, _qembedding_shape)
