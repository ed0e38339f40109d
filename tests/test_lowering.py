"""Lowering each graph once: length variants derived from their base's decomposition equal the
variants decomposed on their own, and a decode attention shape no kernel covers is decomposed."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from foldline.backends import lowering
from foldline.backends.importer import kernel_keep_rule
from foldline.frontend.arch import get_preset
from foldline.passes.graph_edit import copy_graph_module
from foldline.passes.kv_length_buckets import ATTENTION_OPS
from foldline.passes.manager import run_pipeline
from foldline.testing.golden import UnitRunner, copy_unit, make_steps

pytestmark = pytest.mark.usefixtures("torch_one_thread")

LENGTHS = [8]  # below the tiny presets' 16-slot rings, so a ring read is cut too


def _ops(program) -> collections.Counter:
    return collections.Counter(str(n.target) for n in program.graph.nodes if n.op == "call_function")


def _bucketed(exported_unit, cfg, batch: int):
    unit = copy_unit(exported_unit(cfg, batch=batch, chunk=8))
    unit.options = {"kv_lengths": LENGTHS}
    run_pipeline(unit, ["ring-buffer-swa", "kv-length-buckets"], progress=lambda _m: None)
    return unit


def _never(_name, _node) -> bool:
    return False


@pytest.mark.parametrize(("preset", "batch"), [("llama-tiny", 1), ("gemma3-tiny", 2)])
def test_derived_variants_equal_their_own_decomposition(preset, batch, exported_unit):
    """Same ops, and bit-identical logits and state over prompts and decodes that cross every length."""
    cfg = get_preset(preset)
    unit = _bucketed(exported_unit, cfg, batch)
    lowered = lowering.lower_entries(unit.programs.items(), unit.variants)
    assert set(lowered.decomposed) == {"prefill", "decode"}  # the variants were not decomposed
    assert set(lowered.variants) == set(unit.programs) - {"prefill", "decode"}

    derived = dataclasses.replace(unit, programs={n: lowered.program(n, _never) for n in unit.programs})
    alone = dataclasses.replace(unit, programs={n: lowering.lower_to_aten(p) for n, p in unit.programs.items()})
    for name in unit.programs:
        assert _ops(derived.programs[name]) == _ops(alone.programs[name]), name
        assert not any(n.target in ATTENTION_OPS for n in derived.programs[name].graph.nodes), name

    prompts = [13] if batch == 1 else [13, 5]
    steps = make_steps(prompts, 8, 6, cfg.vocab_size, seed=5)  # positions up to 18: past 8 and the ring
    a, b = UnitRunner(derived), UnitRunner(alone)
    for step in steps:
        end = int(step.end_pos.max())
        length = next((n for n in LENGTHS if end <= n), None)
        entry = step.entry if length is None else f"{step.entry}_{length}"
        step = dataclasses.replace(step, entry=entry)
        got, want = a.step(step)[0], b.step(step)[0]
        assert torch.equal(got, want), entry
        for x, y in zip(a.state, b.state):
            assert torch.equal(x, y), entry


def test_edited_variants_are_decomposed_on_their_own(exported_unit):
    """A pass that replaces a variant after kv-length-buckets breaks the derivation: it is decomposed."""
    unit = _bucketed(exported_unit, get_preset("llama-tiny"), 1)
    programs = dict(unit.programs)
    programs["decode_8"] = copy_unit(unit).programs["prefill_8"]  # another object under that name
    lowered = lowering.lower_entries(programs.items(), unit.variants)
    assert "decode_8" in lowered.decomposed and "decode_8" not in lowered.variants
    assert "prefill_8" in lowered.variants


def test_the_cpu_kernel_keeps_decode_attention_it_covers(exported_unit):
    cfg = get_preset("gemma3-tiny")
    unit = _bucketed(exported_unit, cfg, 1)
    lowered = lowering.lower_entries(unit.programs.items(), unit.variants)
    keep = kernel_keep_rule(decode_attention_kernel=True)
    for name in unit.programs:
        kept = [n for n in lowered.program(name, keep).graph.nodes if n.target in ATTENTION_OPS]
        if name.startswith("decode"):
            assert len(kept) == cfg.num_layers and all(n.target in lowering.DECODE_ATTENTION_OPS for n in kept), name
        else:
            assert kept == [], name
    gpu = lowered.program("decode", kernel_keep_rule(decode_attention_kernel=False))
    assert not any(n.target in ATTENTION_OPS for n in gpu.graph.nodes)


def test_a_head_dim_no_kernel_covers_is_decomposed(exported_unit):
    """head_dim 24 is not a whole number of 16-lane vectors: the portable form, not a failed compile."""
    cfg = dataclasses.replace(get_preset("gemma3-tiny"), head_dim=24)
    unit = _bucketed(exported_unit, cfg, 1)
    lowered = lowering.lower_entries(unit.programs.items(), unit.variants)
    decode = lowered.program("decode", kernel_keep_rule(decode_attention_kernel=True))
    assert not any(n.target in ATTENTION_OPS for n in decode.graph.nodes)


def test_expand_ops_traces_each_signature_once(exported_unit):
    cfg = get_preset("llama-tiny")
    unit = _bucketed(exported_unit, cfg, 1)
    base = lowering.lower_to_aten(unit.programs["prefill"], keep=ATTENTION_OPS)
    gm, traces = copy_graph_module(base), {}
    n = lowering.expand_ops(gm, lambda node: node.target in ATTENTION_OPS, traces=traces)
    assert n == cfg.num_layers and len(traces) == 1  # every layer has the same attention call
    assert not any(node.target in ATTENTION_OPS for node in gm.graph.nodes)
