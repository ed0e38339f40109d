"""Batched bundles: rows at different positions match eager at batch N and N separate batch-1 runs."""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from foldline.frontend.model import new_state
from foldline.frontend.sources import load_model
from foldline.runtime import ContextFullError, Model, RowError, TokenIdError

pytestmark = pytest.mark.slow

ROWS = 2
# a sliding-window model (rings wrap within the run) and a gated-delta-net one (recurrent + conv state)
PRESETS = ["gemma3-tiny", "qwen35-tiny"]


class RecordingBatch:
    """A Batch whose module calls are recorded, so the eager reference can replay exactly the same calls."""

    def __init__(self, model: Model):
        self.batch = model.batch()
        self.calls: list[tuple[str, list[np.ndarray]] | tuple[str, int]] = []
        real_call = model.ctx.call

        def record(entry, inputs, state):
            self.calls.append((entry, [a.copy() for a in inputs]))
            return real_call(entry, inputs, state)

        model.ctx.call = record

    def open_row(self, row: int) -> int:
        self.calls.append(("open", row))
        return self.batch.open_row(row)


def replay_eager(preset: str, calls: list, rows: int) -> list[np.ndarray]:
    """The reference module at batch `rows` fed the recorded calls; logits [rows, V] per module call."""
    module = load_model(preset).module
    state = new_state(module.cfg, rows)
    out = []
    with torch.no_grad():
        for entry, inputs in calls:
            if entry == "open":
                for t in state:
                    t[inputs].zero_()
                continue
            tokens, start = torch.from_numpy(inputs[0]), torch.from_numpy(inputs[1])
            k = tokens.shape[0]  # an entry point over the first k rows: the same rows of the state
            n_valid = torch.from_numpy(inputs[2]) if entry.startswith("prefill") else torch.ones(k, dtype=torch.int64)
            out.append(module(tokens, start, n_valid, *(t[:k] for t in state)).numpy())
    return out


def drive(batch: RecordingBatch, prompts: Sequence[list[int]], decode_steps: int,
          chunk: int) -> tuple[dict, list[dict[int, np.ndarray]]]:
    """Row 0 starts alone; row 1 joins while row 0 decodes, then is replaced by a new sequence midway.

    Returns per sequence the token groups fed and the logits after each group,
    and per step the logits of each fed row.
    """
    b = batch.batch
    seqs: dict[str, dict] = {}

    def feed(name: str, row: int, groups: dict[int, list[int]], logits: dict[int, np.ndarray]) -> None:
        seqs[name]["groups"].append(groups[row])
        seqs[name]["logits"].append(logits[row])

    rows = {0: "a"}
    batch.open_row(0)
    seqs["a"] = {"groups": [], "logits": []}
    pending = {"a": list(prompts[0])}
    step, per_step = 0, []
    while step < decode_steps:
        if step == 3:  # a second sequence joins mid-run, with a long prompt fed in chunks
            batch.open_row(1)
            rows[1], seqs["b"], pending["b"] = "b", {"groups": [], "logits": []}, list(prompts[1])
        if step == decode_steps // 2:  # row 1 is released and reused by a third sequence
            b.release(1)
            batch.open_row(1)
            rows[1], seqs["c"], pending["c"] = "c", {"groups": [], "logits": []}, list(prompts[2])
        groups = {}
        for row, name in rows.items():
            if pending[name]:
                groups[row], pending[name] = pending[name][:chunk], pending[name][chunk:]
            else:
                groups[row] = [int(np.argmax(seqs[name]["logits"][-1]))]
        logits = b.step(groups)
        per_step.append(logits)
        for row, name in rows.items():
            feed(name, row, groups, logits)
        step += 1
    return seqs, per_step


