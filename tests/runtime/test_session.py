"""The runtime an app embeds: id checks, broken sessions, snapshots that fit, close, threads, exit codes."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest

from foldline.errors import FoldlineError, InputError
from foldline.runtime import ContextFullError, Model, Sampler, SessionStateError, TokenIdError

pytestmark = pytest.mark.slow

PROMPT = [1, 5, 9, 13, 2, 7, 11, 3, 4, 8, 6, 10, 12, 14, 15, 16, 17, 18, 19, 20]  # two prefill chunks of 16


@pytest.fixture(scope="module")
def bundle(bundle_factory):
    return bundle_factory("llama-tiny")


def _greedy(model: Model, prompt: list[int], n: int = 8) -> list[int]:
    with model.session() as session:
        return list(session.generate_ids(prompt, n, Sampler()))


def test_ids_must_be_integers(bundle):
    session = Model.load(bundle).session()
    for bad in ([1.0, 2.5], np.array([1, 2], np.float32), ["3"], [True]):
        with pytest.raises(TokenIdError, match="must be integers"):
            session.prefill(bad)
    with pytest.raises(TokenIdError, match="must be integers"):
        session.decode(2.9)
    assert session.position == 0 and session.tokens == []
    session.prefill(np.array([1, 2, 3], np.int32))
    assert session.position == 3


def test_a_failed_call_breaks_the_session_until_restore(bundle, monkeypatch):
    model = Model.load(bundle)
    expected = _greedy(model, PROMPT)
    session = model.session()
    start = session.snapshot()
    real_call, calls = model.ctx.call, []

    def failing_second_call(fn, inputs, state):
        calls.append(fn)
        if len(calls) == 2:
            raise RuntimeError("device lost")
        return real_call(fn, inputs, state)

    monkeypatch.setattr(model.ctx, "call", failing_second_call)
    with pytest.raises(RuntimeError, match="device lost"):
        session.prefill(PROMPT)
    assert session.broken and "device lost" in session.broken
    assert session.position == 16 and session.tokens == PROMPT[:16], "position and tokens agree with the state"
    with pytest.raises(SessionStateError, match="broken"):
        session.decode(1)
    with pytest.raises(SessionStateError, match="broken"):
        session.snapshot()
    monkeypatch.setattr(model.ctx, "call", real_call)
    session.restore(start)
    assert session.broken is None
    assert list(session.generate_ids(PROMPT, 8, Sampler())) == expected


def test_decode_checks_the_pending_token_with_its_own_once(bundle, monkeypatch):
    """decode after a generated token: the pending token and the new one are checked together, once, then fed
    in order (the logits of feed_pending and decode one after the other); at the context's edge a refusal feeds
    neither."""
    import foldline.runtime.model as runtime_model

    model = Model.load(bundle)
    with model.session() as reference:
        [token] = reference.generate_ids(PROMPT, 1, Sampler())
        reference.feed_pending()
        expected = reference.decode(3)
    real_check, checked = runtime_model.check_ids, []

    def counted_check(ids, *args):
        checked.append(list(ids))
        return real_check(ids, *args)

    with model.session() as session:
        list(session.generate_ids(PROMPT, 1, Sampler()))
        monkeypatch.setattr(runtime_model, "check_ids", counted_check)
        np.testing.assert_array_equal(session.decode(3), expected)
        assert checked == [[token, 3]], "the pending token was checked again on its own"
        assert session.tokens == [*PROMPT, token, 3] and session.pending_token is None
    with model.session() as edge:
        edge.prefill([5] * (model.max_context - 2))
        [last] = edge.generate_ids([1], 1, Sampler())
        assert edge.position == model.max_context - 1 and edge.pending_token == last
        with pytest.raises(ContextFullError, match="context full"):
            edge.decode(3)
        assert edge.position == model.max_context - 1 and edge.pending_token == last, "a refusal fed nothing"


def test_restore_refuses_a_snapshot_that_does_not_fit(bundle, bundle_factory):
    model = Model.load(bundle)
    session = model.session()
    session.prefill(PROMPT[:4])
    snap = session.snapshot()
    first = model.manifest.state[0]
    wrong_dtype = type(snap)(snap.position, [b.astype(np.float64) if i == 0 else b for i, b in enumerate(snap.buffers)],
                             snap.tokens)
    with pytest.raises(SessionStateError, match=f"{first.name}.*float64"):
        session.restore(wrong_dtype)
    wrong_shape = type(snap)(snap.position, [b[..., :1] if i == 0 else b for i, b in enumerate(snap.buffers)],
                             snap.tokens)
    with pytest.raises(SessionStateError, match=first.name):
        session.restore(wrong_shape)
    with pytest.raises(SessionStateError, match="position"):
        session.restore(type(snap)(snap.position + 1, snap.buffers, snap.tokens))
    other = Model.load(bundle_factory("ripple-tiny")).session()
    with pytest.raises(SessionStateError):
        other.restore(snap)
    assert session.position == 4, "a refused restore changes nothing"


def test_close_and_context_managers(bundle):
    with Model.load(bundle) as model:
        session = model.session()
        session.prefill(PROMPT[:3])
        with model.session() as other:
            other.prefill(PROMPT[:2])
        assert other.closed and other.buffers == []
        with pytest.raises(SessionStateError, match="closed"):
            other.decode(1)
    assert model.closed
    with pytest.raises(SessionStateError, match="closed"):
        session.decode(1)
    with pytest.raises(SessionStateError, match="closed"):
        model.session()
    model.close()  # idempotent


def test_sessions_on_several_threads_match_serial_runs(bundle):
    model = Model.load(bundle)
    prompts = [PROMPT[: 3 + 4 * i] for i in range(4)]
    serial = [_greedy(model, p, 12) for p in prompts]
    results: list[list[int] | None] = [None] * len(prompts)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for _ in range(3):
                results[i] = _greedy(model, prompts[i], 12)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert results == serial


THREADS_SCRIPT = """
import sys
from foldline.errors import InputError
from foldline.runtime import Model, Sampler
bundle, threads = sys.argv[1], int(sys.argv[2])
model = Model.load(bundle, threads=threads)
tokens = list(model.session().generate_ids([1, 5, 9], 6, Sampler()))
try:
    Model.load(bundle, threads=threads + 1)
    print("no error")
