"""Attention that reads the tokens held (prefill's kv_tiles, decode's position); the in-place cache
updates are tested in test_inplace_state.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from foldline.contract.entry_points import kv_tile_count, kv_tile_size
from foldline.frontend.arch import get_preset
from foldline.frontend.export import kv_tiles_shape
from foldline.passes.manager import run_pipeline
from foldline.testing.golden import (
    GOLDEN_TOL,
    UnitRunner,
    copy_unit,
    held_slots,
    make_steps,
    scaled_error,
)

pytestmark = pytest.mark.usefixtures("torch_one_thread")

CONTEXT = 256  # four tiles of 64 slots


def test_tile_size_and_count():
    assert kv_tile_size(8192) == 64 and kv_tile_size(256) == 64 and kv_tile_size(96) == 32
    assert kv_tile_size(100) == 4 and kv_tile_size(127) == 1
    # the tiles a chunk reads cover its last position, never fewer than one, never more than the cache
    assert [kv_tile_count(end, 256) for end in (0, 1, 64, 65, 128, 129, 256, 300)] == [1, 1, 1, 2, 2, 3, 4, 4]
    assert kv_tile_count(97, 100) == 25 and kv_tile_count(1, 127) == 1 and kv_tile_count(127, 127) == 127


class _FixedTiles:
    """Steps whose prefill reads every tile of the cache, whatever it holds: the reference for the cut."""

    def __init__(self, step, slots: int):
        self.step, self.slots = step, slots

    def args(self, slots: int):
        if self.step.entry != "prefill":
            return self.step.args(slots)
        return (*self.step.args(slots)[:3], kv_tiles_shape(slots // kv_tile_size(slots)))

    def __getattr__(self, name):
        return getattr(self.step, name)


def _unit(exported_unit, preset: str, batch: int = 2, context: int = CONTEXT):
    cfg = get_preset(preset).replace(max_context=context)
    unit = copy_unit(exported_unit(cfg, batch=batch, chunk=8))
    run_pipeline(unit, ["ring-buffer-swa"], progress=lambda _m: None)
    return cfg, unit


@pytest.mark.parametrize("preset", ["llama-tiny", "gemma3-tiny", "qwen35-tiny", "ripple-tiny"])
def test_reading_the_tiles_held_equals_reading_every_tile(preset, exported_unit):
    """Batch 2, rows at different positions (padded and empty chunks), crossing tiles: prefill cut to the
    tiles its furthest row holds gives what reading the whole cache gives; decode reads its row's tiles."""
    cfg, unit = _unit(exported_unit, preset)
    steps = make_steps([137, 21], 8, 40, cfg.vocab_size, seed=3)  # up to position 177: three of four tiles
    full, cut = UnitRunner(unit), UnitRunner(unit)
    counts = set()
    for i, step in enumerate(steps):
        if step.entry == "prefill":
            counts.add(int(step.args(CONTEXT)[3].shape[1]))
        want, scale = full.step(_FixedTiles(step, CONTEXT))
        got, _ = cut.step(step)
        rows = step.n_valid > 0 if step.n_valid is not None else torch.ones(got.shape[0], dtype=torch.bool)
        assert scaled_error(got[rows], want[rows], scale[rows]) < GOLDEN_TOL["float32"], f"step {i} ({step.entry})"
        for spec, a, b in zip(unit.state_specs, cut.state, full.state):
            if spec.kind == "global_kv":
                a, b = held_slots(a, step.end_pos), held_slots(b, step.end_pos)
            assert scaled_error(a, b, max(float(b.abs().max()), 1e-30)) < GOLDEN_TOL["float32"], (i, spec.name)
    assert counts == {1, 2, 3}


def test_a_cut_below_the_tokens_held_changes_the_logits(exported_unit):
    """The cut is real: reading one tile too few loses keys (the equality above is not vacuous)."""
    cfg, unit = _unit(exported_unit, "llama-tiny", batch=1)
    steps = make_steps([72], 8, 0, cfg.vocab_size, seed=1)
    right, short = UnitRunner(unit), UnitRunner(unit)
    for step in steps[:-1]:
        right.step(step), short.step(step)
    last = steps[-1]  # positions 64-71: the second tile
    short_step = dataclasses.replace(last)
    short_step.args = lambda slots: (*last.args(slots)[:3], kv_tiles_shape(1))
    assert not torch.allclose(right.step(last)[0], short.step(short_step)[0])


def test_the_exported_lengths_are_symbolic(exported_unit):
    """prefill's attention length comes from kv_tiles and decode's from its position: no length is a
    constant of the traced example."""
    cfg, unit = _unit(exported_unit, "llama-tiny", batch=1)
    for name, program in unit.programs.items():
        lengths = [n.args[7] for n in program.graph.nodes if n.target == torch.ops.foldline.cache_attention.default]
        assert len(lengths) == cfg.num_layers and all(isinstance(n, torch.fx.Node) for n in lengths), name
        assert "64*" in str(lengths[0].meta["val"]), (name, lengths[0].meta["val"])


@pytest.mark.slow
@pytest.mark.parametrize(("preset", "kv_dtype"), [
    ("gemma3-tiny", "float16"), ("llama-tiny", "float32"),
    ("qwen35-tiny", "float32"), ("ripple-tiny", "float16"),
])
def test_compiled_tiles_match_eager(bundle_factory, preset, kv_dtype):
    """Every tiny preset compiled for 256 positions (four 64-slot tiles) follows eager greedy decoding
    from a prompt that fills two tiles through decodes into the fourth (sliding-window rings wrapping
    many times, GDN layers), with f32 or f16 caches: each call reads only the tiles it holds."""
    from foldline.frontend.sources import load_model
    from foldline.runtime import Model
    from foldline.testing.parity import SCALED_TOL_FP32, run_parity

    bundle = bundle_factory(preset, max_context=CONTEXT, kv_dtype=kv_dtype)
    model = Model.load(bundle)
    assert model.manifest.kv_tile == 64 and model.max_context == CONTEXT
    assert {s.dtype for s in model.manifest.state if s.kind == "global_kv"} == {kv_dtype}
    loaded = load_model(preset, max_context=CONTEXT)
    ids = np.random.default_rng(0).integers(0, model.vocab_size, 100).tolist()
    with loaded.reconfigured(kv_dtype=kv_dtype):  # the eager reference holds the same cache type
        report = run_parity(loaded.module, model, ids, steps=100)
    assert report.steps == 101 and report.ok(SCALED_TOL_FP32), report.summary()


def test_unsupported_kv_dtype_is_a_clear_error(tmp_path):
    from foldline.backends.build import BuildOptions, compile_model
    from foldline.errors import FoldlineError
    from foldline.frontend.sources import load_model

    with pytest.raises(FoldlineError, match="K/V cache dtype 'float64' is not supported"):
        compile_model(load_model("llama-tiny"), tmp_path / "b", BuildOptions(kv_dtype="float64"))
    assert not (tmp_path / "b").exists()
