"""Load an HF-layout model directory (config.json + *.safetensors) into our reference modules.

Supported model_type values: "llama", "gemma3_text", "qwen3_5_text" (what
Qwen3_5ForCausalLM.save_pretrained writes) and "qwen3_5" (the multimodal
checkpoint; only its text tower is read). Every HF convention is translated into
a ModelConfig field here, and HF parameter names are renamed onto ours; a
tensor that is missing, left over, or of the wrong shape is an error, never
silently ignored. Weights are read with safetensors only (no pickle).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .config import ConfigError, ModelConfig
from .model import TORCH_DTYPES, CausalLM, build_model
from .sources import LoadedModel

# The reference modules keep full-length KV caches, so compiling for a model's
# whole advertised context (Qwen3.5: 262144) is never what a default should do.
DEFAULT_MAX_CONTEXT = 4096

SUPPORTED_MODEL_TYPES = ("llama", "gemma3_text", "qwen3_5_text", "qwen3_5")

_LAYER_KINDS = {"full_attention": "global", "sliding_attention": "local", "linear_attention": "gdn"}


class HFLoadError(ConfigError):
    """A model directory foldline cannot translate faithfully."""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise HFLoadError(f"{path.parent}: no config.json (expected an HF model directory)") from None


def _text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of a config (multimodal qwen3_5 nests it under text_config)."""
    if raw.get("model_type") == "qwen3_5":
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise HFLoadError("model_type 'qwen3_5' without a text_config")
        merged = dict(text)
        merged.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        merged["model_type"] = "qwen3_5_text"
        return merged
    return raw


def _eos(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _dtype(raw: dict[str, Any]) -> str:
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    return name if name in TORCH_DTYPES else "float32"


def _rope(params: dict[str, Any] | None, default_theta: float, what: str) -> tuple[float, float]:
    """(theta, linear position scale); rope types we do not implement are refused."""
    params = params or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", default_theta))
    if rope_type == "default":
        return theta, 1.0
    if rope_type == "linear":
        return theta, float(params["factor"])
    raise HFLoadError(f"{what}: rope_type {rope_type!r} is not supported (only 'default' and 'linear')")


def _common(raw: dict[str, Any], name: str, max_context: int | None) -> dict[str, Any]:
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    if raw.get("attention_bias"):
        raise HFLoadError(f"{name}: attention_bias=true is not supported by the reference attention")
    if raw.get("mlp_bias"):
        raise HFLoadError(f"{name}: mlp_bias=true is not supported")
    ctx = max_context if max_context is not None else raw.get("max_position_embeddings", DEFAULT_MAX_CONTEXT)
    return {
        "name": name,
        "vocab_size": raw["vocab_size"],
        "hidden_size": raw["hidden_size"],
        "intermediate_size": raw["intermediate_size"],
        "num_heads": heads,
        "num_kv_heads": raw.get("num_key_value_heads", heads),
        "head_dim": head_dim,
        "kv_mapping": "blocked",  # HF repeat_kv
        "rms_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "max_context": int(ctx),
        "dtype": _dtype(raw),
        "bos_token_id": raw.get("bos_token_id"),
        "eos_token_ids": _eos(raw.get("eos_token_id")),
    }


def _activation(raw: dict[str, Any], name: str) -> str:
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    if act == "silu":
        return "silu"
    if act in ("gelu_pytorch_tanh", "gelu_tanh"):
        return "gelu_tanh"
    raise HFLoadError(f"{name}: MLP activation {act!r} is not supported")


def _layer_types(raw: dict[str, Any], name: str, default_interval: int | None) -> tuple[str, ...]:
    types = raw.get("layer_types")
    if types is None:
        n = raw["num_hidden_layers"]
        if default_interval is None:
            return ("global",) * n
        interval = raw.get("full_attention_interval", default_interval)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    unknown = sorted({t for t in types if t not in _LAYER_KINDS})
    if unknown:
        raise HFLoadError(f"{name}: unknown layer types {unknown}")
    return tuple(_LAYER_KINDS[t] for t in types[: raw["num_hidden_layers"]])


def _llama_config(raw: dict[str, Any], name: str, max_context: int | None) -> ModelConfig:
    theta, scale = _rope(raw.get("rope_parameters") or raw.get("rope_scaling"), raw.get("rope_theta", 10000.0), name)
    if scale != 1.0:
        raise HFLoadError(f"{name}: linear RoPE scaling on llama is not supported")
    return ModelConfig(
        family="llama",
        layer_types=_layer_types(raw, name, None),
        rope_theta_local=theta,
        rope_theta_global=theta,
        norm_placement="pre",
        mlp_activation=_activation(raw, name),
        **_common(raw, name, max_context),
    )


def _gemma3_config(raw: dict[str, Any], name: str, max_context: int | None) -> ModelConfig:
    if raw.get("attn_logit_softcapping") is not None:
        raise HFLoadError(f"{name}: attn_logit_softcapping is not supported")
    if raw.get("use_bidirectional_attention"):
        raise HFLoadError(f"{name}: bidirectional attention is not a causal LM")
    rope = raw.get("rope_parameters") or {}
    theta_local, local_scale = _rope(rope.get("sliding_attention"), raw.get("rope_local_base_freq", 10000.0), name)
    theta_global, global_scale = _rope(rope.get("full_attention"), raw.get("rope_theta", 1_000_000.0), name)
    if local_scale != 1.0:
        raise HFLoadError(f"{name}: RoPE scaling on sliding layers is not supported")
    common = _common(raw, name, max_context)
    return ModelConfig(
        family="gemma3",
        layer_types=_layer_types(raw, name, None),
        sliding_window=int(raw.get("sliding_window") or 0),
        attn_scale=float(raw.get("query_pre_attn_scalar", common["head_dim"])) ** -0.5,
        rope_theta_local=theta_local,
        rope_theta_global=theta_global,
        rope_scaling_factor_global=global_scale,
        qk_norm=True,
        norm_placement="peri",
        norm_weight_offset=1.0,
        mlp_activation=_activation(raw, name),
        embed_scale=math.sqrt(raw["hidden_size"]),
        embed_scale_dtype="float32",  # a float32 buffer cast to the weight dtype
        final_logit_softcap=raw.get("final_logit_softcapping"),
        **common,
    )


def _qwen35_config(raw: dict[str, Any], name: str, max_context: int | None) -> ModelConfig:
    rope = raw.get("rope_parameters") or {}
    theta, scale = _rope(rope, raw.get("rope_theta", 10_000_000.0), name)
    if scale != 1.0:
        raise HFLoadError(f"{name}: RoPE scaling is not supported for qwen3_5")
    common = _common(raw, name, max_context)
    factor = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25)))
    rotary = int(common["head_dim"] * factor)
    if raw.get("linear_conv_kernel_dim", 4) < 2:
        raise HFLoadError(f"{name}: linear_conv_kernel_dim must be >= 2")
    return ModelConfig(
        family="qwen35",
        layer_types=_layer_types(raw, name, 4),
        rope_theta_global=theta,
        rotary_dim_global=rotary,
        qk_norm=True,
        attn_output_gate="fused_q",
        gate_fp32=False,  # HF multiplies by sigmoid(gate) in the model dtype
        norm_placement="pre",
        norm_weight_offset=1.0,
        mlp_activation=_activation(raw, name),
        gdn_num_k_heads=raw.get("linear_num_key_heads", 16),
        gdn_num_v_heads=raw.get("linear_num_value_heads", 32),
        gdn_head_k_dim=raw.get("linear_key_head_dim", 128),
        gdn_head_v_dim=raw.get("linear_value_head_dim", 128),
        gdn_conv_kernel=raw.get("linear_conv_kernel_dim", 4),
        gdn_kv_mapping="blocked",  # HF repeat_interleave over k heads
        gdn_norm_eps="plain",
        **common,
    )


