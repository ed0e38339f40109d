"""State buffers: the one record of a runtime-owned buffer and the layout rule of each kind.

The frontend builds its modules' state from `state_buffers`, the ring pass
shrinks windowed caches with `ring_buffer`, `foldline plan` predicts the
allocation with `planned_state_buffers`, the manifest lists the buffers and
its schema accepts only the shapes `allowed_shapes` gives: a new kind of state
is registered once, in STATE_KINDS.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..dtypes import DTYPES, itemsize

SEQ_DIM = 2  # KV caches are [rows, kv heads, slots, head dim]
Config = Mapping[str, Any]  # a model config as the manifest holds it (ModelConfig.to_dict())


# How a module's windowed-layer caches hold their window (ModuleEntry.window_order). A ring (None,
# the default) keeps position p in slot p mod window; "recent" keeps the positions held in order,
# the most recent last, as ONNX Runtime's GroupQueryAttention does with `sliding_window_cache`.
RECENT_WINDOW_ORDER = "recent"
WINDOW_ORDERS = (RECENT_WINDOW_ORDER,)


@dataclass(frozen=True)
class StateBuffer:
    """One runtime-owned state buffer: its name, shape over every row, element type, kind and layers."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # foldline.dtypes name ("float16")
    kind: str  # a STATE_KINDS key
    layers: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    @property
    def host_dtype(self) -> np.dtype:
        """The numpy type of a host copy (bfloat16 is ml_dtypes')."""
        return DTYPES[self.dtype].numpy

    @property
    def row_nbytes(self) -> int:
        """Bytes of one row's slice (rows are the first dimension)."""
        return self.nbytes // self.shape[0]

    def rows(self, count: int) -> StateBuffer:
        """The same buffer over `count` rows."""
        return replace(self, shape=(count, *self.shape[1:]))


def _cache_dtype(cfg: Config) -> str:
    return cfg.get("kv_dtype") or cfg["dtype"]


def _kv_shape(cfg: Config, batch: int, slots: int) -> tuple[int, ...]:
    return (batch, cfg["num_kv_heads"], slots, cfg["head_dim"])


def _gdn(cfg: Config, key: str) -> int:
    return int(cfg.get(key, 0) or 0)


def _conv_channels(cfg: Config) -> int:
    return (2 * _gdn(cfg, "gdn_num_k_heads") * _gdn(cfg, "gdn_head_k_dim")
            + _gdn(cfg, "gdn_num_v_heads") * _gdn(cfg, "gdn_head_v_dim"))


@dataclass(frozen=True)
class StateKind:
    """The layout rule of one kind of state: which layers hold it, its buffers, shape and dtype."""

    name: str
    layer_type: str  # the ModelConfig.layer_types entry whose layers hold it
    suffixes: tuple[str, ...]  # one buffer per suffix per layer: layer{i}.{suffix}
    shape: Callable[[Config, int, int], tuple[int, ...]]  # (config, rows, context) -> full-form shape
    dtype: Callable[[Config], str]
    meaning: str  # what the dimensions are, for error messages
    ring: bool = False  # the ring pass may shrink it to the sliding window


STATE_KINDS: dict[str, StateKind] = {k.name: k for k in (
    StateKind("global_kv", "global", ("k", "v"), lambda c, b, n: _kv_shape(c, b, n), _cache_dtype,
              "batch, num_kv_heads, max_context, head_dim"),
    StateKind("local_kv", "local", ("k", "v"), lambda c, b, n: _kv_shape(c, b, n), _cache_dtype,
              "batch, num_kv_heads, max_context or a ring of sliding_window slots, head_dim", ring=True),
    StateKind("gdn_recurrent", "gdn", ("ssm",),
              lambda c, b, n: (b, _gdn(c, "gdn_num_v_heads"), _gdn(c, "gdn_head_v_dim"), _gdn(c, "gdn_head_k_dim")),
              lambda c: "float32", "batch, gdn_num_v_heads, gdn_head_v_dim, gdn_head_k_dim"),
    StateKind("gdn_conv", "gdn", ("conv",),
              lambda c, b, n: (b, _conv_channels(c), _gdn(c, "gdn_conv_kernel") - 1),
              lambda c: c["dtype"], "batch, conv channels, gdn_conv_kernel - 1"),
)}
# layer type -> the kinds of state each of its layers holds, in buffer order
LAYER_TYPES: dict[str, tuple[str, ...]] = {}
for _kind in STATE_KINDS.values():
    LAYER_TYPES.setdefault(_kind.layer_type, ())
    LAYER_TYPES[_kind.layer_type] += (_kind.name,)
RECURRENT_KINDS = LAYER_TYPES["gdn"]  # state that sums every token fed: no rewind


def layer_state(cfg: Config, layer: int, batch: int, context: int | None = None,
                layer_type: str | None = None) -> list[StateBuffer]:
    """The buffers of layer `layer` in their full (reference) form, in buffer order.

    layer_type: the layer's type when it is not the config's (a mixer built on its own).
    """
    context = cfg["max_context"] if context is None else context
    out = []
    for kind in LAYER_TYPES[layer_type or cfg["layer_types"][layer]]:
        rule = STATE_KINDS[kind]
        shape = rule.shape(cfg, batch, context)
        out += [StateBuffer(f"layer{layer}.{s}", shape, rule.dtype(cfg), kind, (layer,)) for s in rule.suffixes]
    return out


def state_buffers(cfg: Config, batch: int, context: int | None = None) -> list[StateBuffer]:
    """Every buffer of the reference modules, in layer order (attention layers keep full caches)."""
    return [b for i in range(len(cfg["layer_types"])) for b in layer_state(cfg, i, batch, context)]


def ring_slots(window: int, length: int) -> int | None:
    """Slots of a ring replacing a `length`-slot cache; None when a ring would not be smaller."""
    if window <= 0 or window >= length:
        return None
    return window


def ring_buffer(buf: StateBuffer, window: int) -> StateBuffer:
    """The ring form of a full-length sliding-window cache (the buffer itself when a ring is no smaller)."""
    slots = ring_slots(window, buf.shape[SEQ_DIM])
    if slots is None:
        return buf
    return replace(buf, shape=(*buf.shape[:SEQ_DIM], slots, *buf.shape[SEQ_DIM + 1:]), kind="local_kv")


def planned_state_buffers(cfg: Config, batch: int, context: int | None = None) -> list[StateBuffer]:
    """The buffers the runtime allocates after the default pipeline (windowed layers as rings)."""
    return [ring_buffer(b, cfg.get("sliding_window", 0)) if STATE_KINDS[b.kind].ring else b
            for b in state_buffers(cfg, batch, context)]


def allowed_shapes(cfg: Config, kind: str, batch: int, context: int) -> tuple[list[tuple[int, ...]], str, str]:
    """The shapes a buffer of `kind` may have in a bundle of this config, its dtype, and what the dims mean."""
    rule = STATE_KINDS[kind]
    full = rule.shape(cfg, batch, context)
    shapes = [full]
    if rule.ring and ring_slots(cfg.get("sliding_window", 0), context) is not None:
        shapes.append(ring_buffer(StateBuffer("", full, "float32", kind, ()), cfg["sliding_window"]).shape)
    return shapes, rule.dtype(cfg), rule.meaning
