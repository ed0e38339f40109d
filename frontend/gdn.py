"""Gated delta net mixer (Qwen3.5 / qwen35 "linear attention" layers).

Conventions follow HF transformers' Qwen3_5GatedDeltaNet; where llama.cpp's
qwen35 graph differs, the difference is a config field (see docs/gdn.md):

    qkv = in_proj_qkv(h)            fused [q | k | v] channels, heads contiguous
    qkv = silu(causal depthwise conv1d(qkv))   K taps, current token in the last tap
    q, k = l2norm per head; v heads read k heads by `gdn_kv_mapping`
    beta = sigmoid(in_proj_b(h)),  g = exp(-exp(A_log) * softplus(in_proj_a(h) + dt_bias))
    delta rule on S[dv][dk] (foldline::gdn_chunk / foldline::gdn_step), o = (S q) / sqrt(Dk)
    out = out_proj(rmsnorm_per_head(o) * w * silu(in_proj_z(h)))

State per layer: the recurrent state S [B, Hv, Dv, Dk] in fp32 and the conv
state [B, channels, K-1] holding the previous K-1 projected inputs (oldest
first). Both are constant in context length and are updated in place; padded
tokens (i >= n_valid) leave both untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..contract.state import StateBuffer, layer_state
from .config import ModelConfig
from .gdn_ops import GDN_CHUNK, GDN_STEP, gdn_step_impl
from .types import ChunkContext

# ModelConfig.gdn_l2norm: "hf" -> x * rsqrt(sum x^2 + 1e-6) (HF / FLA),
# "ggml" -> x / max(|x|, rms_eps) (llama.cpp ggml_l2_norm).
HF_L2NORM_EPS = 1e-6


def gdn_state_specs(cfg: ModelConfig, layer_idx: int, batch: int) -> list[StateBuffer]:
    """The two state buffers of GDN layer `layer_idx` (recurrent, conv); neither grows with context."""
    return layer_state(cfg.to_dict(), layer_idx, batch, layer_type="gdn")


def gdn_norm_epsilon(cfg: ModelConfig) -> float:
    """HF adds rms_eps inside the gated norm; llama.cpp adds rms_eps * head_v_dim."""
    return cfg.rms_eps * (cfg.gdn_head_v_dim if cfg.gdn_norm_eps == "scaled" else 1)


def l2_normalize(x: Tensor, convention: str, rms_eps: float) -> Tensor:
    """Per-head L2 normalisation in fp32 (the two conventions differ only for tiny norms)."""
    xf = x.float()
    sq = (xf * xf).sum(-1, keepdim=True)
    if convention == "hf":
        return xf * torch.rsqrt(sq + HF_L2NORM_EPS)
    return xf / torch.sqrt(sq).clamp(min=rms_eps)


def map_k_heads_to_v_heads(x: Tensor, n_v: int, mapping: str) -> Tensor:
    """[B, C, Hk, D] -> [B, C, Hv, D]: blocked (v head h reads h // rep) or interleaved (h % Hk)."""
    b, c, n_k, d = x.shape
    rep = n_v // n_k
    if rep == 1:
        return x
    if mapping == "blocked":
        return x[:, :, :, None].expand(b, c, n_k, rep, d).reshape(b, c, n_v, d)
    return x[:, :, None].expand(b, c, rep, n_k, d).reshape(b, c, n_v, d)


def causal_conv(x: Tensor, conv_state: Tensor, weight: Tensor, n_valid: Tensor) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv over [previous K-1 inputs | chunk]; returns (out, new conv state).

    x: [B, C, ch], conv_state: [B, ch, K-1] (oldest first), weight: [ch, K] with tap K-1 on
    the current token. The new state is the K-1 inputs ending at the last VALID token, so
    padding never enters it (n_valid = 0 returns the old state).
    """
    b, c, ch = x.shape
    taps = weight.shape[1]
    ext = torch.cat([conv_state.transpose(1, 2).to(x.dtype), x], dim=1)  # [B, K-1+C, ch]
    w = weight.to(x.dtype)
    out = ext[:, 0:c] * w[:, 0]
    for j in range(1, taps):
        out = out + ext[:, j : j + c] * w[:, j]
    index = n_valid[:, None] + torch.arange(taps - 1, dtype=n_valid.dtype, device=x.device)[None, :]
    new_state = torch.gather(ext, 1, index[:, :, None].expand(b, taps - 1, ch))
    return out, new_state.transpose(1, 2).to(conv_state.dtype)


class GatedRMSNorm(nn.Module):
    """rmsnorm(o) * (offset + w) * silu(z) per head, in fp32 (HF Qwen3_5RMSNormGated; w is plain)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(dim) - offset)

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        xf = xf * (self.offset + self.weight.float())
        return (xf * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """One GDN mixer; forward(h, ctx, recurrent_state, conv_state) -> [B, C, d]."""

    state_count = 2  # the recurrent and conv states

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        d = cfg.hidden_size
        n_v = cfg.gdn_num_v_heads
        self.in_proj_qkv = nn.Linear(d, cfg.gdn_conv_channels, bias=False)
        self.in_proj_z = nn.Linear(d, cfg.gdn_value_width, bias=False)
        self.in_proj_b = nn.Linear(d, n_v, bias=False)
        self.in_proj_a = nn.Linear(d, n_v, bias=False)
        # [channels, K]: tap K-1 multiplies the current token (HF conv1d.weight[:, 0, :]).
        self.conv1d_weight = nn.Parameter(torch.zeros(cfg.gdn_conv_channels, cfg.gdn_conv_kernel))
        self.dt_bias = nn.Parameter(torch.ones(n_v))
        self.A_log = nn.Parameter(torch.zeros(n_v))
        self.norm = GatedRMSNorm(cfg.gdn_head_v_dim, gdn_norm_epsilon(cfg))
        self.out_proj = nn.Linear(cfg.gdn_value_width, d, bias=False)
        self.l2norm = cfg.gdn_l2norm
        self.scale = cfg.gdn_head_k_dim**-0.5

    def init_random(self, seed: int) -> None:
        """Ranges that exercise the recurrence: decays spread over (0, 1), a real conv filter."""
        gen = torch.Generator().manual_seed(10_000 + seed)
        n_v = self.cfg.gdn_num_v_heads
        with torch.no_grad():
            self.A_log.copy_(torch.empty(n_v).uniform_(0.05, 3.0, generator=gen).log())
            self.dt_bias.copy_(torch.randn(n_v, generator=gen) * 0.5)
            self.conv1d_weight.copy_(torch.randn(self.conv1d_weight.shape, generator=gen) * 0.4)

    def forward(self, h: Tensor, ctx: ChunkContext, recurrent_state: Tensor, conv_state: Tensor) -> Tensor:
        cfg = self.cfg
        b, c, _ = h.shape
        n_k, n_v = cfg.gdn_num_k_heads, cfg.gdn_num_v_heads
        dk, dv = cfg.gdn_head_k_dim, cfg.gdn_head_v_dim

        mixed, new_conv = causal_conv(self.in_proj_qkv(h), conv_state, self.conv1d_weight, ctx.n_valid)
        mixed = F.silu(mixed)
        q, k, v = torch.split(mixed, [cfg.gdn_key_width, cfg.gdn_key_width, cfg.gdn_value_width], dim=-1)
        q = l2_normalize(q.reshape(b, c, n_k, dk), self.l2norm, cfg.rms_eps)
        k = l2_normalize(k.reshape(b, c, n_k, dk), self.l2norm, cfg.rms_eps)
        q = map_k_heads_to_v_heads(q, n_v, cfg.gdn_kv_mapping)
        k = map_k_heads_to_v_heads(k, n_v, cfg.gdn_kv_mapping)
        v = v.reshape(b, c, n_v, dv).float()

        beta = torch.sigmoid(self.in_proj_b(h).float())  # [B, C, Hv]
        log_g = -torch.exp(self.A_log.float()) * F.softplus(self.in_proj_a(h).float() + self.dt_bias.float())

        args = (
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            log_g.transpose(1, 2),
            beta.transpose(1, 2),
            recurrent_state,
            ctx.n_valid,
            self.scale,
        )
        if c == 1:
            o, new_state = GDN_STEP(*args)
        else:
            o, new_state = GDN_CHUNK(*args)
        recurrent_state.copy_(new_state)
        conv_state.copy_(new_conv)

        z = self.in_proj_z(h).reshape(b, c, n_v, dv)
        o = self.norm(o.transpose(1, 2).to(h.dtype), z)
        return self.out_proj(o.reshape(b, c, n_v * dv))


def gdn_sequential_reference(
    q: Tensor, k: Tensor, v: Tensor, log_g: Tensor, beta: Tensor, state: Tensor, n_valid: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """Token-by-token delta rule (the definition) for checking the chunked form; same signature."""
    c = q.shape[2]
    outs = []
    s = state
    for i in range(c):
        step_valid = (n_valid > i).to(n_valid.dtype)
        o, s = gdn_step_impl(
            q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1],
            log_g[:, :, i : i + 1], beta[:, :, i : i + 1], s, step_valid, scale,
        )
        outs.append(o)
    return torch.cat(outs, dim=2), s


def state_bytes_per_layer(cfg: ModelConfig) -> int:
    """Bytes of one GDN layer's state at batch 1 (for reports)."""
    return sum(s.nbytes for s in gdn_state_specs(cfg, 0, 1))


__all__ = [
    "GatedDeltaNet",
    "GatedRMSNorm",
    "causal_conv",
    "gdn_sequential_reference",
    "gdn_state_specs",
    "map_k_heads_to_v_heads",
    "state_bytes_per_layer",
]
