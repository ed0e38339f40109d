"""The pass registry: what a pass sees (CompileUnit), what it reports (PassResult), and registration.

A leaf of the passes package: each pass module registers itself here, and the
pass manager imports the pass modules, so neither imports the other's user.

A target pass is registered with the target it applies to ("onnx", "iree, fused
attention"): an FX rewrite a backend needs on the programs it makes. Its module
lives with its backend, which registers it when imported and runs it through the
pass manager (`run_target_passes`); it is never part of the model pipeline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.export import ExportedProgram

from ..contract.state import StateBuffer
from ..frontend.config import ModelConfig


@dataclass
class CompileUnit:
    """What passes transform: all entry points of one model, and its state layout."""

    config: ModelConfig
    programs: dict[str, ExportedProgram]
    state_specs: list[StateBuffer]
    # Per-compile pass options, e.g. {"hadamard": "fold" | "online", "weights": "auto" | "int4"}.
    options: dict[str, Any] = field(default_factory=dict)
    # The checkpoint's own block-quantized weights (quant.QuantizedTensor) by lifted-parameter
    # name in the programs (frontend.export.parameter_target).
    source_blocks: dict[str, Any] = field(default_factory=dict)


@dataclass
class PassResult:
    """What one pass did: the number of rewritten sites and anything worth reporting."""

    changed: bool
    sites: int = 0
    bytes_saved: int = 0
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> str:
        parts = [f"{self.sites} site(s)"]
        if self.bytes_saved:
            parts.append(f"{self.bytes_saved:,} state bytes saved")
        parts.extend(self.notes)
        return "; ".join(parts)


@dataclass
class Pass:
    name: str
    description: str
    run: Callable[[CompileUnit], PassResult]
    target: str | None = None  # a target pass: the targets it applies to; None: a pass of the model pipeline


PASSES: dict[str, Pass] = {}


def register_pass(name: str, description: str, target: str | None = None):
    def wrap(fn: Callable[[CompileUnit], PassResult]):
        PASSES[name] = Pass(name, description, fn, target)
        return fn

    return wrap