except InputError as e:
    print("refused:", e)
print(",".join(map(str, tokens)))
"""


@pytest.mark.parametrize("threads", [1, 2])
def test_thread_count(bundle, threads):
    expected = _greedy(Model.load(bundle), [1, 5, 9], 6)
    out = subprocess.run([sys.executable, "-c", THREADS_SCRIPT, str(bundle), str(threads)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    refused, tokens = out.stdout.strip().splitlines()[-2:]
    assert tokens == ",".join(map(str, expected))
    if threads == 1:
        assert refused == "no error", "1 thread runs on the caller (local-sync): any count may follow"
    else:
        assert refused.startswith("refused:") and "new process" in refused
    with pytest.raises(InputError, match="positive integer"):
        Model.load(bundle, threads=0)


# ---- exit codes of the command line -------------------------------------------------------------------


def test_user_error_is_one_line_exit_2(bundle, capsys, monkeypatch):
    from foldline.tools.cli import main

    monkeypatch.delenv("FOLDLINE_DEBUG", raising=False)
    rc = main(["generate", str(bundle), "--prompt-ids", "1,999999", "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == "foldline generate: error: token id 999999 is out of range for vocabulary size " \
        f"{Model.load(bundle).vocab_size}"
    rc = main(["--debug", "generate", str(bundle), "--prompt-ids", "1,999999"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" in err and "TokenIdError" in err
    monkeypatch.setenv("FOLDLINE_DEBUG", "1")
    assert main(["generate", str(bundle), "--prompt-ids", "1,999999"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_internal_error_shows_its_traceback_exit_1(bundle, capsys, monkeypatch):
    from foldline.runtime import batch as batch_module
    from foldline.tools.cli import main

    def broken_step(self, feeds, prompt_rows=()):
        raise KeyError("an internal bug")

    monkeypatch.setattr(batch_module.Batch, "step", broken_step)
    rc = main(["generate", str(bundle), "--prompt-ids", "1,2", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "Traceback" in err and "KeyError: 'an internal bug'" in err and "internal error" in err


def test_every_user_facing_error_class_is_a_foldline_error():
    from foldline.backends.targets import TargetError
    from foldline.dtypes import DTypeError
    from foldline.frontend.config import ConfigError
    from foldline.frontend.gguf_file import GGUFError, MissingTensorError, UnsupportedQuantError
    from foldline.runtime import BundleError, ContextFullError, RowError, SessionFileError
    from foldline.runtime.scheduler import QueueFullError
    from foldline.server.protocol import ApiError

    for cls in (TargetError, ConfigError, GGUFError, MissingTensorError, UnsupportedQuantError, BundleError,
                ContextFullError, TokenIdError, SessionStateError, SessionFileError, InputError, RowError,
                QueueFullError, DTypeError, ApiError):
        assert issubclass(cls, FoldlineError), cls
    assert not issubclass(KeyError, FoldlineError)
