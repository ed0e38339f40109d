"""How a tensor-parallel bundle deals each layer's heads and MLP features to its devices.

`foldline plan --scheme tensor` counts bytes with these rules and `foldline
compile --scheme tensor` builds its modules and state with them, so the two
agree buffer by buffer:

- query heads (GDN value heads) are ordered by the KV head (GDN key head) they
  read and dealt to the devices in contiguous runs as even as they go;
- a device holds the KV heads its query heads read; a KV head whose query heads
  land on two devices is held by both (a copy of its weights and cache);
- on one device, the heads form parts: whole groups (every query head of a
  run of KV heads) make one part, a group cut by a device boundary a part of
  its own. Each part is one attention (or GDN) of its own heads, with the
  blocked head mapping, its own state buffers, and its own columns of the
  output projection; the layer adds the parts' outputs (the all-reduce);
- MLP features are dealt in contiguous runs, one part per device.
"""

from __future__ import annotations

from dataclasses import dataclass

from .state import LAYER_TYPES, Config, StateBuffer, allowed_shapes, layer_state


def deal_counts(total: int, devices: int) -> tuple[int, ...]:
    """`total` units over `devices` in contiguous runs as even as they go (the first ones get the extra)."""
    base, extra = divmod(total, devices)
    return tuple(base + (1 if i < extra else 0) for i in range(devices))


def deal_runs(total: int, devices: int) -> list[range]:
    """The contiguous runs `deal_counts` gives each device."""
    runs, start = [], 0
    for n in deal_counts(total, devices):
        runs.append(range(start, start + n))
        start += n
    return runs


def shared_head(head: int, n_query: int, n_shared: int, mapping: str) -> int:
    """The KV head (GDN key head) query head `head` reads: blocked (head // group) or interleaved (head % n_shared)."""
    return head // (n_query // n_shared) if mapping == "blocked" else head % n_shared


@dataclass(frozen=True)
class HeadPart:
    """One part of a layer's heads: computed on `device`, its query heads in the order the part holds them
    (blocked: the i-th group of `len(query) // len(shared)` reads `shared[i]`)."""

    device: int
    query: tuple[int, ...]
    shared: tuple[int, ...]


def head_parts(n_query: int, n_shared: int, mapping: str, devices: int) -> list[HeadPart]:
    """A layer's heads as parts over `devices` (module docstring), in device order."""
    order = sorted(range(n_query), key=lambda h: (shared_head(h, n_query, n_shared, mapping), h))
    parts: list[HeadPart] = []
    group = n_query // n_shared
    for device, run in enumerate(deal_runs(n_query, devices)):
        heads = [order[i] for i in run]
        whole: list[int] = []  # query heads of complete groups, waiting to form one part
        pieces: list[list[int]] = []
        for h in heads:
            if pieces and shared_head(pieces[-1][0], n_query, n_shared, mapping) == shared_head(
                    h, n_query, n_shared, mapping):
                pieces[-1].append(h)
            else:
                pieces.append([h])
        for piece in pieces:
            if len(piece) == group:
                whole += piece
                continue
            if whole:
                parts.append(_part(device, whole, n_query, n_shared, mapping))
                whole = []
            parts.append(_part(device, piece, n_query, n_shared, mapping))
        if whole:
            parts.append(_part(device, whole, n_query, n_shared, mapping))
    return parts


def _part(device: int, query: list[int], n_query: int, n_shared: int, mapping: str) -> HeadPart:
    shared = tuple(dict.fromkeys(shared_head(h, n_query, n_shared, mapping) for h in query))
    return HeadPart(device, tuple(query), shared)


def attention_parts(cfg: Config, devices: int) -> list[HeadPart]:
    return head_parts(cfg["num_heads"], cfg["num_kv_heads"], cfg.get("kv_mapping", "blocked"), devices)


def gdn_parts(cfg: Config, devices: int) -> list[HeadPart]:
    return head_parts(cfg["gdn_num_v_heads"], cfg["gdn_num_k_heads"], cfg.get("gdn_kv_mapping", "blocked"), devices)


def mixer_parts(cfg: Config, layer: int, devices: int) -> list[HeadPart]:
    """The parts of layer `layer`'s mixer: GDN value/key heads or attention query/KV heads."""
    return gdn_parts(cfg, devices) if cfg["layer_types"][layer] == "gdn" else attention_parts(cfg, devices)


def mlp_part_devices(cfg: Config, devices: int) -> list[int]:
    """The device of each MLP part, in part order (a device dealt no features has none)."""
    return [j for j, run in enumerate(deal_runs(cfg["intermediate_size"], devices)) if len(run)]


def part_config(cfg: Config, layer: int, part: HeadPart) -> dict:
    """The config of one part's mixer: its head counts, the blocked mapping."""
    if cfg["layer_types"][layer] == "gdn":
        return {**cfg, "gdn_num_v_heads": len(part.query), "gdn_num_k_heads": len(part.shared),
                "gdn_kv_mapping": "blocked"}
    return {**cfg, "num_heads": len(part.query), "num_kv_heads": len(part.shared), "kv_mapping": "blocked"}


def part_buffer_name(layer: int, part: int, suffix: str) -> str:
    return f"layer{layer}.part{part}.{suffix}"


def tensor_state(cfg: Config, batch: int, devices: int, context: int | None = None
                 ) -> list[tuple[StateBuffer, int]]:
    """Every buffer of the tensor-parallel modules, in argument order, with the device holding it:
    per layer, each mixer part's buffers in part order (full caches, as `state_buffers`)."""
    out = []
    for i in range(len(cfg["layer_types"])):
        for p, part in enumerate(mixer_parts(cfg, i, devices)):
            for buf in layer_state(part_config(cfg, i, part), i, batch, context):
                suffix = buf.name.split(".", 1)[1]
                out.append((StateBuffer(part_buffer_name(i, p, suffix), buf.shape, buf.dtype, buf.kind, buf.layers),
                            part.device))
    return out


def allowed_part_shapes(cfg: Config, kind: str, batch: int, context: int, devices: int
                        ) -> tuple[list[tuple[int, ...]], str, str]:
    """`allowed_shapes` for the buffers of a tensor-parallel bundle: any part's, of any layer of the kind."""
    shapes: list[tuple[int, ...]] = []
    want = meaning = ""
    for i, layer_type in enumerate(cfg["layer_types"]):
        if kind not in LAYER_TYPES[layer_type]:
            continue
        for part in mixer_parts(cfg, i, devices):
            found, want, meaning = allowed_shapes(part_config(cfg, i, part), kind, batch, context)
            shapes += [s for s in found if s not in shapes]
    if not shapes:
        return allowed_shapes(cfg, kind, batch, context)
    return shapes, want, meaning

