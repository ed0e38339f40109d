"""Pass manager: named ExportedProgram -> ExportedProgram passes in an ordered pipeline.

A pass sees a CompileUnit (the config, every entry point's program, and the
state layout), rewrites it, and returns what it did. Passes are idempotent: run
twice, the second run changes nothing. Every built-in pass module is imported
here; one that fails to import is an error, never a silently missing pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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

__all__ = ["PASSES", "CompileUnit", "Pass", "PassError", "PassResult", "available_passes", "default_pipeline",
           "register_pass", "resolve_pipeline", "run_pipeline"]

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
