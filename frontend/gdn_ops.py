"""The gated delta net's recurrence (Qwen3.5 / qwen35 "linear attention" layers) as custom ops.

Per v head, with the state S[dv][dk] (v-major), a token (q, k, v, g, beta):
    kv = S k;  delta = (v - g kv) beta;  S = g S + outer(delta, k);  o = (S q) scale
g = exp(log_g). Tokens with i >= n_valid get beta = 0 and log_g = 0, which
makes them an exact identity on S. q and k arrive normalised and head-mapped
(one q/k row per v head), all tensors [B, H, C, *] with the state [B, H, Dv, Dk].
A prefill chunk runs `gdn_chunk` (matrix work), a decode step `gdn_step` (the recurrence).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .attention_ops import _valid
from .op_registry import declare_op


def _gdn_mask_padding(log_g: Tensor, beta: Tensor, n_valid: Tensor) -> tuple[Tensor, Tensor]:
    valid = _valid(n_valid, log_g.shape[-1])[:, None, :]
    zero = torch.zeros_like(beta)
    return torch.where(valid, log_g, zero), torch.where(valid, beta, zero)


def _unit_lower_inverse(a: Tensor) -> Tensor:
    """(I + A)^-1 for strictly lower-triangular A [..., C, C], by repeated squaring.

    A is nilpotent, so (I + A)^-1 = sum_n (-A)^n = prod_j (I + (-A)^(2^j)): ceil(log2 C)
    matmuls instead of C dependent row updates, and no data-dependent control flow.
    """
    c = a.shape[-1]
    idx = torch.arange(c, device=a.device)
    eye = (idx[:, None] == idx[None, :]).to(a.dtype)  # aten.eye crashes IREE's torch lowering
    power = -a
    inverse = eye + power
    span = 2
    while span < c:
        power = torch.matmul(power, power)
        inverse = inverse + torch.matmul(inverse, power)
        span *= 2
    return inverse


def gdn_chunk_impl(
    q: Tensor, k: Tensor, v: Tensor, log_g: Tensor, beta: Tensor, state: Tensor, n_valid: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """A whole chunk of the delta rule as matrix work (WY / UT form); returns (o, new state).

    With gamma_t = prod_{s<=t} g_s the chunk's writes u_t solve the unit lower-triangular
    system (I + A) U = beta V - beta gamma K S0^T, A[t,s] = beta_t (gamma_t/gamma_s) k_t.k_s (s<t);
    then O = gamma Q S0^T + (mask * gamma_t/gamma_s * Q K^T) U and
    S = gamma_C S0 + U^T diag(gamma_C / gamma) K.
    """
    out_dtype = v.dtype
    log_g, beta = _gdn_mask_padding(log_g.float(), beta.float(), n_valid)
    q, k, v, s0 = q.float() * scale, k.float(), v.float(), state.float()
    c = q.shape[2]
    cum = torch.cumsum(log_g, dim=-1)  # [B,H,C], <= 0 and non-increasing
    t_idx = torch.arange(c, device=q.device)
    causal = t_idx[:, None] >= t_idx[None, :]
    strict = t_idx[:, None] > t_idx[None, :]
    diff = cum[..., :, None] - cum[..., None, :]  # log(gamma_t / gamma_s)
    decay = torch.where(causal, torch.exp(diff.clamp(max=0.0)), torch.zeros_like(diff))
    kk = torch.matmul(k, k.transpose(-1, -2))
    a = torch.where(strict, beta[..., :, None] * decay * kk, torch.zeros_like(kk))
    gamma = torch.exp(cum)
    s0_t = s0.transpose(-1, -2)  # [B,H,Dk,Dv]
    rhs = beta[..., None] * (v - gamma[..., None] * torch.matmul(k, s0_t))
    u = torch.matmul(_unit_lower_inverse(a), rhs)  # [B,H,C,Dv]
    qk = torch.where(causal, decay * torch.matmul(q, k.transpose(-1, -2)), torch.zeros_like(kk))
    o = gamma[..., None] * torch.matmul(q, s0_t) + torch.matmul(qk, u)
    last = cum[..., -1:]
    tail = torch.exp(last - cum)  # gamma_C / gamma_s
    new_state = torch.exp(last)[..., None] * s0 + torch.matmul((u * tail[..., None]).transpose(-1, -2), k)
    return o.to(out_dtype), new_state.to(state.dtype)


def gdn_step_impl(
    q: Tensor, k: Tensor, v: Tensor, log_g: Tensor, beta: Tensor, state: Tensor, n_valid: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """One token (C == 1) of the delta rule, written exactly as the recurrence."""
    out_dtype = v.dtype
    log_g, beta = _gdn_mask_padding(log_g.float(), beta.float(), n_valid)
    q0, k0, v0 = q[:, :, 0].float(), k[:, :, 0].float(), v[:, :, 0].float()
    g = torch.exp(log_g[:, :, 0])[..., None]  # [B,H,1]
    s = state.float()
    kv = torch.matmul(s, k0[..., None])[..., 0]  # S k: [B,H,Dv]
    delta = (v0 - g * kv) * beta[:, :, 0][..., None]
    s = g[..., None] * s + delta[..., :, None] * k0[..., None, :]
    o = torch.matmul(s, q0[..., None])[..., 0] * scale
    return o[:, :, None].to(out_dtype), s.to(state.dtype)


GDN_CHUNK = declare_op("gdn_chunk", gdn_chunk_impl, ["v", "state"])
GDN_STEP = declare_op("gdn_step", gdn_step_impl, ["v", "state"])
