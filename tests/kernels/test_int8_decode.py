"""The int8-activation decode kernels (kernels/int8_decode.py) against numpy, in each ISA of kernels/isa.py.

Two references: an int8 emulation in numpy (the same activation quantization,
exact integer dots, float64 scaling), which the kernel must match to float32
rounding, and the float64 product with unquantized activations, which bounds
what 8-bit activations cost. Each ISA's kernel is compiled for a CPU level this
host runs (AVX-512 VNNI: the host; AVX2: x86-64-v3, no 512-bit registers) and
must hold its dot-product instruction.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from foldline.kernels import int8_decode as vk
from foldline.kernels.int8_channels import int8_decode_executable
from foldline.kernels.x86 import AVX2, AVX512_VNNI, AVX_VNNI
from foldline.runtime.device import host_cpu_features

from kernels.int8_reference import (
    X86_FORMS,
    check_form_code,
    compile_on_host,
    int8_product,
    random_blocks,
)

ISAS = X86_FORMS


def rms_normed(h: np.ndarray, weight: np.ndarray, norm: vk.RowNorm) -> np.ndarray:
    """RMSNorm in float32, in frontend/layers.py's order: (h * rsqrt(mean(h^2) + eps)) * (w + offset)."""
    r = np.float32(1) / np.sqrt(np.mean(h.astype(np.float64) ** 2) + norm.eps).astype(np.float32)
    w = weight if norm.offset is None else weight + np.float32(norm.offset)
    return ((h * r) * w).astype(np.float32)


def gated_activation(gate: str, g: np.ndarray) -> np.ndarray:
    """SwiGLU's silu or GeGLU's tanh-approximated GELU, in float32 as torch computes them."""
    if gate == "silu":
        return g * (np.float32(1) / (np.float32(1) + np.exp(-g)))
    inner = np.float32(vk.GELU_TANH_BETA) * (g + np.float32(vk.GELU_TANH_KAPPA) * g * g * g)
    return np.float32(0.5) * g * (np.float32(1) + np.tanh(inner))


def _case(shape: vk.Int8DotShape, rng: np.random.Generator, weights: np.random.Generator | None = None):
    """(kernel arguments, int8 emulation, float64 product) of a random row; weights: the generator of the
    codes and norm weight, where several rows share them (default rng)."""
    n, k, g = shape.n, shape.k, shape.group
    weights = weights or rng
    x = rng.standard_normal(k).astype(np.float32)
    x[:g] = 0  # a group of zeros: scale 0, no division by zero
    codes, q, scales, mins, w = random_blocks(shape.fmt, g, shape.scale_type, n, k, weights)
    w = w + (mins.astype(np.float64)[..., None] if shape.has_min else 0)
    args = [x]
    if shape.gated:  # the kernel takes the fused gate/up row [g, u] and makes act(g) * u
        gate_up = (rng.standard_normal(2 * k) * 2).astype(np.float32)
        gate, up = gate_up[:k], gate_up[k:]
        x = (gated_activation(shape.gate, gate) * up).astype(np.float32)
        args = [gate_up]
    if shape.norm is not None:  # the kernel takes the raw row h and the norm weight, and normalizes
        h = (x * 7.5).astype(np.float32)  # far from unit RMS: the norm has something to do
        weight = weights.uniform(0.5, 1.5, k).astype(np.float32)
        x = rms_normed(h, weight, shape.norm)
        args = [h, weight]
    exact = w.reshape(n, k) @ x.astype(np.float64)
    emulated = int8_product(x, q, scales, mins if shape.has_min else None, g)
    args += [codes, scales] + ([mins] if shape.has_min else [])
    if shape.residual:
        residual = (rng.standard_normal(n) * np.abs(exact).max()).astype(np.float32)
        exact, emulated = exact + residual, emulated + residual
        args.append(residual)
    return args, emulated, exact


