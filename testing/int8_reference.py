"""numpy references for the int8-activation kernels: the activation quantization and the products.

Both VNNI kernels (decode, backends/vnni_kernels.py; prefill,
backends/vnni_gemm.py) quantize each activation row per weight group as
llama.cpp's Q8 rows do, then take exact integer dots scaled in float. These
emulate that in numpy (float64 scaling), which the kernels must match to
float32 rounding.
"""

from __future__ import annotations

import numpy as np


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