@pytest.mark.parametrize("preset", PRESETS)
def test_rows_match_eager_and_single_runs(bundle_factory, preset):
    model = Model.load(bundle_factory(preset, batch=ROWS))
    assert model.batch_size == ROWS
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, model.vocab_size, size=n).tolist() for n in (20, 2 * model.chunk + 3, 7)]
    batch = RecordingBatch(model)
    seqs, per_step = drive(batch, prompts, decode_steps=40, chunk=model.chunk)
    calls = [c for c in batch.calls if c[0] != "open"]
    assert len(calls) == len(per_step), "one module call per step"
    entries = {entry for entry, _ in calls}
    assert entries == {"prefill", "decode", "prefill_rows1", "decode_rows1"}, \
        "both entry points, over both rows and over row 0 alone, were exercised"
    assert any(len(inputs[1]) == 2 and inputs[1][0] != inputs[1][1] for _, inputs in calls), \
        "rows sat at different positions"

    # the reference module at batch ROWS, replaying the same calls (and row resets)
    eager = replay_eager(preset, batch.calls, ROWS)
    for step, (logits, want) in enumerate(zip(per_step, eager)):
        for row, got in logits.items():
            np.testing.assert_allclose(got, want[row], rtol=0, atol=1e-4 * max(1.0, float(np.abs(want[row]).max())),
                                       err_msg=f"{preset} step {step} row {row}")

    # N separate batch-1 runs of each sequence, on a batch-1 bundle
    single = Model.load(bundle_factory(preset))
    for name, seq in seqs.items():
        session = single.session()
        for group, got in zip(seq["groups"], seq["logits"]):
            want = session.prefill(group) if len(group) > 1 else session.decode(group[0])
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * max(1.0, float(np.abs(want).max())),
                                       err_msg=f"{preset} sequence {name}")
            assert int(np.argmax(got)) == int(np.argmax(want))


def test_rows_are_checked_and_kept_apart(bundle_factory):
    model = Model.load(bundle_factory("gemma3-tiny", batch=ROWS))
    batch = model.batch()
    with pytest.raises(RowError, match="not open"):
        batch.step({0: [1]})
    row = batch.open_row()
    assert row == 0 and batch.free_rows() == [1]
    batch.step({0: [5, 6, 7]})
    before = [model.ctx.to_host(b)[0].copy() for b in batch.buffers]
    batch.open_row(1)  # zeroes row 1 only
    after = [model.ctx.to_host(b) for b in batch.buffers]
    for b0, a in zip(before, after):
        assert np.array_equal(b0, a[0]), "opening a row never touches another row's state"
        assert not a[1].any()
    for bad, error in (({2: [1]}, RowError), ({0: list(range(model.chunk + 1))}, RowError),
                       ({0: [model.vocab_size]}, TokenIdError), ({0: [1.5]}, TokenIdError), ({}, RowError),
                       ({0: [1] * model.max_context}, ContextFullError)):
        with pytest.raises(error):
            batch.step(bad)
    assert batch.positions == [3, 0] and batch.tokens[0] == [5, 6, 7], "a refused step changes nothing"
    with pytest.raises(RowError):
        batch.open_row()  # no free row
    # fill row 0 to the context limit: feeding it more is refused; it must be released before a call over
    # both rows (row 1's) can run without feeding it
    batch.step({0: [1] * (model.chunk - 3)})
    for _ in range(model.max_context // model.chunk - 1):
        batch.step({0: [1] * model.chunk})
    assert batch.positions[0] == model.max_context
    with pytest.raises(ContextFullError):
        batch.step({0: [1]})
    with pytest.raises(ContextFullError, match="release it"):
        batch.step({1: [1, 2]})
    batch.release(0)
    assert batch.step({1: [1, 2]})[1].shape == (model.vocab_size,)


def test_a_session_on_a_batched_bundle_is_a_single_sequence(bundle_factory):
    batched, single = Model.load(bundle_factory("gemma3-tiny", batch=ROWS)), Model.load(bundle_factory("gemma3-tiny"))
    prompt = list(range(1, 24))
    with batched.session() as a, single.session() as b:
        got, want = a.prefill(prompt), b.prefill(prompt)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * max(1.0, float(np.abs(want).max())))
        np.testing.assert_allclose(a.decode(3), b.decode(3), rtol=0, atol=1e-4 * max(1.0, float(np.abs(want).max())))
        assert a.position == b.position == len(prompt) + 1


def _feed_prompts(batch, prompts: dict[int, list[int]], chunk: int) -> dict[int, np.ndarray]:
    """Prompt tokens for several rows, chunk by chunk in shared prefill calls; each row's logits after its last."""
    out, pending = {}, {row: list(ids) for row, ids in prompts.items()}
    while any(pending.values()):
        feeds = {row: ids[:chunk] for row, ids in pending.items() if ids}
        logits = batch.step(feeds, prompt_rows=set(feeds))
        for row in feeds:
            pending[row], out[row] = pending[row][chunk:], logits[row]
    return out


