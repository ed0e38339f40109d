"""The KV-cache and attention custom ops the reference modules emit: full-length caches and rings.

Passes anchor their rewrites on these ops instead of matching long aten
sequences. Each op is functional (returns a new tensor, mutates nothing) and
its eager kernel is written in plain aten ops with static shapes, so the same
function serves as the eager reference and as the decomposition applied before
MLIR import (frontend/op_registry.py).

Positions are absolute token positions. A chunk of C tokens for batch row b
covers positions start_pos[b] + i, i < C; tokens with i >= n_valid[b] are
padding and must not change any state.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..contract.entry_points import kv_tile_size
from .op_registry import declare_op

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
    """Grouped attention; `allowed` is [B, C, L] (query x key). Softmax in fp32.

    One query token (decode) is written as broadcast products summed over one axis,
    which IREE fuses into reductions that read each cache slot once in its stored
    layout; matmuls would first materialise K transposed and repeated per query head
    (several times slower per step on CPU: docs/history.md, "Where the time goes, and
    what is next"). Chunks keep the matmul form, which tiles better.
    """
    n_kv = k.shape[1]
    qg = _group_query(q, n_kv, kv_mapping).to(torch.float32)  # [B, Hkv, rep, C, D]
    mask = allowed[:, None, None]  # [B, 1, 1, C, L]
    if q.shape[2] == 1:
        # k and v keep the cache dtype: type promotion widens them inside the products' bodies,
        # where IREE fuses the widening into the reductions (an explicit .to() is a dispatch of its own)
        scores = (qg * k[:, :, None]).sum(-1, keepdim=True).transpose(-1, -2) * scale  # [B, Hkv, rep, 1, L]
        scores = torch.where(mask, scores, torch.full_like(scores, MASK_VALUE))
        probs = torch.softmax(scores, dim=-1)
        out = (probs.transpose(-1, -2) * v[:, :, None]).sum(-2, keepdim=True)  # [B, Hkv, rep, 1, D]
    else:
        kf, vf = k.to(torch.float32), v.to(torch.float32)
        scores = torch.matmul(qg, kf[:, :, None].transpose(-1, -2)) * scale
        scores = torch.where(mask, scores, torch.full_like(scores, MASK_VALUE))
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, vf[:, :, None])
    return _ungroup(out, kv_mapping).to(q.dtype)


# ---------------------------------------------------------------------------
# Reference form: a full-length cache whose slot j holds position j.
# ---------------------------------------------------------------------------


def kv_cache_write_impl(
    cache: Tensor, new: Tensor, start_pos: Tensor, n_valid: Tensor, host_pos: int | None = None
) -> Tensor:
    """Write new[:, :, i] into slot start_pos + i for the valid tokens i < n_valid; no other slot changes.

    Padding tokens rewrite the last valid token's value into its own slot, so the
    write never reads the cache: IREE then updates the caller's buffer in place
    instead of copying the whole cache first (backends/iree/inplace_state.py). A row
    with no valid token writes padding into slot start_pos, which holds no
    position yet (masked, and overwritten by that row's next token); such a row
    must not be at a full cache (start_pos == max_context), where it would
    overwrite the last slot.

    `host_pos` is start_pos[0] known on the host (decode entry points carry it in
    an input's shape): one real token of one row is then a slice update at that
    slot, one in-place copy, where the scatter costs IREE eight dispatches.
    """
    if host_pos is not None and cache.shape[0] == 1 and new.shape[2] == 1:
        return _write_slot(cache, new, host_pos)
    b, h, length, d = cache.shape
    chunk = new.shape[2]
    i = torch.arange(chunk, dtype=start_pos.dtype, device=start_pos.device)[None, :]
    source = torch.minimum(i, (n_valid[:, None] - 1).clamp(min=0))  # [B, C]: the token each write takes
    pos = (start_pos[:, None] + source).clamp(max=length - 1)
    value = torch.gather(new.to(cache.dtype), 2, source[:, None, :, None].expand(b, h, chunk, d))
    index = pos[:, None, :, None].expand(b, h, chunk, d)
    return torch.scatter(cache, 2, index, value)


def _write_slot(cache: Tensor, new: Tensor, position) -> Tensor:
    """new (one token) into slot position mod S of a cache or ring of S slots, as a slice update.

    `position` is a host integer (a SymInt in the exported graph): IREE computes
    the offset on the host and writes the slot in place, with no read of device
    memory before the step. Taken mod S so that any position stays inside the
    buffer (a full cache is never called past its last slot; a ring wraps).
    """
    slot = _host_mod(position, cache.shape[2])
    return torch.ops.aten.slice_scatter(cache, new.to(cache.dtype), 2, slot, slot + 1)


def _first_slots(cache: Tensor, length) -> Tensor:
    """cache[:, :, :length]; a symbolic length is cut in whole tiles.

    Sliced as [tiles of `tile` slots][:T] rather than [:T * tile], the slots keep a
    static inner dimension: IREE's CPU codegen then tiles the products over the
    slots as it does for a static length (a plain dynamic slice costs more per slot:
    docs/architecture.md, "Attention that reads the tokens held").
    """
    slots = cache.shape[2]
    if isinstance(length, int):
        return cache[:, :, : min(length, slots)]
    tile = kv_tile_size(slots)
    b, h, _, d = cache.shape
    # narrow, not [:, :, :T]: indexing drops a slice that its example value says is whole, which
    # would fix the length at the traced one; view, not reshape: reshape asks whether the cut is
    # contiguous, true only for a whole cache, and that question fixes it too
    tiles = length // tile
    return cache.view(b, h, slots // tile, tile, d).narrow(2, 0, tiles).view(b, h, tiles * tile, d)


def cache_attention_impl(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    start_pos: Tensor,
    window: int,
    scale: float,
    kv_mapping: str,
    length: int,
) -> Tensor:
    """Causal attention over the first `length` slots of a full cache; window > 0 adds the window mask.

    `length` below the cache size is a promise by the caller that every position of
    the chunk is below it: the work then follows the tokens held, not the cache size.
    In an exported entry point it is symbolic, a whole number of tiles
    (contract.entry_points.kv_tile_size) known only at the call.
    """
    slots = torch.arange(k_cache.shape[2], dtype=start_pos.dtype, device=start_pos.device)
    # the key positions are cut as the caches are, so every read has one (symbolic) length
    kpos = _first_slots(slots[None, None, :, None], length)[0, 0, :, 0][None, None, :]
    k_cache, v_cache = _first_slots(k_cache, length), _first_slots(v_cache, length)
    chunk = q.shape[2]
    qpos = _chunk_positions(start_pos, chunk)[:, :, None]
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


def _first_ring_slots(ring: Tensor, length) -> Tensor:
    """ring[:, :, :min(length, W)] for a symbolic `length`, in whole tiles of the ring.

    While no position has reached W the ring has not wrapped: position p sits in slot p, and
    slots from `length` on are empty. From W on every slot is held. The minimum is `sym_min`, so
    that torch proves the cut in range; the lowering spells it for IREE's importer
    (backends/lowering.spell_min).
    """
    window = ring.shape[2]
    tile = kv_tile_size(window)
    return _first_slots(ring, torch.sym_min((length + tile - 1) // tile, window // tile) * tile)


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
    length: int = 0,
) -> Tensor:
    """Sliding-window attention over the ring (before this chunk's write) plus the chunk itself.

    `length` in (0, window) is the promise `cache_attention` takes too: every
    position of the chunk is below it. Position p sits in slot p % window = p, so slots
    from `length` on are empty and only the first `length` are read.
    """
    chunk = q.shape[2]
    qpos = _chunk_positions(start_pos, chunk)
    ring_pos = _ring_slot_positions(start_pos, window)
    if not isinstance(length, int):  # the prefill's symbolic tiles: read the ring's slots up to it
        ring_k, ring_v = _first_ring_slots(ring_k, length), _first_ring_slots(ring_v, length)
        ring_pos = _first_ring_slots(ring_pos[:, None, :, None], length)[:, 0, :, 0]
    elif 0 < length < window:
        ring_k, ring_v, ring_pos = ring_k[:, :, :length], ring_v[:, :, :length], ring_pos[:, :length]
    kpos = torch.cat([ring_pos, qpos], dim=1)  # [B, W + C]
    kvalid = torch.cat([ring_pos >= 0, _valid(n_valid, chunk)], dim=1)
    diff = qpos[:, :, None] - kpos[:, None, :]
    allowed = kvalid[:, None, :] & (diff >= 0) & (diff < window)
    keys = torch.cat([ring_k, k_new.to(ring_k.dtype)], dim=2)
    values = torch.cat([ring_v, v_new.to(ring_v.dtype)], dim=2)
    return _attend(q, keys, values, allowed, scale, kv_mapping)


def ring_decode_attention_impl(
    q: Tensor, ring_k: Tensor, ring_v: Tensor, start_pos: Tensor, window: int, scale: float, kv_mapping: str,
    length: int = 0,
) -> Tensor:
    """One token's sliding-window attention over the ring after its own write.

    With the token at start_pos written, the ring holds exactly the window
    (start_pos - W, start_pos]: every filled slot is allowed, so attention reads
    the written ring alone. The ring's only reader is then its update, which IREE
    does in place; `ring_attention`'s read of the old ring beside the new token
    made it copy both the ring (into the concatenated keys) and, to keep that
    read intact, the ring again before the write. Valid for chunks of one token
    whose token is real (decode entry points pass n_valid = 1). `length` in (0, window):
    the token's position is below it, so only the first `length` slots are filled (ring_attention).
    """
    allowed = (_ring_slot_positions(start_pos + 1, window) >= 0)[:, None, :]  # [B, 1, W]
    if 0 < length < window:
        ring_k, ring_v, allowed = ring_k[:, :, :length], ring_v[:, :, :length], allowed[..., :length]
    return _attend(q, ring_k, ring_v, allowed, scale, kv_mapping)


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


def _host_mod(x, n: int):
    """x mod n on a host integer, as host arithmetic in the compiled module.

    Written with floordiv because `%` exports as `aten.fmod.int`, which IREE's torch
    input conversion cannot legalize.
    """
    return x - (x // n) * n


def ring_write_token_impl(
    ring: Tensor, new: Tensor, start_pos: Tensor, n_valid: Tensor, host_pos: int | None = None
) -> Tensor:
    """`ring_write` of a chunk of one real token (decode entry points: n_valid = 1).

    With the position on the host (`host_pos`, one row) the write is a slice
    update at slot host_pos % W, which IREE does in place; the general form
    rewrites every slot, and IREE placed that result by copying the ring.
    """
    if host_pos is None or ring.shape[0] > 1:
        return ring_write_impl(ring, new, start_pos, n_valid)
    return _write_slot(ring, new, host_pos)


# ---------------------------------------------------------------------------
# Declaration: the handles passes and backends match graph nodes against.
# ---------------------------------------------------------------------------

KV_CACHE_WRITE = declare_op("kv_cache_write", kv_cache_write_impl, ["cache"])
CACHE_ATTENTION = declare_op("cache_attention", cache_attention_impl, ["q"])
RING_ATTENTION = declare_op("ring_attention", ring_attention_impl, ["q"])
RING_WRITE = declare_op("ring_write", ring_write_impl, ["ring"])
RING_DECODE_ATTENTION = declare_op("ring_decode_attention", ring_decode_attention_impl, ["q"])
RING_WRITE_TOKEN = declare_op("ring_write_token", ring_write_token_impl, ["ring"])
