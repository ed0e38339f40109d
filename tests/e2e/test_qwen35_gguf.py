"""qwen35 GGUF files: foldline vs HF transformers and llama.cpp on the same converted file.

tests/fixtures/qwen35-tiny.gguf is a seeded random Qwen3_5ForCausalLM (4 layers:
3 GDN + 1 attention, 2 key / 4 value heads, so the converter's head reordering
is exercised) converted by llama.cpp's own convert_hf_to_gguf.py; the JSON holds
HF eager logits and llama.cpp's logits (f32 KV cache) after each prompt and each
of 8 decode steps. scripts/record_llamacpp_qwen35.py rebuilds both.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from foldline.frontend.arch.qwen35 import gguf_tensor_names as qwen35_tensor_name_map
from foldline.frontend.arch.qwen35 import grouped_to_tiled, tiled_to_grouped
from foldline.frontend.gguf_file import GGUFError, GGUFFile, MissingTensorError
from foldline.frontend.gguf_loader import load_gguf, read_gguf_config
from foldline.testing.parity import SCALED_TOL_FP32, EagerRunner

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GGUF = FIXTURES / "qwen35-tiny.gguf"
RECORD = json.loads((FIXTURES / "qwen35_llamacpp.json").read_text())
CHUNK = 16


def _run(module: torch.nn.Module, ids: list[int], continuation: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Logits after the prompt and after each continuation token, with each step's term scale."""
    runner = EagerRunner(module, CHUNK)
    logits, scales = [runner.prefill(ids)], [runner.term_scale()]
    for tok in continuation:
        logits.append(runner.decode(tok))
        scales.append(runner.term_scale())
    return np.array(logits), np.array(scales)


def _scaled_error(ours: np.ndarray, ref: np.ndarray, scale: np.ndarray) -> float:
    return float((np.abs(ours.astype(np.float64) - ref) / np.maximum(scale, 1e-30)).max())


def _worst(module: torch.nn.Module, key: str) -> float:
    errors = []
    for run in RECORD["runs"]:
        ours, scale = _run(module, run["ids"], run["continuation"])
        errors.append(_scaled_error(ours, np.array(run[key]), scale))
    return max(errors)


@pytest.fixture(scope="module")
def loaded():
    return load_gguf(GGUF, max_context=128)


def test_config_follows_the_file(loaded):
    cfg = loaded.config
    assert cfg.family == "qwen35"
    assert cfg.layer_types == ("gdn", "gdn", "gdn", "global")
    assert (cfg.gdn_num_k_heads, cfg.gdn_num_v_heads, cfg.gdn_head_k_dim, cfg.gdn_head_v_dim) == (2, 4, 16, 16)
    assert cfg.gdn_kv_mapping == "interleaved" and cfg.gdn_norm_eps == "plain"
    assert cfg.norm_weight_offset == 0.0  # the converter stored 1 + w
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim_global) == (4, 2, 32, 8)
    assert cfg.attn_output_gate == "fused_q" and not cfg.tie_word_embeddings
    assert cfg.rope_theta_global == 10000.0
    assert cfg.eos_token_ids[0] == 0 and cfg.bos_token_id is None
    assert read_gguf_config(GGUF).max_context == 256  # the file's own limit caps the default


def test_eager_matches_recorded_hf(loaded):
    worst = _worst(loaded.module, "hf_logits")
    print(f"foldline (GGUF) vs HF eager: worst scaled error {worst:.2e}")
    assert worst < SCALED_TOL_FP32


def test_eager_matches_recorded_llamacpp(loaded):
    worst = _worst(loaded.module, "llamacpp_logits")
    print(f"foldline (GGUF) vs llama.cpp: worst scaled error {worst:.2e}")
    assert worst < SCALED_TOL_FP32
    for run in RECORD["runs"]:
        ours, _ = _run(loaded.module, run["ids"], run["continuation"])
        assert ours.argmax(-1).tolist() == run["llamacpp_top1"]
        assert run["llamacpp_top1"][:-1] == run["continuation"]  # llama.cpp follows HF's greedy path
        assert np.ptp(ours[0]) > 0.5  # logits are not degenerate


def test_recorded_references_agree():
    """HF and llama.cpp themselves agree on this file; f16 KV caching is the only visible gap."""
    for run in RECORD["runs"]:
        hf, lc = np.array(run["hf_logits"]), np.array(run["llamacpp_logits"])
        assert np.abs(hf - lc).max() < 2e-5
        assert 2e-5 < run["llamacpp_f16_kv_max_abs_vs_hf"] < 1e-2
        assert run["llamacpp_f16_kv_top1"] == run["llamacpp_top1"]


