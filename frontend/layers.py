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
    """RoPE on the first rot_dim features of each head. x: [B, H, C, D], positions: [B, C]."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32, device=x.device) / rot_dim))
    angles = (positions.to(torch.float32) / pos_scale)[:, None, :, None] * inv_freq  # [B,1,C,rot/2]
    cos, sin = torch.cos(angles), torch.sin(angles)
    xr, xpass = x[..., :rot_dim].float(), x[..., rot_dim:]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    else:
        half = rot_dim // 2
        x1, x2 = xr[..., :half], xr[..., half:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([out.to(x.dtype), xpass], dim=-1)
