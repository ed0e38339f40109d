"""Lowering node by node: the same program `run_decompositions` gives, at a fraction of its cost;
decode attention kept for the CPU kernel where it covers the shape, decomposed elsewhere."""

from __future__ import annotations

import collections
import dataclasses
import operator

import pytest
import torch

from foldline.backends import lowering
from foldline.backends.iree.importer import kernel_keep_rule
from foldline.frontend.arch import get_preset
from foldline.passes.graph_edit import copy_graph_module, rebuild
from foldline.passes.manager import run_pipeline
from foldline.testing.golden import UnitRunner, copy_unit, make_steps

pytestmark = pytest.mark.usefixtures("torch_one_thread")

ATTENTION_OPS = (torch.ops.foldline.cache_attention.default, torch.ops.foldline.ring_attention.default,
                 torch.ops.foldline.ring_decode_attention.default)
# What run_decompositions adds that the node-wise form needs not: its re-functionalisation writes
# the state outputs through `copy` and turns lift_fresh_copy into clone; node-wise expansion keeps
# the exported program's own functional form.
RETRACE_ONLY = {"aten.copy.default", "aten.clone.default"}
NODEWISE_ONLY = {"aten.lift_fresh_copy.default"}


def _ops(program) -> collections.Counter:
    """The tensor ops of a program (SymInt arithmetic, which either form may spell its own way, left out)."""
    return collections.Counter(str(n.target) for n in program.graph.nodes
                               if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                               and n.target != torch.ops.aten.sym_size.int)


def _unit(exported_unit, cfg, batch: int, passes=("ring-buffer-swa",)):
    unit = copy_unit(exported_unit(cfg, batch=batch, chunk=8))
    run_pipeline(unit, list(passes), progress=lambda _m: None)
    return unit


def _never(_name, _node) -> bool:
    return False


@pytest.mark.parametrize(("preset", "batch", "context"), [
    ("llama-tiny", 1, 256), ("gemma3-tiny", 2, 256), ("qwen35-tiny", 1, 128), ("ripple-tiny", 1, 128),
])
def test_nodewise_lowering_equals_run_decompositions(preset, batch, context, exported_unit):
    """Same core-aten ops, and bit-identical logits and state over prompts and decodes that cross
    attention tiles (context 256: four tiles of 64) and wrap the rings."""
    cfg = get_preset(preset).replace(max_context=context)
    unit = _unit(exported_unit, cfg, batch)
    low = lowering.Lowering()
    nodewise = dataclasses.replace(unit, programs={n: low.program(n, p, _never) for n, p in unit.programs.items()})
    retraced = dataclasses.replace(unit, programs={n: lowering.lower_to_aten(p) for n, p in unit.programs.items()})
    for name in unit.programs:
        a, b = _ops(nodewise.programs[name]), _ops(retraced.programs[name])
        assert {k: v for k, v in (a - b).items() if k not in NODEWISE_ONLY} == {}, name
        assert {k: v for k, v in (b - a).items() if k not in RETRACE_ONLY} == {}, name
        assert not any(n.target in low.table for n in nodewise.programs[name].graph.nodes
                       if n.op == "call_function"), name

    prompts = [70] if batch == 1 else [70, 21]
    steps = make_steps(prompts, 8, 6, cfg.vocab_size, seed=5)  # past the first 64-slot tile and the rings
    a, b = UnitRunner(nodewise), UnitRunner(retraced)
    for i, step in enumerate(steps):
        got, want = a.step(step)[0], b.step(step)[0]
        assert torch.equal(got, want), (i, step.entry)
        for x, y in zip(a.state, b.state):
            assert torch.equal(x, y), (i, step.entry)


