"""foldline's block formats: exact repacking of every GGUF block type, and groupwise quantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from foldline.frontend.quant import (
    REPACKABLE,
    QuantError,
    QuantizedTensor,
    dequantize_torch,
    quantize,
    repack_gguf,
)

# Byte offsets of the float16 fields in each block (random bytes there could be inf / NaN).
F16_FIELDS = {
    GGMLQuantizationType.Q8_0: (0,),
    GGMLQuantizationType.Q5_0: (0,),
    GGMLQuantizationType.Q5_1: (0, 2),
    GGMLQuantizationType.Q4_0: (0,),
    GGMLQuantizationType.Q4_1: (0, 2),
    GGMLQuantizationType.Q4_K: (0, 2),
    GGMLQuantizationType.Q5_K: (0, 2),
    GGMLQuantizationType.Q6_K: (208,),
}


def random_blocks(qtype: GGMLQuantizationType, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Raw GGUF bytes [rows, row_bytes]: every code and sub-scale bit random, float16 fields finite."""
    rng = np.random.default_rng(seed)
    _, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * blocks_per_row, size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        values = (rng.standard_normal(raw.shape[0]) * 0.05).astype(np.float16)
        raw[:, off : off + 2] = values.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, blocks_per_row * size)


@pytest.mark.parametrize("qtype", REPACKABLE, ids=lambda q: q.name)
def test_repacked_blocks_dequantize_bit_exactly_like_gguf(qtype):
    raw = random_blocks(qtype, rows=6, blocks_per_row=2, seed=int(qtype))
    expected = gguf_dequantize(raw, qtype).astype(np.float32)
    packed = repack_gguf(raw, qtype)
    assert packed.shape == expected.shape
    got = packed.dequantize()
    assert np.array_equal(got, expected), f"{qtype.name}: {np.sum(got != expected)} of {got.size} values differ"
    # Bit for bit too, but for the sign of zero: Q4_0's d * (q - 8) gives -0 where d < 0 and q = 8.
    nonzero = expected != 0
    assert np.array_equal(got[nonzero].view(np.uint32), expected[nonzero].view(np.uint32))
    torch_got = dequantize_torch(torch.from_numpy(packed.codes), torch.from_numpy(packed.scales),
                                 None if packed.mins is None else torch.from_numpy(packed.mins),
                                 packed.format, packed.group).numpy()
    assert np.array_equal(torch_got, got)


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
                                   GGMLQuantizationType.Q5_0], ids=lambda q: q.name)
def test_legacy_formats_keep_the_files_bytes(qtype):
    """Q8_0 / Q4_x / Q5_0 repack losslessly in size too: codes at their own width + float16 scales (and
    mins: Q4_0's -8 d and Q5_0's -16 d cost 2 bytes per 32 codes)."""
    raw = random_blocks(qtype, rows=4, blocks_per_row=4, seed=1)
    packed = repack_gguf(raw, qtype)
    assert packed.scales.dtype == np.float16
    bits = {GGMLQuantizationType.Q8_0: 8, GGMLQuantizationType.Q5_0: 5}.get(qtype, 4)
    n, k = packed.shape
    mins = 0 if packed.mins is None else packed.mins.nbytes
    assert packed.nbytes == n * k * bits // 8 + packed.scales.nbytes + mins
    if qtype in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1):
        assert packed.nbytes == raw.nbytes


def test_q4_codes_keep_ggml_nibble_order():
    """Byte b of a group holds code b (low nibble) and code b + group/2 (high): a Q4_1 block's own bytes."""
    raw = random_blocks(GGMLQuantizationType.Q4_1, rows=2, blocks_per_row=3, seed=3)
    packed = repack_gguf(raw, GGMLQuantizationType.Q4_1)
    codes = packed.unpacked_codes()
    assert packed.codes[0, 0] == codes[0, 0] | (codes[0, 16] << 4)
    assert packed.codes[1, 17] == codes[1, 33] | (codes[1, 49] << 4)  # second group: byte 1 -> codes 32 + 1, 32 + 17
    assert np.array_equal(packed.codes.reshape(2, 3, 16), raw.reshape(2, 3, 20)[:, :, 4:]), "the block's bytes as they are"


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q5_K],
                         ids=lambda q: q.name)
