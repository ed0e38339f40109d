"""Ripple: 4 local : 1 global attention, window 1024, NoPE global layers, value residual, PeriNorm.

No public checkpoint format is mapped yet: Ripple exists as presets (a tiny
test model and the published 65B config, for `foldline plan`).
"""

from __future__ import annotations

import math

from ..config import ModelConfig
from .base import Architecture


def ripple_tiny() -> ModelConfig:
    """Ripple's exact block at small size: 2 x (4 local + 1 global)."""
    hidden = 64
    return ModelConfig(
        name="ripple-tiny",
        family="ripple",
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=192,
        layer_types=("local",) * 4 + ("global",) + ("local",) * 4 + ("global",),
        num_heads=8,
        num_kv_heads=2,
        head_dim=16,  # Q width 128 = 2 x residual width, as in Ripple
        kv_mapping="blocked",
        sliding_window=16,
        rope_theta_local=10000.0,
        rope_theta_global=None,  # NoPE, still causal
        qk_norm=True,
        attn_output_gate="separate",
        gate_fp32=True,
        value_residual=True,
        norm_placement="peri",
        rms_eps=1e-6,
        mlp_activation="silu",
        mlp_gate_clip_max=20.0,
        mlp_up_clip=20.0,
        embed_scale=math.sqrt(hidden),
        tie_word_embeddings=False,
        max_context=128,
    )


def ripple_65b() -> ModelConfig:
    """The published Ripple-65B config: for planning only, never instantiated."""
    hidden = 5120
    return ModelConfig(
        name="ripple-65b",
        family="ripple",
        vocab_size=100352,
        hidden_size=hidden,
        intermediate_size=40960,
        layer_types=(("local",) * 4 + ("global",)) * 16,
        num_heads=80,
        num_kv_heads=8,
        head_dim=128,
        sliding_window=1024,
        rope_theta_local=10000.0,
        rope_theta_global=None,
        qk_norm=True,
        attn_output_gate="separate",
        value_residual=True,
        norm_placement="peri",
        mlp_gate_clip_max=20.0,
        mlp_up_clip=20.0,
        embed_scale=math.sqrt(hidden),
        max_context=1048576,
        dtype="bfloat16",
        planning_only=True,
    )


ARCHITECTURE = Architecture(
    family="ripple",
    presets={"ripple-tiny": ripple_tiny, "ripple-65b": ripple_65b},
)
