"""`foldline plan`: state bytes from the config, the compact-KV formula, agreement with the ring pass."""

from __future__ import annotations

import re

import pytest

from foldline.frontend.arch import PRESETS, get_preset
from foldline.frontend.model import state_specs
from foldline.passes.manager import run_pipeline
from foldline.passes.state_layout import plan_state, planned_state_specs
from foldline.testing.golden import copy_unit
from foldline.tools.cli import main
from foldline.tools.plan_cmd import fmt_bytes

GIB = 1024**3


def compact_kv_bytes(cfg, context: int, itemsize: int, batch: int = 1) -> int:
    """2 * Hkv * D * bytes * (n_global * S + n_local * min(S, W)), per sequence."""
    n_global, n_local = len(cfg.layers_of("global")), len(cfg.layers_of("local"))
    per_position = 2 * cfg.num_kv_heads * cfg.head_dim * itemsize
    return batch * per_position * (n_global * context + n_local * min(context, cfg.sliding_window))


def test_plan_ripple_65b_one_million(capsys):
    assert main(["plan", "ripple-65b", "--context", "1048576"]) == 0
    out = capsys.readouterr().out
    total = re.search(r"total: (\S+ \S+) \(([\d,]+) bytes\) compact vs (\S+ \S+) \(([\d,]+) bytes\) naive", out)
    assert total, out
    assert total.group(1) == "64.25 GiB" and total.group(3) == "320 GiB"
    cfg = get_preset("ripple-65b")
    assert int(total.group(2).replace(",", "")) == compact_kv_bytes(cfg, 1048576, 2) == int(64.25 * GIB)
    assert int(total.group(4).replace(",", "")) == 320 * GIB
    # One line per buffer: 80 layers, K and V each.
    assert len(re.findall(r"^  layer\d+\.[kv] ", out, flags=re.M)) == 160
    assert re.search(r"local_kv\s+128 buffers\s+256 MiB", out)


@pytest.mark.parametrize("dtype,itemsize", [("bf16", 2), ("f32", 4)])
@pytest.mark.parametrize("context", [1, 500, 1024, 1025, 4096])
@pytest.mark.parametrize("batch", [1, 3])
def test_plan_matches_formula(dtype, itemsize, context, batch):
    cfg = get_preset("ripple-65b").replace(dtype={"bf16": "bfloat16", "f32": "float32"}[dtype])
    plan = plan_state(cfg, batch, context)
    assert plan.total_bytes == compact_kv_bytes(cfg, context, itemsize, batch)
    assert plan.naive_bytes == batch * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize * cfg.num_layers * context


def test_plan_flags_change_the_figures(capsys):
    def total(*argv: str) -> int:
        assert main(["plan", "ripple-tiny", "--summary", *argv]) == 0
        return int(re.search(r"total: .*?\(([\d,]+) bytes\)", capsys.readouterr().out).group(1).replace(",", ""))

    base = total("--context", "100")
    assert total("--context", "100", "--batch", "2") == 2 * base
    assert total("--context", "100", "--dtype", "bf16") == base // 2
    assert base == compact_kv_bytes(get_preset("ripple-tiny"), 100, 4)


def test_plan_includes_gdn_state(capsys):
    names = [n for n, f in PRESETS.items() if "gdn" in f().layer_types and not f().planning_only]
    if not names:
        pytest.skip("no preset with gdn layers")
    cfg = get_preset(names[0])
    plan = plan_state(cfg)
    kinds = {s.kind for s in plan.specs}
    assert {"gdn_recurrent", "gdn_conv"} <= kinds
    assert plan.total_bytes == sum(s.nbytes for s in state_specs(cfg, 1))  # no local layers: nothing to shrink
    assert main(["plan", cfg.name]) == 0
    assert "gdn_recurrent" in capsys.readouterr().out


def test_plan_agrees_with_ring_pass(exported_unit):
    """The plan and the pass share one layout function: the compiled state is what plan predicts."""
    cfg = get_preset("gemma3-tiny")
    unit = copy_unit(exported_unit(cfg, batch=2, chunk=8))
    report = run_pipeline(unit, ["ring-buffer-swa"], progress=lambda _m: None)
    assert unit.state_specs == planned_state_specs(cfg, 2)
    plan = plan_state(cfg, 2)
    assert report[0]["bytes_saved"] == plan.naive_bytes - plan.total_bytes


def test_plan_errors(capsys):
    assert main(["plan", "no-such-model"]) == 2
    assert main(["plan", "ripple-65b", "--context", "0"]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "--context" in err


def test_fmt_bytes():
    assert fmt_bytes(int(64.25 * GIB)) == "64.25 GiB"
    assert fmt_bytes(320 * GIB) == "320 GiB"
    assert fmt_bytes(256 * 1024**2) == "256 MiB"
    assert fmt_bytes(1536) == "1.5 KiB"
    assert fmt_bytes(7) == "7 B"
