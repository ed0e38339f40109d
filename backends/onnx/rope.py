"""A query's or key's rotary embedding (and the per-head RMS norm before it), found in a program
so that GroupQueryAttention rotates them (backends/onnx/gqa.py).

foldline's attention splits each projection into heads, applies the optional
per-head norm (Gemma 3's q_norm and k_norm) and the rotary embedding
(frontend/layers.rotary: x * cos + partner(x) * signed sin), then attends.
Exported, those are about twenty small ONNX nodes per layer for q and k; at one
token each costs a few microseconds whatever it computes. GroupQueryAttention
rotates q and k itself (`do_rotary`, over cos and sin tables indexed by
position), at the positions it already knows (the
chunk's start plus the row). `match_rotated` reads the projection, the norm's
weight and epsilon, and the rotation's frequencies off the graph; `rope_tables`
adds the cos and sin tables, computed in the graph from those frequencies (ONNX
Runtime folds them into constants when it loads the model). ONNX Runtime's CPU
kernel takes no norm weights, so `normed_source` keeps the norm in the graph,
over the projection split into heads but not transposed.

Only the full rotation of the head is matched (partial rotary ends in a concat);
anything else is left as it is, and stays correct decomposed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from ...passes.graph_edit import placeholders_under

aten = torch.ops.aten


@dataclass(frozen=True)
class Rotated:
    """q or k as GroupQueryAttention takes it: the projection before the head split, and what
    the program did to it after."""

    source: Node  # [B, C, heads x head_dim]
    inv_freq: Node  # [head_dim / 2]: the rotation's frequencies
    pos_scale: float  # positions are divided by it (linear RoPE scaling)
    interleaved: bool  # pairs (2i, 2i + 1), else (i, i + half)
    norm_weight: Node | None  # the per-head RMS norm's weight (offset included), or None
    norm_eps: float | None


def _call(node, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _shape(node: Node) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape)


def _before_conversion(node):
    """The tensor `node` converts to another float type (float16 heads widened for rotary's or a norm's
    float32 arithmetic, and the result narrowed back), else `node` itself."""
    if _call(node, aten._to_copy.default) and set(node.kwargs) <= {"dtype"}:
        return node.args[0]
    return node


def match_rotated(node: Node) -> Rotated | None:
    """`node` as rotary(norm?(heads(projection))) of frontend/layers.py, else None; in float16 compute, with
    the rotation's conversions to float32 and back around it."""
    node = _before_conversion(node)
    if not _call(node, aten.view.default, aten.reshape.default) or not _call(node.args[0], aten.add.Tensor):
        return None
    total = node.args[0]
    for straight, crossed in (total.args, reversed(total.args)):
        found = _rotation(straight, crossed)
        if found is not None:
            pairs, cos_angle, interleaved = found
            break
    else:
        return None
    if not _call(pairs, aten.view.default, aten.reshape.default):
        return None
    heads = _before_conversion(pairs.args[0])
    if _shape(heads) != _shape(node):
        return None
    angles = cos_angle.args[0]
    freq = _frequencies(angles, _shape(heads)[-1] // 2)
    if freq is None:
        return None
    inv_freq, pos_scale = freq
    norm_weight, norm_eps, split = _per_head_norm(heads)
    source = _head_split_source(split, _shape(heads))
    if source is None:
        return None
    return Rotated(source, inv_freq, pos_scale, interleaved, norm_weight, norm_eps)


def _rotation(straight, crossed) -> tuple[Node, Node, bool] | None:
    """(pairs, cos node, interleaved) if straight = pairs * unsqueeze(cos) and
    crossed = flip(pairs) * (unsqueeze(sin) * sign) over the same angles."""
    if not (_call(straight, aten.mul.Tensor) and _call(crossed, aten.mul.Tensor)):
        return None
    for pairs, cos_u in (straight.args, reversed(straight.args)):
        if not (_call(cos_u, aten.unsqueeze.default) and _call(cos_u.args[0], aten.cos.default)):
            continue
        for flipped, signed_sin in (crossed.args, reversed(crossed.args)):
            if not (_call(flipped, aten.flip.default) and flipped.args[0] is pairs):
                continue
            dims = [d % len(_shape(pairs)) for d in flipped.args[1]]
            rank = len(_shape(pairs))
            interleaved = dims == [rank - 1] and _shape(pairs)[-1] == 2
            halves = dims == [rank - 2] and _shape(pairs)[-2] == 2
            if not (interleaved or halves) or not _reads_sin_of(signed_sin, cos_u.args[0].args[0]):
                continue
            return pairs, cos_u.args[0], interleaved
    return None


def _reads_sin_of(node, angles: Node) -> bool:
    """sin(angles) within the two ops (unsqueeze, times the sign) that frontend/layers.rotary puts on it."""
    frontier = [node]
    for _ in range(3):
        frontier = [a for n in frontier if isinstance(n, Node) for a in n.args if isinstance(a, Node)]
        if any(_call(n, aten.sin.default) and n.args[0] is angles for n in frontier):
            return True
    return False


def _frequencies(angles: Node, half: int) -> tuple[Node, float] | None:
    """(inv_freq, pos_scale) if angles = positions / pos_scale (unsqueezed) * inv_freq[half]."""
    if not _call(angles, aten.mul.Tensor):
        return None
    for positions, inv_freq in (angles.args, reversed(angles.args)):
        if not isinstance(inv_freq, Node) or _shape(inv_freq) != (half,) or placeholders_under(inv_freq):
            continue
        while _call(positions, aten.unsqueeze.default):
            positions = positions.args[0]
        if _call(positions, aten.div.Tensor) and isinstance(positions.args[1], (int, float)):
            return inv_freq, float(positions.args[1])
    return None


def _per_head_norm(x: Node) -> tuple[Node | None, float | None, Node]:
    """(weight, eps, its input) if x = x0 * rsqrt(mean(x0^2, -1) + eps) * weight, else (None, None, x);
    in float16 compute, computed in float32 between conversions (frontend/layers.RMSNorm)."""
    unnormed, x = x, _before_conversion(x)
    if not _call(x, aten.mul.Tensor):
        return None, None, unnormed
    for normed, weight in (x.args, reversed(x.args)):
        if not (_call(normed, aten.mul.Tensor) and isinstance(weight, Node)):
            continue
        for x0, inv in (normed.args, reversed(normed.args)):
            if not _call(inv, aten.rsqrt.default) or not _call(inv.args[0], aten.add.Tensor):
                continue
            mean, eps = inv.args[0].args
            if not (_call(mean, aten.mean.dim) and isinstance(eps, float) and list(mean.args[1]) == [-1]):
                continue
            power = mean.args[0]
            if _call(power, aten.pow.Tensor_Scalar) and power.args[0] is x0 and power.args[1] == 2:
                return weight, eps, _before_conversion(x0)
    return None, None, unnormed


def _head_split_source(node: Node, heads_shape: tuple[int, ...]) -> Node | None:
    """The [B, C, H x D] projection if node = transpose(view(projection, [B, C, H, D]), 1, 2)."""
    if not (_call(node, aten.transpose.int) and sorted(node.args[1:3]) == [1, 2]):
        return None
    split = node.args[0]
    if not _call(split, aten.view.default, aten.reshape.default):
        return None
    b, h, c, d = heads_shape
    source = split.args[0]
    return source if _shape(source) == (b, c, h * d) else None


def rope_tables(graph: Graph, rotated: Rotated, positions: int, fake_of: Node,
                dtype: torch.dtype = torch.float32) -> tuple[Node, Node]:
    """cos and sin tables [positions, head_dim / 2] of `rotated`'s rotation in `dtype` (computed in
    float32), as graph nodes (before the current insertion point); `fake_of`'s fake mode makes their
    metadata."""
    add = _adder(graph, fake_of)
    steps = add(aten.arange.default, (positions,), {"dtype": torch.float32, "device": torch.device("cpu")})
    scaled = add(aten.div.Tensor, (steps, rotated.pos_scale))
    angles = add(aten.mul.Tensor, (add(aten.unsqueeze.default, (scaled, 1)),
                                   add(aten.unsqueeze.default, (rotated.inv_freq, 0))))
    tables = add(aten.cos.default, (angles,)), add(aten.sin.default, (angles,))
    if dtype == torch.float32:
        return tables
    return tuple(add(aten._to_copy.default, (table,), {"dtype": dtype}) for table in tables)


def normed_source(graph: Graph, rotated: Rotated, fake_of: Node) -> Node:
    """`rotated.source` [B, C, H x D] with its per-head norm applied, as graph nodes (before the current
    insertion point). ONNX Runtime's CPU GroupQueryAttention does not take the norm's weights (it
    refuses q_norm_weight: CUDA and WebGPU only), so the norm stays in the graph, in the layout
    GroupQueryAttention reads: [B, C, H, D], where backends/onnx/norms.py makes it one node."""
    if rotated.norm_weight is None:
        return rotated.source
    add = _adder(graph, fake_of)
    b, c, width = _shape(rotated.source)
    dim = _shape(rotated.norm_weight)[-1]
    dtype = rotated.source.meta["val"].dtype
    heads = add(aten.view.default, (rotated.source, [b, c, width // dim, dim]))
    if dtype != torch.float32:  # the norm computes in float32 (frontend/layers.RMSNorm)
        heads = add(aten._to_copy.default, (heads,), {"dtype": torch.float32})
    mean = add(aten.mean.dim, (add(aten.pow.Tensor_Scalar, (heads, 2)), [-1], True))
    inv = add(aten.rsqrt.default, (add(aten.add.Tensor, (mean, rotated.norm_eps)),))
    normed = add(aten.mul.Tensor, (add(aten.mul.Tensor, (heads, inv)), rotated.norm_weight))
    if dtype != torch.float32:
        normed = add(aten._to_copy.default, (normed,), {"dtype": dtype})
    return add(aten.view.default, (normed, [b, c, width]))


def _adder(graph: Graph, fake_of: Node):
    """A function adding a call to the graph, its metadata computed in `fake_of`'s fake mode."""
    mode = fake_of.meta["val"].fake_mode

    def add(target, args, kwargs=None) -> Node:
        node = graph.call_function(target, args, kwargs or {})
        with mode:
            node.meta["val"] = target(*[a.meta["val"] if isinstance(a, Node) else a for a in args], **(kwargs or {}))
        return node

    return add


def rotate_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 interleaved: bool) -> torch.Tensor:
    """x [B, H, C, D] rotated at positions [B, C] by the tables (the eager form of what GroupQueryAttention
    does; frontend/layers.rotary computes the same from the frequencies)."""
    c, s = cos[positions][:, None], sin[positions][:, None]  # [B, 1, C, D/2]
    if interleaved:
        first, second = x[..., 0::2], x[..., 1::2]
        return torch.stack([first * c - second * s, second * c + first * s], dim=-1).flatten(-2)
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * c - second * s, second * c + first * s], dim=-1)
