"""Sessions saved to disk: resumed after a restart exactly, refused when they belong elsewhere."""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from foldline.runtime import Model, Sampler
from foldline.runtime import session_file as session_file_module
from foldline.runtime.session_file import SessionFileError, held_nbytes, held_slots

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
    """A session after the prompt and 8 greedy tokens; the 8th is sampled but not yet fed back (saving
    feeds it)."""
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
for _ in range(7):
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
    # a restart: another process loads the bundle and the file, feeds the next token and carries on
    out = subprocess.run([sys.executable, "-c", RESUME_SCRIPT, str(bundle), str(path), str(uninterrupted[8])],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    header, tokens = out.stdout.strip().splitlines()[-2:]
    assert header == f"{len(PROMPT) + 8} {','.join(map(str, PROMPT + generated))}"
    assert [int(t) for t in tokens.split(",")] == uninterrupted[9:16]


def test_a_session_file_of_another_bundle_is_refused(bundle, bundle_factory, other_weights_bundle, tmp_path):
    path = tmp_path / "chat.session"
    with Model.load(bundle) as model:
        session, _ = _first_half(model)
        session.save(path)
    with Model.load(other_weights_bundle) as other, pytest.raises(SessionFileError, match="other weights"):
        other.session_from(path)
    with Model.load(bundle_factory("ripple-tiny")) as other, pytest.raises(SessionFileError, match="another model"):
        other.session_from(path)


def test_corrupted_or_foreign_files_are_named_in_one_clean_line(bundle, tmp_path):
    """Whatever the file is (empty, random bytes, cut short, a bit flipped, an npz of something else, a
    pickled object array), the error names the file and what it is not, in one line, without numpy's
    advice about allow_pickle; nothing pickled is ever loaded."""
    path = tmp_path / "chat.session"
    with Model.load(bundle) as model:
        session, _ = _first_half(model)
        session.save(path)
        data = path.read_bytes()
        with zipfile.ZipFile(path) as z:
            members = {n: z.read(n) for n in z.namelist()}
            state_offset = z.getinfo("state_0.npy").header_offset + 200
        assert "header.npy" in members and "state_0.npy" in members
        np.savez(tmp_path / "plain.npz", x=np.arange(3))
        with open(tmp_path / "pickled.npz", "wb") as f:
            np.savez(f, header=np.array([{"format": "foldline-session"}], dtype=object))
        _rewrite(path, tmp_path / "pickled-state.npz", lambda h: None,
                 lambda i, raw: np.array([{"a": 1}] * 3, dtype=object) if i == 0 else raw)
        cases = {
            "empty": (b"", "not a zip archive"),
            "random": (np.random.default_rng(3).integers(0, 256, 4096, np.uint8).tobytes(), "not a zip archive"),
            "gguf": (b"GGUF" + bytes(100), "not a zip archive"),
            "truncated": (data[: len(data) // 2], "zip"),
            "bit flip in a buffer": (_flip(data, state_offset), "damaged zip archive: Bad CRC"),
            "plain": ((tmp_path / "plain.npz").read_bytes(), "no header"),
            "pickled": ((tmp_path / "pickled.npz").read_bytes(), "'header' holds object"),
            "pickled buffer": ((tmp_path / "pickled-state.npz").read_bytes(), "'state_0' holds object"),
        }
        for name, (content, reason) in cases.items():
            target = tmp_path / f"{name}.session"
            target.write_bytes(content)
            with pytest.raises(SessionFileError) as caught:
                model.session_from(target)
            message = str(caught.value)
            assert message.startswith(f"{target} is not a foldline session file (") and reason in message, name
            assert "\n" not in message and "allow_pickle" not in message, (name, message)
        with pytest.raises(SessionFileError, match="does not exist"):
            model.session_from(tmp_path / "missing.session")


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


def _write_whole_rows(source, target, snap, version: int, rows: int = 1) -> None:
    """`source` (a version 3 file) as an older version wrote it: every slot of `rows` rows, row 0 the
    snapshot's and the others filled with 0x7F bytes; version 1 without a prefilled count."""
    with np.load(source, allow_pickle=False) as archive:
        header = json.loads(archive["header"].tobytes().decode())
    header["format_version"] = version
    for entry in header["state"]:
        del entry["held"]
        entry["shape"][0] = rows
    if version == 1:
        del header["prefilled"]
    arrays = {f"state_{i}": np.concatenate([buf.reshape(-1).view(np.uint8), np.full((rows - 1) * buf.nbytes, 0x7F, np.uint8)])
              for i, buf in enumerate(snap.buffers)}
    with open(target, "wb") as f:
        np.savez(f, header=np.frombuffer(json.dumps(header).encode(), np.uint8), **arrays)


def test_old_and_foreign_layouts_and_versions(bundle, tmp_path):
    """Version 2 files (one whole row) and version 1 files (every row of the bundle that saved them, no
    prefilled count) resume as their row 0; a file of another state layout or of a newer format is
    refused, naming why."""
    path = tmp_path / "chat.session"
    with Model.load(bundle) as model:
        session, _ = _first_half(model)
        session.save(path)
        snap = session.snapshot()
        assert model.read_snapshot(path).prefilled == len(PROMPT), "the header counts the prefilled tokens"

        _write_whole_rows(path, tmp_path / "v2.session", snap, version=2)
        _write_whole_rows(path, tmp_path / "v1.session", snap, version=1)
        _write_whole_rows(path, tmp_path / "v1-rows3.session", snap, version=1, rows=3)
        for name, prefilled in (("v2.session", snap.prefilled), ("v1.session", 0), ("v1-rows3.session", 0)):
            old = model.read_snapshot(tmp_path / name)
            assert (old.position, old.tokens, old.prefilled) == (snap.position, snap.tokens, prefilled), name
            for a, b in zip(old.buffers, snap.buffers):
                assert np.array_equal(a, b), name

        def wider(header: dict) -> None:
            header["state"][0]["shape"][2] *= 2  # a cache of twice the slots: another context size

        _rewrite(path, tmp_path / "wider.session", wider,
                 lambda i, raw: np.concatenate([raw, raw]) if i == 0 else raw)
        with pytest.raises(SessionFileError, match="another state layout"):
            model.session_from(tmp_path / "wider.session")
        _rewrite(path, tmp_path / "v4.session", lambda h: h.update(format_version=4))
        with pytest.raises(SessionFileError, match="version 4.*newer foldline"):
            model.session_from(tmp_path / "v4.session")
        _rewrite(path, tmp_path / "bad-prefilled.session", lambda h: h.update(prefilled=snap.position + 1))
        with pytest.raises(SessionFileError, match="prefilled"):
            model.session_from(tmp_path / "bad-prefilled.session")


def test_a_header_that_disagrees_with_its_buffers_is_refused_before_they_are_read(bundle, tmp_path):
    """The header's held slot count must be the one its position fills, and each buffer the size the
    count gives, checked from the .npy header before the data is read."""
    path = tmp_path / "chat.session"
    with Model.load(bundle) as model:
        session, _ = _first_half(model)
        session.save(path)

        position = session.position

        def more_held(header: dict) -> None:
            header["state"][0]["held"] += 1

        _rewrite(path, tmp_path / "held.session", more_held)
        with pytest.raises(SessionFileError, match=f"corrupted session header .*'layer0.k' holds {position + 1} "
                                                   f"slots; position {position} fills {position}"):
            model.session_from(tmp_path / "held.session")
        with zipfile.ZipFile(path) as z:
            members = {n: z.read(n) for n in z.namelist()}
        npy = io.BytesIO()  # state_1 claims 1 TiB: refused from its .npy header, nothing allocated
        np.lib.format.write_array_header_1_0(npy, {"descr": "|u1", "fortran_order": False, "shape": (1 << 40,)})
        members["state_1.npy"] = npy.getvalue() + bytes(16)
        with zipfile.ZipFile(tmp_path / "huge.session", "w") as z:
            for name, content in members.items():
                z.writestr(name, content)
        with pytest.raises(SessionFileError, match="'state_1' has 1099511627776 bytes, its header implies"):
            model.session_from(tmp_path / "huge.session")


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
    """The state goes to a temporary file beside the target, owner-only from its creation, and only a
    complete one is renamed over the previous file."""
    path = tmp_path / "chat.session"
    with Model.load(bundle) as model:
        session, _ = _first_half(model)
        session.save(path)
        saved = path.read_bytes()
        session.decode(3)
        modes = []

        def crash(f, **arrays):
            modes.append(stat.S_IMODE(os.fstat(f.fileno()).st_mode))
            raise KeyboardInterrupt

        monkeypatch.setattr(session_file_module.np, "savez", crash)
        old_umask = os.umask(0)  # the mode is the file's own, not what the umask leaves
        try:
            with pytest.raises(KeyboardInterrupt):
                session.save(path)
        finally:
            os.umask(old_umask)
        assert modes == [0o600], "the temporary file is owner-only from its creation"
        assert path.read_bytes() == saved
        assert [p.name for p in tmp_path.iterdir()] == ["chat.session"], "no temporary file left behind"


def test_saved_files_are_owner_only(bundle, tmp_path):
    """A conversation is private: a new file and one saved over a world-readable file are 0600,
    whatever the umask."""
    new, existing = tmp_path / "new.session", tmp_path / "existing.session"
    existing.write_bytes(b"")
    existing.chmod(0o644)
    with Model.load(bundle) as model, model.session() as session:
        session.prefill(PROMPT)
        old_umask = os.umask(0)
        try:
            for path in (new, existing):
                session.save(path)
                assert stat.S_IMODE(path.stat().st_mode) == 0o600, path.name
        finally:
            os.umask(old_umask)
        assert model.read_snapshot(existing).tokens == PROMPT


def _stored_bytes(path) -> dict[str, int]:
    """Array name -> the bytes of data it stores (its .npy header's count: the arrays are raw bytes)."""
    out = {}
    with zipfile.ZipFile(path) as z:
        for name in z.namelist():
            with z.open(name) as f:
                assert np.lib.format.read_magic(f) == (1, 0)
                shape, _, dtype = np.lib.format.read_array_header_1_0(f)
            assert dtype == np.uint8 and len(shape) == 1
            out[name.removesuffix(".npy")] = shape[0]
    return out


def test_a_file_grows_with_the_tokens_held(bundle, tmp_path, monkeypatch):
    """Only the held slots are stored, and only they leave the device: between two positions a file grows
    by the K/V bytes of the tokens between them (the header's token list aside), whatever the bundle's
    context."""
    with Model.load(bundle) as model, model.session() as session:
        crossed, read_range = [], model.ctx.read_range

        def counted(array, offset: int, length: int):
            crossed.append(length)  # the bytes that cross from the device
            return read_range(array, offset, length)

        monkeypatch.setattr(model.ctx, "read_range", counted)
        layout = model.row_layout()
        per_token = sum(s.row_nbytes // s.shape[2] for s in layout)  # llama-tiny: full caches only
        assert all(s.kind == "global_kv" for s in layout) and per_token == 3 * 2 * 2 * 16 * 4
        files, stored = {}, {}
        for position, ids in ((20, PROMPT), (52, list(range(30, 62)))):
            session.prefill(ids)
            path = tmp_path / f"at{position}.session"
            crossed.clear()
            session.save(path)
            assert session.position == position and sum(crossed) == held_nbytes(layout, position)
            files[position], stored[position] = path.stat().st_size, _stored_bytes(path)
        state = {p: sum(n for name, n in arrays.items() if name.startswith("state_")) for p, arrays in stored.items()}
        assert state[20] == held_nbytes(layout, 20) == per_token * 20
        assert state[52] - state[20] == per_token * (52 - 20)
        header_growth = stored[52]["header"] - stored[20]["header"]  # the token list, a few bytes a token
        assert 0 < header_growth < 8 * (52 - 20)
        assert abs(files[52] - files[20] - per_token * (52 - 20) - header_growth) <= 64, "zip and .npy headers are fixed"
        large = files[52]
        assert large < sum(s.nbytes for s in layout) // 2, "a row of the whole context is not stored"


@pytest.mark.parametrize("preset", ["llama-tiny", "gemma3-tiny", "qwen35-tiny", "ripple-tiny"])
def test_a_resumed_session_continues_to_the_bit(preset, bundle_factory, tmp_path):
    """Full caches, rings (gemma3-tiny and ripple-tiny: 16 slots, filling at position 13, wrapped at 43)
    and recurrent state (qwen35-tiny): the file stores each one's held slots, and a session resumed from
    it, fresh or over a session that held a longer conversation, gives the uninterrupted logits to the bit."""
    rng = np.random.default_rng(5)
    path = tmp_path / "chat.session"
    with Model.load(bundle_factory(preset)) as model:
        layout = model.row_layout()
        for prompt_length in (10, 40):
            prompt, other, later = (rng.integers(1, model.vocab_size, n).tolist() for n in (prompt_length, 90, 20))

            def carry_on(session, later=later) -> list[np.ndarray]:
                return [session.decode(9), session.prefill(later), session.decode(11)]

            with model.session() as uninterrupted:
                uninterrupted.prefill(prompt)
                for token in (5, 6, 7):
                    uninterrupted.decode(token)
                uninterrupted.save(path)
                want = carry_on(uninterrupted)
            position = prompt_length + 3
            stored = _stored_bytes(path)
            for i, spec in enumerate(layout):
                ring = spec.kind == "local_kv" and spec.shape[2] < model.max_context
                expected = None if spec.kind not in ("global_kv", "local_kv") else min(position, 16) if ring else position
                assert held_slots(spec, position) == expected, spec.name
                assert stored[f"state_{i}"] == held_nbytes([spec], position), spec.name
            with model.session_from(path) as fresh:
                got_fresh = carry_on(fresh)
            with model.session() as used:
                used.prefill(other)  # every slot of its caches past the saved position holds another conversation's
                used.restore(model.read_snapshot(path))
                got_used = carry_on(used)
            for step, (w, a, b) in enumerate(zip(want, got_fresh, got_used)):
                assert np.array_equal(w, a) and np.array_equal(w, b), f"{preset} at {position}: step {step}"


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

