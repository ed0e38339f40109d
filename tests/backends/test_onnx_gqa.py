"""onnx-gqa, the ONNX target's FX rewrite (backends/onnx/gqa.py): golden against the unrewritten program in
torch eager, run through the pass manager as the ONNX export runs it (no ONNX export here)."""

from __future__ import annotations

import pytest
import torch

from foldline.backends.onnx.gqa import GQA_ATTENTION, GQA_PASS, GQA_ROPE_ATTENTION, WINDOW_CACHES
from foldline.frontend.arch import get_preset
from foldline.passes.manager import PassError, resolve_pipeline, run_pipeline, run_target_passes
from foldline.testing.golden import GOLDEN_TOL, compare_units, copy_unit, make_steps

pytestmark = pytest.mark.usefixtures("torch_one_thread")

TOL = GOLDEN_TOL["float32"]
CACHE_ATTENTION = torch.ops.foldline.cache_attention.default


def _count(program, *targets) -> int:
    return sum(n.op == "call_function" and n.target in targets for n in program.graph.nodes)


@pytest.mark.parametrize(("preset", "passes", "window_caches"), [
    ("llama-tiny", (), False),  # every layer global: q and k rotated by the fused op
    ("gemma3-tiny", (), False),  # windowed layers holding full caches: the window as the op's local window
    ("gemma3-tiny", ("ring-buffer-swa",), True),  # the windows' rings as window-ordered caches
])
def test_group_query_attention_matches_the_unrewritten_program(preset, passes, window_caches, exported_unit):
    """Every one-row attention with its two cache writes becomes one fused op, and the rewritten programs
    follow the unrewritten ones within fp32 over prompts of several chunks and decode steps. Window-ordered
    caches hold the window in another order than the rings, so there only the logits are compared."""
    cfg = get_preset(preset).replace(max_context=96)
    before = copy_unit(exported_unit(cfg, batch=1, chunk=16))
    run_pipeline(before, list(passes), progress=lambda _m: None)
    after = copy_unit(before)
    after.options[WINDOW_CACHES] = window_caches
    report = run_target_passes(after, [GQA_PASS], progress=lambda _m: None)
    layers = len(cfg.layer_types)
    for name, program in after.programs.items():
        fused = _count(program, GQA_ATTENTION, GQA_ROPE_ATTENTION)
        assert fused == (layers if window_caches else _count(before.programs[name], CACHE_ATTENTION)), name
        assert _count(program, CACHE_ATTENTION) == 0, name
    assert report[0]["sites"] == layers * len(after.programs) and report[0]["changed"]
    if preset == "llama-tiny":  # its rotation is GroupQueryAttention's: q and k reach the op unrotated
        assert _count(after.programs["prefill"], GQA_ROPE_ATTENTION) == layers

    golden = compare_units(before, after, make_steps([70], 16, 12, cfg.vocab_size, seed=5))
    assert golden.worst_logit_error < TOL, golden
    if not window_caches:
        assert golden.worst_state_error < TOL, golden


def test_the_pass_dumps_its_programs_and_stays_out_of_the_pipeline(exported_unit, tmp_path):
    unit = copy_unit(exported_unit(get_preset("llama-tiny").replace(max_context=96), batch=1, chunk=16))
    run_target_passes(unit, [GQA_PASS], dump_after={GQA_PASS: tmp_path}, progress=lambda _m: None)
    assert "gqa_rope_attention" in (tmp_path / f"prefill.after-{GQA_PASS}.txt").read_text()
    assert run_target_passes(unit, [GQA_PASS], progress=lambda _m: None)[0]["changed"] is False  # idempotent
    with pytest.raises(PassError, match=f"{GQA_PASS} is a target pass \\(onnx\\)"):
        resolve_pipeline([GQA_PASS])
    with pytest.raises(PassError, match="not a target pass"):
        run_target_passes(unit, ["ring-buffer-swa"])
