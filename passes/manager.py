"""Pass manager: named ExportedProgram -> ExportedProgram passes in an ordered pipeline.

A pass sees a CompileUnit (the config, every entry point's program, and the
state layout), rewrites it, and returns what it did. Passes are idempotent: run
twice, the second run changes nothing. Every built-in pass module is imported
here; one that fails to import is an error, never a silently missing pass.

Target passes (registry.py) are registered by their backend and run by it, one
entry point at a time as it makes them (`TargetPasses`), with the same report
and `--dump-after` files as a pipeline's passes; the model pipeline refuses them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.export import ExportedProgram

from ..errors import FoldlineError
from . import (  # noqa: F401  (each registers its pass)
    fold_embedding_scale,
    fuse_hadamard,
    fuse_sibling_qlinears,
    place_devices,
    quantize_weights,
    ring_buffer_swa,
)
from .pipeline import DEFAULT_PIPELINE
from .registry import PASSES, CompileUnit, Pass, PassResult, register_pass

__all__ = ["PASSES", "CompileUnit", "Pass", "PassError", "PassResult", "TargetPasses", "available_passes",
           "default_pipeline", "register_pass", "resolve_pipeline", "run_pipeline", "run_target_passes"]

class PassError(FoldlineError, ValueError):
    """An unknown pass name or an invalid pipeline."""


def available_passes() -> dict[str, Pass]:
    return dict(PASSES)


def default_pipeline() -> list[str]:
    return list(DEFAULT_PIPELINE)


def resolve_pipeline(names: list[str] | None, drop: list[str] | None = None) -> list[str]:
    passes = available_passes()
    pipeline = default_pipeline() if names is None else list(names)
    for name in pipeline + list(drop or []):
        if name not in passes:
            known = sorted(n for n, p in passes.items() if p.target is None)
            raise PassError(f"unknown pass {name!r}; known passes: {', '.join(known) or 'none'}")
        if passes[name].target is not None:
            raise PassError(f"{name} is a target pass ({passes[name].target}): its backend runs it where it "
                            "applies, never in the pipeline")
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
    return _run(unit, resolve_pipeline(names, drop), dump_after, progress)


def run_target_passes(
    unit: CompileUnit,
    names: list[str],
    dump_after: dict[str, Path] | None = None,
    progress: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Run target passes in order on `unit` (in place), as their backend does; the per-pass report."""
    for name in names:
        if name not in PASSES or PASSES[name].target is None:
            raise PassError(f"{name!r} is not a target pass; registered target passes: "
                            f"{', '.join(sorted(n for n, p in PASSES.items() if p.target)) or 'none'}")
    return _run(unit, names, dump_after, progress)


def _run(unit: CompileUnit, names: list[str], dump_after: dict[str, Path] | None,
         progress: Callable[[str], None]) -> list[dict[str, Any]]:
    report = []
    for name in names:
        started = time.perf_counter()
        result = PASSES[name].run(unit)
        progress(f"      {name}: {'changed' if result.changed else 'no change'} in "
                 f"{time.perf_counter() - started:.1f} s ({result.summary()})")
        entry = {"name": name, "changed": result.changed, "sites": result.sites,
                 "bytes_saved": result.bytes_saved, "notes": result.notes}
        if result.details:
            entry["details"] = result.details
        report.append(entry)
        if dump_after and name in dump_after:
            dump_program(unit, Path(dump_after[name]), name)
    return report


@dataclass
class TargetPasses:
    """Target passes as a backend runs them: on each entry point as it makes it (after its own lowering, say),
    one program at a time, in the compile's context (the unit's config, state layout and options, with the
    backend's own `options` over them); `--dump-after` writes their files as it does a pipeline pass's."""

    unit: CompileUnit
    names: list[str]
    dump_after: dict[str, Path] | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def run(self, name: str, program: ExportedProgram) -> ExportedProgram:
        """Entry point `name`'s program after the passes (a new program where one changed it)."""
        one = dataclasses.replace(self.unit, programs={name: program}, options={**self.unit.options, **self.options})
        run_target_passes(one, self.names, self.dump_after, progress=lambda _m: None)
        return one.programs[name]
