"""Qwen3.5 / qwen35 (Bonsai): 3 gated-delta-net : 1 full attention, partial RoPE, gated attention output.

HF conventions (Qwen3_5ForCausalLM) are the reference modules' own: GDN value
heads read key heads blocked (h // rep), plain gated-norm epsilon, (1 + w) norms.

What llama.cpp's converter (`conversion/qwen.py`, `Qwen3_5TextModel` on top of
`_LinearAttentionVReorderBase` and `Qwen3NextModel`) does to an HF Qwen3.5
checkpoint, and how it is read back here:

- every `*norm.weight` except the GDN gated norm is stored as `1 + w`: the
  module uses `x * w` (norm_weight_offset 0) on the stored values;
- `A_log` is stored as `ssm_a = -exp(A_log)`: read back as `log(-ssm_a)`;
- `dt_bias` becomes `ssm_dt.bias`; `conv1d.weight [ch, 1, K]` is squeezed to
  `ssm_conv1d.weight` (numpy `[ch, K]`, our layout);
- the GDN value heads are reordered from grouped-by-key-head (HF) to tiled
  order (v rows of `in_proj_qkv` and `conv1d`, `in_proj_z`, `in_proj_a/b`,
  `A_log`, `dt_bias`, `out_proj` columns). The file order is kept, and the
  config says `gdn_kv_mapping="interleaved"` (v head h reads k head h % Hk),
  which is exactly llama.cpp's `ggml_repeat`. Keeping the file order is also
  what Hadamard-folded files need: their `ssm_out` rotation is defined on the
  tiled activation;
- attention weights are not permuted (NEOX rotation, as HF); `attn_q` keeps
  HF's per-head `[q | gate]` rows (`attn_output_gate="fused_q"`);
- `post_attention_layernorm` is `post_attention_norm` (the pre-MLP norm).

Multi-token-prediction blocks (`qwen35.nextn_predict_layers`, stored after the
trunk layers) are not part of next-token inference and are skipped.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..config import ModelConfig
from ..gguf_file import GGUFError, GGUFFile
from ..gguf_meta import common_fields
from ..hf_config import HFLoadError, layer_types, mlp_activation, rope_params
from ..hf_config import common_fields as hf_common_fields
from .base import Architecture


def qwen35_tiny() -> ModelConfig:
    """Qwen3.5 / qwen35's block at small size: 2 x (3 GDN + 1 full attention).

    Conventions as HF transformers' Qwen3_5ForCausalLM: partial RoPE (a quarter of
    the head), q/k norm before RoPE, q_proj emitting [q, gate] per head, (1+w)
    norms, GDN value heads reading key heads blocked (h // rep) with a plain
    gated-norm epsilon. RoPE base 1e4 rather than 1e7 so short test prompts
    still rotate measurably.
    """
    return ModelConfig(
        name="qwen35-tiny",
        family="qwen35",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        layer_types=("gdn", "gdn", "gdn", "global") * 2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        kv_mapping="blocked",
        rope_theta_global=10000.0,
        rotary_dim_global=8,
        qk_norm=True,
        attn_output_gate="fused_q",
        gate_fp32=False,
        norm_placement="pre",
        norm_weight_offset=1.0,
        rms_eps=1e-6,
        mlp_activation="silu",
        tie_word_embeddings=False,
        gdn_num_k_heads=2,
        gdn_num_v_heads=4,
        gdn_head_k_dim=16,
        gdn_head_v_dim=16,
        gdn_conv_kernel=4,
        gdn_kv_mapping="blocked",
        gdn_norm_eps="plain",
        max_context=128,
    )



# ---- HF config.json -------------------------------------------------------


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


def config_from_hf(raw: dict[str, Any], name: str, max_context: int | None) -> ModelConfig:
    """Qwen3_5ForCausalLM (qwen3_5_text) or the text tower of the multimodal qwen3_5 checkpoint."""
    raw = _text_config(raw)
    rope = raw.get("rope_parameters") or {}
    theta, scale = rope_params(rope, raw.get("rope_theta", 10_000_000.0), name)
    if scale != 1.0:
        raise HFLoadError(f"{name}: RoPE scaling is not supported for qwen3_5")
    common = hf_common_fields(raw, name, max_context)
    factor = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25)))
    rotary = int(common["head_dim"] * factor)
    if raw.get("linear_conv_kernel_dim", 4) < 2:
        raise HFLoadError(f"{name}: linear_conv_kernel_dim must be >= 2")
    return ModelConfig(
        family="qwen35",
        layer_types=layer_types(raw, name, 4),
        rope_theta_global=theta,
        rotary_dim_global=rotary,
        qk_norm=True,
        attn_output_gate="fused_q",
        gate_fp32=False,  # HF multiplies by sigmoid(gate) in the model dtype
        norm_placement="pre",
        norm_weight_offset=1.0,
        mlp_activation=mlp_activation(raw, name),
        gdn_num_k_heads=raw.get("linear_num_key_heads", 16),
        gdn_num_v_heads=raw.get("linear_num_value_heads", 32),
        gdn_head_k_dim=raw.get("linear_key_head_dim", 128),
        gdn_head_v_dim=raw.get("linear_value_head_dim", 128),
        gdn_conv_kernel=raw.get("linear_conv_kernel_dim", 4),
        gdn_kv_mapping="blocked",  # HF repeat_interleave over k heads
        gdn_norm_eps="plain",
        **common,
    )


# ---- GGUF ----------------------------------------------------------------------

_GLOBAL = {
    "embed_tokens.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_COMMON_LAYER = {
    "input_norm.weight": "attn_norm.weight",
    "mlp_norm.weight": "post_attention_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_ATTENTION = {
    "mixer.q_proj.weight": "attn_q.weight",
    "mixer.k_proj.weight": "attn_k.weight",
    "mixer.v_proj.weight": "attn_v.weight",
    "mixer.o_proj.weight": "attn_output.weight",
    "mixer.q_norm.weight": "attn_q_norm.weight",
    "mixer.k_norm.weight": "attn_k_norm.weight",
}
_GDN = {
    "mixer.in_proj_qkv.weight": "attn_qkv.weight",
    "mixer.in_proj_z.weight": "attn_gate.weight",
    "mixer.in_proj_b.weight": "ssm_beta.weight",
    "mixer.in_proj_a.weight": "ssm_alpha.weight",
    "mixer.conv1d_weight": "ssm_conv1d.weight",
    "mixer.dt_bias": "ssm_dt.bias",
    "mixer.A_log": "ssm_a",
    "mixer.norm.weight": "ssm_norm.weight",
    "mixer.out_proj.weight": "ssm_out.weight",
}


def _trunk_layers(g: GGUFFile) -> int:
    """Decoder layers that run at inference: block_count less the trailing MTP blocks."""
    return int(g.require("block_count")) - int(g.arch_key("nextn_predict_layers", 0) or 0)


def qwen35_layer_types(g: GGUFFile, layers: int) -> tuple[str, ...]:
    """GDN vs full attention per layer: the explicit recurrent_layers list, else every Nth is attention."""
    recurrent = g.arch_key("attention.recurrent_layers")
    if isinstance(recurrent, list):
        if len(recurrent) < layers:
            raise GGUFError(f"{g.path}: recurrent_layers has {len(recurrent)} entries for {layers} layers")
        return tuple("gdn" if r else "global" for r in recurrent[:layers])
    interval = int(g.arch_key("full_attention_interval", 4))
    if interval <= 0:
        raise GGUFError(f"{g.path}: full_attention_interval {interval} must be positive")
    return tuple("global" if (i + 1) % interval == 0 else "gdn" for i in range(layers))


def config_from_gguf(g: GGUFFile, max_context: int | None = None) -> ModelConfig:
    """The ModelConfig of a qwen35 file, in the file's own (llama.cpp) conventions."""
    c = common_fields(g, max_context)
    layers = _trunk_layers(g)
    n_k = int(g.require("ssm.group_count"))
    n_v = int(g.require("ssm.time_step_rank"))
    inner = int(g.require("ssm.inner_size"))
    if n_v <= 0 or inner % n_v:
        raise GGUFError(f"{g.path}: ssm.inner_size {inner} is not a multiple of ssm.time_step_rank {n_v}")
    rot = int(g.arch_key("rope.dimension_count", c["head_dim"]))
    sections = g.arch_key("rope.dimension_sections")
    if isinstance(sections, list) and any(sections[3:]):
        # Only then do the M-RoPE streams differ on text: the fourth carries no text position.
        raise GGUFError(f"{g.path}: rope.dimension_sections {sections} with a non-empty 4th section")
    scale = float(g.arch_key("rope.scaling.factor", 1.0) or 1.0)
    if g.arch_key("rope.scaling.type") not in (None, "none") and scale != 1.0:
        raise GGUFError(f"{g.path}: RoPE scaling is not supported for qwen35")
    return ModelConfig(
        **c,
        layer_types=qwen35_layer_types(g, layers),
        rope_theta_global=float(g.arch_key("rope.freq_base", 10_000_000.0)),
        rotary_dim_global=rot,
        rope_interleaved=False,  # NEOX halves; all M-RoPE sections see the same text position
        qk_norm=True,
        attn_output_gate="fused_q",
        gate_fp32=False,
        norm_placement="pre",
        norm_weight_offset=0.0,  # stored weights are already 1 + w
        mlp_activation="silu",
        gdn_num_k_heads=n_k,
        gdn_num_v_heads=n_v,
        gdn_head_k_dim=int(g.require("ssm.state_size")),
        gdn_head_v_dim=inner // n_v,
        gdn_conv_kernel=int(g.require("ssm.conv_kernel")),
        gdn_kv_mapping="interleaved",  # value heads stored in tiled order by the converter
        gdn_norm_eps="plain",  # llama.cpp's build_norm_gated uses rms_eps (checked, docs/gdn.md)
        # llama.cpp's GDN q/k norm is x * rsqrt(sum x^2 + rms_eps) (build_gdn_l2_norm); HF's uses a
        # fixed 1e-6, which is the same expression for every released Qwen3.5 (rms_eps 1e-6).
        gdn_l2norm="hf",
    )


def gguf_tensor_names(cfg: ModelConfig) -> dict[str, str]:
    """module parameter name -> GGUF tensor name for every parameter of a qwen35 module."""
    out = {k: v for k, v in _GLOBAL.items() if not (k == "lm_head.weight" and cfg.tie_word_embeddings)}
    for i, kind in enumerate(cfg.layer_types):
        table = {**_COMMON_LAYER, **(_GDN if kind == "gdn" else _ATTENTION)}
        out.update({f"layers.{i}.{p}": f"blk.{i}.{t}" for p, t in table.items()})
    return out


def gguf_skip_tensor(name: str, cfg: ModelConfig) -> bool:
    """MTP tensors: anything in a block past the trunk."""
    trunk_layers = cfg.num_layers
    if not name.startswith("blk."):
        return False
    return int(name.split(".", 2)[1]) >= trunk_layers


def gguf_tensor_value(tensor_name: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Undo the converter's value transforms (norm `1 + w` is kept; the module reads it as is)."""
    if tensor_name.endswith(".ssm_a"):
        if not np.all(w < 0):
            raise GGUFError(f"tensor {tensor_name!r} must be -exp(A_log) < 0, got max {float(w.max())}")
        return np.log(-w).astype(np.float32)
    return w


# ---- HF <-> file layout (used by tests to check the mapping tensor by tensor) ----


def grouped_to_tiled(x: np.ndarray, axis: int, n_k: int, rep: int, head_dim: int) -> np.ndarray:
    """The converter's `_reorder_v_heads`: value heads grouped by key head -> tiled order."""
    x = np.moveaxis(x, axis, 0)
    rest = x.shape[1:]
    y = x.reshape(n_k, rep, head_dim, *rest).swapaxes(0, 1).reshape(x.shape)
    return np.moveaxis(y, 0, axis)


def tiled_to_grouped(x: np.ndarray, axis: int, n_k: int, rep: int, head_dim: int) -> np.ndarray:
    """Inverse of grouped_to_tiled."""
    x = np.moveaxis(x, axis, 0)
    rest = x.shape[1:]
    y = x.reshape(rep, n_k, head_dim, *rest).swapaxes(0, 1).reshape(x.shape)
    return np.moveaxis(y, 0, axis)


ARCHITECTURE = Architecture(
    family="qwen35",
    presets={"qwen35-tiny": qwen35_tiny},
    hf_model_types=("qwen3_5_text", "qwen3_5"),
    config_from_hf=config_from_hf,
    hf_layer_renames={"input_layernorm": "input_norm", "post_attention_layernorm": "mlp_norm"},
    gguf_architecture="qwen35",
    config_from_gguf=config_from_gguf,
    gguf_tensor_names=gguf_tensor_names,
    gguf_tensor_value=gguf_tensor_value,
    gguf_skip_tensor=gguf_skip_tensor,
)
