"""Small foldline custom ops that the reference modules emit.

Passes anchor their rewrites on these ops instead of matching long aten
sequences. Each op is functional (returns a new tensor, mutates nothing) and
its eager kernel is written in plain aten ops with static shapes, so the same
function serves as the eager reference and as the decomposition applied before
MLIR import (`DECOMPOSITIONS`).

Positions are absolute token positions. A chunk of C tokens for batch row b
covers positions start_pos[b] + i, i < C; tokens with i >= n_valid[b] are
padding and must not change any state.
"""

from __future__ import annotations

import torch
from torch import Tensor

MASK_VALUE = -1e30  # finite: a fully masked padded row stays finite, never NaN


def _chunk_positions(start_pos: Tensor, chunk: int) -> Tensor:
    return start_pos[:, None] + torch.arange(chunk, dtype=start_pos.dtype, device=start_pos.device)


def _valid(n_valid: Tensor, chunk: int) -> Tensor:
    return torch.arange(chunk, dtype=n_valid.dtype, device=n_valid.device)[None, :] < n_valid[:, None]


def _group_query(q: Tensor, n_kv: int, kv_mapping: str) -> Tensor:
    """[B, Hq, C, D] -> [B, Hkv, rep, C, D] without materialising repeated K/V."""
    b, hq, c, d = q.shape
    rep = hq // n_kv
    if kv_mapping == "blocked":  # head h reads kv h // rep
        return q.reshape(b, n_kv, rep, c, d)
    # interleaved: head h reads kv h % n_kv, so h = r * n_kv + kv
    return q.reshape(b, rep, n_kv, c, d).transpose(1, 2)


def _ungroup(o: Tensor, kv_mapping: str) -> Tensor:
    b, n_kv, rep, c, d = o.shape
    if kv_mapping == "blocked":
        return o.reshape(b, n_kv * rep, c, d)
    return o.transpose(1, 2).reshape(b, n_kv * rep, c, d)


def _attend(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float, kv_mapping: str) -> Tensor:
    """Grouped attention; `allowed` is [B, C, L] (query x key). Softmax in fp32."""
    n_kv = k.shape[1]
    qg = _group_query(q, n_kv, kv_mapping).to(torch.float32)
    scores = torch.matmul(qg, k.to(torch.float32)[:, :, None].transpose(-1, -2)) * scale
    scores = torch.where(allowed[:, None, None], scores, torch.full_like(scores, MASK_VALUE))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.to(torch.float32)[:, :, None])
    return _ungroup(out, kv_mapping).to(q.dtype)


# ---------------------------------------------------------------------------
# Reference form: a full-length cache whose slot j holds position j.
# ---------------------------------------------------------------------------


def kv_cache_write_impl(cache: Tensor, new: Tensor, start_pos: Tensor, n_valid: Tensor) -> Tensor:
    """Write new[:, :, i] into slot start_pos + i for valid i; padding leaves slots alone."""
    b, h, length, d = cache.shape
    chunk = new.shape[2]
    pos = _chunk_positions(start_pos, chunk) % length  # padding past the end wraps onto old slots
    valid = _valid(n_valid, chunk)
    index = pos[:, None, :, None].expand(b, h, chunk, d)
    old = torch.gather(cache, 2, index)
    value = torch.where(valid[:, None, :, None], new.to(cache.dtype), old)
    return torch.scatter(cache, 2, index, value)


def cache_attention_impl(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, start_pos: Tensor, window: int, scale: float, kv_mapping: str
) -> Tensor:
    """Causal attention over a full cache; window > 0 adds the sliding-window mask."""
    chunk, length = q.shape[2], k_cache.shape[2]
    qpos = _chunk_positions(start_pos, chunk)[:, :, None]
    kpos = torch.arange(length, dtype=start_pos.dtype, device=start_pos.device)[None, None, :]
    allowed = kpos <= qpos
    if window > 0:
        allowed = allowed & (qpos - kpos < window)
    return _attend(q, k_cache, v_cache, allowed, scale, kv_mapping)


# ---------------------------------------------------------------------------
# Ring form: W slots, slot s holds the newest position p with p % W == s.
# ---------------------------------------------------------------------------


def _ring_slot_positions(start_pos: Tensor, window: int) -> Tensor:
    """Absolute position held by each slot before this chunk (-1: empty). [B, W]"""
    last = start_pos[:, None] - 1
    slots = torch.arange(window, dtype=start_pos.dtype, device=start_pos.device)[None, :]
    return last - torch.remainder(last - slots, window)


