"""State-buffer layout after the default pipeline, computed from a config alone.

`ring-buffer-swa` retypes sliding-window caches with `contract.state.ring_buffer`,
and `foldline plan` predicts the runtime's allocation with `planned_state_specs`,
which applies the same function to the reference layout: the two cannot
disagree about how many slots a ring has.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..contract.state import StateBuffer, planned_state_buffers, state_buffers
from ..frontend.config import ModelConfig


def reference_state_specs(cfg: ModelConfig, batch: int, context: int | None = None) -> list[StateBuffer]:
    """Every state buffer the reference modules use (all attention layers keep full caches)."""
    return state_buffers(cfg.to_dict(), batch, context)


def planned_state_specs(cfg: ModelConfig, batch: int, context: int | None = None) -> list[StateBuffer]:
    """The buffers the runtime allocates after the default pipeline (local layers as rings)."""
    return planned_state_buffers(cfg.to_dict(), batch, context)


@dataclass(frozen=True)
class StatePlan:
    """Compact (after passes) and naive (every layer full) state for one config."""

    specs: list[StateBuffer]
    naive_specs: list[StateBuffer]

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    @property
    def naive_bytes(self) -> int:
        return sum(s.nbytes for s in self.naive_specs)


def plan_state(cfg: ModelConfig, batch: int = 1, context: int | None = None) -> StatePlan:
    return StatePlan(planned_state_specs(cfg, batch, context), reference_state_specs(cfg, batch, context))
