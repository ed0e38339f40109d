"""The architectures foldline builds, one module each, and the lookups the loaders use.

Adding a family: write `frontend/arch/<family>.py` declaring an `ARCHITECTURE`
(its presets, its HF config and GGUF mappings) and list it in `ARCHITECTURES`
below. docs/architecture.md walks through it.
"""

from __future__ import annotations

from ..config import ConfigError, ModelConfig
from . import gemma3, llama, qwen35, ripple
from .base import Architecture

ARCHITECTURES: tuple[Architecture, ...] = (
    llama.ARCHITECTURE,
    gemma3.ARCHITECTURE,
    qwen35.ARCHITECTURE,
    ripple.ARCHITECTURE,
)

BY_FAMILY = {a.family: a for a in ARCHITECTURES}
BY_HF_MODEL_TYPE = {t: a for a in ARCHITECTURES for t in a.hf_model_types}
BY_GGUF_ARCHITECTURE = {a.gguf_architecture: a for a in ARCHITECTURES if a.gguf_architecture}
PRESETS = {name: factory for a in ARCHITECTURES for name, factory in a.presets.items()}


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]()


def architecture_of(cfg: ModelConfig) -> Architecture:
    if cfg.family not in BY_FAMILY:
        raise ConfigError(f"config {cfg.name!r}: unknown family {cfg.family!r}; known: {', '.join(BY_FAMILY)}")
    return BY_FAMILY[cfg.family]


__all__ = [
    "ARCHITECTURES",
    "BY_FAMILY",
    "BY_GGUF_ARCHITECTURE",
    "BY_HF_MODEL_TYPE",
    "PRESETS",
    "Architecture",
    "architecture_of",
    "get_preset",
]
