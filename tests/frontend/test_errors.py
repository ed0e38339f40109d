"""Bad presets, configs and model paths get a clear error naming the problem."""

from __future__ import annotations

import json

import pytest

from foldline.frontend.arch import get_preset
from foldline.frontend.config import ConfigError
from foldline.frontend.sources import load_model


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
