"""Prefill attention in IREE's own attention op, whose scratch does not grow with the context.

The portable decomposition of `foldline::cache_attention` (frontend/attention_ops.py)
materialises a chunk's float32 scores against every key it reads,
`4 B x heads x chunk x length`: 20 GiB for Ripple-65B's 80 heads at 1 Mi
positions. Here the same attention is lowered for IREE's attention op, tiled
over the keys with an online softmax (flash attention), the f16 cache widening
inside its dispatch.

One row (`_prefix_and_tail`): the keys before the chunk's last two tiles are
allowed for every query, so they take `aten.scaled_dot_product_attention` with
no mask and their log-sum-exp (`foldline::attention_lse`), which
backends/iree/online_attention.py makes one online-attention pass after the
import; the two tiles holding the chunk take the causal mask in a small softmax
of their own, and the parts add as a split softmax does. Nothing made has the
context's length.

Batched rows sit at positions the host does not pass, so they (and windows
over full caches) keep one biased attention over every key read: an additive
float32 bias of 0 or `MASK_VALUE`, `4 B x heads x chunk x length`, since IREE
3.13 computes no mask inside its attention dispatch. The bias is not a
boolean: a padded query past the keys read (a sliding-window layer's) has no
allowed key, and a boolean mask becomes -inf inside IREE's online softmax,
whose running maximum would then give NaN for that row.

GQA needs no repeated K/V: the query heads that read one KV head are stacked
as that head's query rows, [B, Hkv, rep x C, D] against [B, Hkv, L, D].

The lowering makes the ops with `fused_decompositions`; the `fused-attention`
target pass (run by the importer on each lowered entry point) renames the
attention op to the aten op, so `--dump-after fused-attention` shows the graph
as imported.

Which targets take it is decided per target (`attention_form`): IREE's SPIR-V
backend cannot compile the attention op, and its CPU backend compiles it one
query row at a time (docs/backends.md, "Fused attention"), so the CPU default
stays the decomposed form.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.fx import GraphModule

from ...contract.entry_points import kv_tile_size
from ...errors import InputError
from ...frontend.attention_ops import (
    CACHE_ATTENTION,
    MASK_VALUE,
    _chunk_positions,
    _first_slots,
    _group_query,
    _ungroup,
    cache_attention_impl,
)
from ...frontend.op_registry import declare_op
from ...passes.graph_edit import copy_graph_module, rebuild
from ...passes.registry import CompileUnit, PassResult, register_pass

ATTENTION_FORMS = ("auto", "fused", "decomposed")
# Targets whose IREE backend compiles iree_linalg_ext.attention, and whether `auto` picks it there.
FUSED_BY_DEFAULT = {"cuda": True, "cpu": False}
# The kernel-site name `foldline inspect` shows for each fused prefill attention.
SITE_NAME = "attention prefill fused"
FUSED_ATTENTION_PASS = "fused-attention"


def biased_attention_impl(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale: float) -> Tensor:
    """softmax(q k^T scale + bias) v over [B, H, M, D] queries and [B, H, L, D] keys/values, bias [B, 1, M, L]
    or None (every key allowed)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias
    return torch.matmul(torch.softmax(scores, dim=-1), v)


# Kept through the lowering (eager, it is the math form); `to_sdpa` renames it afterwards.
BIASED_ATTENTION = declare_op("biased_attention", biased_attention_impl, ["q"], decompose=False)