def test_the_attention_length_stays_symbolic(exported_unit):
    """prefill's attention reads a slice whose length comes from kv_tiles, not the traced example:
    a decomposition traced on the example value alone would fix it at the traced length."""
    cfg = get_preset("llama-tiny").replace(max_context=256)
    unit = _unit(exported_unit, cfg, 1, passes=())
    prefill = lowering.Lowering().program("prefill", unit.programs["prefill"], _never)
    tiles = next(n for n in prefill.graph.nodes if n.op == "placeholder" and n.name == "kv_tiles")
    reads = [n for n in prefill.graph.nodes if n.target == torch.ops.aten.slice.Tensor
             and any(isinstance(a, torch.fx.Node) and a.op == "call_function" and a.target is operator.floordiv
                     for a in n.args)]
    assert len(reads) >= 2 * cfg.num_layers, "every K and V read is cut by the symbolic tile count"
    assert tiles.users, "kv_tiles is read"


def test_shared_meta_values_are_not_one_tensor(exported_unit):
    """Two results inlined from one trace share their meta values; a later trace that took those as its
    inputs would read K for V. The K/V written by the same decomposition must stay two tensors."""
    cfg = get_preset("llama-tiny").replace(max_context=256)
    unit = _unit(exported_unit, cfg, 1, passes=())
    gm = copy_graph_module(unit.programs["prefill"])
    traces: dict = {}
    lowering.expand_ops(gm, lambda n: n.target == torch.ops.foldline.kv_cache_write.default, traces=traces)
    lowering.expand_ops(gm, lambda n: n.target == torch.ops.foldline.cache_attention.default, traces=traces)
    lowered = rebuild(unit.programs["prefill"], gm)
    steps = make_steps([20], 8, 0, cfg.vocab_size, seed=2)
    runs = [UnitRunner(dataclasses.replace(unit, programs={"prefill": p})) for p in (lowered, unit.programs["prefill"])]
    for step in steps:
        assert torch.equal(runs[0].step(step)[0], runs[1].step(step)[0])


def test_the_cpu_kernel_keeps_decode_attention_it_covers(exported_unit):
    cfg = get_preset("gemma3-tiny")
    unit = _unit(exported_unit, cfg, 1)
    low = lowering.Lowering()
    keep = kernel_keep_rule(decode_attention_kernel=True)
    for name, program in unit.programs.items():
        nodes = list(low.program(name, program, keep).graph.nodes)
        kept = [n for n in nodes if n.target in ATTENTION_OPS]
        writes = [n for n in nodes if n.target in lowering.DECODE_WRITE_OPS]
        if name == "decode":
            assert len(kept) == cfg.num_layers and all(n.target in lowering.DECODE_ATTENTION_OPS for n in kept), name
            # and the two cache writes each reads, which the kernel makes itself (the ring's and the full cache's)
            assert len(writes) == 2 * cfg.num_layers and {n.target for n in writes} == set(lowering.DECODE_WRITE_OPS)
            assert all(cache.target in lowering.DECODE_WRITE_OPS for node in kept for cache in node.args[1:3])
        else:
            assert kept == [] and writes == [], name
    gpu = low.program("decode", unit.programs["decode"], kernel_keep_rule(decode_attention_kernel=False))
    assert not any(n.target in ATTENTION_OPS + lowering.DECODE_WRITE_OPS for n in gpu.graph.nodes)


def test_a_head_dim_no_kernel_covers_is_decomposed(exported_unit):
    """head_dim 24 is not a whole number of 16-lane vectors: the portable form, not a failed compile."""
    cfg = dataclasses.replace(get_preset("gemma3-tiny"), head_dim=24)
    unit = _unit(exported_unit, cfg, 1)
    decode = lowering.Lowering().program("decode", unit.programs["decode"], kernel_keep_rule(decode_attention_kernel=True))
    assert not any(n.target in ATTENTION_OPS + lowering.DECODE_WRITE_OPS for n in decode.graph.nodes)


def test_expand_ops_traces_each_signature_once(exported_unit):
    cfg = get_preset("llama-tiny")
    unit = _unit(exported_unit, cfg, 1, passes=())
    gm, traces = copy_graph_module(unit.programs["prefill"]), {}
    n = lowering.expand_ops(gm, lambda node: node.target in ATTENTION_OPS, traces=traces)
    assert n == cfg.num_layers and len(traces) == 1  # every layer has the same attention call
    assert not any(node.target in ATTENTION_OPS for node in gm.graph.nodes)
