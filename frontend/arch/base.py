"""What an architecture module declares: its presets and how its checkpoints map onto ModelConfig.

The generic loaders (`frontend/hf_loader.py`, `frontend/gguf_loader.py`) read
files; an `Architecture` says what the names and values in them mean. Model
differences stay ModelConfig fields: the reference modules never ask which
family they are running.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config import ModelConfig
from ..gguf_file import GGUFFile

PresetFactory = Callable[[], ModelConfig]


def keep_value(tensor_name: str, value: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """The default GGUF value conversion: the stored value is the module's value."""
    return value


def skip_nothing(tensor_name: str, cfg: ModelConfig) -> bool:
    return False


@dataclass(frozen=True)
class Architecture:
    """One model family: everything foldline knows that is specific to it."""

    family: str
    presets: Mapping[str, PresetFactory] = field(default_factory=dict)

    # HF directories: the config.json model_type values this family reads, and how.
    hf_model_types: tuple[str, ...] = ()
    config_from_hf: Callable[[dict[str, Any], str, int | None], ModelConfig] | None = None
    # HF per-layer module names -> ours (`layers.N.<hf name>.` -> `layers.N.<ours>.`).
    hf_layer_renames: Mapping[str, str] = field(default_factory=dict)

    # GGUF files: general.architecture, the config, the tensor names and value conversions.
    gguf_architecture: str | None = None
    config_from_gguf: Callable[[GGUFFile, int | None], ModelConfig] | None = None
    gguf_tensor_names: Callable[[ModelConfig], dict[str, str]] | None = None
    gguf_tensor_value: Callable[[str, np.ndarray, ModelConfig], np.ndarray] = keep_value
    gguf_skip_tensor: Callable[[str, ModelConfig], bool] = skip_nothing