def attention_lse_impl(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """log sum_l exp(q k_l scale) over [B, H, M, D] queries and [B, H, L, D] keys: [B, H, M], -inf for L = 0.

    With the unmasked biased_attention of the same q and k it gives the part of a softmax those keys
    hold, so that a second, masked part can be added (`_prefix_and_tail`). IREE computes both in one
    pass over the keys (backends/iree/online_attention.py)."""
    return torch.logsumexp(torch.matmul(q, k.transpose(-1, -2)) * scale, dim=-1)


def _attention_lse_shape(q: Tensor, k: Tensor, scale: float) -> Tensor:
    return q.new_empty(q.shape[:-1])


# Kept through the lowering with biased_attention: online_attention.py pairs them into one IREE op.
ATTENTION_LSE = declare_op("attention_lse", attention_lse_impl, _attention_lse_shape, decompose=False)


TAIL_TILES = 2  # the tiles a chunk of at most one tile can reach beyond the last whole prefix tile


def _splits_at_a_tile(q: Tensor, k_cache: Tensor, window: int, length) -> bool:
    """Whether `_prefix_and_tail` covers this call: one row, no window, a chunk of at most one tile,
    and a symbolic length (tiles the host counts) over a cache of several tiles."""
    slots = k_cache.shape[2]
    tile = kv_tile_size(slots)
    return (q.shape[0] == 1 and window == 0 and q.shape[2] <= tile and not isinstance(length, int)
            and slots // tile >= TAIL_TILES)


def _prefix_and_tail(q: Tensor, k_cache: Tensor, v_cache: Tensor, start_pos: Tensor, scale: float,
                     kv_mapping: str, length) -> Tensor:
    """Causal attention of one row's chunk over the first `length` slots, with no tensor of that length.

    The host's tile count T covers the chunk's end, so with a chunk of at most one tile every key of
    the first P = max(T - 2, 0) tiles is at a position below the chunk's first: allowed for every
    query. Those keys take the unmasked fused attention with its log-sum-exp (one online-softmax pass
    over the keys in IREE); the two tiles after them, which hold the chunk, take the causal mask
    in a softmax of their own, 4 B x heads x chunk x 2 tiles. The parts add as a split softmax does.
    """
    b, hq, chunk, d = q.shape
    n_kv, slots = k_cache.shape[1], k_cache.shape[2]
    rep = hq // n_kv
    tile = kv_tile_size(slots)
    tiles = length // tile
    prefix = tiles - torch.sym_min(tiles, TAIL_TILES)

    def split(cache: Tensor) -> tuple[Tensor, Tensor]:
        by_tile = cache.view(b, n_kv, slots // tile, tile, d)
        head = by_tile.narrow(2, 0, prefix).view(b, n_kv, prefix * tile, d).to(torch.float32)
        tail = by_tile.narrow(2, prefix, TAIL_TILES).reshape(b, n_kv, TAIL_TILES * tile, d).to(torch.float32)
        return head, tail

    (k_head, k_tail), (v_head, v_tail) = split(k_cache), split(v_cache)
    queries = _group_query(q, n_kv, kv_mapping).to(torch.float32).reshape(b, n_kv, rep * chunk, d)
    head_out = BIASED_ATTENTION(queries, k_head, v_head, None, scale)
    head_lse = ATTENTION_LSE(queries, k_head, scale)  # [B, Hkv, rep x C]

    slots_read = torch.arange(TAIL_TILES * tile, dtype=start_pos.dtype, device=start_pos.device)
    kpos = prefix * tile + slots_read  # [2 tiles]
    qpos = _chunk_positions(start_pos, chunk).repeat(1, rep)  # [B, rep x C], row r x C + i
    allowed = (kpos[None, None, :] <= qpos[:, :, None])[:, None]  # [B, 1, rep x C, 2 tiles]
    scores = torch.matmul(queries, k_tail.transpose(-1, -2)) * scale
    scores = torch.where(allowed, scores, torch.full_like(scores, MASK_VALUE))
    tail_max = scores.amax(dim=-1)
    weights = torch.exp(scores - tail_max[..., None])
    tail_sum = weights.sum(dim=-1)
    tail_acc = torch.matmul(weights, v_tail)

    top = torch.maximum(head_lse, tail_max)
    head_w = torch.exp(head_lse - top)  # 0 for an empty prefix (lse -inf), whose output is 0 / 0
    tail_w = torch.exp(tail_max - top)
    head_part = torch.where(head_w[..., None] > 0, head_out * head_w[..., None], torch.zeros_like(head_out))
    out = (head_part + tail_acc * tail_w[..., None]) / (head_w + tail_sum * tail_w)[..., None]
    return _ungroup(out.reshape(b, n_kv, rep, chunk, d), kv_mapping).to(q.dtype)


def fused_cache_attention_impl(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, start_pos: Tensor, window: int, scale: float, kv_mapping: str,
    length: int,
) -> Tensor:
    """`cache_attention_impl`'s attention (same keys, same mask) with the keys in a fused attention op; a
    decode step (one query token) keeps the decomposed form, whose scores are one row per head.

    One row without a window splits at a tile (`_prefix_and_tail`: nothing of the context's length);
    batched rows, which sit at positions the host does not pass, and windows keep one biased
    attention over every key read, whose additive mask is 4 B x heads x chunk x length."""
    if q.shape[2] == 1:
        return cache_attention_impl(q, k_cache, v_cache, start_pos, window, scale, kv_mapping, length)
    if _splits_at_a_tile(q, k_cache, window, length):
        return _prefix_and_tail(q, k_cache, v_cache, start_pos, scale, kv_mapping, length)
    slots = torch.arange(k_cache.shape[2], dtype=start_pos.dtype, device=start_pos.device)
    kpos = _first_slots(slots[None, None, :, None], length)[0, 0, :, 0][None, None, :]
    k = _first_slots(k_cache, length).to(torch.float32)
    v = _first_slots(v_cache, length).to(torch.float32)
    b, hq, chunk, d = q.shape
    n_kv = k.shape[1]
    rep = hq // n_kv
    qpos = _chunk_positions(start_pos, chunk)[:, :, None]
    allowed = kpos <= qpos
    if window > 0:
        allowed = allowed & (qpos - kpos < window)
    bias = torch.where(allowed, 0.0, MASK_VALUE)  # [B, C, L]
    bias = bias[:, None, None].expand(b, 1, rep, chunk, bias.shape[-1]).reshape(b, 1, rep * chunk, bias.shape[-1])
    queries = _group_query(q, n_kv, kv_mapping).to(torch.float32).reshape(b, n_kv, rep * chunk, d)
    out = BIASED_ATTENTION(queries, k, v, bias, scale)
    return _ungroup(out.reshape(b, n_kv, rep, chunk, d), kv_mapping).to(q.dtype)


def fused_decompositions() -> dict:
    """Decomposition-table entries that give prefill chunks the fused form (decode keeps its own)."""
    return {CACHE_ATTENTION: fused_cache_attention_impl}


def to_sdpa(gm: GraphModule) -> int:
    """Rename every biased_attention node to aten.scaled_dot_product_attention, which the FX importer knows.

    The op is kept as an op through the lowering (eager, it is the math form); only
    here, after the decompositions, does it become the aten op IREE fuses. Edits `gm` in place;
    returns how many.
    """
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is BIASED_ATTENTION:
            q, k, v, bias, scale = node.args
            node.target = torch.ops.aten.scaled_dot_product_attention.default
            node.args = (q, k, v, bias)
            node.kwargs = {"scale": scale}
            count += 1
    if count:
        gm.recompile()
    return count


@register_pass(FUSED_ATTENTION_PASS, "the fused lowering's prefill attention as aten.scaled_dot_product_attention, "
               "one flash-style op for IREE", target="iree, fused attention")
def fused_attention(unit: CompileUnit) -> PassResult:
    """`to_sdpa` on each lowered entry point: a new program for each that holds the fused form."""
    sites = 0
    for name, program in list(unit.programs.items()):
        gm = copy_graph_module(program)
        count = to_sdpa(gm)
        if count:
            unit.programs[name] = rebuild(program, gm)
            sites += count
    return PassResult(changed=sites > 0, sites=sites)


def count_fused_attention(mlir: str) -> int:
    """How many fused attention ops an imported module holds (torch dialect text)."""
    return mlir.count("torch.aten.scaled_dot_product_attention ")


def attention_form(device: str, requested: str) -> str:
    """`fused` or `decomposed` for a target's prefill attention.

    `fused` where the target's backend compiles the attention op; a target that
    cannot (Vulkan's SPIR-V, ONNX) keeps the portable decomposed form whatever
    is asked, so a request never fails a compile. `auto` picks fused where it
    is also the faster form (CUDA).
    """
    if requested not in ATTENTION_FORMS:
        raise InputError(f"--attention must be one of {', '.join(ATTENTION_FORMS)}, got {requested!r}")
    if device not in FUSED_BY_DEFAULT or requested == "decomposed":
        return "decomposed"
    if requested == "fused":
        return "fused"
    return "fused" if FUSED_BY_DEFAULT[device] else "decomposed"
