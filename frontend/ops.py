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

from ..contract.entry_points import kv_tile_size

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
# Registration.
# ---------------------------------------------------------------------------


@torch.library.custom_op("foldline::kv_cache_write", mutates_args=())
def kv_cache_write(cache: Tensor, new: Tensor, start_pos: Tensor, n_valid: Tensor, host_pos: int | None = None) -> Tensor:
    return kv_cache_write_impl(cache, new, start_pos, n_valid, host_pos)


@kv_cache_write.register_fake
def _(cache, new, start_pos, n_valid, host_pos=None):
    return cache.new_empty(cache.shape)


@torch.library.custom_op("foldline::cache_attention", mutates_args=())
def cache_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    start_pos: Tensor,
    window: int,
    scale: float,
    kv_mapping: str,
    length: int,
) -> Tensor:
    return cache_attention_impl(q, k_cache, v_cache, start_pos, window, scale, kv_mapping, length)


@cache_attention.register_fake
def _(q, k_cache, v_cache, start_pos, window, scale, kv_mapping, length):
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
    length: int = 0,
) -> Tensor:
    return ring_attention_impl(q, ring_k, ring_v, k_new, v_new, start_pos, n_valid, window, scale, kv_mapping, length)


@ring_attention.register_fake
def _(q, ring_k, ring_v, k_new, v_new, start_pos, n_valid, window, scale, kv_mapping, length=0):
    return q.new_empty(q.shape)


@torch.library.custom_op("foldline::ring_write_token", mutates_args=())
def ring_write_token(ring: Tensor, new: Tensor, start_pos: Tensor, n_valid: Tensor, host_pos: int | None = None) -> Tensor:
    return ring_write_token_impl(ring, new, start_pos, n_valid, host_pos)


@ring_write_token.register_fake
def _(ring, new, start_pos, n_valid, host_pos=None):
    return ring.new_empty(ring.shape)


@torch.library.custom_op("foldline::ring_decode_attention", mutates_args=())
def ring_decode_attention(
    q: Tensor, ring_k: Tensor, ring_v: Tensor, start_pos: Tensor, window: int, scale: float, kv_mapping: str,
    length: int = 0,
) -> Tensor:
    return ring_decode_attention_impl(q, ring_k, ring_v, start_pos, window, scale, kv_mapping, length)


@ring_decode_attention.register_fake
def _(q, ring_k, ring_v, start_pos, window, scale, kv_mapping, length=0):
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
    torch.ops.foldline.ring_decode_attention.default: ring_decode_attention_impl,
    torch.ops.foldline.ring_write_token.default: ring_write_token_impl,
}


def register_decomposition(op, impl) -> None:
    """Other modules (GDN, Hadamard) add their custom ops here."""
    DECOMPOSITIONS[op] = impl


# ---------------------------------------------------------------------------
# Gated delta net (Qwen3.5 / qwen35 "linear attention" layers).
#
# Per v head, with the state S[dv][dk] (v-major), a token (q, k, v, g, beta):
#     kv = S k;  delta = (v - g kv) beta;  S = g S + outer(delta, k);  o = (S q) scale
# g = exp(log_g). Tokens with i >= n_valid get beta = 0 and log_g = 0, which
# makes them an exact identity on S. q and k arrive normalised and head-mapped
# (one q/k row per v head), all tensors [B, H, C, *] with the state [B, H, Dv, Dk].
# ---------------------------------------------------------------------------


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


@torch.library.custom_op("foldline::gdn_chunk", mutates_args=())
def gdn_chunk(
    q: Tensor, k: Tensor, v: Tensor, log_g: Tensor, beta: Tensor, state: Tensor, n_valid: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    return gdn_chunk_impl(q, k, v, log_g, beta, state, n_valid, scale)


@gdn_chunk.register_fake
def _(q, k, v, log_g, beta, state, n_valid, scale):
    return v.new_empty(v.shape), state.new_empty(state.shape)


@torch.library.custom_op("foldline::gdn_step", mutates_args=())
def gdn_step(
    q: Tensor, k: Tensor, v: Tensor, log_g: Tensor, beta: Tensor, state: Tensor, n_valid: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    return gdn_step_impl(q, k, v, log_g, beta, state, n_valid, scale)


@gdn_step.register_fake
def _(q, k, v, log_g, beta, state, n_valid, scale):
    return v.new_empty(v.shape), state.new_empty(state.shape)


register_decomposition(torch.ops.foldline.gdn_chunk.default, gdn_chunk_impl)
register_decomposition(torch.ops.foldline.gdn_step.default, gdn_step_impl)


# ---------------------------------------------------------------------------
# Placement over several devices (passes/place_devices.py): a value moved to device `device`.
# The identity in eager; IREE's `flow.tensor.transfer` in a module compiled for several devices
# (backends/iree/multi_device.py).
# ---------------------------------------------------------------------------


@torch.library.custom_op("foldline::to_device", mutates_args=())
def to_device(x: Tensor, device: int) -> Tensor:
    return x.clone()


@to_device.register_fake
def _(x, device):
    return x.new_empty(x.shape)


def to_device_impl(x: Tensor, device: int) -> Tensor:
    """One device's view of a move: the value itself (a target without several devices decomposes it)."""
    return x.clone()


register_decomposition(torch.ops.foldline.to_device.default, to_device_impl)
