"""Sessions saved to disk: resumed after a restart exactly, refused when they belong elsewhere."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import numpy as np
import pytest

from foldline.runtime import Model, Sampler
from foldline.runtime import session_file as session_file_module
from foldline.runtime.session_file import SessionFileError

pytestmark = pytest.mark.slow

PROMPT = [1, 5, 9, 13, 2, 7, 11, 3, 4, 8, 6, 10, 12, 14, 15, 16, 17, 18, 19, 20]


@pytest.fixture(scope="module")
def bundle(bundle_factory):
    return bundle_factory("llama-tiny")


@pytest.fixture(scope="module")
def uninterrupted(bundle) -> list[int]:
    """Prompt + 16 greedy tokens in one go: what a resumed session must reproduce."""
    with Model.load(bundle) as model, model.session() as session:
        return list(session.generate_ids(PROMPT, 16, Sampler()))


def _first_half(model: Model) -> tuple[object, list[int]]:
    """A session after the prompt and 8 greedy tokens; the 8th is sampled but not yet fed back."""
    session = model.session()
    generated = list(session.generate_ids(PROMPT, 8, Sampler()))
    return session, generated


RESUME_SCRIPT = """
import sys
from foldline.runtime import Model, Sampler
model = Model.load(sys.argv[1])
session = model.session_from(sys.argv[2])
print(session.position, ",".join(map(str, session.tokens)))
token, tokens, sampler = int(sys.argv[3]), [], Sampler()
for _ in range(8):
    token = sampler(session.decode(token))
    tokens.append(token)
