"""Pass manager: named ExportedProgram -> ExportedProgram passes in an ordered pipeline.

A pass sees a CompileUnit (the config, every entry point's program, and the
state layout), rewrites it, and returns what it did. Passes are idempotent: run
twice, the second run changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.export import ExportedProgram

from ..frontend.config import ModelConfig
from ..frontend.model import StateSpec


@dataclass
class CompileUnit:
    """What passes transform: all entry points of one model, and its state layout."""

    config: ModelConfig
    programs: dict[str, ExportedProgram]
    state_specs: list[StateSpec]
    # Per-compile pass options, e.g. {"hadamard": "fold" | "online"}.
    options: dict[str, Any] = field(default_factory=dict)


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


class PassError(ValueError):
    """An unknown pass name or an invalid pipeline."""


PASSES: dict[str, Pass] = {}
# fuse-hadamard first: folding restores the plain embedding lookups fold-embedding-scale anchors on.
DEFAULT_PIPELINE: list[str] = ["fuse-hadamard", "fold-embedding-scale", "ring-buffer-swa"]


def register_pass(name: str, description: str):
    def wrap(fn: Callable[[CompileUnit], PassResult]):
        PASSES[name] = Pass(name, description, fn)
        return fn

    return wrap


def _load_builtin_passes() -> None:
    # Importing registers them; each pass module is independent.
    import importlib

    for module in ("fold_embedding_scale", "ring_buffer_swa", "fuse_hadamard"):
        try:
            importlib.import_module(f"{__package__}.{module}")
        except ModuleNotFoundError as e:
            if e.name != f"{__package__}.{module}":
                raise


def available_passes() -> dict[str, Pass]:
    _load_builtin_passes()
    return dict(PASSES)


def default_pipeline() -> list[str]:
    passes = available_passes()
    return [name for name in DEFAULT_PIPELINE if name in passes]


def resolve_pipeline(names: list[str] | None, drop: list[str] | None = None) -> list[str]:
    passes = available_passes()
    pipeline = default_pipeline() if names is None else list(names)
    for name in pipeline + list(drop or []):
        if name not in passes:
            raise PassError(f"unknown pass {name!r}; known passes: {', '.join(sorted(passes)) or 'none'}")
    return [n for n in pipeline if n not in set(drop or [])]


def dump_program(unit: CompileUnit, directory: Path, after: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, program in unit.programs.items():
        (directory / f"{name}.after-{after}.txt").write_text(str(program.graph_module.code))
        (directory / f"{name}.after-{after}.graph.txt").write_text(str(program.graph))


def run_pipeline(
    unit: CompileUnit,
    names: list[str] | None = None,
    drop: list[str] | None = None,
    dump_after: dict[str, Path] | None = None,
    progress: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Run passes in order on `unit` (in place); returns the per-pass report for the manifest."""
    report = []
    for name in resolve_pipeline(names, drop):
        result = PASSES[name].run(unit)
        progress(f"      {name}: {'changed' if result.changed else 'no change'} ({result.summary()})")
        report.append(
            {"name": name, "changed": result.changed, "sites": result.sites,
             "bytes_saved": result.bytes_saved, "notes": result.notes}
        )
        if dump_after and name in dump_after:
            dump_program(unit, Path(dump_after[name]), name)
    return report