def test_a_row_moves_to_another_row_and_bundle_alone(bundle_factory, tmp_path):
    """Row 1 of a batch-2 bundle, saved, continues in row 0 of another batch with the logits of the
    uninterrupted row, to the bit; a restore leaves the other row's state and logits its own; the same
    file resumes as a session of this bundle and of the batch-1 bundle of the same model."""
    from foldline.runtime import SessionStateError, Snapshot

    model = Model.load(bundle_factory("gemma3-tiny", batch=ROWS))
    rng = np.random.default_rng(21)
    # 20 and 27 prompt tokens (two chunks), then 5 and 9: both rows' continuations end at the same
    # position, so a prefill call reads as many K/V tiles whichever of the two conversations it feeds
    p0, p1, q0, q1 = (rng.integers(1, model.vocab_size, n).tolist() for n in (20, 27, 5, 9))

    def start() -> object:
        batch = model.batch()
        batch.open_row(0)
        batch.open_row(1)
        _feed_prompts(batch, {0: p0, 1: p1}, model.chunk)
        batch.step({0: [7], 1: [8]})  # a decode step: the rows hold decode-written state too
        return batch

    a = start()
    snap = a.snapshot_row(1)
    assert [b.shape for b in snap.buffers] == [s.rows(1).shape for s in model.state_layout()], "one row only"
    assert (snap.position, snap.tokens, snap.prefilled) == (len(p1) + 1, [*p1, 8], len(p1))
    path = a.save_row(1, tmp_path / "row1.npz")
    want_prompt = _feed_prompts(a, {0: q0, 1: q1}, model.chunk)
    want_decode = a.step({0: [3], 1: [4]})

    # the same calls give the same state; zeroed state restored into row 0 leaves row 1 as it was
    b = start()
    kept = b.snapshot_row(1)
    for x, y in zip(kept.buffers, snap.buffers):
        assert np.array_equal(x, y)
    with pytest.raises(RowError, match="is open"):
        b.open_row_from(0, snap, [*snap.tokens, 1])
    every_row = Snapshot(snap.position, [np.zeros(s.shape, s.host_dtype) for s in model.state_layout()], snap.tokens)
    with pytest.raises(SessionStateError, match="copy of every row"):
        b.restore_row(0, every_row)
    zeros = Snapshot(len(p0) + 1, [np.zeros_like(x) for x in snap.buffers], [*p0, 7])
    b.restore_row(0, zeros)
    for x, y, z in zip(b.snapshot_row(0).buffers, b.snapshot_row(1).buffers, kept.buffers):
        assert not x.any() and np.array_equal(y, z), "a restore into row 0 never touches row 1"
    got_prompt, got_decode = _feed_prompts(b, {0: q0, 1: q1}, model.chunk), b.step({0: [3], 1: [4]})
    assert np.array_equal(got_prompt[1], want_prompt[1]) and np.array_equal(got_decode[1], want_decode[1])
    assert not np.array_equal(got_prompt[0], want_prompt[0]), "row 0 continued from the zeroed state"

    # row 1's file into row 0 of another batch: both rows now continue row 1's conversation, to the bit
    c = start()
    c.load_row(0, path)
    assert (c.positions, c.tokens, c.prefilled) == ([snap.position] * 2, [snap.tokens] * 2, [len(p1)] * 2)
    got_prompt, got_decode = _feed_prompts(c, {0: q1, 1: q1}, model.chunk), c.step({0: [4], 1: [4]})
    for row in (0, 1):
        assert np.array_equal(got_prompt[row], want_prompt[1]) and np.array_equal(got_decode[row], want_decode[1])

    # a session (row 0 through the one-row functions): its prefill is the rows' to the bit, its decode
    # step differs by the two decode kernels' rounding (docs/serving.md); a session copies one row
    single = Model.load(bundle_factory("gemma3-tiny"))
    want_prompt, want_decode = want_prompt[1], want_decode[1]
    for owner in (model, single):
        with owner.session_from(path) as session:
            assert session.tokens == snap.tokens
            logits = session.prefill(q1)
            if owner is model:
                assert np.array_equal(logits, want_prompt)
            np.testing.assert_allclose(logits, want_prompt, rtol=0, atol=1e-4 * float(np.abs(want_prompt).max()))
            np.testing.assert_allclose(session.decode(4), want_decode, rtol=0,
                                       atol=1e-3 * float(np.abs(want_decode).max()))
            assert session.snapshot().buffers[0].shape[0] == 1


