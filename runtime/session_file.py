"""A session on disk: the state one row holds, the position and the tokens, tied to one model.

An app saves a conversation and resumes it after a restart without replaying
the prompt; a server keeps conversations its rows cannot hold (runtime/slots.py).
The file is a zip of raw numpy arrays (.npz) holding one JSON header and one
byte array per state buffer; it is read member by member, and anything but a
raw byte array (a pickled object, another format) is refused unread. The
header names the bundle it belongs to (model config and parameter hashes,
state layout), so a file from another model, another build of the weights or
another context size is refused with a clear error instead of resuming on
state that means nothing. Zip CRCs catch a corrupted file. The write goes to
a temporary file beside the target, created owner-only (conversations are
private), flushed to disk and renamed over the target, so a crash mid-save
leaves the previous file intact.

Version 3 stores only the slots that hold tokens (`held_slots`): a file grows
with the conversation, not with the context the bundle was compiled for. Its
header records each buffer's held slot count, checked against the position
before anything is read. Version 2 held the whole row ([1, ...] per buffer,
`Batch.snapshot_row`) and version 1 every row of the bundle that saved it (a
session was row 0) and no count of prefilled tokens: both are still read, as
their row 0 (version 1 with none prefilled). Any version restores into any
row of a bundle of the same model, weights and per-row layout.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import zipfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ..contract.state import LAYER_TYPES, SEQ_DIM, StateBuffer
from ..errors import FoldlineError

FORMAT = "foldline-session"
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
HEADER = "header"
MAX_HEADER_BYTES = 64 << 20  # the JSON header: a few bytes per token, so millions of tokens fit
CACHE_KINDS = LAYER_TYPES["global"] + LAYER_TYPES["local"]  # indexed by slot: only the held ones are stored


class SessionFileError(FoldlineError, ValueError):
    """A session file that is missing, corrupted, or belongs to another bundle."""


def bundle_identity(config: dict[str, Any], params_sha256: str | None, window_order: str | None = None) -> dict[str, Any]:
    """What must match for saved state to mean something: the model, its weights, and how the module
    that ran it orders its windowed caches (None: rings; contract/state.py's WINDOW_ORDERS)."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    identity = {"config_sha256": hashlib.sha256(canonical).hexdigest(), "params_sha256": params_sha256,
                "model": config.get("name")}
    if window_order is not None:
        identity["window_order"] = window_order
    return identity


def held_slots(spec: StateBuffer, position: int) -> int | None:
    """How many leading slots of a cache hold tokens after `position` tokens; None: kept whole (recurrent state).

    Every cache holds its tokens in a prefix of its slots: a full cache keeps position p in slot p,
    so [0, position); a ring of `window` slots keeps p in slot p mod window, so all of them once
    the position passes the window; a window-ordered cache of `window` rows (contract/state.py's
    RECENT_WINDOW_ORDER, the ONNX module's) keeps the min(position, window) most recent positions
    in its first rows.
    The slots past the prefix are never read before a later token writes them, so zeros (a fresh
    row's) serve as well as whatever they held.
    """
    if spec.kind not in CACHE_KINDS:
        return None
    return min(position, spec.shape[SEQ_DIM])


def held_nbytes(layout: Sequence[StateBuffer], position: int) -> int:
    """The bytes of state a file of one row (`layout`) stores after `position` tokens."""
    return sum(held_spec(spec, position).nbytes for spec in layout)


def held_spec(spec: StateBuffer, position: int) -> StateBuffer:
    """`spec` cut to the slots a file stores after `position` tokens (`held_slots`)."""
    held = held_slots(spec, position)
    if held is None:
        return spec
    return replace(spec, shape=(*spec.shape[:SEQ_DIM], held, *spec.shape[SEQ_DIM + 1:]))


def save_session_file(path: str | Path, identity: dict[str, Any], layout: list[StateBuffer],
                      buffers: list[np.ndarray], position: int, tokens: list[int], prefilled: int = 0) -> Path:
    """Write the held slots of one row's state to an owner-only file, atomically; returns the path written.

    layout: one row of each buffer; buffers: their host copies, whole ([1, ...], a Snapshot's) or
    already cut to the held slots (`held_spec`, what `Batch.save_row` reads from the device).
    """
    path = Path(path)
    header = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "bundle": identity,
        "state": [_state_entry(s, position) for s in layout],
        "position": int(position), "tokens": [int(t) for t in tokens], "prefilled": int(prefilled),
    }
    arrays = {HEADER: np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)}
    for i, (spec, buf) in enumerate(zip(layout, buffers)):
        held = held_spec(spec, position)
        kept = buf if buf.shape == held.shape else buf[tuple(slice(0, n) for n in held.shape)]
        if kept.shape != held.shape or kept.dtype != held.host_dtype:
            raise ValueError(f"state buffer {spec.name!r} is {buf.dtype}{list(buf.shape)}; one row of it is "
                             f"{held.host_dtype}{list(spec.shape)}, its held slots {list(held.shape)}")
        arrays[f"state_{i}"] = np.ascontiguousarray(kept).reshape(-1).view(np.uint8)
    write_private_atomically(path, lambda f: np.savez(f, **arrays))
    return path


