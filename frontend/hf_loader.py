"""Load an HF-layout model directory (config.json + *.safetensors) into our reference modules.

The config.json's model_type picks the architecture module (`frontend/arch/`)
that translates every HF convention into a ModelConfig field and names the
per-layer module renames. HF parameter names are mapped onto ours here; a
tensor that is missing, left over, or of the wrong shape is an error, never
silently ignored. Weights are read with safetensors only (no pickle).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .arch import BY_HF_MODEL_TYPE, architecture_of
from .config import ModelConfig
from .hf_config import HFLoadError
from .model import CausalLM, skeleton
from .types import TORCH_DTYPES, LoadedModel

SUPPORTED_MODEL_TYPES = tuple(BY_HF_MODEL_TYPE)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise HFLoadError(f"{path.parent}: no config.json (expected an HF model directory)") from None
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8 text, nested beyond reason
        raise HFLoadError(f"{path} is not a JSON document: {type(e).__name__}: {e}") from None
    if not isinstance(raw, dict):
        raise HFLoadError(f"{path} holds a {type(raw).__name__}, not a JSON object of model settings")
    return raw


# Sizes read from config.json: positive integers when present. A per-layer list (and the module)
# is built from num_hidden_layers, so it is also bounded, far above any real model.
_SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "max_position_embeddings")
MAX_LAYERS = 65536


def _check_sizes(raw: dict[str, Any], where: Path) -> None:
    for key in (*_SIZE_KEYS, "head_dim"):
        if key not in raw or (key == "head_dim" and raw[key] is None):
            continue
        value = raw[key]
        if type(value) is not int or value <= 0:
            raise HFLoadError(f"{where}: config.json {key} = {value!r} is not a positive integer")
    if raw.get("num_hidden_layers", 0) > MAX_LAYERS:
        raise HFLoadError(f"{where}: config.json num_hidden_layers = {raw['num_hidden_layers']} "
                          f"is more than {MAX_LAYERS} layers: not a model foldline can build")


def read_hf_config(path: str | Path, max_context: int | None = None) -> ModelConfig:
    """The ModelConfig of an HF directory; max_context None = the model's own maximum."""
    path = Path(path)
    raw = _read_json(path / "config.json")
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in BY_HF_MODEL_TYPE:
        raise HFLoadError(
            f"{path}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    _check_sizes(raw, path)
    try:
        return BY_HF_MODEL_TYPE[model_type].config_from_hf(raw, path.name or str(path), max_context)
    except HFLoadError:
        raise
    except KeyError as e:
        raise HFLoadError(f"{path}: config.json lacks {e.args[0]!r}, which a {model_type} model needs") from None
    except (TypeError, ValueError, AttributeError, ZeroDivisionError, OverflowError) as e:
        # A setting of the wrong type or value (ConfigError, a ValueError, names what it refuses).
        raise HFLoadError(f"{path}: config.json does not describe a {model_type} model foldline can build: "
                          f"{type(e).__name__}: {e}") from e


# ---------------------------------------------------------------------------
# Parameter names.
# ---------------------------------------------------------------------------

# HF tensors that belong to parts of a checkpoint we do not build.
_IGNORED = (re.compile(r"^mtp\."), re.compile(r"^model\.visual\."), re.compile(r"^visual\."))

_LAYER_RE = re.compile(r"^layers\.(\d+)\.([^.]+)\.(.+)$")


def _strip_prefix(name: str) -> str:
    for prefix in ("model.language_model.", "language_model.model.", "model."):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def hf_to_foldline_name(name: str, renames: dict[str, str]) -> str | None:
    """Our parameter name for an HF tensor name; None for tensors we deliberately skip."""
    if any(p.match(name) for p in _IGNORED):
        return None
    if name == "lm_head.weight":
        return name
    name = _strip_prefix(name)
    m = _LAYER_RE.match(name)
    if not m:
        return name  # embed_tokens.weight, norm.weight
    idx, part, rest = m.groups()
    if part in ("self_attn", "linear_attn"):
        if part == "linear_attn" and rest == "conv1d.weight":
            rest = "conv1d_weight"
        return f"layers.{idx}.mixer.{rest}"
    part = renames.get(part, part)
    return f"layers.{idx}.{part}.{rest}"


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise HFLoadError(f"{path}: no *.safetensors files (pickled .bin checkpoints are not read)")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except SafetensorError as e:  # truncated, or a header that lies about offsets, dtype or shape
            raise HFLoadError(f"{f} is not a readable safetensors file: {e}") from e
    return tensors


def _assign(module: CausalLM, tensors: dict[str, torch.Tensor], where: Path) -> None:
    cfg = module.cfg
    family = cfg.family
    renames = dict(architecture_of(cfg).hf_layer_renames)
    ours = module.state_dict()
    mapped: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for hf_name, tensor in tensors.items():
        name = hf_to_foldline_name(hf_name, renames)
        if name is None:
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the head is the embedding table
        if name not in ours:
            unexpected.append(hf_name)
            continue
        if name.endswith("mixer.conv1d_weight") and tensor.dim() == 3:
            tensor = tensor[:, 0, :]  # HF nn.Conv1d depthwise weight [ch, 1, K]
        if tuple(tensor.shape) != tuple(ours[name].shape):
            raise HFLoadError(
                f"{where}: tensor {hf_name} has shape {tuple(tensor.shape)}, expected {tuple(ours[name].shape)} for {name}"
            )
        mapped[name] = tensor
    if unexpected:
        raise HFLoadError(f"{where}: tensors with no place in the {family} model: {sorted(unexpected)[:8]}")
    missing = sorted(set(ours) - set(mapped))
    if missing:
        raise HFLoadError(f"{where}: missing tensors for {missing[:8]}" + (" ..." if len(missing) > 8 else ""))
    dtype = TORCH_DTYPES[cfg.dtype]
    module.load_state_dict({k: v.to(dtype) for k, v in mapped.items()}, strict=True, assign=True)


def _tokenizer_files(path: Path) -> tuple[str | None, str | None]:
    tok = path / "tokenizer.json"
    tokenizer_json = tok.read_text() if tok.is_file() else None
    template = None
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        template = jinja.read_text()
    else:
        tc = path / "tokenizer_config.json"
        if tc.is_file():
            value = json.loads(tc.read_text()).get("chat_template")
            template = value if isinstance(value, str) else None
    return tokenizer_json, template


def load_hf_dir(path: str | Path, max_context: int | None = None) -> LoadedModel:
    """Config, weights and tokenizer of an HF directory; max_context None = the trained context, capped."""
    path = Path(path)
    cfg = read_hf_config(path)
    if max_context is not None:
        cfg = cfg.replace(max_context=max_context)
    # Built on the meta device: the config's sizes allocate nothing until the file's tensors,
    # checked against them, are assigned (a config.json that lies about sizes cannot exhaust memory).
    try:
        module = skeleton(cfg)
    except (RuntimeError, TypeError, OverflowError) as e:  # sizes whose products overflow
        raise HFLoadError(f"{path}: config.json sizes do not form a model: {e}") from e
    _assign(module, _load_tensors(path), path)
    tokenizer_json, template = _tokenizer_files(path)
    return LoadedModel(cfg, module.eval(), tokenizer_json=tokenizer_json, chat_template=template,
                       source=f"hf:{path}")
