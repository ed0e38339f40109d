"""Llama (and SmolLM2): global attention only, pre-norm, SiLU MLP.

GGUF convention: llama.cpp's converter permutes the rows of Q and K so that
RoPE rotates adjacent pairs. We undo that permutation at load (as HF's GGUF
loader does) and keep the half rotation (`rope_interleaved=False`); both are
exact row reorders, and the parity tests against HF transformers prove the choice.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..config import ModelConfig
from ..gguf_file import GGUFError, GGUFFile
from ..gguf_meta import common_fields, rope_scaling, standard_tensor_names
from ..hf_config import HFLoadError, layer_types, mlp_activation, rope_params
from ..hf_config import common_fields as hf_common_fields
from ..model import parameter_names
from .base import Architecture


def llama_tiny() -> ModelConfig:
    """A Llama / SmolLM2 block at small size: global attention only, pre-norm."""
    return ModelConfig(
        name="llama-tiny",
        family="llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        layer_types=("global",) * 3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta_local=100000.0,
        rope_theta_global=100000.0,
        norm_placement="pre",
        rms_eps=1e-5,
        mlp_activation="silu",
        tie_word_embeddings=True,
        max_context=128,
    )


# ---- HF config.json -------------------------------------------------------


def config_from_hf(raw: dict[str, Any], name: str, max_context: int | None) -> ModelConfig:
    theta, scale = rope_params(raw.get("rope_parameters") or raw.get("rope_scaling"), raw.get("rope_theta", 10000.0), name)
    if scale != 1.0:
        raise HFLoadError(f"{name}: linear RoPE scaling on llama is not supported")
    return ModelConfig(
        family="llama",
        layer_types=layer_types(raw, name, None),
        rope_theta_local=theta,
        rope_theta_global=theta,
        norm_placement="pre",
        mlp_activation=mlp_activation(raw, name),
        **hf_common_fields(raw, name, max_context),
    )


# ---- GGUF ----------------------------------------------------------------------


def config_from_gguf(g: GGUFFile, max_context: int | None) -> ModelConfig:
    if "rope_freqs.weight" in g.tensors:
        raise GGUFError(f"{g.path}: per-frequency RoPE factors (rope_freqs.weight, Llama 3.1 scaling) are not supported")
    c = common_fields(g, max_context)
    layers = int(g.require("block_count"))
    base = float(g.arch_key("rope.freq_base", 10000.0))
    rot = int(g.arch_key("rope.dimension_count", c["head_dim"]))
    return ModelConfig(
        **c,
        layer_types=("global",) * layers,
        rope_theta_local=base,
        rope_theta_global=base,
        rotary_dim_local=rot,
        rotary_dim_global=rot,
        rope_scaling_factor_global=rope_scaling(g),
        rope_interleaved=False,  # Q/K rows are un-permuted at load
        norm_placement="pre",
        mlp_activation="silu",
    )


def gguf_tensor_names(cfg: ModelConfig) -> dict[str, str]:
    return standard_tensor_names(cfg, parameter_names(cfg))


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (adjacent-pair RoPE -> HF half rotation)."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def gguf_tensor_value(tensor_name: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Q and K rows back in HF order (half rotation)."""
    if tensor_name.endswith(("attn_q.weight", "attn_q.bias")):
        return unpermute_rope_rows(w, cfg.num_heads)
    if tensor_name.endswith(("attn_k.weight", "attn_k.bias")):
        return unpermute_rope_rows(w, cfg.num_kv_heads)
    return w


ARCHITECTURE = Architecture(
    family="llama",
    presets={"llama-tiny": llama_tiny},
    hf_model_types=("llama",),
    config_from_hf=config_from_hf,
    hf_layer_renames={"input_layernorm": "input_norm", "post_attention_layernorm": "mlp_norm"},
    gguf_architecture="llama",
    config_from_gguf=config_from_gguf,
    gguf_tensor_names=gguf_tensor_names,
    gguf_tensor_value=gguf_tensor_value,
)