def ring_attention_impl(
    q: Tensor,
    ring_k: Tensor,
    ring_v: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    start_pos: Tensor,
    n_valid: Tensor,
    window: int,
    scale: float,
    kv_mapping: str,
) -> Tensor:
    """Sliding-window attention over the ring (before this chunk's write) plus the chunk itself."""
    chunk = q.shape[2]
    qpos = _chunk_positions(start_pos, chunk)
    ring_pos = _ring_slot_positions(start_pos, window)
    kpos = torch.cat([ring_pos, qpos], dim=1)  # [B, W + C]
    kvalid = torch.cat([ring_pos >= 0, _valid(n_valid, chunk)], dim=1)
    diff = qpos[:, :, None] - kpos[:, None, :]
    allowed = kvalid[:, None, :] & (diff >= 0) & (diff < window)
    keys = torch.cat([ring_k, k_new.to(ring_k.dtype)], dim=2)
    values = torch.cat([ring_v, v_new.to(ring_v.dtype)], dim=2)
    return _attend(q, keys, values, allowed, scale, kv_mapping)


def ring_write_impl(ring: Tensor, new: Tensor, start_pos: Tensor, n_valid: Tensor) -> Tensor:
    """Each slot takes the newest valid chunk token that maps to it, else keeps its value.

    Written as a gather over slots (not a scatter over tokens) so a chunk longer
    than the window, whose tokens collide on slots, stays deterministic.
    """
    b, h, window, d = ring.shape
    chunk = new.shape[2]
    last = start_pos + n_valid - 1  # newest valid position [B]
    slots = torch.arange(window, dtype=start_pos.dtype, device=start_pos.device)[None, :]
    newest = last[:, None] - torch.remainder(last[:, None] - slots, window)  # [B, W]
    token = newest - start_pos[:, None]
    take = (token >= 0) & (n_valid[:, None] > 0)
    index = token.clamp(0, chunk - 1)[:, None, :, None].expand(b, h, window, d)
    picked = torch.gather(new.to(ring.dtype), 2, index)
    return torch.where(take[:, None, :, None], picked, ring)


# ---------------------------------------------------------------------------
# Registration.
# ---------------------------------------------------------------------------


@torch.library.custom_op("foldline::kv_cache_write", mutates_args=())
def kv_cache_write(cache: Tensor, new: Tensor, start_pos: Tensor, n_valid: Tensor) -> Tensor:
    return kv_cache_write_impl(cache, new, start_pos, n_valid)


@kv_cache_write.register_fake
def _(cache, new, start_pos, n_valid):
    return cache.new_empty(cache.shape)


@torch.library.custom_op("foldline::cache_attention", mutates_args=())
def cache_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, start_pos: Tensor, window: int, scale: float, kv_mapping: str
) -> Tensor:
    return cache_attention_impl(q, k_cache, v_cache, start_pos, window, scale, kv_mapping)


@cache_attention.register_fake
def _(q, k_cache, v_cache, start_pos, window, scale, kv_mapping):
    return q.new_empty(q.shape)


@torch.library.custom_op("foldline::ring_attention", mutates_args=())
def ring_attention(
    q: Tensor,
    ring_k: Tensor,
    ring_v: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    start_pos: Tensor,
    n_valid: Tensor,
    window: int,
    scale: float,
    kv_mapping: str,
) -> Tensor:
    return ring_attention_impl(q, ring_k, ring_v, k_new, v_new, start_pos, n_valid, window, scale, kv_mapping)


@ring_attention.register_fake
def _(q, ring_k, ring_v, k_new, v_new, start_pos, n_valid, window, scale, kv_mapping):
    return q.new_empty(q.shape)


@torch.library.custom_op("foldline::ring_write", mutates_args=())
def ring_write(ring: Tensor, new: Tensor, start_pos: Tensor, n_valid: Tensor) -> Tensor:
    return ring_write_impl(ring, new, start_pos, n_valid)


@ring_write.register_fake
def _(ring, new, start_pos, n_valid):
    return ring.new_empty(ring.shape)


# Custom op -> aten implementation, for `ExportedProgram.run_decompositions`.
DECOMPOSITIONS: dict = {
    torch.ops.foldline.kv_cache_write.default: kv_cache_write_impl,
    torch.ops.foldline.cache_attention.default: cache_attention_impl,
    torch.ops.foldline.ring_attention.default: ring_attention_impl,
    torch.ops.foldline.ring_write.default: ring_write_impl,
}


def register_decomposition(op, impl) -> None:
    """Other modules (GDN, Hadamard) add their custom ops here."""
    DECOMPOSITIONS[op] = impl
