"""numpy references for the int8-activation kernels: the activation quantization and the products.

The int8 kernels (decode, kernels/int8_decode.py; prefill,
kernels/int8_gemm.py; every ISA of kernels/isa.py) quantize each activation row per weight group as
llama.cpp's Q8 rows do, then take exact integer dots scaled in float. These
emulate that in numpy (float64 scaling), which the kernels must match to
float32 rounding.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import numpy as np
import pytest

from foldline.kernels.x86 import AVX2, AVX512_VNNI, AVX_VNNI

if TYPE_CHECKING:
    from foldline.kernels.isa import Int8Isa

# The x86 int8 forms, each compiled for a CPU that has it and nothing better (alderlake: AVX-VNNI, no
# AVX-512), with the --cpu its kernels are compiled for here.
X86_FORMS = [pytest.param(AVX512_VNNI, "host", id="avx512vnni"), pytest.param(AVX_VNNI, "alderlake", id="avxvnni"),
             pytest.param(AVX2, "x86-64-v3", id="avx2")]


def quantize_activation(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """int8 codes [G, g] and scales [G] of one row: max |x| / 127 per group, round half to even."""
    xg = x.reshape(-1, group).astype(np.float32)
    amax = np.abs(xg).max(1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    return np.rint(xg * inv[:, None]).astype(np.int64), (amax / np.float32(127)).astype(np.float64)


def int8_product(x: np.ndarray, q: np.ndarray, scales: np.ndarray, mins: np.ndarray | None, group: int) -> np.ndarray:
    """y [..., N] for activations x [..., K] and codes q [N, K] (w = scale * q (+ min) per group)."""
    n, k = q.shape
    rows = x.reshape(-1, k)
    qg = q.reshape(n, k // group, group).astype(np.int64)
    s64 = scales.astype(np.float64)
    y = np.zeros((rows.shape[0], n))
    for r, row in enumerate(rows):
        xq, dx = quantize_activation(row, group)
        y[r] = ((qg * xq[None]).sum(-1) * s64 * dx[None]).sum(1)
        if mins is not None:
            y[r] += (mins.astype(np.float64) * (dx * xq.sum(1))[None]).sum(1)
    return y.reshape(*x.shape[:-1], n)


def random_blocks(fmt: str, group: int, scale_type: str, n: int, k: int, rng: np.random.Generator):
    """Random codes in the bundle layout and their scales and mins, as the kernels read them.

    Returns (codes, q, scales, mins, weight): codes as stored (q4: [N, K/2] bytes in ggml's
    nibble order, byte b of a group holding codes b and b + g/2; q5: those nibbles, then the
    [N, K/8] fifth bits; q8: [N, K] int8), q the
    codes as int64 [N, K], and weight the float64 [N, G, g] w = scale * q (the caller adds the
    mins where the format has them).
    """
    sdt = np.float16 if scale_type == "f16" else np.float32
    scales = (rng.standard_normal((n, k // group)) * 0.02).astype(sdt)
    mins = (rng.standard_normal((n, k // group)) * 0.02).astype(sdt)
    if fmt == "q4":
        q = rng.integers(0, 16, (n, k)).astype(np.int64)
        halves = q.astype(np.uint8).reshape(n, k // group, 2, group // 2)
        codes = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2).view(np.int8)
    elif fmt == "q5":
        from foldline.frontend.quant import pack_q5

        q = rng.integers(0, 32, (n, k)).astype(np.int64)
        q[:, ::5] = 31  # the largest code, and every fifth bit set somewhere
        codes = pack_q5(q.astype(np.uint8), group).view(np.int8)
    else:
        codes = rng.integers(-128, 128, (n, k)).astype(np.int8)
        codes[:, ::7] = -128  # the edge of the products' exactness (kernels/isa.py): |-128| is 128
        q = codes.astype(np.int64)
    weight = q.reshape(n, k // group, group) * scales.astype(np.float64)[..., None]
    return codes, q, scales, mins, weight


def compile_on_host(text: str, dump_dir, cpu: str = "host") -> tuple[object, str]:
    """Compile a module for `cpu` (one this CPU runs: host, or an older level such as x86-64-v3) and load it
    here; returns its `main` module handle and the dumped assembly."""
    import iree.compiler as ireec
    import iree.runtime as rt

    from foldline.backends.targets import cpu_target

    vmfb = ireec.compile_str(text, extra_args=[*cpu_target(cpu).flags,
                                               f"--iree-hal-dump-executable-files-to={dump_dir}"])
    assembly = "\n".join(p.read_text() for p in dump_dir.glob("*.s"))
    config = rt.Config("local-task")
    ctx = rt.SystemContext(config=config)
    ctx.add_vm_module(rt.VmModule.copy_buffer(config.vm_instance, vmfb))
    return ctx.modules.module, assembly


def check_form_code(assembly: str, isa: Int8Isa) -> None:
    """The compiled kernel holds its int8 form's instruction, and no 512-bit register where the form has none."""
    assert isa.instruction in assembly, f"the kernel was compiled without {isa.instruction}"
    if not isa.zmm:
        assert not re.search(r"\bzmm\d", assembly), "512-bit registers in a kernel for a CPU without them"
