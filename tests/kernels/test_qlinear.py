"""The generated decode kernels: exact against numpy, and compiled with the tiles they ask for."""

from __future__ import annotations

import re

import numpy as np
import pytest

from foldline.backends.targets import cpu_target
from foldline.frontend.quant import pack_q5
from foldline.kernels import qlinear as qk
from foldline.kernels import template
from foldline.kernels.mlir import FloatIsa


def _module(spec: qk.QLinearSpec, kernel: str) -> str:
    params = [f"%x: {qk.tensor_type(spec.x_shape, 'f32')}", f"%codes: {qk._stored_codes_t(spec)}", f"%scales: {qk._scales_t(spec)}"]
    if spec.has_min:
        params.append(f"%mins: {qk._scales_t(spec)}")
    names = ", ".join(p.split(":")[0] for p in params)
    types = ", ".join(p.split(": ")[1] for p in params)
    y_t = qk.tensor_type((*spec.x_shape[:-1], spec.n), "f32")
    return (f"module {{\n{kernel}\nutil.func public @main({', '.join(params)}) -> {y_t} {{\n"
            f"  %y = util.call @{spec.name}({names}) : ({types}) -> {y_t}\n  util.return %y : {y_t}\n}}\n}}")


def _inputs(spec: qk.QLinearSpec, rng: np.random.Generator):
    n, k, g = spec.n, spec.k, spec.group
    x = rng.standard_normal(spec.x_shape).astype(np.float32)
    sdt = np.float16 if spec.scale_type == "f16" else np.float32
    if spec.fmt == "q4":
        q = rng.integers(0, 16, (n, k)).astype(np.uint8)
        halves = q.reshape(n, k // g, 2, g // 2)  # ggml's order: byte b holds codes b and b + g/2 of its group
        codes = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2).view(np.int8)
    elif spec.fmt == "q5":  # the nibbles as q4, then the fifth bits (frontend/quant.py)
        q = rng.integers(0, 32, (n, k)).astype(np.uint8)
        codes = pack_q5(q, g).view(np.int8)
    else:
        q = codes = rng.integers(-128, 128, (n, k)).astype(np.int8)
    scales = (rng.standard_normal((n, k // g)) * 0.02).astype(sdt)
    args = [x, codes, scales]
    w = q.astype(np.float64).reshape(n, k // g, g) * scales.astype(np.float64)[..., None]
    if spec.has_min:
        mins = (rng.standard_normal((n, k // g)) * 0.02).astype(sdt)
        args.append(mins)
        w = w + mins.astype(np.float64)[..., None]
    ref = x.reshape(-1, k).astype(np.float64) @ w.reshape(n, k).T
    return args, ref.reshape(*spec.x_shape[:-1], n)


def _compile_and_check(spec: qk.QLinearSpec, text: str, tmp_path, seeds: int) -> str:
    """Compile the kernel for a generic CPU, check it against numpy on random inputs; returns the configured IR."""
    import iree.compiler as ireec
    import iree.runtime as rt

    dump = tmp_path / "dump"
    vmfb = ireec.compile_str(_module(spec, text), extra_args=[*cpu_target("generic").flags,
                                                             f"--iree-hal-dump-executable-files-to={dump}"])
    config = rt.Config("local-task")
    ctx = rt.SystemContext(config=config)
    ctx.add_vm_module(rt.VmModule.copy_buffer(config.vm_instance, vmfb))
    for seed in range(seeds):
        args, ref = _inputs(spec, np.random.default_rng(seed))
        y = ctx.modules.module["main"](*args).to_host()
        assert y.shape == ref.shape
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    return "\n".join(p.read_text() for p in dump.glob("configured_*.mlir"))


CASES = [
    qk.QLinearSpec("q4", 32, "f16", True, (1, 1, 256), 96),  # Q4_0 / Q4_1 blocks
    qk.QLinearSpec("q4", 32, "f32", True, (1, 128), 64),  # Q4_K
    qk.QLinearSpec("q8", 32, "f16", False, (128,), 160),  # Q8_0 / Q5_0
    qk.QLinearSpec("q8", 16, "f32", False, (1, 96), 64),  # Q6_K: groups of 16, 8 lanes
    qk.QLinearSpec("q4", 64, "f16", True, (1, 256), 32),  # quantized at compile time, group 64: 32 lanes
    qk.QLinearSpec("q8", 32, "f32", True, (1, 32), 48),  # one group: the horizontal form
    qk.QLinearSpec("q4", 32, "f16", True, (1, 32), 48),  # one group, q4: the horizontal form in ggml's order
    qk.QLinearSpec("q4", 32, "f16", True, (1, 1024), 64),  # a long row (32 groups): four rows per step
    qk.QLinearSpec("q5", 32, "f16", True, (1, 1, 256), 96),  # Q5_0 / Q5_1, read widened to bytes
    qk.QLinearSpec("q5", 16, "f32", True, (1, 32), 48),  # groups of 16, two groups
    qk.QLinearSpec("q5", 32, "f32", True, (1, 32), 48),  # one group: the horizontal form
]


@pytest.mark.parametrize("spec", CASES, ids=lambda s: s.name)
def test_decode_kernel_matches_numpy_and_keeps_its_tiles(spec, tmp_path):
    text = qk.fused_matvec_mlir(spec)
    lanes = qk._half_lanes(spec)
    assert (lanes is None) == (spec.groups < 2)
    configured = _compile_and_check(spec, text, tmp_path, seeds=3)
    if lanes:
        # IREE keeps the tiles only while no operand has a unit dimension (docs/quantization.md)
        assert lanes == spec.group // 2
        assert f"vector_common_parallel = [{qk._rows_per_step(spec)}, {lanes}, 0]" in configured
        assert "vector_reduction = [0, 0, 1]" in configured


def test_rows_per_step_follow_row_length_format_and_activation_rows():
    def rows(fmt: str, k: int, m: int = 1, n: int = 64) -> int:
        return qk._rows_per_step(qk.QLinearSpec(fmt, 32, "f16", fmt == "q4", (m, k), n))

    assert rows("q4", 576) == qk.ROWS_PER_STEP == 2  # 18 groups: short q4 rows
    assert rows("q4", 1536) == rows("q8", 576) == qk.ROWS_PER_STEP_LONG == 4  # 48 groups; q8 codes
    assert rows("q8", 576, m=2) == 2 and rows("q4", 576, m=3) == 1  # rows x activation rows <= 4
    assert rows("q8", 576, n=66) == 2 and rows("q4", 576, n=63) == 1  # a divisor of the output rows


@pytest.mark.parametrize("spec", [qk.QLinearSpec("q4", 32, "f16", True, (4, 256), 96),
                                  qk.QLinearSpec("q8", 16, "f32", False, (3, 96), 64),
                                  qk.QLinearSpec("q5", 32, "f16", True, (4, 256), 96)], ids=lambda s: s.name)
def test_prefill_dequantize_matmul_matches_numpy(spec, tmp_path):
    """The prefill form reads the same layouts (q4 in ggml's nibble order) through its own maps."""
    assert not qk.fuses_rows(qk.QLinearSpec(spec.fmt, spec.group, spec.scale_type, spec.has_min, (64, spec.k),
                                            spec.n))
    for q4_bytes in (True, False):  # CPU reads q4 bytes and picks the nibble; GPUs read the i4 bitcast
        _compile_and_check(spec, qk.dequantize_matmul_mlir(spec, q4_bytes), tmp_path / str(q4_bytes), seeds=2)


MULTIROW_CASES = [
    qk.QLinearSpec("q4", 32, "f16", True, (8, 1, 256), 96),  # batch-8 decode, Q4_1 blocks
    qk.QLinearSpec("q8", 32, "f16", False, (2, 128), 160),  # batch-2 decode, Q8_0
    qk.QLinearSpec("q8", 16, "f32", False, (3, 96), 64),  # Q6_K: groups of 16, 8 lanes
    qk.QLinearSpec("q5", 32, "f16", True, (4, 1, 256), 96),  # batch-4 decode, Q5_0 blocks
]


@pytest.mark.parametrize("spec", MULTIROW_CASES, ids=lambda s: s.name)
def test_multirow_decode_kernel_matches_numpy_and_keeps_its_tiles(spec, tmp_path):
    """Decode of a batched bundle: every row exact, the codes read in the reduction (no float weight tile)."""
    assert qk.fuses_rows(spec)
    text = qk.fused_rows_mlir(spec)
    assert "tensor<" + f"{spec.n}x{spec.k}xf32" not in text, "no float copy of the weight"
    configured = _compile_and_check(spec, text, tmp_path, seeds=2)
    assert f"vector_common_parallel = [{spec.m}, " in configured and "vector_reduction = [0, 0, 0, 1]" in configured


def test_which_calls_fuse():
    assert qk.fuses_rows(qk.QLinearSpec("q4", 32, "f16", True, (1, 1, 256), 96))
    assert qk.fuses_rows(qk.QLinearSpec("q4", 32, "f16", True, (1, 1, 32), 96)), "one row: the horizontal form"
    assert not qk.fuses_rows(qk.QLinearSpec("q4", 32, "f16", True, (2, 32), 96)), "no lanes for several rows"
    assert not qk.fuses_rows(qk.QLinearSpec("q4", 32, "f16", True, (1, 64, 256), 96)), "prefill chunks dequantize"
    with pytest.raises(qk.QuantKernelError):
        qk.half_group_mlir(qk.QLinearSpec("q4", 32, "f16", True, (9, 256), 96))


# ---- CPUs without FMA or F16C (x86-64-v2, generic x86-64): the float kernels spell both out ----

SOFT_FLOAT = FloatIsa.of(cpu_target("generic").cpu_flags, "x86_64")
LIBRARY_CALLS = {"fmaf", "__extendhfsf2"}  # what LLVM calls per element for math.fma and extf from f16 there


def _library_calls(tmp_path) -> set[str]:
    """The functions the dumped code of the last _compile_and_check calls."""
    asm = "\n".join(p.read_text() for p in (tmp_path / "dump").glob("*.s"))
    return set(re.findall(r"\bcall[lq]?\s+(\w+)", asm))


@pytest.mark.parametrize("spec", [CASES[0], CASES[2], CASES[6], MULTIROW_CASES[1],
                                  qk.QLinearSpec("q4", 32, "f16", True, (1, 96), 48),  # N x G = 144: in the loop
                                  qk.QLinearSpec("q4", 32, "f16", True, (4, 256), 96)], ids=lambda s: s.name)
def test_float_kernels_without_fma_or_f16c_match_numpy_without_library_calls(spec, tmp_path):
    """Decode (half-group with its scales converted before it or in its loop, horizontal, several rows) and
    prefill forms: exact, one row per step (SSE's registers), and neither `fmaf` nor `__extendhfsf2`
    called per element (many times slower)."""
    assert not SOFT_FLOAT.fma and not SOFT_FLOAT.f16 and not SOFT_FLOAT.wide_registers
    if qk.fuses_rows(spec):
        text = "\n".join(qk.fused_rows_code(spec, SOFT_FLOAT))
        half_group = spec.m > 1 or qk._half_lanes(spec) is not None
        assert ("foldline_widen_f16" in text) == (half_group and spec.n * spec.groups % 64 == 0)
        configured = _compile_and_check(spec, text, tmp_path, seeds=2)
        if qk._half_lanes(spec) and spec.m == 1:
            assert f"vector_common_parallel = [1, {spec.group // 2}, 0]" in configured
    else:
        _compile_and_check(spec, qk.dequantize_matmul_mlir(spec, isa=SOFT_FLOAT), tmp_path, seeds=2)
    assert not _library_calls(tmp_path) & LIBRARY_CALLS


def test_f16_widened_without_f16c_is_exact_for_every_bit_pattern(tmp_path):
    """Normal, subnormal, zero, infinite and NaN halves of both signs: the integer form gives the f32 that
    numpy (and F16C) gives, bit for bit (NaN for NaN)."""
    import iree.compiler as ireec
    import iree.runtime as rt

    t16, t32 = "tensor<65536xf16>", "tensor<65536xf32>"
    widen = template.instantiate("widen_f16", src="%h", dst="%f", f16_type="f16", f16=SOFT_FLOAT.f16, pad="")
    body = "\n".join(f"      {line}" for line in widen.split("\n"))
    module = (f"module {{\nutil.func public @main(%x: {t16}) -> {t32} {{\n"
              f"  %e = tensor.empty() : {t32}\n"
              "  %y = linalg.generic {indexing_maps = [affine_map<(i) -> (i)>, affine_map<(i) -> (i)>], "
              f'iterator_types = ["parallel"]}} ins(%x : {t16}) outs(%e : {t32}) {{\n'
              f"    ^bb0(%h: f16, %o: f32):\n{body}\n      linalg.yield %f : f32\n  }} -> {t32}\n"
              f"  util.return %y : {t32}\n}}\n}}")
    dump = tmp_path / "dump"
    vmfb = ireec.compile_str(module, extra_args=[*cpu_target("generic").flags,
                                                 f"--iree-hal-dump-executable-files-to={dump}"])
    config = rt.Config("local-sync")
    ctx = rt.SystemContext(config=config)
    ctx.add_vm_module(rt.VmModule.copy_buffer(config.vm_instance, vmfb))
    halves = np.arange(65536, dtype=np.uint16).view(np.float16)
    got, want = ctx.modules.module["main"](halves).to_host(), halves.astype(np.float32)
    nan = np.isnan(want)
    assert np.isnan(got[nan]).all()
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    assert not _library_calls(tmp_path) & LIBRARY_CALLS