print(",".join(map(str, tokens)))
"""


def test_a_saved_session_resumes_in_a_new_process(bundle, uninterrupted, tmp_path):
    path = tmp_path / "chat.session"
    with Model.load(bundle) as model:
        session, generated = _first_half(model)
        assert generated == uninterrupted[:8]
        before = session.snapshot()
        assert session.save(path) == path
        resumed = model.session_from(path)
        assert resumed.position == session.position and resumed.tokens == session.tokens
        for a, b in zip(before.buffers, resumed.snapshot().buffers):
            assert a.dtype == b.dtype and np.array_equal(a, b)
    # a restart: another process loads the bundle and the file, feeds the pending token and carries on
    out = subprocess.run([sys.executable, "-c", RESUME_SCRIPT, str(bundle), str(path), str(generated[-1])],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    header, tokens = out.stdout.strip().splitlines()[-2:]
    assert header == f"{len(PROMPT) + 7} {','.join(map(str, PROMPT + generated[:7]))}"
    assert [int(t) for t in tokens.split(",")] == uninterrupted[8:16]


def test_a_session_file_of_another_bundle_is_refused(bundle, bundle_factory, other_weights_bundle, tmp_path):
    path = tmp_path / "chat.session"
    with Model.load(bundle) as model:
        session, _ = _first_half(model)
        session.save(path)
    with Model.load(other_weights_bundle) as other, pytest.raises(SessionFileError, match="other weights"):
        other.session_from(path)
    with Model.load(bundle_factory("ripple-tiny")) as other, pytest.raises(SessionFileError, match="another model"):
        other.session_from(path)


def test_corrupted_or_foreign_files_are_clear_errors(bundle, tmp_path):
    path = tmp_path / "chat.session"
    with Model.load(bundle) as model:
        session, _ = _first_half(model)
        session.save(path)
        data = path.read_bytes()
        cases = {
            "missing": None,
            "empty": b"",
            "truncated": data[: len(data) // 2],
            "not a zip": b"GGUF" + bytes(100),
            "bit flip in a buffer": _flip(data, len(data) // 2),
        }
        for name, content in cases.items():
            target = tmp_path / f"{name}.session"
            if content is not None:
                target.write_bytes(content)
            with pytest.raises(SessionFileError):
                model.session_from(target)
        # an npz that is not a session file, and one with a pickled object array
        np.savez(tmp_path / "plain.npz", x=np.arange(3))
        with pytest.raises(SessionFileError, match="not a foldline session"):
            model.session_from(tmp_path / "plain.npz")
        with zipfile.ZipFile(path) as z:
            members = {n: z.read(n) for n in z.namelist()}
        with open(tmp_path / "pickled.npz", "wb") as f:
            np.savez(f, header=np.array([{"format": "foldline-session"}], dtype=object))
        with pytest.raises(SessionFileError):
            model.session_from(tmp_path / "pickled.npz")
        assert "header.npy" in members and "state_0.npy" in members


def _rewrite(source, target, edit_header, edit_buffer=lambda i, raw: raw) -> None:
    """A copy of session file `source` with its header (a dict) and raw buffers edited."""
    import json

    with np.load(source, allow_pickle=False) as archive:
        header = json.loads(archive["header"].tobytes().decode())
        buffers = {k: archive[k] for k in archive.files if k != "header"}
    edit_header(header)
    arrays = {k: edit_buffer(int(k.split("_")[1]), v) for k, v in buffers.items()}
    with open(target, "wb") as f:  # a file object: np.savez would add .npz to a path
        np.savez(f, header=np.frombuffer(json.dumps(header).encode(), np.uint8), **arrays)


def test_old_and_foreign_layouts_and_versions(bundle, tmp_path):
    """Version 1 files (every row of the bundle that saved them, no prefilled count) resume as their row 0;
    a file of another state layout or of a newer format is refused, naming why."""
    path = tmp_path / "chat.session"
    with Model.load(bundle) as model:
        session, _ = _first_half(model)
        session.save(path)
        snap = session.snapshot()
        assert model.read_snapshot(path).prefilled == len(PROMPT), "the header counts the prefilled tokens"

        def v1(header: dict, rows: int = 1) -> None:
            header["format_version"] = 1
            del header["prefilled"]
            for s in header["state"]:
                s["shape"][0] = rows

        _rewrite(path, tmp_path / "v1.session", v1)
        _rewrite(path, tmp_path / "v1-rows3.session", lambda h: v1(h, rows=3),
                 lambda _i, raw: np.concatenate([raw, np.full(2 * raw.size, 0x7F, np.uint8)]))
        for name in ("v1.session", "v1-rows3.session"):
            old = model.read_snapshot(tmp_path / name)
            assert (old.position, old.tokens, old.prefilled) == (snap.position, snap.tokens, 0), name
            for a, b in zip(old.buffers, snap.buffers):
                assert np.array_equal(a, b), name

        def wider(header: dict) -> None:
            header["state"][0]["shape"][2] *= 2  # a cache of twice the slots: another context size

        _rewrite(path, tmp_path / "wider.session", wider,
                 lambda i, raw: np.concatenate([raw, raw]) if i == 0 else raw)
        with pytest.raises(SessionFileError, match="another state layout"):
            model.session_from(tmp_path / "wider.session")
        _rewrite(path, tmp_path / "v3.session", lambda h: h.update(format_version=3))
        with pytest.raises(SessionFileError, match="version 3.*newer foldline"):
            model.session_from(tmp_path / "v3.session")
        _rewrite(path, tmp_path / "bad-prefilled.session", lambda h: h.update(prefilled=snap.position + 1))
        with pytest.raises(SessionFileError, match="prefilled"):
            model.session_from(tmp_path / "bad-prefilled.session")


def test_a_session_of_a_module_ordering_its_windows_otherwise_is_refused(bundle, tmp_path):
    """A bundle with CPU and ONNX modules shares one state layout, but its ONNX module may hold windowed
    caches in window order where the CPU module holds rings (ModuleEntry.window_order): a session saved
    by one is refused by the other, naming why, in either direction."""
    path = tmp_path / "chat.session"
    with Model.load(bundle) as model:
        session, _ = _first_half(model)
        session.save(path)
        _rewrite(path, tmp_path / "recent.session", lambda h: h["bundle"].update(window_order="recent"))
        with pytest.raises(SessionFileError, match="in window order; this one holds them as rings"):
            model.session_from(tmp_path / "recent.session")
        identity = {**model.identity(), "window_order": "recent"}
        with pytest.raises(SessionFileError, match="as rings; this one holds them in window order"):
            session_file_module.load_session_file(path, identity, model.row_layout(), model.max_context)


def test_an_interrupted_save_keeps_the_previous_file(bundle, tmp_path, monkeypatch):
    path = tmp_path / "chat.session"
    with Model.load(bundle) as model:
        session, _ = _first_half(model)
        session.save(path)
        saved = path.read_bytes()
        session.decode(3)

        def crash(*args, **kwargs):
            raise KeyboardInterrupt

        monkeypatch.setattr(session_file_module.np, "savez", crash)
        with pytest.raises(KeyboardInterrupt):
            session.save(path)
        assert path.read_bytes() == saved
        assert [p.name for p in tmp_path.iterdir()] == ["chat.session"], "no temporary file left behind"


def _flip(data: bytes, offset: int) -> bytes:
    return data[:offset] + bytes([data[offset] ^ 0xFF]) + data[offset + 1 :]


def test_generate_continues_a_conversation_across_runs(bundle, tmp_path, capsys):
    from foldline.tools.cli import main

    path = tmp_path / "chat.session"
    first, second = PROMPT[:6], PROMPT[6:10]
    outputs = []
    for ids in (first, second):
        rc = main(["generate", str(bundle), "--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", "4",
                   "--session", str(path)])
        captured = capsys.readouterr()
        assert rc == 0, captured.err
        outputs.append([int(t) for t in captured.out.strip().split(",")])
        assert "session saved" in captured.err
    history = first + outputs[0] + second + outputs[1]
    with Model.load(bundle) as model, model.session_from(path) as resumed:
        assert resumed.tokens == history, "the file holds every prompt and generated token, in order"
    with Model.load(bundle) as model, model.session() as one_run:
        assert list(one_run.generate_ids(first + outputs[0] + second, 4, Sampler())) == outputs[1]
