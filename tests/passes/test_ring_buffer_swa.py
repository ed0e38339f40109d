"""ring-buffer-swa: golden tests against the full-cache reference, corner cases, layout."""

from __future__ import annotations

import pytest
import torch

from foldline.frontend import attention_ops
from foldline.frontend.arch import get_preset
from foldline.passes.graph_edit import copy_graph_module, rebuild, state_placeholder_names
from foldline.passes.manager import run_pipeline
from foldline.passes.state_layout import planned_state_specs
from foldline.testing.golden import (
    GOLDEN_TOL,
    compare_units,
    copy_unit,
    golden_check,
    make_steps,
    ring_from_full,
)

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PASS = "ring-buffer-swa"
TOL = GOLDEN_TOL["float32"]


def corner_config(window: int = 5, layers: tuple[str, ...] = ("local", "global", "local"), max_context: int = 64):
    """Ripple's block with a small window and few layers: cheap to export, wraps often."""
    return get_preset("ripple-tiny").replace(
        name=f"ring-corner-w{window}", layer_types=layers, sliding_window=window, max_context=max_context
    )


def _targets(program, op):
    return [n for n in program.graph.nodes if n.op == "call_function" and n.target == op]


# ---- the op pair the pass rewrites to, against the reference pair ---------------------------------


@pytest.mark.parametrize("chunk", [1, 3, 5, 8, 13])
def test_ring_ops_match_full_cache_ops(chunk):
    """Random chunk sequences, rows at different positions, empty and padded chunks, chunk vs W."""
    gen = torch.Generator().manual_seed(chunk)
    b, h, d, window, length = 3, 2, 4, 5, 64
    full_k = torch.zeros(b, h, length + 1, d)  # one slot more: a full row's empty chunk may write its last slot
    ring_k = torch.zeros(b, h, window, d)
    full_v, ring_v = full_k.clone(), ring_k.clone()
    pos = torch.tensor([0, 3, 11])
    for _ in range(12):
        n_valid = torch.randint(0, chunk + 1, (b,), generator=gen)
        n_valid = torch.minimum(n_valid, length - pos)
        k_new = torch.randn(b, h, chunk, d, generator=gen)
        v_new = torch.randn(b, h, chunk, d, generator=gen)
        q = torch.randn(b, 2 * h, chunk, d, generator=gen)
        full_k = attention_ops.kv_cache_write_impl(full_k, k_new, pos, n_valid)
        full_v = attention_ops.kv_cache_write_impl(full_v, v_new, pos, n_valid)
        want = attention_ops.cache_attention_impl(q, full_k, full_v, pos, window, 0.5, "blocked", full_k.shape[2])
        got = attention_ops.ring_attention_impl(q, ring_k, ring_v, k_new, v_new, pos, n_valid, window, 0.5, "blocked")
        ring_k = attention_ops.ring_write_impl(ring_k, k_new, pos, n_valid)
        ring_v = attention_ops.ring_write_impl(ring_v, v_new, pos, n_valid)
        valid = torch.arange(chunk)[None, :] < n_valid[:, None]  # padded queries have no defined output
        assert torch.allclose(got.transpose(1, 2)[valid], want.transpose(1, 2)[valid], atol=1e-6)
        pos = pos + n_valid
        assert torch.equal(ring_k, ring_from_full(full_k, pos, window))
        assert torch.equal(ring_v, ring_from_full(full_v, pos, window))


def test_padded_chunk_leaves_live_slots_alone():
    ring = torch.arange(1 * 1 * 4 * 2, dtype=torch.float32).reshape(1, 1, 4, 2)
    new = torch.full((1, 1, 6, 2), -1.0)
    out = attention_ops.ring_write_impl(ring, new, torch.tensor([9]), torch.tensor([0]))
    assert torch.equal(out, ring)
    out = attention_ops.ring_write_impl(ring, new, torch.tensor([9]), torch.tensor([2]))  # positions 9, 10 -> slots 1, 2
    assert torch.equal(out[0, 0, [0, 3]], ring[0, 0, [0, 3]])
    assert torch.equal(out[0, 0, [1, 2]], new[0, 0, :2])


# ---- golden tests on the presets -----------------------------------------------------------------