_CONFIG_BUILDERS: dict[str, Callable[[dict[str, Any], str, int | None], ModelConfig]] = {
    "llama": _llama_config,
    "gemma3_text": _gemma3_config,
    "qwen3_5_text": _qwen35_config,
}


def read_hf_config(path: str | Path, max_context: int | None = None) -> ModelConfig:
    """The ModelConfig of an HF directory; max_context None = the model's own maximum."""
    path = Path(path)
    raw = _read_json(path / "config.json")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HFLoadError(
            f"{path}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    text = _text_config(raw)
    return _CONFIG_BUILDERS[text["model_type"]](text, path.name or str(path), max_context)


# ---------------------------------------------------------------------------
# Parameter names.
# ---------------------------------------------------------------------------

_LAYER_RENAMES = {
    "llama": {
        "input_layernorm": "input_norm",
        "post_attention_layernorm": "mlp_norm",
    },
    "gemma3": {
        "input_layernorm": "input_norm",
        "post_attention_layernorm": "post_mixer_norm",
        "pre_feedforward_layernorm": "mlp_norm",
        "post_feedforward_layernorm": "post_mlp_norm",
    },
    "qwen35": {
        "input_layernorm": "input_norm",
        "post_attention_layernorm": "mlp_norm",
    },
}

# HF tensors that belong to parts of a checkpoint we do not build.
_IGNORED = (re.compile(r"^mtp\."), re.compile(r"^model\.visual\."), re.compile(r"^visual\."))

_LAYER_RE = re.compile(r"^layers\.(\d+)\.([^.]+)\.(.+)$")


def _strip_prefix(name: str) -> str:
    for prefix in ("model.language_model.", "language_model.model.", "model."):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def hf_to_foldline_name(name: str, family: str) -> str | None:
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
    part = _LAYER_RENAMES[family].get(part, part)
    return f"layers.{idx}.{part}.{rest}"


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise HFLoadError(f"{path}: no *.safetensors files (pickled .bin checkpoints are not read)")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def _assign(module: CausalLM, tensors: dict[str, torch.Tensor], family: str, where: Path) -> None:
    cfg = module.cfg
    ours = module.state_dict()
    mapped: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for hf_name, tensor in tensors.items():
        name = hf_to_foldline_name(hf_name, family)
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
    module.load_state_dict({k: v.to(dtype) for k, v in mapped.items()}, strict=True)


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
    """Config, weights and tokenizer of an HF directory; max_context None = min(model max, 4096)."""
    path = Path(path)
    cfg = read_hf_config(path)
    ctx = max_context if max_context is not None else min(cfg.max_context, DEFAULT_MAX_CONTEXT)
    cfg = cfg.replace(max_context=ctx)
    module = build_model(cfg, seed=None)
    _assign(module, _load_tensors(path), cfg.family, path)
    tokenizer_json, template = _tokenizer_files(path)
    return LoadedModel(cfg, module.eval(), tokenizer_json=tokenizer_json, chat_template=template,
                       source=f"hf:{path}")
