"""Fuzzed GGUF files: every damaged file loads or ends in a GGUFError (a FoldlineError), nothing else.

Base files are small valid GGUFs written with gguf.GGUFWriter (F32 norms,
F16 / Q8_0 / Q4_0 matrices); each case damages one: truncation, magic,
version, absurd tensor / key counts, absurd or too many dims, unknown tensor
types, offsets past the end, misaligned or overlapping, bad alignment, value
types and string lengths rewritten, and random byte flips in the header,
metadata and tensor directory. A case runs `load_model` (what `foldline
compile` does) and the metadata-only readers, under an address-space cap and
a time limit (fuzz_common.FuzzLog).
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize as gguf_quantize

from foldline.frontend.arch import get_preset
from foldline.frontend.gguf_file import GGUFError, GGUFFile
from foldline.frontend.gguf_loader import load_gguf, read_gguf_config
from foldline.frontend.model import build_model
from foldline.frontend.sources import holds_block_quantized_weights

from helpers.rotated_gguf import llama_gguf_tensors
from reliability.fuzz_common import FuzzLog
from reliability.reliability_common import scaled

# ---- a small valid file -------------------------------------------------------------------------


def write_base(path: Path, matrix_type: Q, seed: int = 0) -> Path:
    """A 2-layer llama GGUF (vocab 64, width 64) whose matrices are stored as `matrix_type`."""
    cfg = get_preset("llama-tiny").replace(vocab_size=64, intermediate_size=96, layer_types=("global",) * 2,
                                           max_context=64)
    params = {n: p.detach().float().numpy() for n, p in build_model(cfg, seed=seed).named_parameters()}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("fuzz-base")
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_context)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_vocab_size(cfg.vocab_size)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_rope_freq_base(float(cfg.rope_theta_global))
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_array("fuzz.numbers", [1, 2, 3])
    w.add_array("fuzz.words", ["a", "bc"])
    assert cfg.tie_word_embeddings
    tensors = llama_gguf_tensors(params, cfg)
    for name, t in tensors.items():
        t = np.ascontiguousarray(t, dtype=np.float32)
        if t.ndim == 2 and matrix_type == Q.F16:
            w.add_tensor(name, t.astype(np.float16))
        elif t.ndim == 2 and matrix_type != Q.F32:
            w.add_tensor(name, gguf_quantize(t, matrix_type), raw_dtype=matrix_type)
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- where the fields are -----------------------------------------------------------------------

_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


@dataclass
class TensorFields:
    name: str
    n_dims_at: int
    dims_at: list[int]
    type_at: int
    offset_at: int
    offset: int


@dataclass
class Layout:
    """Byte positions of the fields a mutation rewrites."""

    kv_type_at: list[int]  # the value type of each key
    kv_value_at: dict[str, int]  # key -> where its value starts
    string_len_at: list[int]  # every string length field (keys, values, names)
    tensors: list[TensorFields]
    directory_end: int


def layout(data: bytes) -> Layout:
    pos = 24
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    lay = Layout([], {}, [], [], 0)

    def string() -> str:
        nonlocal pos
        lay.string_len_at.append(pos)
        (n,) = struct.unpack_from("<Q", data, pos)
        s = data[pos + 8 : pos + 8 + n].decode()
        pos += 8 + n
        return s

    def value(vtype: int) -> None:
        nonlocal pos
        if vtype == 8:
            string()
        elif vtype == 9:
            etype, count = struct.unpack_from("<IQ", data, pos)
            pos += 12
            for _ in range(count):
                value(etype)
        else:
            pos += _SCALAR_SIZES[vtype]

    for _ in range(n_kv):
        key = string()
        lay.kv_type_at.append(pos)
        (vtype,) = struct.unpack_from("<I", data, pos)
        pos += 4
        lay.kv_value_at[key] = pos
        value(vtype)
    for _ in range(n_tensors):
        name = string()
        (n_dims,) = struct.unpack_from("<I", data, pos)
        fields = TensorFields(name, pos, [pos + 4 + 8 * i for i in range(n_dims)], pos + 4 + 8 * n_dims,
                              pos + 8 + 8 * n_dims, 0)
        fields.offset = struct.unpack_from("<Q", data, fields.offset_at)[0]
        lay.tensors.append(fields)
        pos = fields.offset_at + 8
    lay.directory_end = pos
    return lay


def put(data: bytes, at: int, fmt: str, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, at, value)
    return bytes(out)


# ---- the cases ----------------------------------------------------------------------------------

HUGE = [2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63, 2**64 - 1]


def mutations(data: bytes, rng: random.Random, n_random: int):
    """(description, damaged bytes) pairs: structured damage to every field kind, then random flips."""
    lay = layout(data)
    head = lay.directory_end
    for cut in sorted({0, 1, 3, 4, 8, 16, 24, head - 1, head, len(data) - 1} | {rng.randrange(len(data)) for _ in range(12)}):
        yield f"truncated at {cut}", data[:cut]
    yield "empty", b""
    yield "wrong magic", b"GGML" + data[4:]
    yield "wrong magic (safetensors)", b"\x08\x00\x00\x00" + data[4:]
    for version in (0, 1, 4, 2**31, 2**32 - 1, 0x03000000):
        yield f"version {version}", put(data, 4, "<I", version)
    for n in [*HUGE, 0, len(lay.tensors) + 1, len(lay.tensors) - 1]:
        yield f"tensor count {n}", put(data, 8, "<Q", n)
    for n in [*HUGE, 0, len(lay.kv_type_at) + 1]:
        yield f"key count {n}", put(data, 16, "<Q", n)
    for t in rng.sample(lay.tensors, min(4, len(lay.tensors))):
        for n in (0, 5, 64, 2**32 - 1):
            yield f"{t.name}: n_dims {n}", put(data, t.n_dims_at, "<I", n)
        for d in (0, 1, 3, 2**20, *HUGE):
            yield f"{t.name}: dim {d}", put(data, rng.choice(t.dims_at), "<Q", d)
        for q in (4, 5, 16, 20, 31, 40, 99, 2**32 - 1):
            yield f"{t.name}: tensor type {q}", put(data, t.type_at, "<I", q)
        others = [o for o in lay.tensors if o is not t]
        for off, why in ((t.offset + 1, "misaligned"), (t.offset + 32, "shifted"),
                         (rng.choice(others).offset, "overlapping"), (len(data), "past the end"),
                         (2**40, "far past the end"), (2**64 - 32, "wrapping")):
            yield f"{t.name}: offset {off} ({why})", put(data, t.offset_at, "<Q", off)
    for at in rng.sample(lay.kv_type_at, min(6, len(lay.kv_type_at))):
        for vtype in (9, 8, 12, 13, 2**32 - 1, rng.randrange(13)):
            yield f"value type {vtype} at {at}", put(data, at, "<I", vtype)
    for at in rng.sample(lay.string_len_at, min(8, len(lay.string_len_at))):
        for n in (0, 2**20, *HUGE):
            yield f"string length {n} at {at}", put(data, at, "<Q", n)
    for at in (lay.kv_value_at["fuzz.numbers"], lay.kv_value_at["fuzz.words"]):
        for n in (2**20, *HUGE):
            yield f"array count {n} at {at}", put(data, at + 4, "<Q", n)
        yield f"array of arrays at {at}", put(data, at, "<I", 9)
    block_at = lay.kv_value_at["llama.block_count"]
    for n in (0, 1, 3, 2**20, 2**31, 2**32 - 1):
        yield f"block_count {n}", put(data, block_at, "<I", n)
    for key in ("llama.embedding_length", "llama.attention.head_count", "llama.feed_forward_length",
                "llama.vocab_size", "llama.context_length"):
        for n in (0, 7, 2**31, 2**32 - 1):
            yield f"{key} {n}", put(data, lay.kv_value_at[key], "<I", n)
    for i in range(n_random):
        out = bytearray(data)
        for _ in range(rng.choice((1, 1, 2, 4, 16))):
            out[rng.randrange(head)] = rng.randrange(256)
        yield f"random bytes #{i}", bytes(out)


def _alignment_variants(path: Path) -> list[tuple[str, bytes]]:
    """Files whose general.alignment is not a usable power of two (the writer lays the data out by it)."""
    out = []
    for align in (0, 3, 2**31):
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_uint32("general.alignment", align)
        w.add_block_count(1)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.close()
        out.append((f"general.alignment {align}", path.read_bytes()))
    return out


def _load_everything(path: Path) -> None:
    """What foldline does with a GGUF: config only (plan), quant detection, full load (compile)."""
    read_gguf_config(path)
    holds_block_quantized_weights(str(path))
    load_gguf(path)


@pytest.mark.parametrize("matrix_type", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
def test_fuzzed_gguf_files_end_in_clear_errors(tmp_path, matrix_type):
    """Every damaged file loads or raises a FoldlineError naming the problem: no crash, hang or huge allocation."""
    base = write_base(tmp_path / "base.gguf", matrix_type).read_bytes()
    load_gguf(tmp_path / "base.gguf")  # the undamaged file loads
    rng = random.Random(int(matrix_type))
    cases = list(mutations(base, rng, scaled(40, 5000)))
    if matrix_type == Q.F32:
        cases += _alignment_variants(tmp_path / "aligned.gguf")
    log = FuzzLog(f"gguf {matrix_type.name}")
    for i, (what, data) in enumerate(cases):
        path = tmp_path / f"case{i}.gguf"
        path.write_bytes(data)
        log.run(what, lambda p=path: _load_everything(p))
        path.unlink()
    log.finish()
    assert log.clear_errors > len(cases) // 2  # most damage is detected, not silently absorbed


# ---- regressions: cases the fuzz found, kept by name ---------------------------------------------


@pytest.fixture(scope="module")
def base_file(tmp_path_factory) -> bytes:
    return write_base(tmp_path_factory.mktemp("gguf") / "base.gguf", Q.Q8_0).read_bytes()


def _first_tensor(data: bytes) -> TensorFields:
    return layout(data).tensors[0]


def _expect_gguf_error(tmp_path: Path, data: bytes, match: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(GGUFError, match=match):
        load_gguf(path)


@pytest.mark.parametrize("offset, match", [(2**40, "past the end"), (2**64 - 32, "past the end"),
                                           (1, "not a multiple of the alignment")])
def test_tensor_offset_outside_the_file_or_misaligned(tmp_path, base_file, offset, match):
    t = _first_tensor(base_file)
    _expect_gguf_error(tmp_path, put(base_file, t.offset_at, "<Q", t.offset + offset), match)


def test_overlapping_tensors(tmp_path, base_file):
    lay = layout(base_file)
    first, second = lay.tensors[0], lay.tensors[1]
    _expect_gguf_error(tmp_path, put(base_file, second.offset_at, "<Q", first.offset), "overlap")


@pytest.mark.parametrize("dim", [2**40, 2**63, 2**64 - 1])
def test_absurd_dims_are_refused_before_any_allocation(tmp_path, base_file, dim):
    t = _first_tensor(base_file)
    _expect_gguf_error(tmp_path, put(base_file, t.dims_at[0], "<Q", dim), "past the end|too large|not a multiple")


@pytest.mark.parametrize("n_dims", [5, 2**32 - 1])
def test_too_many_dims(tmp_path, base_file, n_dims):
    _expect_gguf_error(tmp_path, put(base_file, _first_tensor(base_file).n_dims_at, "<I", n_dims), "dimensions")


@pytest.mark.parametrize("count", [2**40, 2**64 - 1])
def test_absurd_counts_fail_fast(tmp_path, base_file, count):
    _expect_gguf_error(tmp_path, put(base_file, 8, "<Q", count), "tensors")
    _expect_gguf_error(tmp_path, put(base_file, 16, "<Q", count), "metadata")


def test_absurd_block_count(tmp_path, base_file):
    """2**32 - 1 layers would build a 4-billion-entry layer list before anything else failed."""
    at = layout(base_file).kv_value_at["llama.block_count"]
    _expect_gguf_error(tmp_path, put(base_file, at, "<I", 2**32 - 1), "block_count")


@pytest.mark.parametrize("key", ["llama.embedding_length", "llama.attention.head_count"])
def test_zero_sizes(tmp_path, base_file, key):
    at = layout(base_file).kv_value_at[key]
    _expect_gguf_error(tmp_path, put(base_file, at, "<I", 0), "")


@pytest.mark.parametrize("align", [0, 3])
def test_bad_alignment(tmp_path, align):
    w = gguf.GGUFWriter(str(tmp_path / "a.gguf"), "llama")
    w.add_uint32("general.alignment", align)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(GGUFError, match="alignment"):
        GGUFFile(tmp_path / "a.gguf")


def test_deeply_nested_metadata_arrays(tmp_path):
    """5000 arrays nested in one value (12 bytes each) must be a GGUFError, not a RecursionError."""
    key = b"k"
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<I", 9)
    data += struct.pack("<IQ", 9, 1) * 5000 + struct.pack("<IQ", 4, 0)
    (tmp_path / "n.gguf").write_bytes(data)
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        GGUFFile(tmp_path / "n.gguf")
