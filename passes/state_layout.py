"""State-buffer layout after the default pipeline, computed from a config alone.

`ring-buffer-swa` retypes sliding-window caches with `ring_spec`, and
`foldline plan` predicts the runtime's allocation with `planned_state_specs`,
which applies the same function to the reference layout: the two cannot
disagree about how many slots a ring has.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..frontend.config import ModelConfig
from ..frontend.model import state_specs
from ..frontend.types import StateSpec

SEQ_DIM = 2  # KV caches are [B, Hkv, slots, D]


def ring_slots(window: int, length: int) -> int | None:
    """Slots of a ring replacing a `length`-slot cache; None when a ring would not be smaller."""
    if window <= 0 or window >= length:
        return None
    return window


def ring_spec(spec: StateSpec, window: int) -> StateSpec:
    """The ring form of a full-length sliding-window cache spec."""
    slots = ring_slots(window, spec.shape[SEQ_DIM])
    if slots is None:
        return spec
    shape = list(spec.shape)
    shape[SEQ_DIM] = slots
    return replace(spec, shape=tuple(shape), kind="local_kv")


def reference_state_specs(cfg: ModelConfig, batch: int, context: int | None = None) -> list[StateSpec]:
    """Every state buffer the reference modules use (all attention layers keep full caches)."""
    if context is not None and context != cfg.max_context:
        cfg = cfg.replace(max_context=context)
    return state_specs(cfg, batch)


def planned_state_specs(cfg: ModelConfig, batch: int, context: int | None = None) -> list[StateSpec]:
    """The buffers the runtime allocates after the default pipeline (local layers as rings)."""
    return [
        ring_spec(s, cfg.sliding_window) if s.kind == "local_kv" else s
        for s in reference_state_specs(cfg, batch, context)
    ]


@dataclass(frozen=True)
class StatePlan:
    """Compact (after passes) and naive (every layer full) state for one config."""

    specs: list[StateSpec]
    naive_specs: list[StateSpec]

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    @property
    def naive_bytes(self) -> int:
        return sum(s.nbytes for s in self.naive_specs)


def plan_state(cfg: ModelConfig, batch: int = 1, context: int | None = None) -> StatePlan:
    return StatePlan(planned_state_specs(cfg, batch, context), reference_state_specs(cfg, batch, context))
