"""A session on disk: one row of every state buffer, the position and the tokens, tied to one model.

An app saves a conversation and resumes it after a restart without replaying
the prompt; a server keeps conversations its rows cannot hold (runtime/slots.py). The file is a numpy .npz archive (a zip of raw arrays, no pickle:
it is read with `allow_pickle=False`) holding one JSON header and one raw byte
array per state buffer. The header names the bundle it belongs to (model
config and parameter hashes, state layout), so a file from another model,
another build of the weights or another context size is refused with a clear
error instead of resuming on state that means nothing. Zip CRCs catch a
corrupted file; the write goes to a temporary file renamed over the target, so
a crash mid-save leaves the previous file intact.

Version 2 holds one row ([1, ...] per buffer, `Batch.snapshot_row`), so a file
saved from any row of any batch size restores into any row of a bundle of the
same model, weights and per-row layout; its header also counts the tokens the
prefill entry point computed (`prefilled`, what the prompt cache may serve).
Version 1 held every row of the bundle that saved it (a session was row 0)
and no count: it is still read, as its row 0 with none prefilled.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..contract.state import StateBuffer
from ..errors import FoldlineError

FORMAT = "foldline-session"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
HEADER = "header"


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


def save_session_file(path: str | Path, identity: dict[str, Any], layout: list[StateBuffer],
                      buffers: list[np.ndarray], position: int, tokens: list[int], prefilled: int = 0) -> Path:
    """Write one row's state (`layout`: one row of each buffer) atomically (temporary file, then rename);
    returns the path written."""
    path = Path(path)
    header = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "bundle": identity,
        "state": [{"name": s.name, "shape": list(s.shape), "dtype": s.host_dtype.name} for s in layout],
        "position": int(position), "tokens": [int(t) for t in tokens], "prefilled": int(prefilled),
    }
    arrays = {HEADER: np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)}
    for i, buf in enumerate(buffers):
        arrays[f"state_{i}"] = np.frombuffer(np.ascontiguousarray(buf).tobytes(), dtype=np.uint8)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


@dataclass
class SessionFile:
    """The contents of a session file, checked against the bundle that reads it."""

    position: int
    tokens: list[int]
    buffers: list[np.ndarray]  # one row of each buffer; [] from read_session_header
    prefilled: int = 0


def load_session_file(path: str | Path, identity: dict[str, Any], layout: list[StateBuffer],
                      max_context: int) -> SessionFile:
    """Read and check a session file against one row of a bundle's buffers (`layout`); raises
    SessionFileError naming what does not fit."""
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
        with np.load(path, allow_pickle=False) as archive:
            header = _read_header(path, archive)
            rows = _check_bundle(path, header, identity, layout, max_context)
            buffers = [_read_buffer(path, archive, i, spec, rows) for i, spec in enumerate(layout)] \
                if read_buffers else []
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        if isinstance(e, SessionFileError):
            raise
        raise SessionFileError(f"{path} is not a readable foldline session file: {e}") from e
    return SessionFile(header["position"], header["tokens"], buffers, header.get("prefilled", 0))


def _read_header(path: Path, archive: Any) -> dict[str, Any]:
    if HEADER not in archive.files:
        raise SessionFileError(f"{path} is not a foldline session file (no header)")
    try:
        header = json.loads(archive[HEADER].tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SessionFileError(f"{path}: corrupted session header: {e}") from e
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise SessionFileError(f"{path} is not a foldline session file")
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
    want = [{"name": s.name, "shape": list(s.rows(rows).shape), "dtype": s.host_dtype.name} for s in layout]
    if header.get("state") != want:
        raise SessionFileError(f"{path} holds another state layout than one row of this bundle's "
                               "(another context size, K/V dtype or build)")
    if not 0 <= header["position"] <= max_context:
        raise SessionFileError(f"{path}: position {header['position']} is outside this model's "
                               f"context of {max_context}")
    return rows


def _read_buffer(path: Path, archive: Any, index: int, spec: StateBuffer, rows: int) -> np.ndarray:
    """One row of buffer `index` (`spec`: one row); a version 1 file's `rows` rows are read, row 0 kept."""
    key = f"state_{index}"
    if key not in archive.files:
        raise SessionFileError(f"{path} lacks state buffer {spec.name!r}")
    raw = archive[key]
    saved = spec.rows(rows)
    if raw.dtype != np.uint8 or raw.size != saved.nbytes:
        raise SessionFileError(f"{path}: state buffer {spec.name!r} has {raw.size} bytes, expected {saved.nbytes}")
    data = raw.view(spec.host_dtype).reshape(saved.shape)
    return data if rows == 1 else data[:1].copy()
