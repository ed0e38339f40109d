"""Soak: one session on a compiled tiny bundle, generating to its context limit run after run.

ripple-tiny has sliding-window layers (W = 16) and max_context 128, so every
run wraps each ring seven times. Checked: resident memory (VmRSS) stays flat
across thousands of steps, every run ends in ContextFullError, the same
prompt gives the same tokens in every run (reset leaves nothing behind), and
snapshot() / restore() in the middle of a run, with other tokens decoded in
between, continues exactly as the uninterrupted run (tokens and logits
bit-identical), in the same session and in another one.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from foldline.runtime import ContextFullError, Model

from reliability.reliability_common import record, rss_bytes, scaled

pytestmark = pytest.mark.slow  # compiles a tiny preset with IREE (shared with the pipeline tests)

PRESET = "ripple-tiny"
# Resident memory may grow by at most this much after the warm-up runs. A leak of one state
# snapshot per run (8 rings of 2x16x16 and 2 full caches of 2x128x16 floats, K and V: 96 KiB) or of
# one logits vector per step (2 KiB x 128 steps = 256 KiB per run) crosses it within 85 or 32 runs.
RSS_GROWTH_BOUND = 8 << 20
WARMUP_RUNS = 3


@pytest.fixture(scope="module")
def model(bundle_factory):
    with Model.load(bundle_factory(PRESET), threads=1) as m:
        yield m


def run_to_limit(session, prompt: list[int]) -> tuple[list[int], list[np.ndarray]]:
    """Greedy decode from `prompt` until the context is full; returns the tokens and every step's logits."""
    logits = session.prefill(prompt)
    tokens, seen = [], [logits]
    while session.position < session.model.max_context:
        token = int(np.argmax(logits))
        tokens.append(token)
        logits = session.decode(token)
        seen.append(logits)
    tokens.append(int(np.argmax(logits)))
    return tokens, seen


def test_soak_runs_to_the_context_limit_with_flat_memory(model):
    """Thousands of steps in one session: ContextFullError every run, the same tokens, RSS growth bounded."""
    runs = scaled(100, 4000)
    rng = random.Random(11)
    prompts = [[rng.randrange(model.vocab_size) for _ in range(rng.randint(1, 40))] for _ in range(4)]
    session = model.session()
    first: dict[int, list[int]] = {}
    steps = 0
    rss = []
    for run in range(runs):
        session.reset()
        which = run % len(prompts)
        if run % 2:
            tokens, _ = run_to_limit(session, prompts[which])
        else:  # the generator API: it stops by itself at the full context
            tokens = list(session.generate_ids(prompts[which], max_new_tokens=10**6, stop_ids=()))
        steps += session.position
        assert session.position == model.max_context
        with pytest.raises(ContextFullError):
            session.decode(tokens[-1])
        with pytest.raises(ContextFullError):
            session.prefill([1])
        assert session.position == model.max_context and session.broken is None
        assert first.setdefault(which, tokens) == tokens, f"run {run}: prompt {which} gave other tokens"
        if run + 1 >= WARMUP_RUNS:
            rss.append(rss_bytes())
    growth = rss[-1] - rss[0]
    peak = max(rss) - rss[0]
    record("soak: runs to the context limit", runs)
    record("soak: tokens processed", steps)
    record("soak: RSS growth after warm-up (KiB)", growth // 1024)
    record("soak: RSS peak above warm-up (KiB)", peak // 1024)
    print(f"soak: {runs} runs, {steps} tokens, RSS {rss[0] / 2**20:.1f} MiB -> {rss[-1] / 2**20:.1f} MiB "
          f"(growth {growth / 2**10:.0f} KiB, peak +{peak / 2**10:.0f} KiB)")
    assert peak <= RSS_GROWTH_BOUND, f"RSS grew by {peak / 2**20:.1f} MiB over {runs} runs"


@pytest.mark.parametrize("cut", [9, 40, 100])
def test_snapshot_restore_mid_run_equals_uninterrupted(model, cut):
    """Snapshot at `cut` tokens (before, across and well past ring wrap-around), decode other tokens,
    restore: the continuation equals the uninterrupted run, tokens and logits bit for bit."""
    prompt = [3, 14, 15, 92, 65]
    ref_tokens, ref_logits = run_to_limit(model.session(), prompt)

    session = model.session()
    logits = session.prefill(prompt)
    while session.position < cut:
        logits = session.decode(int(np.argmax(logits)))
    snap = session.snapshot()
    for t in range(12):  # other tokens overwrite ring slots and the global caches
        session.decode((t * 37) % model.vocab_size)
    session.restore(snap)
    other = model.session()
    other.restore(snap)
    for s in (session, other):
        tokens, seen = [], [logits]
        current = logits
        while s.position < model.max_context:
            token = int(np.argmax(current))
            tokens.append(token)
            current = s.decode(token)
            seen.append(current)
        tokens.append(int(np.argmax(current)))
        held = cut - len(prompt)
        assert tokens == ref_tokens[held:]
        for got, want in zip(seen, ref_logits[held:], strict=True):
            assert np.array_equal(got, want)
        with pytest.raises(ContextFullError):
            s.decode(tokens[-1])
    record("soak: snapshot/restore continuations compared", 2)
