"""The default pipeline end to end: graph dumps, `foldline passes`, compiled bundles against eager."""

from __future__ import annotations

import json

import numpy as np
import pytest

from foldline.frontend.arch import get_preset
from foldline.passes.manager import available_passes, default_pipeline, run_pipeline
from foldline.passes.state_layout import plan_state
from foldline.testing.golden import copy_unit
from foldline.tools.cli import main

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def test_dump_after_writes_graphs(exported_unit, tmp_path):
    unit = copy_unit(exported_unit(get_preset("ripple-tiny"), batch=2, chunk=8))
    dumps = {"fold-embedding-scale": tmp_path / "fold", "ring-buffer-swa": tmp_path / "ring"}
    run_pipeline(unit, ["fold-embedding-scale", "ring-buffer-swa"], dump_after=dumps, progress=lambda _m: None)
    for entry in unit.programs:
        fold_code = (tmp_path / "fold" / f"{entry}.after-fold-embedding-scale.txt").read_text()
        ring_code = (tmp_path / "ring" / f"{entry}.after-ring-buffer-swa.txt").read_text()
        assert "embed_tokens_weight_scaled" in fold_code and "ring_attention" not in fold_code
        attention = "ring_decode_attention" if entry.startswith("decode") else "ring_attention"
        assert attention in ring_code and "ring_write" in ring_code
        assert (tmp_path / "ring" / f"{entry}.after-ring-buffer-swa.graph.txt").stat().st_size > 0


def test_passes_command_lists_passes(capsys):
    assert main(["passes"]) == 0
    out = capsys.readouterr().out
    pipeline = default_pipeline()
    for name, p in available_passes().items():
        line = next(line for line in out.splitlines() if line.startswith(name + " "))
        assert p.description in line
        assert ("[default" in line) == (name in pipeline)
    assert " -> ".join(pipeline) in out
    assert pipeline.index("fold-embedding-scale") < pipeline.index("ring-buffer-swa")


def test_passes_command_lists_the_target_passes(capsys):
    """The backends' FX rewrites are registered passes, listed with the target they apply to, never default."""
    from foldline.backends.iree.fused_attention import FUSED_ATTENTION_PASS
    from foldline.backends.onnx.gqa import GQA_PASS

    assert main(["passes"]) == 0
    out = capsys.readouterr().out
    passes = available_passes()
    for name, target in ((FUSED_ATTENTION_PASS, "iree, fused attention"), (GQA_PASS, "onnx")):
        assert passes[name].target == target
        line = next(line for line in out.splitlines() if line.startswith(name + " "))
        assert f"[target: {target}]" in line and passes[name].description in line
        assert name not in default_pipeline()


def test_passes_command_lists_the_onnx_graph_rewrites(capsys):
    """The ONNX graph's rewrites, a level below the passes, under their own heading, each the export runs."""
    from foldline.backends.onnx.export import GRAPH_REWRITE_ORDER
    from foldline.backends.onnx.graph_rewrites import GRAPH_REWRITES

    assert main(["passes"]) == 0
    out = capsys.readouterr().out.splitlines()
    heading = next(i for i, line in enumerate(out) if line.startswith("onnx graph:"))
    listed = {line.split()[0]: line for line in out[heading + 1:]}
    assert set(listed) == set(GRAPH_REWRITES) == set(GRAPH_REWRITE_ORDER)
    for name, rewrite in GRAPH_REWRITES.items():
        assert rewrite.description in listed[name]


# ---- compiled (IREE CPU) ----------------------------------------------------------------------------


def _check_bundle(spec: str, bundle_dir) -> None:
    from foldline.frontend.sources import load_model
    from foldline.runtime import Model
    from foldline.testing.parity import SCALED_TOL_FP32, run_parity

    cfg = get_preset(spec)
    manifest = json.loads((bundle_dir / "manifest.json").read_text())
    ran = {p["name"]: p for p in manifest["passes"]}
    assert ran["fold-embedding-scale"]["changed"] and ran["ring-buffer-swa"]["changed"]
    plan = plan_state(cfg, batch=1)
    # The manifest lists exactly the planned buffers: local layers hold W slots, global ones all.
    assert [(s["name"], tuple(s["shape"]), s["kind"]) for s in manifest["state"]] == [
        (s.name, s.shape, s.kind) for s in plan.specs
    ]
    for s in manifest["state"]:
        assert s["shape"][2] == (cfg.sliding_window if s["kind"] == "local_kv" else cfg.max_context)
    assert manifest["state_bytes"] == plan.total_bytes < plan.naive_bytes

    bundle = Model.load(bundle_dir)
    session = bundle.session()
    assert session.allocated_bytes == plan.total_bytes
    # Greedy decode well past 4 windows, against the reference module without any pass.
    module = load_model(spec).module
    prompt = np.random.default_rng(3).integers(0, cfg.vocab_size, size=37).tolist()
    steps = 4 * cfg.sliding_window + 10
    report = run_parity(module, bundle, prompt, steps)
    assert report.steps == steps + 1
    print(f"{spec} compiled vs eager: {report.summary()}")
    assert report.ok(SCALED_TOL_FP32), report.summary()


@pytest.mark.slow
def test_compiled_ripple_tiny_default_pipeline(cli_bundle, tmp_path_factory):
    """Compiled through `foldline compile --dump-after`, which also writes the graph after the ring pass."""
    dump = tmp_path_factory.mktemp("ripple_dump")
    bundle_dir = cli_bundle("ripple-tiny", "--cpu", "host", "--dump-after", "ring-buffer-swa", str(dump))
    assert "ring_decode_attention" in (dump / "decode.after-ring-buffer-swa.txt").read_text()
    _check_bundle("ripple-tiny", bundle_dir)


@pytest.mark.slow
def test_compiled_gemma3_tiny_default_pipeline(bundle_factory):
    _check_bundle("gemma3-tiny", bundle_factory("gemma3-tiny"))
