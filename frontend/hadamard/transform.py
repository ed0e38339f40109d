"""The Hadamard transform: block Walsh-Hadamard math, weight folding, and its custom ops.

A Hadamard-folded checkpoint stores some weights in a rotated basis so that
quantization error spreads evenly over the input dimension. Each listed weight
W_s expects its activation rotated just before the matmul:

    x -> [tiled->grouped head permutation P, when listed] -> x * signs -> WHT(x) -> W_s @ x

so the weight in the model's own basis is W = W_s H D P. Tables listed as
inverse (the token embedding) store rotated rows z = H D e; a lookup restores
the row in the reverse order, e = signs * WHT(z). The transform is a
normalized Sylvester Walsh-Hadamard transform applied independently to
contiguous blocks (see `block_for_width`).

The rotation is emitted as `foldline::hadamard_rotate` / `foldline::hadamard_unrotate`
so the `fuse-hadamard` pass can find it; both decompose into an O(n log n)
butterfly (adds, subtracts, reshapes), never a dense n x n matmul.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ...errors import FoldlineError
from ..op_registry import declare_op

DEFAULT_BLOCK_SIZE = 1024  # where the metadata names none: the qwen35 / Bonsai files' block


class HadamardMetadataError(FoldlineError, ValueError):
    """prism.hadamard.* metadata that is inconsistent or that foldline does not understand."""


# ---------------------------------------------------------------------------
# Math
# ---------------------------------------------------------------------------


def block_for_width(width: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """The transform block for an activation of `width`: the largest power of two dividing it, capped.

    For widths that are multiples of block_size (all of qwen35's: 5120, 6144, 17408)
    this is block_size itself. Other widths (576 = 9 x 64) use the largest
    power-of-two block that tiles them exactly, so no padding changes the shapes.
    """
    if block_size < 2 or block_size & (block_size - 1):
        raise HadamardMetadataError(f"Hadamard block size {block_size} is not a power of two >= 2")
    if width <= 0:
        raise HadamardMetadataError(f"activation width {width} must be positive")
    low_bit = width & -width
    block = min(low_bit, block_size)
    if block < 2:
        raise HadamardMetadataError(f"activation width {width} is odd: no Walsh-Hadamard block tiles it")
    return block


def _compute_dtype(x: Tensor) -> torch.dtype:
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


def wht(x: Tensor, block: int) -> Tensor:
    """Normalized Sylvester WHT on contiguous blocks of the last dim, as a log2(block)-stage butterfly.

    H_{2n} = [[H_n, H_n], [H_n, -H_n]] is H_2 applied on every index bit, so each
    stage pairs elements `half` apart: (a, b) -> (a + b, a - b). One scale of
    1/sqrt(block) at the end (exactly 1/32 for 1024). H is symmetric and orthogonal.
    """
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"width {n} is not a multiple of the Hadamard block {block}")
    lead = tuple(x.shape[:-1])
    groups = n // block
    y = x
    half = 1
    while half < block:
        y = y.reshape(*lead, groups, block // (2 * half), 2, half)
        a, b = y.select(-2, 0), y.select(-2, 1)
        y = torch.stack((a + b, a - b), dim=-2)
        half *= 2
    return y.reshape(*lead, n) * (1.0 / math.sqrt(block))


def tiled_to_grouped(x: Tensor, head_dim: int, rep: int) -> Tensor:
    """Reorder heads from tiled [rep, nk, hd] to grouped [nk, rep, hd] (numpy order, last dim).

    ggml writes these shapes innermost first: tiled [hd, nk, rep] -> grouped [hd, rep, nk].
    Tiled is llama.cpp's GDN value-head order (head h = r * nk + k reads key head
    h % nk); grouped is the order the rotation was computed in (h = k * rep + r).
    """
    n = x.shape[-1]
    nk = n // (head_dim * rep)
    if nk * head_dim * rep != n:
        raise ValueError(f"width {n} is not head_dim {head_dim} x rep {rep} x key heads")
    lead = tuple(x.shape[:-1])
    return x.reshape(*lead, rep, nk, head_dim).transpose(-3, -2).reshape(*lead, n)


def permutation_index(width: int, head_dim: int, rep: int) -> Tensor:
    """perm with tiled_to_grouped(x)[..., i] == x[..., perm[i]] (identity when rep <= 1)."""
    idx = torch.arange(width)
    if rep <= 1 or head_dim <= 0:
        return idx
    return tiled_to_grouped(idx[None], head_dim, rep)[0]


def rotate_activation(x: Tensor, signs: Tensor, block: int, perm_head_dim: int = 0, perm_rep: int = 1) -> Tensor:
    """What a listed weight expects: WHT(signs * P x), computed in fp32 (or fp64), returned in x's dtype."""
    y = x.to(_compute_dtype(x))
    if perm_rep > 1:
        y = tiled_to_grouped(y, perm_head_dim, perm_rep)
    y = y * signs.to(y.dtype)
    return wht(y, block).to(x.dtype)


def unrotate_rows(z: Tensor, signs: Tensor, block: int) -> Tensor:
    """An embedding row back in the model's basis: signs * WHT(z) (reverse order of the forward)."""
    y = z.to(_compute_dtype(z))
    return (wht(y, block) * signs.to(y.dtype)).to(z.dtype)


def fold_weight(w_stored: Tensor, signs: Tensor, block: int, perm_head_dim: int = 0, perm_rep: int = 1) -> Tensor:
    """W = W_s H D P: the weight that reads the unrotated activation; fp64 math, one rounding."""
    m = wht(w_stored.to(torch.float64), block) * signs.to(torch.float64)  # rows: (W_s H D)
    if perm_rep > 1:
        perm = permutation_index(m.shape[-1], perm_head_dim, perm_rep)
        out = torch.empty_like(m)
        out[..., perm] = m  # (M P)[:, perm[i]] = M[:, i]
        m = out
    return m.to(w_stored.dtype).contiguous()


def rotate_weight(w: Tensor, signs: Tensor, block: int, perm_head_dim: int = 0, perm_rep: int = 1) -> Tensor:
    """W_s = W P^T D H, the inverse of `fold_weight` (what a converter stores); fp64 math.

    With perm = 0 this is also the stored form of an inverse-listed table: z = H D e per row.
    """
    m = w.to(torch.float64)
    if perm_rep > 1:
        m = m[..., permutation_index(m.shape[-1], perm_head_dim, perm_rep)]
    return wht(m * signs.to(torch.float64), block).to(w.dtype).contiguous()


def random_signs(width: int, generator: torch.Generator) -> Tensor:
    """A random +-1 vector (float32) of `width` entries."""
    return torch.randint(0, 2, (width,), generator=generator).to(torch.float32) * 2 - 1


# ---------------------------------------------------------------------------
# Custom ops
# ---------------------------------------------------------------------------


def hadamard_rotate_impl(x: Tensor, signs: Tensor, block: int, perm_head_dim: int, perm_rep: int) -> Tensor:
    return rotate_activation(x, signs, block, perm_head_dim, perm_rep)


def hadamard_unrotate_impl(z: Tensor, signs: Tensor, block: int) -> Tensor:
    return unrotate_rows(z, signs, block)


HADAMARD_ROTATE = declare_op("hadamard_rotate", hadamard_rotate_impl, ["x"])
HADAMARD_UNROTATE = declare_op("hadamard_unrotate", hadamard_unrotate_impl, ["z"])

HADAMARD_OPS = (HADAMARD_ROTATE, HADAMARD_UNROTATE)


