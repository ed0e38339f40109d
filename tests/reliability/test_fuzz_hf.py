"""Fuzzed HF model directories: config.json and *.safetensors damage ends in an HFLoadError.

A small valid llama directory (config.json + model.safetensors written with
safetensors, HF parameter names) is damaged one way per case: config keys
removed, values of the wrong type, zero / negative / absurd sizes, JSON that
is not an object or not text; safetensors truncated, a header that lies about
its length, offsets, dtype or shape, random bytes in the header. A case runs
`read_hf_config` (what `foldline plan` reads) and `load_model` on the
directory (what `foldline compile` does), under the harness of fuzz_common.
"""

from __future__ import annotations

import json
import random
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from foldline.frontend.arch import get_preset
from foldline.frontend.hf_config import HFLoadError
from foldline.frontend.hf_loader import load_hf_dir, read_hf_config
from foldline.frontend.model import build_model
from foldline.frontend.sources import load_model

from reliability.fuzz_common import FuzzLog
from reliability.reliability_common import scaled

CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
    "tie_word_embeddings": True, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "dtype": "float32",
}
_HF_PARTS = {"mixer": "self_attn", "input_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}


def hf_tensors() -> dict[str, torch.Tensor]:
    """The weights of a seeded model with CONFIG's sizes, under HF's parameter names."""
    cfg = get_preset("llama-tiny").replace(vocab_size=64, intermediate_size=96, layer_types=("global",) * 2,
                                           max_context=64)
    out = {}
    for name, p in build_model(cfg, seed=0).state_dict().items():
        parts = name.split(".")
        if parts[0] == "layers":
            parts[2] = _HF_PARTS.get(parts[2], parts[2])
        out["model." + ".".join(parts)] = p.detach().clone().contiguous()
    return out


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf") / "base"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(CONFIG))
    save_file(hf_tensors(), str(root / "model.safetensors"))
    load_hf_dir(root)  # the undamaged directory loads
    return root


BAD_VALUES = [None, "64", 64.5, -1, 0, [64], {"a": 1}, True, 2**31, 2**40, 10**30, float("nan")]
SIZE_KEYS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings"]


def config_cases(rng: random.Random, n_random: int):
    yield "config removed", None
    yield "empty file", b""
    yield "not JSON", b"{model_type: llama"
    yield "not text", b"\xff\xfe\x00\x01"
    yield "a list", b"[1, 2]"
    yield "a string", b'"llama"'
    yield "nested too deep", b"[" * 100000 + b"]" * 100000
    for key in CONFIG:
        yield f"without {key}", {k: v for k, v in CONFIG.items() if k != key}
    for key in [*SIZE_KEYS, "rms_norm_eps", "rope_theta", "tie_word_embeddings", "model_type", "hidden_act",
                "eos_token_id", "bos_token_id", "dtype"]:
        for value in BAD_VALUES:
            yield f"{key} = {value!r}", {**CONFIG, key: value}
    for value in ([], ["full_attention"], ["nonsense"] * 2, "full_attention", [1, 2], ["full_attention"] * 5):
        yield f"layer_types = {value!r}", {**CONFIG, "layer_types": value}
    for value in ({"rope_type": "yarn", "factor": 4}, {"rope_type": "linear"}, {"rope_type": "linear", "factor": "x"},
                  "linear", [1]):
        yield f"rope_scaling = {value!r}", {**CONFIG, "rope_scaling": value}
    for i in range(n_random):
        cfg = dict(CONFIG)
        for key in rng.sample(sorted(CONFIG), rng.randint(1, 4)):
            cfg[key] = rng.choice([*BAD_VALUES, rng.randint(-5, 300), rng.random() * 100, "x" * rng.randint(0, 9)])
        yield f"random config #{i}", cfg


def safetensors_cases(data: bytes, rng: random.Random, n_random: int):
    (header_len,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8 : 8 + header_len])
    body = data[8 + header_len :]

    def with_header(h: dict) -> bytes:
        raw = json.dumps(h).encode()
        return struct.pack("<Q", len(raw)) + raw + body

    for cut in sorted({0, 4, 8, 20, 8 + header_len - 1, 8 + header_len, len(data) - 1}
                      | {rng.randrange(len(data)) for _ in range(10)}):
        yield f"truncated at {cut}", data[:cut]
    for n in (0, 1, header_len - 1, header_len + 1, len(data), 2**31, 2**63, 2**64 - 1):
        yield f"header length {n}", struct.pack("<Q", n) + data[8:]
    names = [k for k in header if k != "__metadata__"]
    for name in rng.sample(names, min(5, len(names))):
        entry = header[name]
        start, end = entry["data_offsets"]
        lies = {
            "offsets past the end": [start, len(body) + 64],
            "offsets reversed": [end, start],
            "offsets overlapping the next": [start, end + 4],
            "offsets negative": [-8, end],
            "offsets huge": [2**62, 2**62 + end - start],
        }
        for why, offsets in lies.items():
            yield f"{name}: {why}", with_header({**header, name: {**entry, "data_offsets": offsets}})
        for dtype in ("F64", "I8", "BOOL", "Q4", "", 7):
            yield f"{name}: dtype {dtype!r}", with_header({**header, name: {**entry, "dtype": dtype}})
        for shape in ([], [2**40], [-1, 64], [64, 64, 64], ["a"], [2**31, 2**31]):
            yield f"{name}: shape {shape}", with_header({**header, name: {**entry, "shape": shape}})
        rest = {k: v for k, v in header.items() if k != name}
        yield f"{name}: missing", with_header(rest)
        yield f"{name}: renamed", with_header({**rest, name + ".extra": entry})
    for i in range(n_random):
        out = bytearray(data)
        for _ in range(rng.choice((1, 2, 8))):
            out[rng.randrange(8 + header_len)] = rng.randrange(256)
        yield f"random header bytes #{i}", bytes(out)