def test_q5_keeps_five_bits_per_code(qtype):
    """GGUF's 5-bit blocks stay 5-bit: a nibble plane in ggml's order, then the fifth bits in k order."""
    raw = random_blocks(qtype, rows=3, blocks_per_row=8, seed=5)
    packed = repack_gguf(raw, qtype)
    n, k = packed.shape
    assert packed.format == "q5" and packed.codes.shape == (n, k // 2 + k // 8)
    codes = packed.unpacked_codes()
    assert codes.min() >= 0 and codes.max() <= 31
    assert np.array_equal(packed.codes[:, : k // 2], _pack_q4_reference(codes & 15, packed.group))
    assert packed.codes[1, k // 2 + 5] == sum(((codes[1, 40 + t] >> 4) & 1) << t for t in range(8))
    if qtype == GGMLQuantizationType.Q5_0:  # the block's own bytes: qh, then qs
        blocks = raw.reshape(n, -1, 22)
        assert np.array_equal(packed.codes[:, : k // 2].reshape(n, -1, 16), blocks[:, :, 6:])
        assert np.array_equal(packed.codes[:, k // 2 :].reshape(n, -1, 4), blocks[:, :, 2:6])
    widened = packed.as_q8()
    assert widened.format == "q8" and np.array_equal(widened.dequantize(), packed.dequantize())
    # Q5_0 widens to the signed codes q - 16 with no min, as its block means them
    assert (widened.mins is None) == (qtype == GGMLQuantizationType.Q5_0)


def test_q5_needs_whole_bytes_of_fifth_bits_per_half_group():
    with pytest.raises(QuantError, match="multiple of 16"):
        QuantizedTensor("q5", (2, 64), 8, np.zeros((2, 40), np.uint8), np.ones((2, 8), np.float16),
                        np.ones((2, 8), np.float16))


def _pack_q4_reference(codes: np.ndarray, group: int) -> np.ndarray:
    n, k = codes.shape
    halves = codes.reshape(n, k // group, 2, group // 2).astype(np.uint8)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2)


def test_q4_packing_round_trips_for_any_group():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((6, 256)).astype(np.float32)
    for group in (16, 32, 64, 128):
        q = quantize(w, "q4", group=group)
        codes = q.unpacked_codes().reshape(6, -1, group)
        half = group // 2
        assert np.array_equal(q.codes.reshape(6, -1, half), (codes[..., :half] | (codes[..., half:] << 4)).astype(np.uint8))
        torch_w = dequantize_torch(torch.from_numpy(q.codes), torch.from_numpy(q.scales), torch.from_numpy(q.mins),
                                   "q4", group)
        assert np.array_equal(torch_w.numpy(), q.dequantize())


@pytest.mark.parametrize("fmt,bound", [("q8", 1 / 254), ("q4", 1 / 30), ("q5", 1 / 62)])
def test_groupwise_quantization_error_is_within_half_a_step(fmt, bound):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 128)).astype(np.float32)
    q = quantize(w, fmt, group=32)
    err = np.abs(q.dequantize() - w).reshape(64, 4, 32)
    span = np.abs(w).reshape(64, 4, 32).max(-1) * 2 if fmt == "q8" else np.ptp(w.reshape(64, 4, 32), -1)
    # half a quantization step, plus the float16 rounding of the scale (and min)
    assert (err.max(-1) <= span * bound * 1.01 + 1e-3 * np.abs(w).reshape(64, 4, 32).max(-1)).all()


def test_zero_groups_quantize_to_zero():
    w = np.zeros((2, 64), dtype=np.float32)
    w[1, 32:] = 1.0
    for fmt in ("q8", "q4"):
        out = quantize(w, fmt).dequantize()
        assert np.array_equal(out[0], np.zeros(64, dtype=np.float32))
        assert np.allclose(out[1, 32:], 1.0, atol=1e-3)


def test_bad_inputs_are_clear_errors():
    with pytest.raises(QuantError, match="multiple of the group"):
        quantize(np.zeros((2, 40), dtype=np.float32), "q8", group=32)
    with pytest.raises(QuantError, match="unknown block format"):
        quantize(np.zeros((2, 64), dtype=np.float32), "q3")
    with pytest.raises(QuantError, match="no foldline block format"):
        repack_gguf(np.zeros((1, 4), dtype=np.uint8), GGMLQuantizationType.F32)
    with pytest.raises(QuantError, match="q4 needs a min"):
        QuantizedTensor("q4", (1, 32), 32, np.zeros((1, 16), np.uint8), np.zeros((1, 1), np.float16))


@pytest.mark.realmodel
@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_real_gguf_tensors_repack_bit_exactly(model):
    from foldline.frontend.gguf_file import GGUFFile
    from foldline.frontend.shipped import ShippedModelError, locate_shipped

    try:
        path = locate_shipped(model)
    except ShippedModelError as e:
        pytest.skip(str(e))
    seen = set()
    with GGUFFile(path) as g:
        for info in g.tensors.values():
            qtype = GGMLQuantizationType(info.qtype)
            if qtype not in REPACKABLE or qtype in seen or len(info.shape) != 2:
                continue
            seen.add(qtype)
            raw = g.raw(info.name)[:64]  # the first rows of one tensor of each type
            expected = gguf_dequantize(raw, qtype).astype(np.float32)
            got = repack_gguf(raw, qtype).dequantize()
            assert np.array_equal(got, expected), info.name
    assert seen  # the file holds block-quantized tensors
