"""Parity with code nobody here wrote: tiny random HF transformers models vs our modules.

Each model is built from a seeded HF config, its weights re-randomised at scales
where every convention matters (norm weights away from identity, decays spread
over (0, 1)), saved with save_pretrained, read back through load_hf_dir and
compared with HF eager on a prompt longer than one prefill chunk plus decode
steps that follow HF's own greedy tokens.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from foldline.frontend import gdn_ops  # noqa: E402
from foldline.frontend.hf_loader import HFLoadError, load_hf_dir, read_hf_config  # noqa: E402
from foldline.testing.parity import SCALED_TOL_FP32, EagerRunner  # noqa: E402

CHUNK = 16
PROMPT_LEN = 40  # > 2 chunks: the last one is padded
DECODE_STEPS = 8


def _qwen35(seed: int):
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        max_position_embeddings=256, tie_word_embeddings=False,
    )
    return transformers.Qwen3_5ForCausalLM(cfg)


def _llama(seed: int):
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        max_position_embeddings=256, tie_word_embeddings=True,
    )
    return transformers.LlamaForCausalLM(cfg)


def _gemma3(seed: int):
    cfg = transformers.Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=8, final_logit_softcapping=30.0, max_position_embeddings=256,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 2.0},
        },
    )
    return transformers.Gemma3ForCausalLM(cfg)


BUILDERS = {"qwen35": _qwen35, "llama": _llama, "gemma3": _gemma3}


@torch.no_grad()
def _randomize(model, family: str, seed: int) -> None:
    """Weights at scales where a wrong convention shows (HF's own init is near-degenerate)."""
    gen = torch.Generator().manual_seed(seed)
    centred_norms = family in ("qwen35", "gemma3")  # (1 + w) norms, w stored around 0
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape).uniform_(0.05, 3.0, generator=gen).log())
        elif name.endswith("dt_bias"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        elif "conv1d" in name:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.4)
        elif "norm" in name:
            plain = name.endswith("linear_attn.norm.weight") or not centred_norms
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if plain else 0.0))
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if family != "gemma3" else 0.1))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))


def make_hf_dir(family: str, root: Path, seed: int = 0,
                dtype: torch.dtype = torch.float32) -> tuple[Path, torch.nn.Module]:
    """A saved tiny HF checkpoint (config.json `dtype` follows `dtype`) and the model in that dtype."""
    torch.manual_seed(seed)
    model = BUILDERS[family](seed).float().eval()
    _randomize(model, family, seed)
    model = model.to(dtype)
    out = root / (f"hf-{family}" if dtype == torch.float32 else f"hf-{family}-{str(dtype).split('.')[-1]}")
    model.save_pretrained(out)
    return out, model


@torch.no_grad()
def hf_reference(model, prompt: list[int], steps: int) -> tuple[list[np.ndarray], list[int]]:
    """HF eager logits after the prompt and after each greedy step (HF's own cache)."""
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    logits = [out.logits[0, -1].float().numpy()]
    tokens = []
    cache = out.past_key_values
    for _ in range(steps):
        tok = int(np.argmax(logits[-1]))
        tokens.append(tok)
        out = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits.append(out.logits[0, -1].float().numpy())
    return logits, tokens


def _scaled(ours: np.ndarray, ref: np.ndarray, scale: np.ndarray) -> float:
    return float((np.abs(ours.astype(np.float64) - ref) / np.maximum(scale, 1e-30)).max())


def _prompt(vocab: int, seed: int = 3) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, size=PROMPT_LEN).tolist()


@pytest.mark.parametrize("family", ["qwen35", "llama", "gemma3"])
def test_hf_dir_eager_matches_hf(tmp_path, family):
    path, hf = make_hf_dir(family, tmp_path)
    loaded = load_hf_dir(path, max_context=128)
    assert loaded.config.family == family
    prompt = _prompt(loaded.config.vocab_size)
    ref_logits, ref_tokens = hf_reference(hf, prompt, DECODE_STEPS)

    runner = EagerRunner(loaded.module, CHUNK)
    ours = [runner.prefill(prompt)]
    errors = [_scaled(ours[0], ref_logits[0], runner.term_scale())]
    for tok, ref in zip(ref_tokens, ref_logits[1:]):
        ours.append(runner.decode(tok))
        errors.append(_scaled(ours[-1], ref, runner.term_scale()))
    print(f"{family} eager vs HF: worst scaled error {max(errors):.2e} over {len(errors)} steps")
    assert max(errors) < SCALED_TOL_FP32, errors
    assert [int(np.argmax(x)) for x in ours[:-1]] == ref_tokens
    # The comparison is not trivially satisfied: logits vary across steps.
    assert np.ptp(ref_logits[0]) > 0.5


