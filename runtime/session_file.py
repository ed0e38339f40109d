"""A session on disk: every state buffer, the position and the tokens, tied to one bundle.

An app saves a conversation and resumes it after a restart without replaying
the prompt. The file is a numpy .npz archive (a zip of raw arrays, no pickle:
it is read with `allow_pickle=False`) holding one JSON header and one raw byte
array per state buffer. The header names the bundle it belongs to (model
config and parameter hashes, state layout), so a file from another model,
another build of the weights or another context size is refused with a clear
error instead of resuming on state that means nothing. Zip CRCs catch a
corrupted file; the write goes to a temporary file renamed over the target, so
a crash mid-save leaves the previous file intact.
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

from ..errors import FoldlineError

FORMAT = "foldline-session"
FORMAT_VERSION = 1
HEADER = "header"


class SessionFileError(FoldlineError, ValueError):
    """A session file that is missing, corrupted, or belongs to another bundle."""


@dataclass(frozen=True)
class BufferLayout:
    """What one state buffer must look like: its name, shape and host dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype


def bundle_identity(config: dict[str, Any], params_sha256: str | None) -> dict[str, Any]:
    """What must match for saved state to mean something: the model and its weights."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    return {"config_sha256": hashlib.sha256(canonical).hexdigest(), "params_sha256": params_sha256,
            "model": config.get("name")}


def save_session_file(path: str | Path, identity: dict[str, Any], layout: list[BufferLayout],
                      buffers: list[np.ndarray], position: int, tokens: list[int]) -> Path:
    """Write the state atomically (temporary file, then rename); returns the path written."""
    path = Path(path)
    header = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "bundle": identity,
        "state": [{"name": s.name, "shape": list(s.shape), "dtype": s.dtype.name} for s in layout],
        "position": int(position), "tokens": [int(t) for t in tokens],
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
    buffers: list[np.ndarray]


def load_session_file(path: str | Path, identity: dict[str, Any], layout: list[BufferLayout],
                      max_context: int) -> SessionFile:
    """Read and check a session file; raises SessionFileError naming what does not fit."""
    path = Path(path)
    if not path.is_file():
        raise SessionFileError(f"session file {path} does not exist")
    try:
        with np.load(path, allow_pickle=False) as archive:
            header = _read_header(path, archive)
            _check_bundle(path, header, identity, layout, max_context)
            buffers = [_read_buffer(path, archive, i, spec) for i, spec in enumerate(layout)]
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        if isinstance(e, SessionFileError):
            raise
        raise SessionFileError(f"{path} is not a readable foldline session file: {e}") from e
    return SessionFile(header["position"], header["tokens"], buffers)


def _read_header(path: Path, archive: Any) -> dict[str, Any]:
    if HEADER not in archive.files:
        raise SessionFileError(f"{path} is not a foldline session file (no header)")
    try:
        header = json.loads(archive[HEADER].tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SessionFileError(f"{path}: corrupted session header: {e}") from e
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise SessionFileError(f"{path} is not a foldline session file")
    if header.get("format_version") != FORMAT_VERSION:
        raise SessionFileError(f"{path} has session format version {header.get('format_version')}; "
                               f"this runtime reads {FORMAT_VERSION}")
    position, tokens = header.get("position"), header.get("tokens")
    if (type(position) is not int or not isinstance(tokens, list) or len(tokens) != position
            or not all(type(t) is int for t in tokens)):
        raise SessionFileError(f"{path}: corrupted session header (position and tokens disagree)")
    return header


def _check_bundle(path: Path, header: dict[str, Any], identity: dict[str, Any], layout: list[BufferLayout],
                  max_context: int) -> None:
    saved = header.get("bundle") or {}
    if saved.get("config_sha256") != identity["config_sha256"]:
        raise SessionFileError(f"{path} was saved by another model ({saved.get('model')!r}, another config); "
                               f"this bundle is {identity['model']!r}")
    if saved.get("params_sha256") != identity["params_sha256"]:
        raise SessionFileError(f"{path} was saved with other weights than this bundle's parameters: "
                               "its state would not continue this model's computation")
    want = [{"name": s.name, "shape": list(s.shape), "dtype": s.dtype.name} for s in layout]
    if header.get("state") != want:
        raise SessionFileError(f"{path} holds another state layout than this bundle's "
                               "(another context size, K/V dtype or build)")
    if not 0 <= header["position"] <= max_context:
        raise SessionFileError(f"{path}: position {header['position']} is outside this model's "
                               f"context of {max_context}")


def _read_buffer(path: Path, archive: Any, index: int, spec: BufferLayout) -> np.ndarray:
    key = f"state_{index}"
    if key not in archive.files:
        raise SessionFileError(f"{path} lacks state buffer {spec.name!r}")
    raw = archive[key]
    nbytes = int(np.prod(spec.shape, dtype=np.int64)) * spec.dtype.itemsize
    if raw.dtype != np.uint8 or raw.size != nbytes:
        raise SessionFileError(f"{path}: state buffer {spec.name!r} has {raw.size} bytes, expected {nbytes}")
    return raw.view(spec.dtype).reshape(spec.shape)
