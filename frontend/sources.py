"""Resolve what a user names as MODEL into a config, a torch module and a tokenizer.

MODEL is a preset name (seeded random weights), a shipped model name, a .gguf
file, or a directory with config.json + *.safetensors (HF layout).
"""

from __future__ import annotations

from pathlib import Path

from .arch import get_preset
from .config import ConfigError, ModelConfig
from .fingerprint import checkpoint_fingerprint
from .gguf_file import GGUFFile
from .gguf_loader import load_gguf, read_gguf_config
from .hf_loader import load_hf_dir, read_hf_config
from .model import build_model
from .shipped import SHIPPED_MODELS, locate_shipped
from .types import LoadedModel


def resolve_config(spec: str) -> ModelConfig:
    """The config alone (for `foldline plan`): no weights are read beyond metadata."""
    path = Path(spec)
    if spec in SHIPPED_MODELS:
        return read_gguf_config(locate_shipped(spec))
    if path.suffix == ".gguf":
        return read_gguf_config(path)
    if path.is_dir():
        return read_hf_config(path)
    return get_preset(spec)


FLOAT_GGUF_TYPES = ("F32", "F16", "BF16")


def holds_block_quantized_weights(spec: str) -> bool:
    """Whether MODEL is a GGUF with block-quantized weight tensors (what compile keeps by default)."""
    path = locate_shipped(spec) if spec in SHIPPED_MODELS else Path(spec)
    if path.suffix != ".gguf" or not path.is_file():
        return False
    with GGUFFile(path) as g:
        return any(t.type_name not in FLOAT_GGUF_TYPES for t in g.tensors.values())


def load_model(spec: str, max_context: int | None = None, seed: int = 0,
               defer_block_weights: bool = False) -> LoadedModel:
    """Build the reference module for MODEL with its weights.

    defer_block_weights: for a compile that keeps a GGUF's blocks, leave the float values of
    block-quantized weights unmade until read (frontend/deferred_weights.py); such a module is
    not an eager reference until `deferred_weights.materialize_module` runs.
    """
    loaded = _load(spec, max_context, seed, defer_block_weights)
    loaded.fingerprint = checkpoint_fingerprint(spec, max_context, seed)
    return loaded


def _load(spec: str, max_context: int | None, seed: int, defer_block_weights: bool = False) -> LoadedModel:
    path = Path(spec)
    if spec in SHIPPED_MODELS or path.suffix == ".gguf":
        gguf_path = locate_shipped(spec) if spec in SHIPPED_MODELS else path
        if not gguf_path.is_file():
            raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
        return load_gguf(gguf_path, max_context=max_context, defer_block_weights=defer_block_weights)
    if path.is_dir():
        return load_hf_dir(path, max_context=max_context)
    if path.suffix or "/" in spec:
        raise FileNotFoundError(f"model {spec!r} is neither an existing .gguf file nor a model directory")
    cfg = get_preset(spec)
    if cfg.planning_only:
        raise ConfigError(f"preset {spec!r} is for planning only (foldline plan); it has no weights to compile")
    if max_context is not None:
        cfg = cfg.replace(max_context=max_context)
    return LoadedModel(cfg, build_model(cfg, seed=seed), source=f"preset:{spec}")