def test_gdn_op_matches_hf_delta_rule_kernels():
    """Our chunk / step kernels vs HF's torch chunked and recurrent gated delta rule."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hfq

    gen = torch.Generator().manual_seed(11)
    b, c, h, dk, dv = 1, 24, 3, 8, 12
    q, k = torch.randn(b, c, h, dk, generator=gen), torch.randn(b, c, h, dk, generator=gen)
    v = torch.randn(b, c, h, dv, generator=gen)
    g = -torch.rand(b, c, h, generator=gen)  # log decay
    beta = torch.sigmoid(torch.randn(b, c, h, generator=gen))
    s0_hf = torch.randn(b, h, dk, dv, generator=gen)  # HF keeps S^T: [B, H, Dk, Dv]

    qn = hfq.l2norm(q, dim=-1, eps=1e-6)
    kn = hfq.l2norm(k, dim=-1, eps=1e-6)
    args = [x.transpose(1, 2) for x in (qn, kn, v, g, beta)]
    n_valid = torch.tensor([c])
    o, s = gdn_ops.gdn_chunk_impl(*args, s0_hf.transpose(-1, -2), n_valid, dk**-0.5)
    for fn in (hfq.torch_chunk_gated_delta_rule, hfq.torch_recurrent_gated_delta_rule):
        o_hf, s_hf = fn(q, k, v, g=g, beta=beta, initial_state=s0_hf.clone(), output_final_state=True,
                        use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o.transpose(1, 2), o_hf, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(s, s_hf.transpose(-1, -2), rtol=1e-4, atol=1e-5)


def test_read_hf_config_qwen35(tmp_path):
    path, _ = make_hf_dir("qwen35", tmp_path)
    cfg = read_hf_config(path)
    assert cfg.layer_types == ("gdn", "gdn", "gdn", "global")
    assert cfg.rotary_dim_global == 8 and cfg.attn_output_gate == "fused_q"
    assert (cfg.gdn_num_k_heads, cfg.gdn_num_v_heads, cfg.gdn_head_k_dim) == (2, 4, 16)
    assert cfg.max_context == 256  # the model's own limit when none is asked for


def test_tokenizer_json_passes_through(tmp_path):
    path, _ = make_hf_dir("llama", tmp_path)
    text = '{"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "a"}}'
    (path / "tokenizer.json").write_text(text)
    assert load_hf_dir(path, max_context=64).tokenizer_json == text


def test_unknown_model_type_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "mamba2"}')
    with pytest.raises(HFLoadError, match="model_type 'mamba2' is not supported"):
        read_hf_config(tmp_path)


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = make_hf_dir("qwen35", tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.linear_attn.A_log"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(HFLoadError, match=r"layers\.1\.mixer\.A_log"):
        load_hf_dir(path, max_context=64)


@pytest.mark.slow
def test_qwen35_hf_dir_compiled_matches_hf(tmp_path):
    """`foldline compile DIR` output (IREE CPU) vs HF eager, prompt + decode steps."""
    from foldline.runtime import Model
    from foldline.tools.cli import main

    path, hf = make_hf_dir("qwen35", tmp_path)
    bundle_dir = tmp_path / "bundle"
    assert main(["compile", str(path), "-o", str(bundle_dir), "--max-context", "96", "--chunk", str(CHUNK),
                 "--cpu", "host"]) == 0
    bundle = Model.load(bundle_dir)
    prompt = _prompt(bundle.vocab_size)
    ref_logits, ref_tokens = hf_reference(hf, prompt, DECODE_STEPS)

    loaded = load_hf_dir(path, max_context=96)
    runner = EagerRunner(loaded.module, CHUNK)  # only for the term scale of each step
    session = bundle.session()
    compiled = [session.prefill(prompt)]
    runner.prefill(prompt)
    errors = [_scaled(compiled[0], ref_logits[0], runner.term_scale())]
    for tok, ref in zip(ref_tokens, ref_logits[1:]):
        compiled.append(session.decode(tok))
        runner.decode(tok)
        errors.append(_scaled(compiled[-1], ref, runner.term_scale()))
    print(f"compiled vs HF: worst scaled error {max(errors):.2e} over {len(errors)} steps")
    assert max(errors) < SCALED_TOL_FP32, errors
    assert [int(np.argmax(x)) for x in compiled[:-1]] == ref_tokens
