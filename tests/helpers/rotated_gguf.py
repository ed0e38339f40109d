"""Write Hadamard-folded GGUF fixtures from unrotated models, with the prism.hadamard.* metadata.

Each listed weight is stored as W_s = W P^T D H (P: the tiled->grouped head
permutation where listed, D = diag(signs), H: the block WHT), the exact inverse
of what the runtime applies (y = W_s @ WHT(signs * P x) = W x). An
inverse-listed table stores rows z = H D e, undone at lookup by e = signs * WHT(z).
Rotated tensors are written as F32 (or F16); everything else is copied
byte for byte, quantization included.

    python tests/helpers/rotated_gguf.py smollm2-135m /tmp/smollm2-rotated.gguf
    python tests/helpers/rotated_gguf.py llama-tiny /tmp/llama-tiny-rotated.gguf --block-size 32
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import nn

from foldline.frontend import hadamard as H
from foldline.frontend.arch import get_preset
from foldline.frontend.config import ModelConfig
from foldline.frontend.gguf_file import GGUFFile
from foldline.frontend.model import CausalLM, build_model
from foldline.frontend.shipped import SHIPPED_MODELS, locate_shipped

# GGUF tensors whose activation is rotated (the measured qwen35 list, by suffix); ssm_alpha / ssm_beta stay plain.
FORWARD_SUFFIXES = (
    "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "attn_qkv.weight",
    "attn_gate.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "ssm_out.weight",
)
HEAD_NAME = "output.weight"
TABLE_NAME = "token_embd.weight"


# ---------------------------------------------------------------------------
# Unrotated tiny models as GGUF (llama family)
# ---------------------------------------------------------------------------


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order (adjacent-pair RoPE); the loader's `unpermute_rope_rows` undoes it."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)



# our parameter names -> llama.cpp's, per layer
LLAMA_LAYER_NAMES = {
    "input_norm.weight": "attn_norm.weight", "mixer.q_proj.weight": "attn_q.weight",
    "mixer.k_proj.weight": "attn_k.weight", "mixer.v_proj.weight": "attn_v.weight",
    "mixer.o_proj.weight": "attn_output.weight", "mlp_norm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def llama_gguf_tensors(params: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """A llama model's parameters under llama.cpp's GGUF names, Q/K rows permuted as its converter does."""
    tensors = {TABLE_NAME: params["embed_tokens.weight"], "output_norm.weight": params["norm.weight"]}
    if not cfg.tie_word_embeddings:
        tensors[HEAD_NAME] = params["lm_head.weight"]
    for i in range(cfg.num_layers):
        for src, dst in LLAMA_LAYER_NAMES.items():
            t = params[f"layers.{i}.{src}"]
            if dst == "attn_q.weight":
                t = permute_rope_rows(t, cfg.num_heads)
            elif dst == "attn_k.weight":
                t = permute_rope_rows(t, cfg.num_kv_heads)
            tensors[f"blk.{i}.{dst}"] = t
    return tensors

def write_llama_gguf(model: CausalLM, path: str | Path) -> Path:
    """An unrotated llama-family CausalLM (e.g. the seeded llama-tiny preset) as an F32 GGUF file."""
    cfg = model.cfg
    if cfg.family != "llama" or set(cfg.layer_types) != {"global"}:
        raise ValueError(f"write_llama_gguf writes llama models with global attention only, not {cfg.name!r}")
    path = Path(path)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(cfg.name)
    a = "llama."
    w.add_uint32(a + "block_count", cfg.num_layers)
    w.add_uint32(a + "context_length", cfg.max_context)
    w.add_uint32(a + "embedding_length", cfg.hidden_size)
    w.add_uint32(a + "feed_forward_length", cfg.intermediate_size)
    w.add_uint32(a + "attention.head_count", cfg.num_heads)
    w.add_uint32(a + "attention.head_count_kv", cfg.num_kv_heads)
    w.add_uint32(a + "vocab_size", cfg.vocab_size)
    w.add_float32(a + "attention.layer_norm_rms_epsilon", cfg.rms_eps)
    w.add_float32(a + "rope.freq_base", float(cfg.rope_theta_global))
    w.add_uint32(a + "rope.dimension_count", cfg.rope_for("global")[1])
    params = {n: p.detach().float().numpy() for n, p in model.named_parameters()}
    tensors = llama_gguf_tensors(params, cfg)
    for name, t in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
    _finish(w)
    return path


def _finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ---------------------------------------------------------------------------
# Rotating a GGUF file
# ---------------------------------------------------------------------------


def default_listing(tensor_names: list[str], tied: bool) -> tuple[list[str], list[str]]:
    """(weight_names, inverse_weight_names) the measured conventions fold, among these tensors."""
    forward = [n for n in tensor_names if n.endswith(FORWARD_SUFFIXES) or n == HEAD_NAME]
    inverse = [TABLE_NAME] if TABLE_NAME in tensor_names else []
    return forward, inverse


def qwen35_permutations(metadata: Mapping[str, object], names: list[str]) -> dict[str, H.Permutation]:
    """ssm_out reads GDN value heads in llama.cpp's tiled order: [hd=state_size, nk=group_count, rep]."""
    hd = metadata.get("qwen35.ssm.state_size")
    nk = metadata.get("qwen35.ssm.group_count")
    nv = metadata.get("qwen35.ssm.time_step_rank")
    if not (hd and nk and nv) or int(nv) // int(nk) <= 1:
        return {}
    return {n: H.Permutation(int(hd), int(nv) // int(nk)) for n in names if n.endswith("ssm_out.weight")}


def _copy_metadata(reader, writer) -> None:
    from gguf import GGUFValueType

    for key, fld in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.alignment"):
            continue
        if key.startswith(H.PREFIX):
            raise ValueError(f"{reader.path} already carries Hadamard metadata ({key}); refusing to rotate twice")
        main = GGUFValueType(fld.types[0])
        sub = GGUFValueType(fld.types[-1]) if main == GGUFValueType.ARRAY else None
        if main == GGUFValueType.ARRAY and len(fld.types) > 2:
            raise ValueError(f"nested array metadata {key!r} is not copied")
        writer.add_key_value(key, fld.contents(), main, sub_type=sub)


def _add_hadamard_fields(writer, meta: H.HadamardMetadata, extra: Mapping[str, object] | None = None) -> None:
    """The prism.hadamard.* keys; `extra` overrides or adds keys (tests write disagreeing files with it)."""
    from gguf import GGUFValueType

    fields = {**meta.to_gguf_fields(), **(extra or {})}
    for key, value in fields.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool) or not isinstance(value, (int, list)):
            raise ValueError(f"cannot write {key!r} = {value!r}")
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif all(isinstance(v, str) for v in value):
            writer.add_array(key, value)
        else:
            sub = GGUFValueType.INT8 if key == H.KEY_SIGN_VALUES else GGUFValueType.UINT32
            writer.add_key_value(key, [int(v) for v in value], GGUFValueType.ARRAY, sub_type=sub)


def rotate_gguf(
    src: str | Path,
    dst: str | Path,
    block_size: int = H.DEFAULT_BLOCK_SIZE,
    seed: int = 0,
    dtype: str = "f32",
    weight_names: list[str] | None = None,
    inverse_names: list[str] | None = None,
    extra_metadata: Mapping[str, object] | None = None,
) -> H.HadamardMetadata:
    """Write `dst`: `src` with its listed weights stored rotated and the prism.hadamard.* keys added."""

    if dtype not in ("f32", "f16"):
        raise ValueError(f"rotated tensors are written as f32 or f16, not {dtype!r}")
    reader = gguf.GGUFReader(str(src))
    with GGUFFile(src) as g:
        names = list(g.tensors)
        tied = HEAD_NAME not in g.tensors
        fwd, inv = default_listing(names, tied)
        fwd = fwd if weight_names is None else list(weight_names)
        inv = inv if inverse_names is None else list(inverse_names)
        perms = qwen35_permutations(g.metadata, fwd) if g.architecture == "qwen35" else {}
        widths = [g.tensors[n].shape[-1] for n in inv + fwd]
        meta = H.make_metadata(widths, fwd, inv, block_size=block_size, seed=seed, permutations=perms)
        writer = gguf.GGUFWriter(str(dst), g.architecture)
        _copy_metadata(reader, writer)
        _add_hadamard_fields(writer, meta, extra_metadata)
        listed = set(fwd) | set(inv)
        out_dtype = np.float32 if dtype == "f32" else np.float16
        for name in names:
            info = g.tensors[name]
            if name not in listed:
                if info.qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                    writer.add_tensor(name, g.dequantize(name).astype(
                        np.float32 if info.qtype == gguf.GGMLQuantizationType.F32 else np.float16))
                else:
                    writer.add_tensor(name, np.array(g.raw(name)), raw_dtype=gguf.GGMLQuantizationType(info.qtype))
                continue
            w = torch.from_numpy(g.dequantize(name)).reshape(-1, info.shape[-1])
            width = info.shape[-1]
            perm = perms.get(name)
            stored = H.rotate_weight(w, meta.signs_for(width, name), H.block_for_width(width, block_size),
                                     perm.head_dim if perm else 0, perm.rep if perm else 1)
            writer.add_tensor(name, stored.numpy().reshape(info.shape).astype(out_dtype))
        _finish(writer)
    return meta


# ---------------------------------------------------------------------------
# In-memory rotation (families without a GGUF writer here, e.g. qwen35-tiny)
# ---------------------------------------------------------------------------


def default_module_listing(model: nn.Module) -> tuple[list[str], list[str]]:
    """Module-name listing with the qwen35 conventions: every projection but the GDN gate inputs (a, b)."""
    forward = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not name.endswith(("in_proj_a", "in_proj_b")):
            forward.append(f"{name}.weight")
    return forward, ["embed_tokens.weight"]


def rotated_model(
    model: CausalLM, block_size: int = H.DEFAULT_BLOCK_SIZE, seed: int = 0, permute_gdn_out: bool = True,
) -> tuple[CausalLM, H.HadamardMetadata]:
    """A deep copy of an unrotated model with rotated stored weights and the rotation attached."""
    cfg = model.cfg
    fwd, inv = default_module_listing(model)
    perms = {}
    if permute_gdn_out and cfg.gdn_num_k_heads and cfg.gdn_num_v_heads // cfg.gdn_num_k_heads > 1:
        rep = cfg.gdn_num_v_heads // cfg.gdn_num_k_heads
        perms = {n: H.Permutation(cfg.gdn_head_v_dim, rep) for n in fwd if n.endswith("mixer.out_proj.weight")}
    params = dict(model.named_parameters())
    widths = [params[n].shape[-1] for n in inv + fwd]
    meta = H.make_metadata(widths, fwd, inv, block_size=block_size, seed=seed, permutations=perms)
    out = copy.deepcopy(model)
    stored = H.rotated_copy_of_weights(model, meta, name_map={})
    out_params = dict(out.named_parameters())
    with torch.no_grad():
        for name, t in stored.items():
            out_params[name].copy_(t)
    H.apply_hadamard_metadata(out, meta, name_map={})
    return out, meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="write a Hadamard-folded GGUF from an unrotated model")
    p.add_argument("source", help="a .gguf file, a shipped model name (smollm2-135m) or a llama preset (llama-tiny)")
    p.add_argument("output", type=Path)
    p.add_argument("--block-size", type=int, default=H.DEFAULT_BLOCK_SIZE)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--f16", action="store_true", help="store rotated tensors as F16 (default F32)")
    args = p.parse_args(argv)
    src = Path(args.source)
    if src.suffix != ".gguf":
        if args.source in SHIPPED_MODELS:
            src = locate_shipped(args.source)
        else:
            src = args.output.with_suffix(".unrotated.gguf")
            write_llama_gguf(build_model(get_preset(args.source)), src)
            print(f"unrotated {args.source} written to {src}")
    meta = rotate_gguf(src, args.output, args.block_size, args.seed, "f16" if args.f16 else "f32")
    print(f"{args.output}: {len(meta.weight_names)} rotated weight(s), {len(meta.inverse_names)} rotated table(s), "
          f"sign widths {list(meta.signs)}, block {meta.block_size}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