@pytest.mark.parametrize("preset", ["ripple-tiny", "gemma3-tiny"])
def test_ring_golden_presets(preset, exported_unit):
    """Batch 2, rows at different positions, chunk < W; >= 4W decodes after the prompt (several wraps)."""
    cfg = get_preset(preset)
    unit = exported_unit(cfg, batch=2, chunk=8)
    window = cfg.sliding_window
    prompts = [37, 21]  # row 1 finishes early: a padded chunk, then an empty one
    decodes = 4 * window + 6
    assert max(prompts) + decodes <= cfg.max_context
    steps = make_steps(prompts, 8, decodes, cfg.vocab_size, seed=1)
    after, report, pass_report = golden_check(unit, [PASS], steps)
    print(f"{preset} ring golden: {report.summary()}")
    assert report.ok(TOL), report.summary()
    assert report.steps == len(steps)

    local = cfg.layers_of("local")
    assert pass_report[0]["changed"] and pass_report[0]["sites"] == 2 * len(local)  # prefill and decode
    for before_spec, spec in zip(unit.state_specs, after.state_specs):
        if spec.layers[0] in local:
            assert spec.kind == "local_kv" and spec.shape == (2, cfg.num_kv_heads, window, cfg.head_dim)
        else:
            assert spec == before_spec
    saved = sum(s.nbytes for s in unit.state_specs) - sum(s.nbytes for s in after.state_specs)
    assert pass_report[0]["bytes_saved"] == saved > 0
    assert after.state_specs == planned_state_specs(cfg, 2)

    for name, program in after.programs.items():
        assert all(n.args[4] == 0 for n in _targets(program, torch.ops.foldline.cache_attention.default)), name
        # chunks read the old ring beside the new tokens; one token reads only the written ring
        one_token = name.startswith("decode")
        attention = torch.ops.foldline.ring_decode_attention if one_token else torch.ops.foldline.ring_attention
        write = torch.ops.foldline.ring_write_token if one_token else torch.ops.foldline.ring_write
        assert len(_targets(program, attention.default)) == len(local), name
        assert len(_targets(program, write.default)) == 2 * len(local)
        # The importer reads shapes from node meta: placeholders and every node downstream are re-typed.
        states = state_placeholder_names(program, len(after.state_specs))
        nodes = {n.name: n for n in program.graph.nodes}
        for spec, ph in zip(after.state_specs, states):
            assert tuple(nodes[ph].meta["val"].shape) == spec.shape
        order = {n: i for i, n in enumerate(program.graph.nodes)}
        for node in _targets(program, write.default):
            assert node.meta["val"].shape[2] == window
            # The compiled module writes the caller's buffer in place: reads of the old ring come first,
            # and a one-token program has none (its attention reads the write's result).
            readers = [u for u in node.args[0].users if u is not node and u.target != torch.ops.aten.copy.default]
            if one_token:
                assert readers == [] and [u.target for u in node.users if u.target != torch.ops.aten.copy.default] == [
                    torch.ops.foldline.ring_decode_attention.default
                ]
            else:
                assert readers and all(order[r] < order[node] for r in readers)
        for node in _targets(program, torch.ops.aten.copy.default):
            assert tuple(node.meta["val"].shape) == tuple(node.args[0].meta["val"].shape)
        # The original program is untouched (golden tests need it).
        assert _targets(unit.programs[name], torch.ops.foldline.ring_write.default) == []


def test_ring_not_applicable_to_llama(exported_unit):
    unit = copy_unit(exported_unit(get_preset("llama-tiny")))
    programs = dict(unit.programs)
    report = run_pipeline(unit, [PASS], progress=lambda _m: None)
    assert not report[0]["changed"] and report[0]["bytes_saved"] == 0
    assert unit.programs == programs


@pytest.mark.parametrize("chunk", [5, 12])
def test_ring_corner_cases(chunk, exported_unit):
    """W = 5: chunks equal to and longer than 2W, padded last chunks over live slots, empty chunks."""
    cfg = corner_config(window=5)
    unit = exported_unit(cfg, batch=2, chunk=chunk)
    steps = make_steps([19, 6], chunk, 4 * 5 + 3, cfg.vocab_size, seed=chunk)
    counts = [v for s in steps if s.n_valid is not None for v in s.n_valid.tolist()]
    assert any(0 < v < chunk for v in counts) and 0 in counts  # padded and empty chunks occur
    _, report, pass_report = golden_check(unit, [PASS], steps)
    assert pass_report[0]["changed"]
    assert report.ok(TOL), report.summary()


def test_golden_catches_a_ring_read_after_its_write(exported_unit):
    """The harness must fail the classic bug: attending over the ring after this chunk's write."""
    cfg = corner_config(window=5)
    unit = exported_unit(cfg, batch=2, chunk=5)
    after = copy_unit(unit)
    run_pipeline(after, [PASS], progress=lambda _m: None)
    for name, program in after.programs.items():
        gm = copy_graph_module(program)
        written = {w.args[0]: w for w in _targets(gm, torch.ops.foldline.ring_write.default)}
        for node in _targets(gm, torch.ops.foldline.ring_attention.default):
            args = list(node.args)
            args[1], args[2] = written[args[1]], written[args[2]]
            node.prepend(args[1])
            node.prepend(args[2])
            node.args = tuple(args)
        after.programs[name] = rebuild(program, gm)
    steps = make_steps([19, 6], 5, 8, cfg.vocab_size)
    report = compare_units(unit, after, steps)
    assert report.worst_logit_error > 1e3 * TOL, report.summary()


def test_ring_idempotent(exported_unit):
    unit = copy_unit(exported_unit(corner_config(window=5), batch=2, chunk=5))
    first = run_pipeline(unit, [PASS], progress=lambda _m: None)
    programs, specs = dict(unit.programs), list(unit.state_specs)
    second = run_pipeline(unit, [PASS], progress=lambda _m: None)
    assert first[0]["changed"] and not second[0]["changed"]
    assert unit.programs == programs and unit.state_specs == specs


def test_ring_declines_window_not_below_cache(exported_unit):
    cfg = corner_config(window=32, layers=("local", "global"), max_context=32)
    unit = copy_unit(exported_unit(cfg, batch=1, chunk=4))
    programs = dict(unit.programs)
    report = run_pipeline(unit, [PASS], progress=lambda _m: None)
    assert not report[0]["changed"]
    assert any("not smaller" in note for note in report[0]["notes"])
    assert unit.programs == programs
