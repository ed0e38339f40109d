"""fuse-sibling-qlinears: golden tests against eager; only compatible siblings fuse; the blocks are stored once."""

from __future__ import annotations

import pytest

from foldline.passes.manager import run_pipeline
from foldline.passes.quantize_weights import QLINEAR
from foldline.testing.golden import GOLDEN_TOL, golden_check

from passes.test_quantize_weights import PRESETS, _blocked_unit, _lifted, _steps

PASSES = ["quantize-weights", "fuse-sibling-qlinears"]


def _qlinears(program) -> int:
    return sum(1 for n in program.graph.nodes if n.op == "call_function" and n.target == QLINEAR)


@pytest.mark.parametrize("preset", PRESETS)
def test_fused_projections_match_eager_within_fp32(preset):
    unit = _blocked_unit(preset)
    after, report, pass_report = golden_check(unit, PASSES, _steps(unit.config))
    fused = pass_report[1]
    assert fused["changed"], fused
    assert report.worst_logit_error < GOLDEN_TOL["float32"], report.summary()
    assert report.worst_state_error < GOLDEN_TOL["float32"], report.summary()
    groups = fused["details"]["groups"]
    assert all(len(members) >= 2 for members in groups.values())
    fused_members = {m for members in groups.values() for m in members}
    for program in after.programs.values():
        lifted = _lifted(program)
        assert not any(t.startswith(m + ".") for m in fused_members for t in lifted), "separate blocks dropped"
        assert sum(t.endswith(".codes") and "+" in t for t in lifted) == len(groups)


def test_llama_fuses_qkv_and_gate_up_per_layer():
    unit = _blocked_unit("llama-tiny")
    run_pipeline(unit, ["quantize-weights"], progress=lambda _m: None)
    before = {name: _qlinears(p) for name, p in unit.programs.items()}
    report = run_pipeline(unit, ["fuse-sibling-qlinears"], progress=lambda _m: None)
    groups = report[0]["details"]["groups"]
    layers = unit.config.num_layers
    assert len(groups) == 2 * layers
    for layer in range(layers):
        prefix = f"model.layers.{layer}."
        kinds = sorted(tuple(m.removeprefix(prefix) for m in members) for members in groups.values()
                       if members[0].startswith(prefix))
        assert kinds == [("mixer.q_proj", "mixer.k_proj", "mixer.v_proj"), ("mlp.gate_proj", "mlp.up_proj")]
    for name, program in unit.programs.items():
        assert _qlinears(program) == before[name] - 3 * layers  # 7 -> 3 per layer (qkv, o, gate+up, down)
    again = run_pipeline(unit, ["fuse-sibling-qlinears"], progress=lambda _m: None)
    assert not again[0]["changed"], "a second run changes nothing"


def test_siblings_with_different_block_formats_stay_apart():
    # k projections held as q8 blocks, every other weight q4 (a K-quant mix's situation)
    unit = _blocked_unit("llama-tiny",
                         format_of=lambda name: "q8" if "embed" in name or name.endswith("k_proj") else "q4")
    after, report, pass_report = golden_check(unit, PASSES, _steps(unit.config))
    assert report.worst_logit_error < GOLDEN_TOL["float32"], report.summary()
    groups = list(pass_report[1]["details"]["groups"].values())
    assert not any(any(m.endswith("k_proj") for m in members) for members in groups)
    assert sum(tuple(m.rsplit(".", 1)[1] for m in members) == ("q_proj", "v_proj") for members in groups) == \
        unit.config.num_layers
