"""Resolve what a user names as MODEL into a config, a torch module and a tokenizer.

MODEL is a preset name (seeded random weights), a shipped model name, a .gguf
file, or a directory with config.json + *.safetensors (HF layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .config import ConfigError, ModelConfig, get_preset, is_planning_only
from .model import CausalLM, build_model


@dataclass
class LoadedModel:
    config: ModelConfig
    module: CausalLM
    tokenizer_json: str | None = None  # a tokenizers JSON document
    chat_template: str | None = None
    source: str = ""


def resolve_config(spec: str) -> ModelConfig:
    """The config alone (for `foldline plan`): no weights are read beyond metadata."""
    path = Path(spec)
    if path.suffix == ".gguf" or _is_shipped(spec):
        from .gguf_loader import read_gguf_config

        return read_gguf_config(_shipped_path(spec) if _is_shipped(spec) else path)
    if path.is_dir():
        from .hf_loader import read_hf_config

        return read_hf_config(path)
    return get_preset(spec)


def load_model(spec: str, max_context: int | None = None, seed: int = 0) -> LoadedModel:
    """Build the reference module for MODEL with its weights."""
    path = Path(spec)
    if _is_shipped(spec) or path.suffix == ".gguf":
        gguf_path = _shipped_path(spec) if _is_shipped(spec) else path
        if not gguf_path.is_file():
            raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
        from .gguf_loader import load_gguf

        return load_gguf(gguf_path, max_context=max_context)
    if path.is_dir():
        from .hf_loader import load_hf_dir

        return load_hf_dir(path, max_context=max_context)
    if path.suffix or "/" in spec:
        raise FileNotFoundError(f"model {spec!r} is neither an existing .gguf file nor a model directory")
    cfg = get_preset(spec)
    if is_planning_only(cfg):
        raise ConfigError(f"preset {spec!r} is for planning only (foldline plan); it has no weights to compile")
    if max_context is not None:
        cfg = cfg.replace(max_context=max_context)
    return LoadedModel(cfg, build_model(cfg, seed=seed), source=f"preset:{spec}")


def _is_shipped(spec: str) -> bool:
    try:
        from .shipped import SHIPPED_MODELS
    except ImportError:
        return False
    return spec in SHIPPED_MODELS


def _shipped_path(spec: str) -> Path:
    from .shipped import locate_shipped

    return locate_shipped(spec)
