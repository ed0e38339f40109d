"""End to end on the attention families: compiled (IREE CPU) vs the eager reference."""

from __future__ import annotations

import numpy as np
import pytest

from foldline.contract.entry_points import position_shape
from foldline.frontend.sources import load_model
from foldline.runtime import Model
from foldline.testing.parity import SCALED_TOL_FP32, run_parity

TINY_PRESETS = ["ripple-tiny", "gemma3-tiny", "llama-tiny"]


@pytest.mark.slow
@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_compiled_matches_eager(bundle_factory, preset):
    """A prompt longer than one chunk, then >= 3 windows of decode steps."""
    loaded = load_model(preset)
    cfg = loaded.config
    bundle = Model.load(bundle_factory(preset))
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, size=40).tolist()
    assert len(prompt) > bundle.chunk
    steps = max(3 * cfg.sliding_window, 48)
    assert len(prompt) + steps < cfg.max_context
    report = run_parity(loaded.module, bundle, prompt, steps)
    assert report.steps == steps + 1
    assert report.tokens_agree, report.summary()
    assert report.worst_scaled_error < SCALED_TOL_FP32, report.summary()


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["ripple-tiny", "gemma3-tiny"])
def test_chunked_prefill_equals_token_by_token(bundle_factory, preset):
    """A padded last chunk leaves the same state and logits as feeding one token at a time."""
    model = Model.load(bundle_factory(preset))
    prompt = np.random.default_rng(2).integers(0, model.vocab_size, size=2 * model.chunk + 5).tolist()

    chunked = model.session()
    logits_chunked = chunked.prefill(prompt)

    stepwise = model.session()
    for token in prompt:
        logits_step = stepwise.decode(token)

    assert chunked.position == stepwise.position == len(prompt)
    np.testing.assert_allclose(logits_chunked, logits_step, rtol=0, atol=2e-5)
    for a, b in zip(chunked.snapshot().buffers, stepwise.snapshot().buffers):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-5)
    # The state past the prompt was never written by the padded tokens.
    for buf, spec in zip(chunked.snapshot().buffers, model.manifest.state):
        if spec.kind == "global_kv":
            assert np.all(buf[:, :, len(prompt):] == 0)


@pytest.mark.slow
def test_state_is_updated_in_place(bundle_factory):
    """decode returns only logits; the session's device buffers change across the call."""
    model = Model.load(bundle_factory("llama-tiny"))
    session = model.session()
    session.prefill([1, 2, 3])
    buffers_before = list(session.buffers)
    host_before = [session.ctx.to_host(b) for b in session.buffers]

    inputs = [np.array([[7]], np.int64), np.array([3], np.int64), position_shape(3)]
    result = model.ctx.module.decode(*[session.ctx.upload(a) for a in inputs], *session.buffers)
    assert not isinstance(result, (tuple, list)), "decode must return logits only, no state"
    assert tuple(result.shape) == (1, model.vocab_size)
    assert all(a is b for a, b in zip(buffers_before, session.buffers)), "no buffer was replaced"
    host_after = [session.ctx.to_host(b) for b in session.buffers]
    changed = [not np.array_equal(a, b) for a, b in zip(host_before, host_after)]
    assert all(changed), "every layer's K/V buffer takes the new token in place"
    # Position 3 was written in every K buffer, and only there.
    for before, after in zip(host_before, host_after):
        diff = np.nonzero(np.any(before != after, axis=(0, 1, 3)))[0]
        assert diff.tolist() == [3]


@pytest.mark.slow
def test_snapshot_restore_is_exact(bundle_factory):
    model = Model.load(bundle_factory("ripple-tiny"))
    session = model.session()
    session.prefill([5, 6, 7, 8, 9])
    snap = session.snapshot()
    first = session.decode(11)
    session.decode(12)
    session.restore(snap)
    assert session.position == 5
    np.testing.assert_array_equal(session.decode(11), first)