def _wait(predicate, timeout: float = 120.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_scheduler_runs_more_requests_than_rows(bundle_factory):
    import threading

    from foldline.runtime import Sampler
    from foldline.runtime.scheduler import QueueFullError, Request, Scheduler

    model = Model.load(bundle_factory("gemma3-tiny", batch=ROWS))
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, model.vocab_size, size=n).tolist() for n in (3, 40, 9, 17, 1)]
    alone = []
    for p in prompts:
        with model.session() as s:
            alone.append(list(s.generate_ids(p, 10, Sampler(), stop_ids=())))

    outputs: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    done = threading.Event()

    def make(i: int, prompt: list[int], n: int = 10) -> Request:
        outputs[i] = []

        def finish(reason: str, error: str | None) -> None:
            reasons[i] = error or reason
            if len(reasons) == len(outputs):
                done.set()
        return Request(prompt, n, lambda token, _logprobs: outputs[i].append(token), finish)

    scheduler = Scheduler(model, max_queue=len(prompts)).start()
    try:
        for i, p in enumerate(prompts):  # 5 requests on 2 rows: three wait, then take freed rows
            scheduler.submit(make(i, p))
        assert done.wait(300)
        assert [outputs[i] for i in range(len(prompts))] == alone
        assert set(reasons.values()) == {"length"}
        assert scheduler.load == (0, 0)

        # a full queue is refused; a cancelled request frees its row
        scheduler.max_queue = 0
        done.clear()
        outputs.clear()
        reasons.clear()
        long = [make(10 + i, prompts[i], n=model.max_context) for i in range(ROWS)]
        for r in long:
            scheduler.submit(r)
        _wait(lambda: scheduler.load == (ROWS, 0))
        with pytest.raises(QueueFullError, match="busy"):
            scheduler.submit(Request(prompts[0], 2, lambda _t, _lp: None, lambda _r, _e: None))
        for r in long:
            r.cancel()
        assert done.wait(120) and set(reasons.values()) == {"cancelled"}
        _wait(lambda: scheduler.load == (0, 0))

        # a module call that fails ends the running requests with an error; the next ones run on fresh rows
        done.clear()
        outputs.clear()
        reasons.clear()
        real_call = model.ctx.call
        model.ctx.call = lambda *a: (_ for _ in ()).throw(RuntimeError("device lost"))
        scheduler.submit(make(20, prompts[0]))
        assert done.wait(120) and "device lost" in reasons[20]
        model.ctx.call = real_call
        done.clear()
        scheduler.submit(make(21, prompts[2]))
        assert done.wait(120) and outputs[21] == alone[2]
        with pytest.raises(ContextFullError):
            scheduler.submit(Request(list(range(1, model.max_context + 1)), 2, lambda _t, _lp: None, lambda _r, _e: None))
    finally:
        scheduler.stop()


def test_default_row_counts_are_the_powers_of_two_below_the_batch():
    """So that a stream on row 1 (row 0 kept for another conversation) computes two rows, not the batch."""
    from foldline.backends.options import BuildOptions, row_counts

    assert [row_counts(BuildOptions(batch=b)) for b in (1, 2, 3, 4, 6, 8)] == \
        [[1], [1, 2], [1, 2, 3], [1, 2, 4], [1, 2, 4, 6], [1, 2, 4, 8]]
    assert row_counts(BuildOptions(batch=8, rows=(1,))) == [1, 8]
    assert row_counts(BuildOptions(batch=8, rows=())) == [8]


@pytest.mark.parametrize(("args", "message"), [
    (["--rows", "1"], "--rows needs --batch N with N > 1"),
    (["--batch", "4", "--rows", "4"], "between 1 and --batch 4"),
    (["--batch", "4", "--rows", "0,2"], "between 1 and --batch 4"),
    (["--batch", "4", "--rows", "two"], "comma-separated row counts"),
    (["--batch", "4", "--activations", "int8", "--target", "onnx"], "--activations int8 on the ONNX target is for --batch 1"),
    (["--batch", "4", "--activations", "int8", "--cpu", "generic"], "needs a CPU target with an int8 dot product"),
])
def test_row_counts_and_activations_of_a_batched_bundle_are_checked(tmp_path, capsys, args, message):
    from foldline.tools.cli import main

    cpu = [] if "--cpu" in args or "--target" in args else ["--cpu", "host"]
    assert main(["compile", "llama-tiny", "-o", str(tmp_path / "b"), *cpu, *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "b" / "manifest.json").exists()


def test_inspect_names_the_row_counts(bundle_factory, capsys):
    from foldline.tools.cli import main

    assert main(["inspect", str(bundle_factory("gemma3-tiny", batch=ROWS))]) == 0
    out = capsys.readouterr().out
    assert "batch 2 (entry points for 1, 2 rows)" in out
    module = json.loads((bundle_factory("gemma3-tiny", batch=ROWS) / "manifest.json").read_text())["modules"]["cpu"]
    assert f"{module['activations']} activations" in out