def _load(path: Path) -> None:
    read_hf_config(path)
    load_model(str(path))


def test_fuzzed_hf_directories_end_in_clear_errors(tmp_path, base_dir):
    """Every damaged config.json or safetensors file loads or raises an HFLoadError: no crash, hang, huge allocation."""
    rng = random.Random(7)
    weights = (base_dir / "model.safetensors").read_bytes()
    log = FuzzLog("hf")
    for i, (what, cfg) in enumerate(config_cases(rng, scaled(30, 8000))):
        case = tmp_path / f"c{i}"
        case.mkdir()
        (case / "model.safetensors").symlink_to(base_dir / "model.safetensors")
        if cfg is not None:
            (case / "config.json").write_bytes(cfg if isinstance(cfg, bytes) else json.dumps(cfg).encode())
        log.run(f"config.json {what}", lambda p=case: _load(p))
        shutil.rmtree(case)
    for i, (what, data) in enumerate(safetensors_cases(weights, rng, scaled(30, 8000))):
        case = tmp_path / f"s{i}"
        case.mkdir()
        shutil.copy(base_dir / "config.json", case / "config.json")
        (case / "model.safetensors").write_bytes(data)
        log.run(f"safetensors {what}", lambda p=case: _load(p))
        shutil.rmtree(case)
    log.finish()
    assert log.clear_errors > log.cases // 2


# ---- regressions: cases the fuzz found, kept by name ---------------------------------------------


def _write(root: Path, cfg: dict | bytes, base_dir: Path) -> Path:
    root.mkdir(exist_ok=True)
    (root / "config.json").write_bytes(cfg if isinstance(cfg, bytes) else json.dumps(cfg).encode())
    shutil.copy(base_dir / "model.safetensors", root / "model.safetensors")
    return root


@pytest.mark.parametrize("text", [b"{model_type: llama", b"\xff\xfe", b"[1, 2]", b""])
def test_config_json_not_an_object(tmp_path, base_dir, text):
    with pytest.raises(HFLoadError, match="config.json"):
        read_hf_config(_write(tmp_path / "d", text, base_dir))


@pytest.mark.parametrize("key", ["hidden_size", "num_attention_heads", "vocab_size", "num_hidden_layers"])
def test_missing_required_key(tmp_path, base_dir, key):
    cfg = {k: v for k, v in CONFIG.items() if k != key}
    with pytest.raises(HFLoadError, match=key):
        read_hf_config(_write(tmp_path / "d", cfg, base_dir))


@pytest.mark.parametrize("value", ["64", 0, -4, 64.5, None, True])
def test_size_of_wrong_type_or_not_positive(tmp_path, base_dir, value):
    with pytest.raises(HFLoadError, match="num_attention_heads"):
        read_hf_config(_write(tmp_path / "d", {**CONFIG, "num_attention_heads": value}, base_dir))


def test_absurd_sizes_are_refused_before_allocating(tmp_path, base_dir):
    """hidden_size 2**31 with the small weights: refused by shape, nothing of that size is allocated."""
    path = _write(tmp_path / "d", {**CONFIG, "hidden_size": 2**31, "head_dim": 2**29}, base_dir)
    with pytest.raises(HFLoadError):
        load_hf_dir(path)


def test_absurd_layer_count(tmp_path, base_dir):
    with pytest.raises(HFLoadError, match="num_hidden_layers"):
        read_hf_config(_write(tmp_path / "d", {**CONFIG, "num_hidden_layers": 2**40}, base_dir))


def test_truncated_safetensors(tmp_path, base_dir):
    path = _write(tmp_path / "d", CONFIG, base_dir)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(HFLoadError, match="safetensors"):
        load_hf_dir(path)
