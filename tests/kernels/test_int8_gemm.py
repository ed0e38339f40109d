"""The int8 prefill kernels (kernels/int8_gemm.py) against numpy, in every x86 form the host runs.

As for the decode kernel: an int8 emulation in numpy (the same activation
quantization per row and group, exact integer dots, float64 scaling), which the
kernels must match to float32 rounding, and the float64 product with
unquantized activations, which bounds what 8-bit activations cost.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from foldline.frontend.quant import pack_q5
from foldline.kernels import int8_gemm as vg
from foldline.kernels import qlinear as qk
from foldline.runtime.device import host_cpu_features

from kernels.int8_reference import (
    X86_FORMS,
    check_form_code,
    compile_on_host,
    int8_product,
    random_blocks,
)

ISAS = X86_FORMS


def _case(s: vg.Int8GemmShape, rng: np.random.Generator):
    m, n, k, g = s.m, s.n, s.k, s.group
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[3, :g] = 0  # a group of zeros: scale 0, no division by zero
    x[5] *= 50  # rows of very different magnitudes: each row and group has its own scale
    codes, q, scales, mins, w = random_blocks(s.fmt, g, s.scale_type, n, k, rng)
    w = w + (mins.astype(np.float64)[..., None] if s.has_min else 0)
    exact = x.astype(np.float64) @ w.reshape(n, k).T
    emulated = int8_product(x, q, scales, mins if s.has_min else None, g)
    return [x, codes, scales] + ([mins] if s.has_min else []), emulated, exact


def _module(s: vg.Int8GemmShape) -> str:
    codes_t, scales_t = vg.as_tensor(vg._codes_memref(s)), vg.as_tensor(vg._scales_memref(s))
    params = [f"%x: tensor<{s.m}x{s.k}xf32>", f"%c: {codes_t}", f"%s: {scales_t}"] + (
        [f"%mn: {scales_t}"] if s.has_min else [])
    lines = vg.int8_gemm_dispatches(s, "%x", "%c", "%s", "%mn" if s.has_min else None, "%y")
    body = "\n  ".join(lines)
    return (f"{vg.quantize_executable(s)}\n{vg.gemm_executable(s)}\n"
            f"util.func public @main({', '.join(params)}) -> tensor<{s.m}x{s.n}xf32> {{\n  {body}\n"
            f"  util.return %y : tensor<{s.m}x{s.n}xf32>\n}}\n")


SHAPES = [
    vg.Int8GemmShape("q4", 32, "f16", True, 64, 576, 192),  # Q4_0 / Q4_1 (SmolLM2, K = 576: chunks of 192)
    vg.Int8GemmShape("q4", 32, "f32", True, 32, 640, 48),  # Q4_K; 48 channels: tiles of 16, 3 workgroups
    vg.Int8GemmShape("q4", 64, "f16", True, 16, 512, 32),  # compile-time int4, group 64; one row vector
    vg.Int8GemmShape("q8", 32, "f16", False, 64, 640, 320),  # Q8_0
    vg.Int8GemmShape("q5", 32, "f16", True, 64, 640, 320),  # Q5_0 / Q5_1
    vg.Int8GemmShape("q5", 16, "f32", True, 16, 256, 32),  # groups of 16: one byte of fifth bits per half
    vg.Int8GemmShape("q8", 16, "f32", False, 48, 2048, 8),  # Q6_K (groups of 16); 8 chains of K; tiles of 8
    vg.Int8GemmShape("q8", 32, "f32", True, 32, 256, 64),  # codes with mins (Q5_1 / Q5_K widened by --weights int8)
]


@pytest.mark.slow
@pytest.mark.parametrize("isa,cpu", ISAS)
@pytest.mark.parametrize("fmt", ["q4", "q5"])
def test_the_largest_codes_against_the_largest_activations_stay_exact(fmt, isa, cpu, tmp_path):
    """Every code at its largest against activations that quantize to +127 and -127: the sums AVX2 adds
    in int16 before widening (4 q5 or 8 q4 products, kernels/x86/avx2.py) reach their bound, 31496 and
    30480, and must not wrap."""
    if not isa.available(host_cpu_features() or set()):
        pytest.skip(f"this CPU cannot run {isa.name}")
    shape = vg.Int8GemmShape(fmt, 32, "f32", True, 16, 256, 8, isa)
    module, _ = compile_on_host(_module(shape), tmp_path / "dump", cpu)
    top = 15 if fmt == "q4" else 31
    q = np.full((shape.n, shape.k), top, dtype=np.uint8)
    codes = (pack_q5(q, 32) if fmt == "q5" else np.full((shape.n, shape.k // 2), 0xFF, np.uint8)).view(np.int8)
    scales, mins = np.full((shape.n, shape.k // 32), 0.5, np.float32), np.zeros((shape.n, shape.k // 32), np.float32)
    x = np.ones((shape.m, shape.k), np.float32)
    x[1::2] = -1  # every other row at the negative end
    y = module.main(x, codes, scales, mins).to_host()
    want = int8_product(x, q.astype(np.int64), scales, mins, 32)
    assert np.array_equal(y, want.astype(np.float32)), (y[:2, :2], want[:2, :2])


@pytest.mark.slow
@pytest.mark.parametrize("isa,cpu", ISAS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_int8_gemm_kernel_matches_int8_emulation(shape, isa, cpu, tmp_path):
    if not isa.available(host_cpu_features() or set()):
        pytest.skip(f"this CPU cannot run {isa.name}")
    shape = dataclasses.replace(shape, isa=isa)
    module, assembly = compile_on_host(_module(shape), tmp_path / "dump", cpu)
    check_form_code(assembly, isa)
    args, emulated, exact = _case(shape, np.random.default_rng(0))
    y = module.main(*args).to_host()
    scale = np.abs(exact).max(1, keepdims=True)  # per row: row 5 is 50x the others
    assert np.all(np.abs(y - emulated) <= 1e-5 * scale), "differs from the int8 emulation beyond float32 rounding"
    # 8-bit activations per group: a relative RMS error of a few tenths of a percent (each row weighted alike)
    rel_rms = np.sqrt(np.sum(((y - exact) / scale) ** 2) / np.sum((exact / scale) ** 2))
    assert rel_rms < 1e-2, f"relative RMS error {rel_rms:.2e} against float activations"


def test_supports_whole_row_vectors_and_channel_blocks():
    assert vg.supports(vg.Int8GemmShape("q4", 32, "f16", True, 64, 576, 3072))
    assert not vg.supports(vg.Int8GemmShape("q4", 32, "f16", True, 24, 576, 64))  # M not a multiple of 16
    assert not vg.supports(vg.Int8GemmShape("q4", 32, "f16", True, 64, 576, 18))  # N not a multiple of 4
    assert not vg.supports(vg.Int8GemmShape("q8", 8, "f16", False, 64, 128, 64))  # group 8
    assert not vg.supports(vg.Int8GemmShape("q4", 32, "f16", False, 64, 128, 64))  # q4 always has mins


@pytest.mark.parametrize("k,n", [(576, 960), (640, 4096), (2048, 640), (1024, 640), (640, 48), (640, 262144)])
def test_tiles_divide_the_shape(k, n):
    s = vg.Int8GemmShape("q8", 32, "f16", False, 64, k, n)
    assert n % s.tile_channels == 0 and s.tile_channels % vg.CHANNELS == 0
    assert k % s.chunk == 0 and s.chunk % s.group == 0 and s.chunk <= vg.MAX_CHUNK


def test_prefill_chunks_take_the_int8_gemm_and_decode_rows_do_not():
    def spec(rows: int) -> qk.QLinearSpec:
        return qk.QLinearSpec("q4", 32, "f16", True, (1, rows, 576), 960)

    assert qk.uses_int8_gemm(spec(64)) and qk.uses_int8_gemm(spec(16))
    assert not qk.uses_int8_gemm(spec(8))  # decode rows of a batched bundle: the few-row int8 kernel
    assert not qk.uses_int8_gemm(spec(1)) and qk.uses_int8_dot(spec(1))
    assert not qk.uses_int8_gemm(spec(40))  # not a multiple of 16: dequantize, then matmul
    # a batched bundle decodes its rows with int8 activations, and prefills them so
    batched = qk.QLinearSpec("q4", 32, "f16", True, (4, 64, 576), 960)
    assert qk.uses_int8_gemm(batched) and qk.uses_int8_dot(qk.QLinearSpec("q4", 32, "f16", True, (4, 1, 576), 960))
    assert not qk.uses_int8_dot(qk.QLinearSpec("q4", 32, "f16", True, (9, 1, 576), 960))  # past MAX_FUSED_ROWS
