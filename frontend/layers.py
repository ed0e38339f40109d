"""Building blocks shared by the attention and GDN mixers: RMSNorm and rotary embeddings.

A leaf module (only torch): the reference modules, the GDN mixer and the
Hadamard model surgery all build on these without importing each other.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32; weight form x * (offset + w)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(dim) - offset)

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (self.offset + self.weight.float())).to(x.dtype)


def rotary(x: Tensor, positions: Tensor, base: float, rot_dim: int, pos_scale: float, interleaved: bool) -> Tensor:
    """RoPE on the first rot_dim features of each head. x: [B, H, C, D], positions: [B, C].

    Written as one elementwise expression, x * cos + partner(x) * signed sin,
    where the partner of a feature is the other one of its rotation pair
    (`flip` over the pair axis) and the sign puts the minus on the first of
    the two. The halves-and-concatenate form it replaces gave IREE two
    half-width dispatches and two copies per rotated tensor, 6 of a decode
    step's ~38 dispatches per layer; this one is a single fused dispatch. The
    result is the same: x1 * cos + x2 * (-sin) is x1 * cos - x2 * sin exactly.
    """
    half = rot_dim // 2
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32, device=x.device) / rot_dim))
    angles = (positions.to(torch.float32) / pos_scale)[:, None, :, None] * inv_freq  # [B,1,C,rot/2]
    cos, sin = torch.cos(angles), torch.sin(angles)
    sign = torch.arange(2, dtype=torch.float32, device=x.device) * 2 - 1  # [-1, 1], computed: no lifted constant
    xr = x[..., :rot_dim].float() if rot_dim < x.shape[-1] else x.float()
    if interleaved:  # pairs (2i, 2i + 1)
        pairs = xr.unflatten(-1, (half, 2))
        out = pairs * cos[..., None] + pairs.flip(-1) * (sin[..., None] * sign)
    else:  # pairs (i, i + half)
        pairs = xr.unflatten(-1, (2, half))
        out = pairs * cos[..., None, :] + pairs.flip(-2) * (sin[..., None, :] * sign[:, None])
    out = out.flatten(-2).to(x.dtype)
    return out if rot_dim == x.shape[-1] else torch.cat([out, x[..., rot_dim:]], dim=-1)