def _module(shape: vk.Int8DotShape, name: str = "main") -> str:
    """The kernel of `shape` behind a util.func @name; with shape.rows rows, x, the residual and y hold
    the rows one after another."""
    codes_t = vk._codes_memref(shape).replace("memref", "tensor")
    scales_t = vk._scales_memref(shape).replace("memref", "tensor")
    x_t, y_t = f"tensor<{shape.rows * shape.x_len}xf32>", f"tensor<{shape.rows * shape.n}xf32>"
    params = [f"%x: {x_t}"] + ([f"%w: tensor<{shape.k}xf32>"] if shape.norm else []) + [f"%c: {codes_t}", f"%s: {scales_t}"] + (
        [f"%m: {scales_t}"] if shape.has_min else []) + ([f"%r: {y_t}"] if shape.residual else [])
    call = vk.int8_dot_dispatch(shape, "%x", "%c", "%s", "%m" if shape.has_min else None, "%y",
                                norm_weight="%w" if shape.norm else None, residual="%r" if shape.residual else None)
    return (f"{int8_decode_executable(shape)}\nutil.func public @{name}({', '.join(params)}) -> {y_t} {{\n"
            f"  {call}\n  util.return %y : {y_t}\n}}\n")


SHAPES = [
    vk.Int8DotShape("q4", 32, "f16", True, 576, 192),  # Q4_0 / Q4_1 (SmolLM2's projections, K = 576)
    vk.Int8DotShape("q4", 32, "f32", True, 640, 64),  # Q4_K
    vk.Int8DotShape("q4", 64, "f16", True, 256, 32),  # compile-time int4, group 64
    vk.Int8DotShape("q8", 32, "f16", False, 640, 320),  # Q8_0 (Gemma's head, K = 640)
    vk.Int8DotShape("q5", 32, "f16", True, 640, 320),  # Q5_0 / Q5_1 (Gemma's projections)
    vk.Int8DotShape("q5", 32, "f32", True, 1024, 64),  # Q5_K
    vk.Int8DotShape("q5", 16, "f16", True, 128, 32),  # groups of 16: one byte of fifth bits per half
    vk.Int8DotShape("q8", 16, "f32", False, 128, 16),  # Q6_K: groups of 16
    vk.Int8DotShape("q8", 32, "f32", True, 1024, 16384),  # Q5_K (mins); large N: 1024 rows per workgroup
    # fused into the decode step: the RMSNorm in front (SmolLM2's eps, no offset; Gemma's offset 1), the residual add behind
    vk.Int8DotShape("q4", 32, "f16", True, 576, 192, norm=vk.RowNorm(1e-5, 0.0)),
    vk.Int8DotShape("q8", 32, "f16", False, 640, 320, norm=vk.RowNorm(1e-6, 1.0)),
    vk.Int8DotShape("q4", 32, "f16", True, 576, 64, norm=vk.RowNorm(1e-5, None)),
    vk.Int8DotShape("q4", 32, "f16", True, 1536, 576, residual=True),
    vk.Int8DotShape("q4", 32, "f16", True, 1536, 576, residual=True, gate="silu"),  # SmolLM2's down
    # Gemma 3's down projections (Q6_K and Q4_K), GELU(tanh) of the gate half taken in
    vk.Int8DotShape("q8", 16, "f32", False, 2048, 640, gate="gelu_tanh"),
    vk.Int8DotShape("q4", 32, "f32", True, 2048, 640, gate="gelu_tanh"),
    vk.Int8DotShape("q8", 32, "f16", False, 256, 64, gate="silu"),
    vk.Int8DotShape("q5", 32, "f16", True, 640, 64, norm=vk.RowNorm(1e-6, 1.0), residual=True),
    vk.Int8DotShape("q5", 32, "f16", True, 2048, 640, gate="gelu_tanh"),
    vk.Int8DotShape("q8", 16, "f32", False, 128, 16, norm=vk.RowNorm(1e-6, 1.0), residual=True),
]


