"""Gemma 3: 5 local : 1 global attention, sandwich (peri) norms, q/k norm, scaled and tied embedding.

GGUF convention: llama.cpp's converter stores RMSNorm weights as `1 + w`, so
the module uses `x * w` (norm_weight_offset 0) on the stored values.
"""

from __future__ import annotations

import math
from typing import Any

from ..config import ModelConfig
from ..gguf_file import GGUFError, GGUFFile
from ..gguf_meta import common_fields, rope_scaling, standard_tensor_names
from ..hf_config import HFLoadError, layer_types, mlp_activation, rope_params
from ..hf_config import common_fields as hf_common_fields
from ..model import parameter_names
from .base import Architecture


def gemma3_tiny() -> ModelConfig:
    """Gemma 3's block at small size: 5 local : 1 global, sandwich norms, tied head."""
    hidden = 64
    return ModelConfig(
        name="gemma3-tiny",
        family="gemma3",
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=128,
        layer_types=("local",) * 5 + ("global",) + ("local", "local"),
        num_heads=4,
        num_kv_heads=1,
        head_dim=32,
        sliding_window=16,
        attn_scale=32**-0.5,  # query_pre_attn_scalar = head_dim
        rope_theta_local=10000.0,
        rope_theta_global=1_000_000.0,
        qk_norm=True,
        norm_placement="peri",
        norm_weight_offset=1.0,
        mlp_activation="gelu_tanh",
        embed_scale=math.sqrt(hidden),
        embed_scale_dtype="float32",
        tie_word_embeddings=True,
        max_context=128,
    )


# ---- HF config.json -------------------------------------------------------


def config_from_hf(raw: dict[str, Any], name: str, max_context: int | None) -> ModelConfig:
    if raw.get("attn_logit_softcapping") is not None:
        raise HFLoadError(f"{name}: attn_logit_softcapping is not supported")
    if raw.get("use_bidirectional_attention"):
        raise HFLoadError(f"{name}: bidirectional attention is not a causal LM")
    rope = raw.get("rope_parameters") or {}
    theta_local, local_scale = rope_params(rope.get("sliding_attention"), raw.get("rope_local_base_freq", 10000.0), name)
    theta_global, global_scale = rope_params(rope.get("full_attention"), raw.get("rope_theta", 1_000_000.0), name)
    if local_scale != 1.0:
        raise HFLoadError(f"{name}: RoPE scaling on sliding layers is not supported")
    common = hf_common_fields(raw, name, max_context)
    return ModelConfig(
        family="gemma3",
        layer_types=layer_types(raw, name, None),
        sliding_window=int(raw.get("sliding_window") or 0),
        attn_scale=float(raw.get("query_pre_attn_scalar", common["head_dim"])) ** -0.5,
        rope_theta_local=theta_local,
        rope_theta_global=theta_global,
        rope_scaling_factor_global=global_scale,
        qk_norm=True,
        norm_placement="peri",
        norm_weight_offset=1.0,
        mlp_activation=mlp_activation(raw, name),
        embed_scale=math.sqrt(raw["hidden_size"]),
        embed_scale_dtype="float32",  # a float32 buffer cast to the weight dtype
        final_logit_softcap=raw.get("final_logit_softcapping"),
        **common,
    )


# ---- GGUF ----------------------------------------------------------------------


def gemma3_layer_types(g: GGUFFile, layers: int) -> tuple[str, ...]:
    """Sliding-window schedule: an explicit per-layer list, a period N (every Nth global) or llama.cpp's 6."""
    pattern = g.arch_key("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise GGUFError(f"{g.path}: sliding_window_pattern has {len(pattern)} entries for {layers} layers")
        return tuple("local" if swa else "global" for swa in pattern)
    period = int(pattern)
    if period <= 0:
        raise GGUFError(f"{g.path}: sliding_window_pattern {period} must be positive")
    return tuple("global" if (i + 1) % period == 0 else "local" for i in range(layers))


def config_from_gguf(g: GGUFFile, max_context: int | None) -> ModelConfig:
    c = common_fields(g, max_context)
    layers = int(g.require("block_count"))
    hidden = c["hidden_size"]
    # query_pre_attn_scalar is not stored; llama.cpp derives it: hidden/heads for
    # the 62-layer 27B model, head_dim for every other size.
    scalar = hidden // c["num_heads"] if layers == 62 else c["head_dim"]
    softcap = g.arch_key("final_logit_softcapping")
    return ModelConfig(
        **c,
        layer_types=gemma3_layer_types(g, layers),
        sliding_window=int(g.require("attention.sliding_window")),
        attn_scale=float(scalar) ** -0.5,
        rope_theta_local=float(g.arch_key("rope.freq_base_swa", 10000.0)),
        rope_theta_global=float(g.arch_key("rope.freq_base", 1_000_000.0)),
        rope_scaling_factor_global=rope_scaling(g),
        rope_interleaved=False,  # NEOX (half) rotation, as the file expects
        qk_norm=True,
        norm_placement="peri",
        norm_weight_offset=0.0,  # stored weights are already 1 + w
        mlp_activation="gelu_tanh",
        embed_scale=math.sqrt(hidden),
        embed_scale_dtype="float32",
        final_logit_softcap=float(softcap) if softcap else None,
    )


def gguf_tensor_names(cfg: ModelConfig) -> dict[str, str]:
    return standard_tensor_names(cfg, parameter_names(cfg))


ARCHITECTURE = Architecture(
    family="gemma3",
    presets={"gemma3-tiny": gemma3_tiny},
    hf_model_types=("gemma3_text",),
    config_from_hf=config_from_hf,
    hf_layer_renames={
        "input_layernorm": "input_norm",
        "post_attention_layernorm": "post_mixer_norm",
        "pre_feedforward_layernorm": "mlp_norm",
        "post_feedforward_layernorm": "post_mlp_norm",
    },
    gguf_architecture="gemma3",
    config_from_gguf=config_from_gguf,
    gguf_tensor_names=gguf_tensor_names,
)
