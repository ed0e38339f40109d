"""ModelConfig: every architectural choice of a hybrid model as a field.

The reference modules read only this object; nothing about a family is assumed
in code. Each architecture's presets and checkpoint mappings live in
`frontend/arch/<family>.py`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from ..dtypes import FLOAT_DTYPES
from ..errors import FoldlineError

LAYER_KINDS = ("global", "local", "gdn")

# The context a bundle supports when the user names none: the model's trained context, capped.
# Attention work follows the tokens held (kv_tiles), but the caches are allocated whole:
# 8192 tokens of SmolLM2-135M hold 189 MB of f16 K/V, Qwen3.5's 262144 would hold gigabytes.
DEFAULT_CONTEXT_CAP = 8192


def default_max_context(trained: int | None) -> int:
    """max_context when none is given: the trained context, at most DEFAULT_CONTEXT_CAP."""
    return min(trained, DEFAULT_CONTEXT_CAP) if trained else DEFAULT_CONTEXT_CAP
GDN_L2NORMS = ("hf", "ggml")


class ConfigError(FoldlineError, ValueError):
    """A config that cannot describe a model foldline can build."""


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only hybrid language model.

    `layer_types[i]` is "global" (full causal attention, full KV history),
    "local" (sliding-window attention) or "gdn" (gated delta net recurrence).
    """

    name: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]

    # Attention geometry.
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    # How query head h finds its KV head: "blocked" (h // rep) or "interleaved" (h % n_kv).
    kv_mapping: str = "blocked"
    sliding_window: int = 0
    # Softmax scale; None means head_dim ** -0.5.
    attn_scale: float | None = None

    # Positions: RoPE base and rotary width per attention kind. base None = NoPE.
    rope_theta_local: float | None = 10000.0
    rope_theta_global: float | None = 10000.0
    rotary_dim_local: int | None = None  # None = full head
    rotary_dim_global: int | None = None
    rope_scaling_factor_global: float = 1.0  # linear position scaling (Gemma 3 >= 1B)
    rope_interleaved: bool = False  # False: rotate halves (HF/NEOX); True: adjacent pairs

    # Per-head RMSNorm on q and k, applied before RoPE.
    qk_norm: bool = False
    # Output gate: "none", "separate" (own projection, Ripple) or "fused_q"
    # (q_proj emits [q, gate] per head, Qwen3.5 / Qwen3-Next).
    attn_output_gate: str = "none"
    gate_fp32: bool = True
    # Ripple's value residual: v = W_V((1-a) e + a h), a = sigmoid(lambda_layer).
    value_residual: bool = False
    attn_bias: bool = False

    # Norms: "pre" (Llama), "peri" (pre and post around attention and MLP;
    # Ripple's PeriNorm and Gemma's sandwich norm are both this placement).
    norm_placement: str = "pre"
    # RMSNorm weight form: 0.0 -> x*w, 1.0 -> x*(1+w) (Gemma, Qwen3.5).
    norm_weight_offset: float = 0.0
    rms_eps: float = 1e-6

    # MLP.
    mlp_activation: str = "silu"  # "silu" or "gelu_tanh"
    mlp_gate_clip_max: float | None = None  # Ripple: 20 (clip above only)
    mlp_up_clip: float | None = None  # Ripple: 20 (clip to [-c, c])

    # Embedding and head.
    embed_scale: float = 1.0
    # Gemma casts its normalizer to the model dtype before multiplying.
    embed_scale_dtype: str | None = None
    tie_word_embeddings: bool = False
    final_logit_softcap: float | None = None

    # Gated delta net (used by "gdn" layers).
    gdn_num_k_heads: int = 0
    gdn_num_v_heads: int = 0
    gdn_head_k_dim: int = 0
    gdn_head_v_dim: int = 0
    gdn_conv_kernel: int = 4
    # v head h reads k head: "interleaved" (h % n_k, llama.cpp qwen35) or
    # "blocked" (h // rep, HF Qwen3-Next repeat_interleave).
    gdn_kv_mapping: str = "blocked"
    # Gated RMSNorm epsilon: "plain" (rms_eps, HF) or "scaled" (rms_eps * head_v_dim).
    gdn_norm_eps: str = "plain"
    # q/k L2 norm: "hf" (x * rsqrt(sum x^2 + 1e-6), HF / FLA) or "ggml" (x / max(|x|, rms_eps)).
    gdn_l2norm: str = "hf"

    # Compile-time limits (not architecture, but they fix the static shapes).
    max_context: int = 256
    dtype: str = "float32"
    # Attention K/V cache element type; None: the compute dtype. float16 halves the caches.
    kv_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # A published config kept for `foldline plan` only: never built or compiled.
    planning_only: bool = False
    # Provenance only (source file, trained context): nothing here changes the numbers.
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        self.validate()

    # ---- derived ---------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    def rope_for(self, kind: str) -> tuple[float | None, int, float]:
        """(base, rotary width, position scale) for an attention kind; base None = NoPE."""
        if kind == "local":
            base, rot, scale = self.rope_theta_local, self.rotary_dim_local, 1.0
        else:
            base, rot, scale = (
                self.rope_theta_global,
                self.rotary_dim_global,
                self.rope_scaling_factor_global,
            )
        return base, (rot if rot is not None else self.head_dim), scale

    @property
    def cache_dtype(self) -> str:
        """The element type of the attention K/V caches."""
        return self.kv_dtype or self.dtype

    def auto_cache_dtype(self, quantized_weights: bool) -> str:
        """The K/V cache type `--kv-dtype auto` picks: float16 beside block-quantized weights
        (half the bytes, rounding far below the weights' own, as llama.cpp does), else cache_dtype."""
        return "float16" if quantized_weights and self.dtype == "float32" else self.cache_dtype

    def layers_of(self, kind: str) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == kind]

    @property
    def gdn_key_width(self) -> int:
        return self.gdn_num_k_heads * self.gdn_head_k_dim

    @property
    def gdn_value_width(self) -> int:
        return self.gdn_num_v_heads * self.gdn_head_v_dim

    @property
    def gdn_conv_channels(self) -> int:
        return 2 * self.gdn_key_width + self.gdn_value_width

    # ---- checks ----------------------------------------------------------
    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(f"config {self.name!r}: {msg}")

        need(len(self.layer_types) > 0, "no layers")
        for t in self.layer_types:
            need(t in LAYER_KINDS, f"unknown layer type {t!r} (expected one of {LAYER_KINDS})")
        attn = [t for t in self.layer_types if t != "gdn"]
        if attn:
            need(self.num_heads % self.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads")
            need(self.kv_mapping in ("blocked", "interleaved"), f"bad kv_mapping {self.kv_mapping!r}")
            for kind in ("local", "global"):
                _, rot, _ = self.rope_for(kind)
                need(rot % 2 == 0 and rot <= self.head_dim, f"rotary width {rot} for {kind} layers")
        if "local" in self.layer_types:
            need(self.sliding_window > 0, "local layers need sliding_window > 0")
        need(self.attn_output_gate in ("none", "separate", "fused_q"), f"bad attn_output_gate {self.attn_output_gate!r}")
        need(self.norm_placement in ("pre", "peri"), f"bad norm_placement {self.norm_placement!r}")
        need(self.mlp_activation in ("silu", "gelu_tanh"), f"bad mlp_activation {self.mlp_activation!r}")
        need(self.dtype in FLOAT_DTYPES, f"bad dtype {self.dtype!r} (expected one of {FLOAT_DTYPES})")
        if "gdn" in self.layer_types:
            need(self.gdn_num_k_heads > 0 and self.gdn_num_v_heads % self.gdn_num_k_heads == 0,
                 "gdn_num_v_heads must be a positive multiple of gdn_num_k_heads")
            need(self.gdn_kv_mapping in ("blocked", "interleaved"), f"bad gdn_kv_mapping {self.gdn_kv_mapping!r}")
            need(self.gdn_norm_eps in ("plain", "scaled"), f"bad gdn_norm_eps {self.gdn_norm_eps!r}")
            need(self.gdn_l2norm in GDN_L2NORMS, f"bad gdn_l2norm {self.gdn_l2norm!r} (expected one of {GDN_L2NORMS})")
        need(self.kv_dtype is None or self.kv_dtype in FLOAT_DTYPES, f"bad kv_dtype {self.kv_dtype!r}")
        need(self.max_context > 0, "max_context must be positive")

    # ---- (de)serialisation -----------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown config fields: {sorted(unknown)}")
        d = dict(d)
        d["layer_types"] = tuple(d["layer_types"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)
