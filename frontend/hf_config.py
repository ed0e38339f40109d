"""HF config.json conventions shared by the architectures: common fields, RoPE, activations.

Architecture modules (`frontend/arch/`) translate their model_type's config
into a ModelConfig with these helpers; anything foldline cannot reproduce
faithfully is an HFLoadError, never silently approximated.
"""

from __future__ import annotations

from typing import Any

from ..dtypes import FLOAT_DTYPES
from .config import ConfigError, default_max_context

_LAYER_KINDS = {"full_attention": "global", "sliding_attention": "local", "linear_attention": "gdn"}


class HFLoadError(ConfigError):
    """A model directory foldline cannot translate faithfully."""


def eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def checkpoint_dtype(raw: dict[str, Any]) -> str:
    """The dtype the checkpoint's weights are stored in (config.json `dtype`); the module is built
    in it, and `foldline compile --dtype` picks the compute dtype from it (backends/policy.py)."""
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    return name if name in FLOAT_DTYPES else "float32"


def rope_params(params: dict[str, Any] | None, default_theta: float, what: str) -> tuple[float, float]:
    """(theta, linear position scale); rope types we do not implement are refused."""
    params = params or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", default_theta))
    if rope_type == "default":
        return theta, 1.0
    if rope_type == "linear":
        return theta, float(params["factor"])
    raise HFLoadError(f"{what}: rope_type {rope_type!r} is not supported (only 'default' and 'linear')")


def common_fields(raw: dict[str, Any], name: str, max_context: int | None) -> dict[str, Any]:
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    if raw.get("attention_bias"):
        raise HFLoadError(f"{name}: attention_bias=true is not supported by the reference attention")
    if raw.get("mlp_bias"):
        raise HFLoadError(f"{name}: mlp_bias=true is not supported")
    ctx = max_context if max_context is not None else default_max_context(raw.get("max_position_embeddings"))
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
        "dtype": checkpoint_dtype(raw),
        "bos_token_id": raw.get("bos_token_id"),
        "eos_token_ids": eos_ids(raw.get("eos_token_id")),
    }


def mlp_activation(raw: dict[str, Any], name: str) -> str:
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    if act == "silu":
        return "silu"
    if act in ("gelu_pytorch_tanh", "gelu_tanh"):
        return "gelu_tanh"
    raise HFLoadError(f"{name}: MLP activation {act!r} is not supported")


def layer_types(raw: dict[str, Any], name: str, default_interval: int | None) -> tuple[str, ...]:
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
