"""Shared fixtures: compiled bundles are expensive, so each is built once per test run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def bundle_factory(tmp_path_factory) -> Callable[..., Path]:
    """compile(spec, target="cpu", passes=None, chunk=16, key=None) -> bundle dir, cached per session."""
    from foldline.backends.build import BuildOptions, compile_model
    from foldline.backends.targets import make_target
    from foldline.frontend.sources import load_model

    cache: dict[tuple, Path] = {}

    def compile_bundle(spec: str, target: str = "cpu", passes: tuple[str, ...] | None = None,
                       chunk: int = 16, max_context: int | None = None) -> Path:
        key = (spec, target, passes, chunk, max_context)
        if key not in cache:
            out = tmp_path_factory.mktemp(spec.replace("/", "_")) / "bundle"
            loaded = load_model(spec, max_context=max_context)
            options = BuildOptions(targets=[make_target(target)], passes=list(passes) if passes is not None else None,
                                   chunk=chunk)
            compile_model(loaded, out, options, progress=lambda _msg: None)
            cache[key] = out
        return cache[key]

    return compile_bundle