@pytest.mark.slow
@pytest.mark.parametrize("isa,cpu", ISAS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_int8_dot_kernel_matches_int8_emulation(shape, isa, cpu, tmp_path):
    if not isa.available(host_cpu_features() or set()):
        pytest.skip(f"this CPU cannot run {isa.name}")
    shape = dataclasses.replace(shape, isa=isa)
    module, assembly = compile_on_host(_module(shape), tmp_path / "dump", cpu)
    check_form_code(assembly, isa)
    for seed in range(2):
        args, emulated, exact = _case(shape, np.random.default_rng(seed))
        y = module.main(*args).to_host()
        scale = np.abs(exact).max()
        np.testing.assert_allclose(y, emulated, rtol=1e-5, atol=1e-5 * scale)
        # 8-bit activations per group: a relative RMS error of a few tenths of a percent on random data;
        # a gated row act(g) * u is a product of two normals, heavy-tailed, and loses more to 8 bits.
        rel_rms = np.sqrt(np.mean((y - exact) ** 2)) / np.sqrt(np.mean(exact ** 2))
        assert rel_rms < (2e-2 if shape.gated else 1e-2), f"relative RMS error {rel_rms:.2e} against float activations"


def _rows_module(shape: vk.Int8DotShape) -> str:
    """@rows: the few-row kernel of `shape` on its rows, one after another; @one: the one-row kernel of a row."""
    return _module(shape, "rows") + _module(dataclasses.replace(shape, rows=1), "one")


def rows_case(shape: vk.Int8DotShape) -> tuple[list[np.ndarray], list[list[np.ndarray]], list[np.ndarray], float]:
    """(the few-row kernel's arguments, each row's one-row kernel arguments, each row's int8 emulation, the
    largest |float64 product|) of shape.rows random rows sharing their codes."""
    cases = [_case(shape, np.random.default_rng(seed), np.random.default_rng(99)) for seed in range(shape.rows)]
    per_row = _row_args(shape)
    stacked = [np.concatenate([c[0][i] for c in cases]) if i in per_row else a for i, a in enumerate(cases[0][0])]
    ones = [[a if i in per_row else stacked[i] for i, a in enumerate(c[0])] for c in cases]
    return stacked, ones, [c[1] for c in cases], max(float(np.abs(c[2]).max()) for c in cases)


ROW_SHAPES = [
    (vk.Int8DotShape("q4", 32, "f16", True, 576, 192, norm=vk.RowNorm(1e-5, None)), 4),  # SmolLM2's q/k/v
    (vk.Int8DotShape("q4", 32, "f16", True, 1536, 576, residual=True, gate="silu"), 8),  # SmolLM2's down
    (vk.Int8DotShape("q8", 32, "f16", False, 640, 320, norm=vk.RowNorm(1e-6, 1.0)), 2),  # Q8_0, Gemma's offset
    (vk.Int8DotShape("q5", 32, "f16", True, 640, 64, norm=vk.RowNorm(1e-6, 1.0), residual=True), 3),
    (vk.Int8DotShape("q8", 16, "f32", False, 2048, 640, gate="gelu_tanh"), 4),  # Q6_K, Gemma 3's down
    (vk.Int8DotShape("q4", 32, "f16", True, 64, 512, norm=vk.RowNorm(1e-5, None)), 4),  # one step a row
    (vk.Int8DotShape("q4", 32, "f16", True, 128, 64, residual=True, gate="silu"), 4),
    (vk.Int8DotShape("q8", 32, "f16", False, 576, 256, norm=vk.RowNorm(1e-5, None)), 5),  # SmolLM2's head, odd rows
    (vk.Int8DotShape("q8", 32, "f32", True, 1024, 64, residual=True), 8),  # q8 codes with mins, 64 groups a row
]


@pytest.mark.slow
@pytest.mark.parametrize("isa,cpu", ISAS)
@pytest.mark.parametrize("shape,rows", ROW_SHAPES, ids=lambda v: v.name if isinstance(v, vk.Int8DotShape) else str(v))
def test_few_row_kernel_gives_each_row_the_one_row_result(shape, rows, isa, cpu, tmp_path):
    """Batched decode: each row of the few-row kernel equals the one-row kernel on that row, to the bit,
    and so matches the int8 emulation as the one-row kernel does."""
    if not isa.available(host_cpu_features() or set()):
        pytest.skip(f"this CPU cannot run {isa.name}")
    shape = dataclasses.replace(shape, isa=isa, rows=rows)
    assert vk.supports(shape)
    module, assembly = compile_on_host(_rows_module(shape), tmp_path / "dump", cpu)
    check_form_code(assembly, isa)
    stacked, ones, emulated, scale = rows_case(shape)
    y = module.rows(*stacked).to_host().reshape(rows, shape.n)
    for r, (args, want) in enumerate(zip(ones, emulated)):
        np.testing.assert_array_equal(y[r], module.one(*args).to_host(), err_msg=f"row {r} differs from the one-row kernel")
        np.testing.assert_allclose(y[r], want, rtol=1e-5, atol=1e-5 * scale)


def _row_args(shape: vk.Int8DotShape) -> set[int]:
    """Which of `_case`'s arguments are per activation row (x, the residual); the others are shared."""
    shared = 2 + shape.has_min + (shape.norm is not None)  # the norm weight, codes, scales, mins
    return {0} | ({1 + shared} if shape.residual else set())


def test_few_row_kernel_splits_where_the_stack_is_short():
    small = vk.Int8DotShape("q4", 32, "f16", True, 576, 192)
    assert vk.dispatch_rows(small, 8) == 8 and vk.dispatch_rows(small, 4) == 4 and vk.dispatch_rows(small, 1) == 1
    wide = vk.Int8DotShape("q4", 32, "f16", True, 8192, 64)  # 8 rows of quantized activations: 80 KiB
    assert vk.dispatch_rows(wide, 8) == 2 and not vk.supports(dataclasses.replace(wide, rows=8))
    assert vk.dispatch_rows(vk.Int8DotShape("q4", 32, "f16", True, 4096, 64), 6) == 3
    assert vk.dispatch_rows(vk.Int8DotShape("q4", 32, "f16", True, 32768, 64), 4) == 1  # the one-row kernel per row
    assert "_r4" in dataclasses.replace(small, rows=4).name and "_r" not in small.name


def test_dispatch_operands_must_match_the_fusions():
    shape = vk.Int8DotShape("q4", 32, "f16", True, 576, 64, norm=vk.RowNorm(1e-5, 0.0))
    with pytest.raises(ValueError, match="norm weight and residual"):
        vk.int8_dot_dispatch(shape, "%x", "%c", "%s", "%m", "%y")  # no norm weight
    with pytest.raises(ValueError, match="norm weight and residual"):
        vk.int8_dot_dispatch(shape, "%x", "%c", "%s", "%m", "%y", norm_weight="%w", residual="%r")
    names = {vk.Int8DotShape("q4", 32, "f16", True, 576, 64, norm=vk.RowNorm(eps, off)).name
             for eps, off in ((1e-5, 0.0), (1e-6, 0.0), (1e-5, 1.0), (1e-5, None))}
    assert len(names) == 4, "each eps and offset needs its own kernel"


def test_supports_only_whole_vector_shapes():
    assert vk.supports(vk.Int8DotShape("q4", 32, "f16", True, 576, 3072))
    assert not vk.supports(vk.Int8DotShape("q4", 32, "f16", True, 96, 64))  # K not a multiple of 64
    assert not vk.supports(vk.Int8DotShape("q4", 32, "f16", True, 128, 24))  # N not a multiple of 16
    assert not vk.supports(vk.Int8DotShape("q8", 8, "f16", False, 128, 64))  # group 8
    assert not vk.supports(vk.Int8DotShape("q4", 32, "f16", False, 128, 64))  # q4 always has mins


@pytest.mark.parametrize("rows", [1, 4])
def test_each_row_asks_for_every_line_of_a_row_ahead(rows):
    """The prefetch the codes' stream relies on (docs/quantization.md): every cache line of the codes,
    scales and mins of a row ahead, clamped to the last row."""
    shape = vk.Int8DotShape("q5", 32, "f16", True, 640, 320, rows=rows)  # Gemma's projections: 400 code bytes a row
    text = vk.int8_dot_executable(shape)
    prefetches = re.findall(r"memref.prefetch %\w+\[%\w+, %\w+\], read, locality<3>, data : memref<(\d+)x(\d+)x(\w+)>", text)
    codes = [p for p in prefetches if p[2] == "i8"]
    assert len(codes) == -(-400 // vk.CACHE_LINE)  # 7 lines of 64 bytes
    assert len([p for p in prefetches if p[2] == "f16"]) == 2  # scales and mins: 20 groups, one line each
    assert "arith.minsi" in text and "arith.constant 319 : index" in text  # the row ahead, at most the last


def test_rows_per_workgroup_divide_n():
    for n in (16, 48, 576, 960, 3072, 49152, 262144, 8208):
        for activation_rows in range(1, vk.MAX_ROWS + 1):
            rows = vk.Int8DotShape("q8", 32, "f16", False, 640, n, rows=activation_rows).rows_per_workgroup
            assert n % rows == 0


def test_several_rows_take_fewer_workgroups():
    """Each workgroup quantizes every activation row again: a call of more rows is split in fewer parts."""
    counts = [576 // vk.Int8DotShape("q4", 32, "f16", True, 1536, 576, rows=r).rows_per_workgroup for r in range(1, 9)]
    assert counts == [8, 8, 4, 4, 2, 2, 2, 2]


def test_activations_follow_the_target():
    from foldline.backends.policy import target_activations
    from foldline.backends.targets import TargetError, make_target

    generic, znver4 = make_target("cpu", cpu="generic"), make_target("cpu", cpu="znver4")
    v3, v2 = make_target("cpu", cpu="x86-64-v3"), make_target("cpu", cpu="x86-64-v2")
    assert target_activations(generic, "auto") == "f32"  # the x86-64 baseline has neither AVX2 nor VNNI
    assert target_activations(v2, "auto") == "f32"  # SSE4.2, no AVX2
    assert target_activations(znver4, "auto") == "int8"
    assert target_activations(v3, "auto") == "int8"  # AVX2 (Zen 3, Haswell and later)
    assert target_activations(znver4, "f32") == "f32"
    # batched bundles: int8 rows, as one row (each row computed to the bit as alone: test_batched_int8.py)
    assert target_activations(znver4, "auto", batch=4) == "int8"
    assert target_activations(znver4, "f32", batch=4) == "f32"
    assert target_activations(generic, "auto", batch=4) == "f32"
    with pytest.raises(TargetError, match="AVX2 .* or AVX-512 VNNI"):
        target_activations(generic, "int8", batch=4)
    onnx = make_target("onnx")
    assert target_activations(onnx, "auto", batch=4) == "f32"  # ONNX Runtime's batched rows: float
    with pytest.raises(TargetError, match="--batch 1"):
        target_activations(onnx, "int8", batch=4)
    assert target_activations(make_target("cuda"), "auto") == "f32"
    for target in (generic, v2):
        with pytest.raises(TargetError, match="AVX2 .* or AVX-512 VNNI"):
            target_activations(target, "int8")
    with pytest.raises(TargetError, match="unknown activations"):
        target_activations(znver4, "int4")


def test_each_target_gets_its_best_kernels():
    from foldline.backends.targets import make_target
    from foldline.kernels.isa import FLOAT_KERNELS, Int8Kernels
    from foldline.kernels.select import choose_kernels

    def kernels(cpu: str) -> Int8Kernels:
        return choose_kernels(make_target("cpu", cpu=cpu).cpu_flags)

    assert kernels("znver4") == Int8Kernels(AVX512_VNNI, AVX512_VNNI)
    assert kernels("alderlake") == Int8Kernels(AVX_VNNI, AVX_VNNI)  # VNNI on 256-bit registers
    assert kernels("x86-64-v3") == Int8Kernels(AVX2, AVX2)
    assert kernels("generic") == FLOAT_KERNELS
    assert Int8Kernels(AVX2, None).record() == {"decode": "int8-avx2", "prefill": "f32"}
