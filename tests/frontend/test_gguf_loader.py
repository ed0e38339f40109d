"""GGUF loading on tiny files written with gguf.GGUFWriter: metadata, dequantization, errors."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from foldline.frontend.arch import get_preset
from foldline.frontend.arch.llama import unpermute_rope_rows
from foldline.frontend.gguf_file import (
    SUPPORTED_QUANTS,
    GGUFError,
    GGUFFile,
    MissingTensorError,
    UnsupportedArchitectureError,
    UnsupportedQuantError,
)
from foldline.frontend.gguf_loader import load_gguf, read_gguf_config
from foldline.frontend.model import build_model
from foldline.frontend.tokenizer import generate_spm_merges
from foldline.testing.parity import EagerRunner

Q = GGMLQuantizationType
# Types gguf can quantize in numpy: tested against the original floats as well as gguf's dequantizer.
QUANTIZABLE = {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1}


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (HF half rotation -> adjacent pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _new_writer(path: Path, arch: str) -> GGUFWriter:
    return GGUFWriter(str(path), arch)


def _finish(w: GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_tiny_llama(path: Path, *, arch: str = "llama", drop: str | None = None, tied: bool = True,
                     qtype: GGMLQuantizationType = Q.F32, raw_quant_tensor: GGMLQuantizationType | None = None,
                     extra: dict[str, np.ndarray] | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """A 2-layer llama-style GGUF laid out as llama.cpp writes it; returns the HF-layout weights."""
    cfg = get_preset("llama-tiny")
    rng = np.random.default_rng(seed)
    d, f, hq, hkv, hd, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 256
    w = _new_writer(path, arch)
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(d)
    w.add_feed_forward_length(f)
    w.add_head_count(hq)
    w.add_head_count_kv(hkv)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(hd)
    hf: dict[str, np.ndarray] = {}

    def tensor(name: str, shape: tuple[int, ...], store=None) -> None:
        if name == drop:
            return
        value = (rng.standard_normal(shape) * 0.2).astype(np.float32)
        hf[name] = value
        stored = store(value) if store is not None else value
        kind = qtype if len(shape) == 2 else Q.F32
        if kind == Q.F32:
            w.add_tensor(name, stored)
        else:
            w.add_tensor(name, gguf_quantize(stored, kind), raw_dtype=kind)

    tensor("token_embd.weight", (vocab, d))
    tensor("output_norm.weight", (d,))
    if not tied:
        tensor("output.weight", (vocab, d))
    for i in range(2):
        tensor(f"blk.{i}.attn_norm.weight", (d,))
        tensor(f"blk.{i}.attn_q.weight", (hq * hd, d), lambda x: llama_permute(x, hq))
        tensor(f"blk.{i}.attn_k.weight", (hkv * hd, d), lambda x: llama_permute(x, hkv))
        tensor(f"blk.{i}.attn_v.weight", (hkv * hd, d))
        tensor(f"blk.{i}.attn_output.weight", (d, hq * hd))
        tensor(f"blk.{i}.ffn_norm.weight", (d,))
        tensor(f"blk.{i}.ffn_gate.weight", (f, d))
        tensor(f"blk.{i}.ffn_up.weight", (f, d))
        if raw_quant_tensor is not None and i == 1:
            block, size = GGML_QUANT_SIZES[raw_quant_tensor]
            raw = rng.integers(0, 256, size=(d, f // block * size), dtype=np.uint8)
            w.add_tensor(f"blk.{i}.ffn_down.weight", raw, raw_dtype=raw_quant_tensor)
        else:
            tensor(f"blk.{i}.ffn_down.weight", (d, f))
    for name, value in (extra or {}).items():
        w.add_tensor(name, value)
    _finish(w)
    return hf


# ---- metadata ---------------------------------------------------------------------


def test_metadata_parser_agrees_with_gguf_reader(tmp_path):
    path = tmp_path / "meta.gguf"
    w = _new_writer(path, "llama")
    w.add_uint32("test.u32", 7)
    w.add_float32("test.f32", 0.25)
    w.add_bool("test.flag", True)
    w.add_string("test.text", "héllo ▁ world")
    w.add_array("test.strings", ["a", "", "東京", "  "])
    w.add_array("test.ints", [1, -2, 3])
    w.add_array("test.floats", [0.5, -1.5])
    w.add_tensor("x", np.arange(12, dtype=np.float32).reshape(3, 4))
    _finish(w)
    ours = GGUFFile(path)
    ref = GGUFReader(path)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        expected = field.contents()
        assert ours.metadata[key] == pytest.approx(expected) if isinstance(expected, float) else ours.metadata[key] == expected, key
    (t,) = ref.tensors
    assert ours.tensors["x"].shape == (3, 4)
    np.testing.assert_array_equal(ours.dequantize("x"), np.asarray(t.data))


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(GGUFError, match="not a GGUF file"):
        read_gguf_config(bad)


# ---- dequantization ----------------------------------------------------------------


def _blocks_for(qtype: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Raw bytes of a K-quant tensor with finite fp16 super-block scales (gguf has no numpy quantizer for them)."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = np.array([0.01], dtype=np.float16).view(np.uint8)
    if qtype in (Q.Q4_K, Q.Q5_K):  # d and dmin lead the block
        raw[..., 0:2] = scale
        raw[..., 2:4] = scale
    elif qtype == Q.Q6_K:  # d closes the block
        raw[..., size - 2 : size] = scale
    return raw.reshape(rows, cols // block * size)


@pytest.mark.parametrize("qtype", SUPPORTED_QUANTS, ids=lambda q: q.name)
def test_dequantize_matches_gguf(tmp_path, qtype):
    rng = np.random.default_rng(int(qtype))
    rows, cols = 3, 512
    original = rng.standard_normal((rows, cols)).astype(np.float32)
    if qtype in QUANTIZABLE:
        stored = gguf_quantize(original, qtype)
    else:
        stored = _blocks_for(qtype, rows, cols, rng)
    path = tmp_path / f"{qtype.name}.gguf"
    w = _new_writer(path, "llama")
    if qtype == Q.F32:
        w.add_tensor("t", stored)
    else:
        w.add_tensor("t", stored, raw_dtype=qtype)
    _finish(w)
    g = GGUFFile(path)
    assert g.tensors["t"].shape == (rows, cols)
    ours = g.dequantize("t")
    assert ours.dtype == np.float32 and ours.shape == (rows, cols)
    # Independent read of the same bytes through gguf's own reader and dequantizer.
    (ref_tensor,) = GGUFReader(path).tensors
    expected = gguf_dequantize(np.asarray(ref_tensor.data), qtype).reshape(rows, cols)
    np.testing.assert_array_equal(ours, expected)
    assert np.isfinite(ours).all()
    if qtype in QUANTIZABLE:
        # Within the format's step: 8-bit types ~1/127 of the block max, 4/5-bit ~1/7..1/15.
        bits = {Q.F32: 24, Q.F16: 11, Q.BF16: 8, Q.Q8_0: 7, Q.Q4_0: 3, Q.Q4_1: 3, Q.Q5_0: 4, Q.Q5_1: 4}[qtype]
        tol = np.abs(original).max() * 2.0**-bits
        assert np.abs(ours - original).max() <= tol


def test_quantized_model_loads_close_to_float_weights(tmp_path):
    path = tmp_path / "q8.gguf"
    hf = write_tiny_llama(path, qtype=Q.Q8_0)
    module = load_gguf(path).module
    got = module.layers[0].mlp.up_proj.weight.detach().numpy()
    ref = hf["blk.0.ffn_up.weight"]
    assert np.abs(got - ref).max() <= np.abs(ref).max() / 100


# ---- errors --------------------------------------------------------------------------


def test_unknown_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    write_tiny_llama(path, arch="mamba")
    with pytest.raises(UnsupportedArchitectureError, match="'mamba'.*llama, gemma3"):
        read_gguf_config(path)


def test_unsupported_quant_type(tmp_path):
    path = tmp_path / "q2k.gguf"
    write_tiny_llama(path, raw_quant_tensor=Q.Q2_K)
    with pytest.raises(UnsupportedQuantError, match=r"'blk\.1\.ffn_down\.weight'.*Q2_K"):
        load_gguf(path)


def test_missing_tensor(tmp_path):
    path = tmp_path / "missing.gguf"
    write_tiny_llama(path, drop="blk.1.ffn_up.weight")
    with pytest.raises(MissingTensorError, match=r"'blk\.1\.ffn_up\.weight'"):
        load_gguf(path)


def test_unexpected_tensor_is_an_error(tmp_path):
    path = tmp_path / "extra.gguf"
    write_tiny_llama(path, extra={"blk.0.attn_gate.weight": np.zeros((4, 64), np.float32)})
    with pytest.raises(GGUFError, match=r"'blk\.0\.attn_gate\.weight' has no place"):
        load_gguf(path)


# ---- llama conventions -------------------------------------------------------------------


def test_llama_config_and_tied_head(tmp_path):
    tied, untied = tmp_path / "tied.gguf", tmp_path / "untied.gguf"
    write_tiny_llama(tied, tied=True)
    write_tiny_llama(untied, tied=False)
    cfg = read_gguf_config(tied)
    assert cfg.tie_word_embeddings is True
    assert read_gguf_config(untied).tie_word_embeddings is False
    assert cfg.layer_types == ("global", "global")
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.rope_theta_global == 100000.0 and cfg.rms_eps == pytest.approx(1e-5)
    assert cfg.max_context == 256  # the trained context when none is asked for
    assert read_gguf_config(tied, max_context=64).max_context == 64
    loaded = load_gguf(untied)
    assert hasattr(loaded.module, "lm_head")
    assert not hasattr(load_gguf(tied).module, "lm_head")


def test_llama_rope_unpermute_is_exact_and_equivalent_to_interleaved(tmp_path):
    """Un-permuted Q/K with half rotation == the file's rows with adjacent-pair rotation."""
    path = tmp_path / "rope.gguf"
    hf = write_tiny_llama(path)
    loaded = load_gguf(path)
    q = loaded.module.layers[1].mixer.q_proj.weight.detach().numpy()
    np.testing.assert_array_equal(q, hf["blk.1.attn_q.weight"])
    k = loaded.module.layers[0].mixer.k_proj.weight.detach().numpy()
    np.testing.assert_array_equal(k, hf["blk.0.attn_k.weight"])
    np.testing.assert_array_equal(unpermute_rope_rows(llama_permute(k, 2), 2), k)

    # The same file, read the other way: raw rows + interleaved RoPE.
    cfg = loaded.config.replace(rope_interleaved=True)
    raw = build_model(cfg, seed=None)
    state = {n: p.detach().clone() for n, p in loaded.module.named_parameters()}
    g = GGUFFile(path)
    for i in range(2):
        state[f"layers.{i}.mixer.q_proj.weight"] = torch.from_numpy(g.dequantize(f"blk.{i}.attn_q.weight"))
        state[f"layers.{i}.mixer.k_proj.weight"] = torch.from_numpy(g.dequantize(f"blk.{i}.attn_k.weight"))
    raw.load_state_dict(state)
    prompt = np.random.default_rng(3).integers(0, cfg.vocab_size, size=21).tolist()
    a = EagerRunner(loaded.module, 8).prefill(prompt)
    b = EagerRunner(raw, 8).prefill(prompt)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # And a wrong convention would be visible: raw rows + half rotation differ.
    wrong = build_model(loaded.config, seed=None)
    wrong.load_state_dict(state)
    c = EagerRunner(wrong, 8).prefill(prompt)
    assert np.abs(a - c).max() > 1e-3