def _state_entry(spec: StateBuffer, position: int | None = None) -> dict[str, Any]:
    """A buffer as a header lists it; with `position`, version 3's count of held slots too."""
    entry = {"name": spec.name, "shape": list(spec.shape), "dtype": spec.host_dtype.name}
    if position is not None:
        entry["held"] = held_slots(spec, position)
    return entry


def write_private_atomically(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write a private file (a conversation's state or messages): `write(f)` fills a 0600 temporary
    file beside `path`, which is fsynced and renamed over it, so a crash leaves any old file whole."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable where the platform allows (POSIX)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@dataclass
class SessionFile:
    """The contents of a session file, checked against the bundle that reads it."""

    position: int
    tokens: list[int]
    buffers: list[np.ndarray]  # one whole row of each buffer; [] from read_session_header
    prefilled: int = 0


def load_session_file(path: str | Path, identity: dict[str, Any], layout: list[StateBuffer],
                      max_context: int) -> SessionFile:
    """Read and check a session file against one row of a bundle's buffers (`layout`); raises
    SessionFileError naming what does not fit. The slots a file does not store come back as zeros."""
    return _load(Path(path), identity, layout, max_context, read_buffers=True)


def read_session_header(path: str | Path, identity: dict[str, Any], layout: list[StateBuffer],
                        max_context: int) -> SessionFile:
    """Check a session file as `load_session_file` does, reading only its header (no buffers): what a
    directory of saved rows is indexed by."""
    return _load(Path(path), identity, layout, max_context, read_buffers=False)


def _load(path: Path, identity: dict[str, Any], layout: list[StateBuffer], max_context: int,
          read_buffers: bool) -> SessionFile:
    if not path.is_file():
        raise SessionFileError(f"session file {path} does not exist")
    try:
        with zipfile.ZipFile(path) as archive:
            header = _read_header(path, archive)
            rows = _check_bundle(path, header, identity, layout, max_context)
            buffers = [_read_buffer(path, archive, header, i, spec, rows) for i, spec in enumerate(layout)] \
                if read_buffers else []
    except zipfile.BadZipFile as e:
        reason = "not a zip archive" if "not a zip file" in str(e) else f"a damaged zip archive: {e}"
        raise SessionFileError(f"{path} is not a foldline session file ({reason})") from e
    except (zlib.error, EOFError, NotImplementedError) as e:
        raise SessionFileError(f"{path} is not a foldline session file (a damaged zip archive: {e})") from e
    except OSError as e:
        raise SessionFileError(f"session file {path} cannot be read: {e.strerror or e}") from e
    return SessionFile(header["position"], header["tokens"], buffers, header.get("prefilled", 0))


def _read_bytes(path: Path, archive: zipfile.ZipFile, name: str, nbytes: int | None, limit: int = 0) -> np.ndarray:
    """Member `name` of the archive as the raw bytes it holds (a 1-D uint8 .npy), writable.

    nbytes: the size it must have, checked against its .npy header before its data is read (None:
    any size up to `limit`). Anything else (a pickled object array, another dtype) is refused unread.
    """
    try:
        info = archive.getinfo(f"{name}.npy")
    except KeyError:
        raise SessionFileError(f"{path} is not a foldline session file (it has no {name!r} array)") from None
    with archive.open(info) as f:
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, _, dtype = np.lib.format.read_array_header_2_0(f)
            else:
                raise ValueError(f".npy version {version}")
        except ValueError as e:
            raise SessionFileError(f"{path} is not a foldline session file ({name!r} is not a numpy "
                                   f"array: {e})") from None
        if dtype != np.uint8 or len(shape) != 1:
            raise SessionFileError(f"{path} is not a foldline session file ({name!r} holds {dtype}"
                                   f"{list(shape)}, not raw bytes)")
        size = shape[0]
        if nbytes is not None and size != nbytes:
            raise SessionFileError(f"{path}: {name!r} has {size} bytes, its header implies {nbytes}")
        if nbytes is None and size > limit:
            raise SessionFileError(f"{path} is not a foldline session file ({name!r} has {size} bytes, "
                                   f"more than {limit})")
        data = bytearray(size)
        if _read_into(f, memoryview(data)) != size or f.read(1):  # reading to the end checks the CRC
            raise SessionFileError(f"{path} is not a foldline session file ({name!r} does not hold the "
                                   f"{size} bytes its .npy header says)")
    return np.frombuffer(data, np.uint8)


def _read_into(f: Any, out: memoryview, chunk: int = 1 << 20) -> int:
    """Fill `out` from `f` a chunk at a time (a zip member's readinto would stage it all in bytes first)."""
    done = 0
    while done < len(out):
        piece = f.read(min(chunk, len(out) - done))
        if not piece:
            break
        out[done : done + len(piece)] = piece
        done += len(piece)
    return done


def _read_header(path: Path, archive: zipfile.ZipFile) -> dict[str, Any]:
    if f"{HEADER}.npy" not in archive.namelist():
        raise SessionFileError(f"{path} is not a foldline session file (no header)")
    raw = _read_bytes(path, archive, HEADER, None, MAX_HEADER_BYTES)
    try:
        header = json.loads(raw.tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SessionFileError(f"{path}: corrupted session header: {e}") from e
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise SessionFileError(f"{path} is not a foldline session file (its header is not a session's)")
    version = header.get("format_version")
    if version not in READABLE_VERSIONS:
        raise SessionFileError(f"{path} has session format version {version}; this runtime reads versions "
                               f"{', '.join(map(str, READABLE_VERSIONS))} (a newer foldline wrote it)")
    position, tokens = header.get("position"), header.get("tokens")
    if (type(position) is not int or not isinstance(tokens, list) or len(tokens) != position
            or not all(type(t) is int for t in tokens)):
        raise SessionFileError(f"{path}: corrupted session header (position and tokens disagree)")
    prefilled = header.get("prefilled", 0 if version == 1 else None)
    if type(prefilled) is not int or not 0 <= prefilled <= position:
        raise SessionFileError(f"{path}: corrupted session header (prefilled {prefilled!r} is not a count "
                               f"of its {position} tokens)")
    return header


def _saved_rows(header: dict[str, Any]) -> int:
    """The rows a file holds: one since version 2; a version 1 file held every row of its bundle."""
    if header["format_version"] != 1:
        return 1
    try:
        rows = header["state"][0]["shape"][0]
    except (KeyError, IndexError, TypeError):
        return 1  # malformed: the layout check below names it
    return rows if type(rows) is int and rows >= 1 else 1


def _stores_held_slots(header: dict[str, Any]) -> bool:
    """Whether the file stores only the held slots of each cache (version 3 on), not whole rows."""
    return header["format_version"] >= 3


def _check_bundle(path: Path, header: dict[str, Any], identity: dict[str, Any], layout: list[StateBuffer],
                  max_context: int) -> int:
    """Refuse a file of another model, weights or layout; returns the rows it holds (row 0 is read)."""
    saved = header.get("bundle") or {}
    if saved.get("config_sha256") != identity["config_sha256"]:
        raise SessionFileError(f"{path} was saved by another model ({saved.get('model')!r}, another config); "
                               f"this bundle is {identity['model']!r}")
    if saved.get("params_sha256") != identity["params_sha256"]:
        raise SessionFileError(f"{path} was saved with other weights than this bundle's parameters: "
                               "its state would not continue this model's computation")
    if saved.get("window_order") != identity.get("window_order"):
        orders = {None: "as rings", "recent": "in window order"}
        raise SessionFileError(f"{path} was saved by a module that holds windowed caches "
                               f"{orders.get(saved.get('window_order'), saved.get('window_order'))}; this one holds "
                               f"them {orders.get(identity.get('window_order'))}: resume it on the device that saved it")
    rows = _saved_rows(header)
    state = header.get("state")
    listed = [{k: v for k, v in entry.items() if k != "held"} if isinstance(entry, dict) else entry
              for entry in state] if isinstance(state, list) else state
    if listed != [_state_entry(s.rows(rows)) for s in layout]:
        raise SessionFileError(f"{path} holds another state layout than one row of this bundle's "
                               "(another context size, K/V dtype or build)")
    position = header["position"]
    if not 0 <= position <= max_context:
        raise SessionFileError(f"{path}: position {position} is outside this model's "
                               f"context of {max_context}")
    if _stores_held_slots(header):
        for spec, entry in zip(layout, state):
            if "held" not in entry or entry["held"] != held_slots(spec, position):
                raise SessionFileError(f"{path}: corrupted session header (buffer {spec.name!r} holds "
                                       f"{entry.get('held')!r} slots; position {position} fills "
                                       f"{held_slots(spec, position)!r})")
    return rows


def _read_buffer(path: Path, archive: zipfile.ZipFile, header: dict[str, Any], index: int, spec: StateBuffer,
                 rows: int) -> np.ndarray:
    """One whole row of buffer `index` (`spec`: one row): the stored slots, zeros after them; a version 1
    file's `rows` rows are read and row 0 kept."""
    name = f"state_{index}"
    if f"{name}.npy" not in archive.namelist():
        raise SessionFileError(f"{path} lacks state buffer {spec.name!r}")
    if not _stores_held_slots(header):
        saved = spec.rows(rows)
        data = _read_bytes(path, archive, name, saved.nbytes).view(spec.host_dtype).reshape(saved.shape)
        return data if rows == 1 else data[:1].copy()
    held = held_spec(spec, header["position"])
    data = _read_bytes(path, archive, name, held.nbytes).view(spec.host_dtype).reshape(held.shape)
    if held.shape == spec.shape:
        return data
    row = np.zeros(spec.shape, spec.host_dtype)
    row[(slice(None),) * SEQ_DIM + (slice(0, held.shape[SEQ_DIM]),)] = data
    return row