@pytest.mark.parametrize(("field", "value"), [("gdn_norm_eps", "scaled"), ("gdn_kv_mapping", "blocked")])
def test_wrong_convention_is_detected(loaded, field, value):
    """The fixture separates the conventions: the other choice is far outside the tolerance."""
    from foldline.frontend.model import CausalLM

    cfg = loaded.config.replace(**{field: value})
    with torch.device("meta"):
        module = CausalLM(cfg)
    module.load_state_dict(loaded.module.state_dict(), strict=True, assign=True)
    worst = _worst(module.eval(), "llamacpp_logits")
    print(f"{field}={value}: worst scaled error vs llama.cpp {worst:.2e}")
    assert worst > 100 * SCALED_TOL_FP32


def test_head_reorder_round_trip():
    x = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2 * 3 * 4, 5)
    tiled = grouped_to_tiled(x, 0, n_k=2, rep=3, head_dim=4)
    # Tiled order: the first value head of key group 0, then that of group 1, ...
    assert tiled[4:8].tolist() == x[12:16].tolist()
    assert np.array_equal(tiled_to_grouped(tiled, 0, 2, 3, 4), x)
    assert np.array_equal(tiled_to_grouped(grouped_to_tiled(x.T, 1, 2, 3, 4), 1, 2, 3, 4), x.T)


