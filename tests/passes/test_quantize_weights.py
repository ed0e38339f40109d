"""quantize-weights: golden tests against eager, lossless and requantized, tied tables stored once."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.export.graph_signature import InputKind

from foldline.frontend.arch import get_preset
from foldline.frontend.export import export_model, parameter_target
from foldline.frontend.model import build_model
from foldline.frontend.quant import quantize
from foldline.passes.manager import CompileUnit, run_pipeline
from foldline.passes.quantize_weights import QEMBEDDING, QLINEAR, WeightsModeError
from foldline.testing.golden import GOLDEN_TOL, golden_check, make_steps

PASS = "quantize-weights"
PRESETS = ["llama-tiny", "gemma3-tiny", "qwen35-tiny", "ripple-tiny"]


def _blocked_unit(preset: str, fmt: str = "q4", mode: str = "auto",
                  format_of: Callable[[str], str] | None = None) -> CompileUnit:
    """A preset whose 2-D weights hold exactly the dequantized values of their blocks (a GGUF's situation).

    format_of: module name -> block format (default: `fmt`, the embedding q8).
    """
    cfg = get_preset(preset)
    model = build_model(cfg, seed=0)
    blocks = {}
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            chosen = format_of(name) if format_of else (fmt if "embed" not in name else "q8")
            b = quantize(module.weight.detach().numpy(), chosen)
            with torch.no_grad():
                module.weight.copy_(torch.from_numpy(b.dequantize()))
            blocks[parameter_target(f"{name}.weight")] = b
    with torch.no_grad():
        entries = export_model(model, batch=2, chunk=8)
    return CompileUnit(cfg, {n: e.program for n, e in entries.items()}, entries["prefill"].state_specs,
                       options={"weights": mode}, source_blocks=blocks)


def _steps(cfg):
    return make_steps([11, 5], chunk=8, decode_steps=20, vocab_size=cfg.vocab_size)


def _lifted(program):
    return {s.target for s in program.graph_signature.input_specs if s.kind == InputKind.PARAMETER}


@pytest.mark.parametrize("preset", PRESETS)
def test_checkpoint_blocks_match_eager_within_fp32(preset):
    unit = _blocked_unit(preset)
    after, report, pass_report = golden_check(unit, [PASS], _steps(unit.config))
    assert pass_report[0]["changed"]
    assert report.worst_logit_error < GOLDEN_TOL["float32"], report.summary()
    assert report.worst_state_error < GOLDEN_TOL["float32"], report.summary()
    for program in after.programs.values():
        targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
        assert QLINEAR in targets and QEMBEDDING in targets
        assert torch.ops.aten.linear.default not in targets  # every linear reads blocks
        lifted = _lifted(program)
        assert not any(t.endswith("proj.weight") or t.endswith("embed_tokens.weight") for t in lifted)
        assert any(t.endswith(".codes") for t in lifted)


def test_a_tied_table_is_stored_once_and_read_by_lookup_and_head():
    unit = _blocked_unit("gemma3-tiny")
    run_pipeline(unit, [PASS], progress=lambda _m: None)
    program = unit.programs["decode"]
    readers = [n for n in program.graph.nodes if n.op == "call_function" and n.target in (QLINEAR, QEMBEDDING)]
    table = [n for n in readers if "embed_tokens" in n.args[1 if n.target == QLINEAR else 0].name]
    assert {n.target for n in table} == {QLINEAR, QEMBEDDING}
    codes = [t for t in _lifted(program) if t.startswith("model.embed_tokens.weight.")]
    assert sorted(codes) == ["model.embed_tokens.weight.codes", "model.embed_tokens.weight.scales"]
    # prefill and decode share the same tensors: the importer writes them once
    assert program.state_dict["model.embed_tokens.weight.codes"] is \
        unit.programs["prefill"].state_dict["model.embed_tokens.weight.codes"]


@pytest.mark.parametrize("mode,bound", [("int8", 2e-2), ("int4", 0.25)])
def test_requantized_float_weights_stay_close_and_report_their_error(mode, bound, exported_unit):
    cfg = get_preset("llama-tiny")
    unit = exported_unit(cfg, batch=2, chunk=8)
    unit = CompileUnit(unit.config, dict(unit.programs), list(unit.state_specs), options={"weights": mode})
    after, report, pass_report = golden_check(unit, [PASS], _steps(cfg))
    assert report.worst_logit_error < bound, report.summary()
    assert report.worst_logit_error > 1e-6  # a lossy path really ran
    weights = pass_report[0]["notes"]
    assert any("requantized" in n for n in weights)
    assert any(n.startswith("worst requantization") for n in weights)


def test_f32_mode_and_float_checkpoints_change_nothing(exported_unit):
    cfg = get_preset("llama-tiny")
    base = exported_unit(cfg, batch=2, chunk=8)
    for mode in ("f32", "auto"):  # auto without checkpoint blocks: floats stay floats
        unit = CompileUnit(base.config, dict(base.programs), list(base.state_specs), options={"weights": mode})
        report = run_pipeline(unit, [PASS], progress=lambda _m: None)
        assert not report[0]["changed"]
        assert unit.programs["decode"] is base.programs["decode"]


def test_the_pass_is_idempotent():
    unit = _blocked_unit("llama-tiny")
    run_pipeline(unit, [PASS], progress=lambda _m: None)
    first = dict(unit.programs)
    assert not run_pipeline(unit, [PASS], progress=lambda _m: None)[0]["changed"]
    assert unit.programs == first


def test_unknown_mode_is_a_clear_error():
    unit = _blocked_unit("llama-tiny", mode="int3")
    with pytest.raises(WeightsModeError, match="int3"):
        run_pipeline(unit, [PASS], progress=lambda _m: None)
