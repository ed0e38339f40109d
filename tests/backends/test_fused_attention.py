"""Prefill attention fused into one flash-style op (backends/iree/fused_attention.py): the fused lowering and its
`fused-attention` target pass golden against eager, compiled against eager across many KV tiles, and which
targets take it."""

from __future__ import annotations

import collections
import dataclasses
import json

import numpy as np
import pytest
import torch

from foldline.backends.iree.fused_attention import (
    FUSED_ATTENTION_PASS,
    SITE_NAME,
    attention_form,
    count_fused_attention,
    fused_decompositions,
)
from foldline.backends.lowering import Lowering
from foldline.errors import InputError
from foldline.frontend.arch import get_preset
from foldline.frontend.sources import load_model
from foldline.passes.manager import run_pipeline, run_target_passes
from foldline.runtime import Model
from foldline.testing.golden import compare_units, copy_unit, make_steps
from foldline.testing.parity import SCALED_TOL_FP32, run_parity

SDPA = torch.ops.aten.scaled_dot_product_attention.default
CACHE_ATTENTION = torch.ops.foldline.cache_attention.default


def _never(_name, _node) -> bool:
    return False


def _count(program, target) -> int:
    return sum(n.op == "call_function" and n.target == target for n in program.graph.nodes)


@pytest.mark.parametrize(("device", "requested", "form"), [
    ("cuda", "auto", "fused"), ("cuda", "decomposed", "decomposed"), ("cuda", "fused", "fused"),
    ("cpu", "auto", "decomposed"), ("cpu", "fused", "fused"), ("cpu", "decomposed", "decomposed"),
    # backends that cannot compile the attention op keep the portable form whatever is asked
    ("vulkan", "fused", "decomposed"), ("vulkan", "auto", "decomposed"), ("onnxruntime", "fused", "decomposed"),
])
def test_which_targets_take_the_fused_form(device, requested, form):
    assert attention_form(device, requested) == form


def test_an_unknown_form_is_refused():
    with pytest.raises(InputError, match="--attention must be one of auto, fused, decomposed"):
        attention_form("cpu", "flash")


@pytest.mark.usefixtures("torch_one_thread")
@pytest.mark.parametrize(("preset", "batch", "passes"), [
    ("llama-tiny", 1, ()),  # GQA, every layer global
    ("gemma3-tiny", 2, ()),  # sliding-window layers as full caches: the window in the mask; rows apart
    ("gemma3-tiny", 1, ("ring-buffer-swa",)),  # rings for the windows, the global layers fused
    ("qwen35-tiny", 1, ()),  # gated attention beside GDN layers
])
def test_fused_lowering_matches_eager(preset, batch, passes, exported_unit, tmp_path):
    """Every prefill chunk's cache attention becomes one attention op (the fused lowering, then the
    fused-attention pass, dumped as any pass), decode's stays decomposed, and the lowered program follows
    the eager one within fp32 over prompts that cross four 64-slot tiles."""
    cfg = get_preset(preset).replace(max_context=320)
    unit = copy_unit(exported_unit(cfg, batch=batch, chunk=16))
    run_pipeline(unit, list(passes), progress=lambda _m: None)
    low = Lowering(fused_decompositions())
    fused = dataclasses.replace(unit, programs={n: low.program(n, p, _never) for n, p in unit.programs.items()})
    dumps = tmp_path / "dump"
    report = run_target_passes(fused, [FUSED_ATTENTION_PASS], dump_after={FUSED_ATTENTION_PASS: dumps},
                               progress=lambda _m: None)
    for name, program in unit.programs.items():
        kept = _count(program, CACHE_ATTENTION)
        sdpa = _count(fused.programs[name], SDPA)
        assert sdpa == (kept if name.startswith("prefill") else 0), (name, kept, sdpa)
    assert _count(fused.programs["prefill"], SDPA) > 0
    assert report[0]["sites"] == sum(_count(p, SDPA) for p in fused.programs.values())
    assert "scaled_dot_product_attention" in (dumps / f"prefill.after-{FUSED_ATTENTION_PASS}.txt").read_text()

    prompts = [260] if batch == 1 else [260, 75]
    report = compare_units(unit, fused, make_steps(prompts, 16, 12, cfg.vocab_size, seed=3))
    assert report.worst_logit_error < SCALED_TOL_FP32, report
    assert report.worst_state_error < SCALED_TOL_FP32, report


def test_the_decomposed_lowering_keeps_no_attention_op(exported_unit):
    cfg = get_preset("llama-tiny").replace(max_context=256)
    unit = exported_unit(cfg, batch=1, chunk=16)
    low = Lowering()
    assert all(_count(low.program(n, p, _never), SDPA) == 0 for n, p in unit.programs.items())


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["llama-tiny", "gemma3-tiny"])
def test_fused_attention_compiled_for_cpu_matches_eager(preset, bundle_factory):
    """IREE's attention op (the form CUDA takes by default), forced on the CPU target so that CI runs it:
    a 300-token prompt over five KV tiles and 40 greedy steps within fp32 of eager; the manifest counts
    one fused site per global layer."""
    bundle = bundle_factory(preset, max_context=512, attention="fused")
    loaded = load_model(preset, max_context=512)
    manifest = json.loads((bundle / "manifest.json").read_text())
    sites = manifest["modules"]["cpu"]["kernels"]
    global_layers = collections.Counter(loaded.config.layer_types)["global"]
    assert sites.get(SITE_NAME) == global_layers > 0, sites
    prompt = np.random.default_rng(1).integers(0, loaded.config.vocab_size, size=300).tolist()
    with Model.load(bundle, device="cpu") as model:
        report = run_parity(loaded.module, model, prompt, steps=40)
    assert report.ok(), report.summary()


def test_fused_sites_are_counted_in_the_imported_text():
    text = ("%1 = torch.aten.scaled_dot_product_attention %q, %k, %v, %m : ...\n"
            "%2 = torch.aten.scaled_dot_product_attention %q, %k, %v, %m : ...\n"
            "%3 = torch.aten.softmax.int %x")
    assert count_fused_attention(text) == 2


@pytest.mark.usefixtures("torch_one_thread")
def test_each_one_row_prefix_becomes_one_online_attention(exported_unit):
    """After the import, each prefill layer's unmasked attention and its log-sum-exp (the same queries and
    keys) are one call of an online-attention function, whose key length is the symbolic prefix; the
    batched form keeps its masked attention op and has none."""
    from foldline.backends.iree.importer import import_programs
    from foldline.backends.iree.online_attention import expand_online_attention
    from foldline.passes.manager import TargetPasses

    cfg = get_preset("llama-tiny").replace(max_context=512)
    for batch, expected in ((1, cfg.num_layers), (2, 0)):
        unit = copy_unit(exported_unit(cfg, batch=batch, chunk=16))
        mlir, _params = import_programs(unit.programs.items(), lowering=Lowering(fused_decompositions()),
                                        target_passes=TargetPasses(unit, [FUSED_ATTENTION_PASS], {}))
        assert count_fused_attention(mlir) == cfg.num_layers
        text, merged = expand_online_attention(mlir)
        assert merged == expected
        assert "attention_lse" not in text
        assert text.count("iree_linalg_ext.online_attention") == (1 if expected else 0)  # one function, shared
        assert count_fused_attention(text) == cfg.num_layers - expected
        if expected:
            assert "tensor<1x2x?x16xf32>" in text  # the prefix: T - min(T, 2) tiles of 64 keys
