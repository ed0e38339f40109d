"""Bad input gets a clear error naming the problem."""

from __future__ import annotations

import json
import shutil

import pytest

from foldline.frontend.arch import get_preset
from foldline.frontend.config import ConfigError
from foldline.frontend.sources import load_model
from foldline.runtime import BundleError, ContextFullError, Model


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset 'nope'.*ripple-tiny"):
        get_preset("nope")


def test_planning_only_preset_cannot_be_compiled():
    with pytest.raises(ConfigError, match="planning only"):
        load_model("ripple-65b")


def test_missing_model_file():
    with pytest.raises(FileNotFoundError, match="does-not-exist.gguf"):
        load_model("does-not-exist.gguf")


def test_config_rejects_bad_fields():
    cfg = get_preset("llama-tiny")
    with pytest.raises(ConfigError, match="unknown layer type 'mamba'"):
        cfg.replace(layer_types=("global", "mamba"))
    with pytest.raises(ConfigError, match="multiple of num_kv_heads"):
        cfg.replace(num_kv_heads=3)
    with pytest.raises(ConfigError, match="sliding_window"):
        cfg.replace(layer_types=("local",), sliding_window=0)


def test_config_roundtrip():
    cfg = get_preset("ripple-tiny")
    assert type(cfg).from_dict(json.loads(cfg.to_json())) == cfg


@pytest.mark.slow
def test_runtime_input_errors(bundle_factory):
    model = Model.load(bundle_factory("llama-tiny"))
    session = model.session()
    with pytest.raises(ValueError, match=f"token id {model.vocab_size} is out of range"):
        session.prefill([1, model.vocab_size])
    with pytest.raises(ValueError, match="token id -1 is out of range"):
        session.decode(-1)
    assert session.position == 0, "a rejected call changes nothing"
    with pytest.raises(ContextFullError, match="context full"):
        session.prefill([1] * (model.max_context + 1))
    session.prefill([1] * model.max_context)
    with pytest.raises(ContextFullError):
        session.decode(1)


@pytest.mark.slow
def test_bundle_missing_file(bundle_factory, tmp_path):
    src = bundle_factory("llama-tiny")
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    (broken / "params.irpa").unlink()
    with pytest.raises(BundleError, match="missing params.irpa"):
        Model.load(broken)
    with pytest.raises(BundleError, match="does not exist"):
        Model.load(tmp_path / "nothing-here")