# ---- gemma3 ----------------------------------------------------------------------------------


def write_gemma3_meta(path: Path, pattern=None, blocks: int = 12) -> None:
    w = _new_writer(path, "gemma3")
    w.add_block_count(blocks)
    w.add_context_length(32768)
    w.add_embedding_length(640)
    w.add_feed_forward_length(2048)
    w.add_head_count(4)
    w.add_head_count_kv(1)
    w.add_key_length(256)
    w.add_value_length(256)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(512)
    if pattern is not None:
        if isinstance(pattern, list):
            w.add_array("gemma3.attention.sliding_window_pattern", pattern)
        else:
            w.add_uint32("gemma3.attention.sliding_window_pattern", pattern)
    w.add_bos_token_id(2)
    w.add_add_bos_token(True)
    w.add_eos_token_id(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 640), np.float32))
    _finish(w)


def test_gemma3_config_mapping(tmp_path):
    path = tmp_path / "g.gguf"
    write_gemma3_meta(path)
    cfg = read_gguf_config(path)
    assert cfg.family == "gemma3"
    assert cfg.layer_types == (("local",) * 5 + ("global",)) * 2
    assert cfg.sliding_window == 512
    assert (cfg.rope_theta_local, cfg.rope_theta_global) == (10000.0, 1_000_000.0)
    assert cfg.rope_interleaved is False
    assert cfg.softmax_scale == pytest.approx(256**-0.5)
    assert cfg.embed_scale == pytest.approx(math.sqrt(640)) and cfg.embed_scale_dtype == "float32"
    assert cfg.tie_word_embeddings and cfg.qk_norm and cfg.norm_placement == "peri"
    assert cfg.norm_weight_offset == 0.0  # the file stores 1 + w
    assert cfg.mlp_activation == "gelu_tanh"
    assert cfg.rms_eps == pytest.approx(1e-6)
    assert cfg.bos_token_id == 2 and cfg.eos_token_ids[0] == 1
    assert cfg.max_context == 8192  # the trained 32768, capped by default


def test_gemma3_explicit_layer_pattern(tmp_path):
    period = tmp_path / "p.gguf"
    write_gemma3_meta(period, pattern=3, blocks=6)
    assert read_gguf_config(period).layer_types == ("local", "local", "global") * 2
    flags = tmp_path / "f.gguf"
    write_gemma3_meta(flags, pattern=[True, False, True, True], blocks=4)
    assert read_gguf_config(flags).layer_types == ("local", "global", "local", "local")


# ---- tokenizer pieces -----------------------------------------------------------------------


def test_spm_merges_follow_merged_token_rank():
    vocab = {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4, "abc": 5}
    order = {t: -i for t, i in vocab.items()}  # earlier token = better
    merges = generate_spm_merges(vocab, order)
    assert merges[0] == ("a", "b")
    assert merges.index(("b", "c")) < merges.index(("ab", "c"))
    assert set(merges) == {("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")}