def _recorder():
    spec = importlib.util.spec_from_file_location("record_llamacpp_qwen35", REPO / "scripts" / "record_llamacpp_qwen35.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tensors_equal_hf_after_undoing_the_converter(loaded):
    """Every loaded tensor is the HF tensor after exactly the converter's transforms (when RNG agrees)."""
    pytest.importorskip("transformers")
    rec = _recorder()
    hf = rec.build_hf_model(RECORD["seed"])
    run = RECORD["runs"][1]
    hf_now = rec.hf_logits(hf, run["ids"], run["continuation"])
    if np.abs(np.array(hf_now) - np.array(run["hf_logits"])).max() > 1e-4:
        pytest.skip("this torch draws different random weights for the seed; the logit tests still apply")
    cfg = loaded.config
    n_k, n_v, dv = cfg.gdn_num_k_heads, cfg.gdn_num_v_heads, cfg.gdn_head_v_dim
    rep = n_v // n_k
    ours = {k: v.numpy() for k, v in loaded.module.state_dict().items()}
    checked = 0
    for name, w in hf.state_dict().items():
        w = w.float().numpy()
        short = name.removeprefix("model.")
        parts = short.split(".")
        if short.startswith("layers.") and parts[2] == "linear_attn":
            i, leaf = parts[1], ".".join(parts[3:])
            key = f"layers.{i}.mixer." + {"conv1d.weight": "conv1d_weight"}.get(leaf, leaf)
            mine = ours[key]
            if leaf == "conv1d.weight":
                w = w[:, 0, :]
            if leaf in ("in_proj_qkv.weight", "conv1d.weight"):
                split = 2 * n_k * cfg.gdn_head_k_dim
                mine = np.concatenate([mine[:split], tiled_to_grouped(mine[split:], 0, n_k, rep, dv)])
            elif leaf == "in_proj_z.weight":
                mine = tiled_to_grouped(mine, 0, n_k, rep, dv)
            elif leaf in ("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias"):
                mine = tiled_to_grouped(mine, 0, n_k, rep, 1)
            elif leaf == "out_proj.weight":
                mine = tiled_to_grouped(mine, 1, n_k, rep, dv)
            elif leaf != "norm.weight":
                raise AssertionError(f"unchecked HF tensor {name}")
            tol = 1e-6 if leaf == "A_log" else 0.0  # log(-(-exp(A_log))) round trip
        else:
            key = {"embed_tokens.weight": "embed_tokens.weight", "norm.weight": "norm.weight"}.get(short, short)
            key = key.replace("self_attn.", "mixer.").replace("input_layernorm", "input_norm")
            key = key.replace("post_attention_layernorm", "mlp_norm")
            mine = ours[key]
            if "norm" in name:
                w = w + 1.0  # stored 1 + w
            tol = 0.0
        np.testing.assert_allclose(mine, w, rtol=0, atol=tol, err_msg=name)
        checked += 1
    assert checked == len(ours)


def test_tensor_name_map_covers_every_tensor(loaded):
    names = qwen35_tensor_name_map(loaded.config)
    with GGUFFile(GGUF) as g:
        assert sorted(names.values()) == sorted(g.tensors)
    assert names["layers.0.mixer.A_log"] == "blk.0.ssm_a"
    assert names["layers.3.mlp_norm.weight"] == "blk.3.post_attention_norm.weight"


# ---------------------------------------------------------------------------
# Rewritten files: MTP blocks, missing tensors, bad values
# ---------------------------------------------------------------------------


def _rewrite(path: Path, drop: tuple[str, ...] = (), add: dict[str, np.ndarray] | None = None,
             meta: dict[str, object] | None = None, change: dict[str, np.ndarray] | None = None) -> Path:
    """A copy of the fixture with tensors dropped, added or replaced and metadata overridden."""
    import gguf

    with GGUFFile(GGUF) as g:
        metadata = {**g.metadata, **(meta or {})}
        tensors = {n: g.dequantize(n) for n in g.tensors if n not in drop}
    tensors.update(add or {})
    tensors.update(change or {})
    writer = gguf.GGUFWriter(str(path), "qwen35")
    for key, value in metadata.items():
        if key in ("general.architecture", "general.alignment"):
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, t in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_rewritten_copy_loads_identically(tmp_path, loaded):
    path = _rewrite(tmp_path / "copy.gguf")
    again = load_gguf(path, max_context=128)
    for (k, a), (_, b) in zip(loaded.module.state_dict().items(), again.module.state_dict().items()):
        assert torch.equal(a, b), k


def test_mtp_blocks_are_skipped(tmp_path, loaded):
    extra = {
        "blk.4.attn_norm.weight": np.ones(64, np.float32),
        "blk.4.nextn.eh_proj.weight": np.zeros((64, 128), np.float32),
    }
    recurrent = [True, True, True, False, False]
    path = _rewrite(tmp_path / "mtp.gguf", add=extra,
                    meta={"qwen35.block_count": 5, "qwen35.nextn_predict_layers": 1,
                          "qwen35.attention.recurrent_layers": recurrent})
    again = load_gguf(path, max_context=128)
    assert again.config.layer_types == loaded.config.layer_types


def test_missing_tensor_is_named(tmp_path):
    path = _rewrite(tmp_path / "missing.gguf", drop=("blk.1.ssm_a",))
    with pytest.raises(MissingTensorError, match=r"blk\.1\.ssm_a"):
        load_gguf(path, max_context=64)


def test_leftover_tensor_is_named(tmp_path):
    path = _rewrite(tmp_path / "extra.gguf", add={"blk.0.attn_q.weight": np.zeros((256, 64), np.float32)})
    with pytest.raises(GGUFError, match=r"blk\.0\.attn_q\.weight"):
        load_gguf(path, max_context=64)


def test_positive_ssm_a_is_refused(tmp_path):
    path = _rewrite(tmp_path / "bad_a.gguf", change={"blk.2.ssm_a": np.full(4, 0.5, np.float32)})
    with pytest.raises(GGUFError, match=r"blk\.2\.ssm_a"):
        load_gguf(path, max_context=64)


def test_a_log_is_recovered_exactly_enough(loaded):
    with GGUFFile(GGUF) as g:
        ssm_a = g.dequantize("blk.0.ssm_a")
    a_log = loaded.module.layers[0].mixer.A_log.detach().numpy()
    np.testing.assert_allclose(-np.exp(a_log), ssm_a, rtol=1e-6)
    assert all(math.isfinite(x) for x in a_log)


# ---------------------------------------------------------------------------
# Compiled (IREE CPU)
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_compiled_gguf_matches_recorded_references(tmp_path):
    """`foldline compile qwen35-tiny.gguf` vs recorded llama.cpp and HF logits, plus verify's parity."""
    from foldline.runtime import Model
    from foldline.testing.parity import run_parity
    from foldline.tools.cli import main

    bundle_dir = tmp_path / "bundle"
    assert main(["compile", str(GGUF), "-o", str(bundle_dir), "--max-context", "96", "--chunk", str(CHUNK),
                 "--cpu", "host"]) == 0
    bundle = Model.load(bundle_dir)
    loaded = load_gguf(GGUF, max_context=96)
    for run in RECORD["runs"]:
        session = bundle.session()
        compiled = [session.prefill(run["ids"])] + [session.decode(t) for t in run["continuation"]]
        _, scale = _run(loaded.module, run["ids"], run["continuation"])
        for key in ("llamacpp_logits", "hf_logits"):
            worst = _scaled_error(np.array(compiled), np.array(run[key]), scale)
            print(f"compiled vs {key}: worst scaled error {worst:.2e}")
            assert worst < SCALED_TOL_FP32
        assert np.array(compiled).argmax(-1).tolist() == run["llamacpp_top1"]
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, loaded.config.vocab_size, size=40).tolist()
    report = run_parity(loaded.module, bundle, prompt, 24)
    print(f"verify-style parity: {report.summary()}")
    assert report.ok(SCALED_TOL_FP32)
