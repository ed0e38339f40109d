"""GGUF metadata shared by the architectures: common hyperparameters and llama.cpp's tensor names.

Architecture modules (`frontend/arch/`) build their configs from these
helpers and add what is specific to them.
"""

from __future__ import annotations

from typing import Any

from .config import ModelConfig, default_max_context
from .gguf_file import GGUFError, GGUFFile


def scalar_heads(g: GGUFFile, key: str) -> int:
    value = g.require(key)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise GGUFError(f"{g.path}: per-layer {g.architecture}.{key} {value} is not supported")
        value = value[0]
    return int(value)


def _eos_ids(g: GGUFFile, tokens: list[str] | None) -> tuple[int, ...]:
    """EOS plus end-of-turn: generation must stop on either (llama.cpp's end-of-generation set)."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        if (value := g.get(key)) is not None and int(value) not in ids:
            ids.append(int(value))
    if tokens is not None:
        for text in ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
            if text in tokens and tokens.index(text) not in ids:
                ids.append(tokens.index(text))
    return tuple(ids)


def _bos_id(g: GGUFFile) -> int | None:
    """The BOS id the runtime prepends, or None when the tokenizer adds none."""
    bos = g.get("tokenizer.ggml.bos_token_id")
    add = g.get("tokenizer.ggml.add_bos_token")
    if add is None:  # llama.cpp's default: SentencePiece vocabularies add BOS
        add = g.get("tokenizer.ggml.model") == "llama"
    return int(bos) if bos is not None and add else None


def rope_scaling(g: GGUFFile) -> float:
    kind = g.arch_key("rope.scaling.type")
    factor = float(g.arch_key("rope.scaling.factor", 1.0) or 1.0)
    if kind in (None, "none") or factor == 1.0:
        return 1.0
    if kind != "linear":
        raise GGUFError(f"{g.path}: RoPE scaling {kind!r} is not supported (only linear)")
    return factor


def common_fields(g: GGUFFile, max_context: int | None) -> dict[str, Any]:
    """The ModelConfig fields every llama.cpp architecture stores the same way.

    max_context None: the trained context, capped (config.default_max_context).
    """
    arch = g.architecture
    hidden = int(g.require("embedding_length"))
    heads = scalar_heads(g, "attention.head_count")
    kv_heads = scalar_heads(g, "attention.head_count_kv") if g.arch_key("attention.head_count_kv") else heads
    head_dim = int(g.arch_key("attention.key_length", hidden // heads))
    value_dim = int(g.arch_key("attention.value_length", head_dim))
    if value_dim != head_dim:
        raise GGUFError(f"{g.path}: value head width {value_dim} != key head width {head_dim} is not supported")
    tokens = g.get("tokenizer.ggml.tokens")
    vocab = g.arch_key("vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:
        vocab = g.info("token_embd.weight").shape[0]
    trained_ctx = int(g.arch_key("context_length", 0) or 0)
    ctx = max_context if max_context is not None else default_max_context(trained_ctx or None)
    name = g.get("general.name") or g.path.stem
    return dict(
        name=str(name),
        family=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(g.require("feed_forward_length")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        kv_mapping="blocked",
        rms_eps=float(g.require("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in g.tensors,
        attn_bias="blk.0.attn_q.bias" in g.tensors,
        max_context=int(ctx),
        dtype="float32",
        bos_token_id=_bos_id(g),
        eos_token_ids=_eos_ids(g, tokens),
        extra={"gguf": str(g.path), "trained_context": trained_ctx},
    )


# llama.cpp's per-layer tensor names -> the reference module's parameter names
# (attention layers of llama, gemma3 and their relatives).
STANDARD_LAYER_TENSORS = {
    "attn_norm.weight": "input_norm.weight",
    "attn_q.weight": "mixer.q_proj.weight",
    "attn_k.weight": "mixer.k_proj.weight",
    "attn_v.weight": "mixer.v_proj.weight",
    "attn_q.bias": "mixer.q_proj.bias",
    "attn_k.bias": "mixer.k_proj.bias",
    "attn_v.bias": "mixer.v_proj.bias",
    "attn_output.weight": "mixer.o_proj.weight",
    "attn_q_norm.weight": "mixer.q_norm.weight",
    "attn_k_norm.weight": "mixer.k_norm.weight",
    "post_attention_norm.weight": "post_mixer_norm.weight",
    "ffn_norm.weight": "mlp_norm.weight",
    "post_ffw_norm.weight": "post_mlp_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
STANDARD_GLOBAL_TENSORS = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}


def standard_tensor_names(cfg: ModelConfig, parameter_names: list[str]) -> dict[str, str]:
    """module parameter name -> GGUF tensor name through the standard tables; unknown names are errors."""
    inverse_layer = {v: k for k, v in STANDARD_LAYER_TENSORS.items()}
    inverse_global = {v: k for k, v in STANDARD_GLOBAL_TENSORS.items()}
    out = {}
    for name in parameter_names:
        if name.startswith("layers."):
            _, idx, rest = name.split(".", 2)
            if rest not in inverse_layer:
                raise GGUFError(f"no GGUF tensor is known for parameter {name!r} of a {cfg.family} model")
            out[name] = f"blk.{idx}.{inverse_layer[rest]}"
        else:
            if name not in inverse_global:
                raise GGUFError(f"no GGUF tensor is known for parameter {name!r} of a {cfg.family} model")
            out[name] = inverse_global[name]
    return out
