"""What identifies a checkpoint, cheaply: the key of the compile cache (backends/compile_cache.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from .shipped import SHIPPED_MODELS, locate_shipped

FULL_HASH_LIMIT = 64 << 20
SAMPLES, SAMPLE_BYTES = 16, 1 << 20


def file_fingerprint(path: Path) -> dict[str, Any]:
    """A file's identity: its full SHA-256 up to 64 MiB, else size + mtime + sampled SHA-256."""
    st = path.stat()
    h = hashlib.sha256()
    with path.open("rb") as f:
        if st.st_size <= FULL_HASH_LIMIT:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
            return {"name": path.name, "size": st.st_size, "sha256": h.hexdigest()}
        for i in range(SAMPLES):
            f.seek((st.st_size - SAMPLE_BYTES) * i // (SAMPLES - 1))
            h.update(f.read(SAMPLE_BYTES))
    return {"name": path.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sampled_sha256": h.hexdigest()}


def directory_fingerprint(path: Path) -> dict[str, Any]:
    """An HF checkpoint directory: every regular file in it (config, weights, tokenizer)."""
    return {"dir": path.name, "files": [file_fingerprint(f) for f in sorted(path.iterdir()) if f.is_file()]}


def preset_fingerprint(name: str, max_context: int | None, seed: int) -> dict[str, Any]:
    """A preset's weights are a function of its name, context and seed (and of foldline's sources,
    which define the presets and are part of the compile cache's key)."""
    return {"preset": name, "max_context": max_context, "seed": seed}


def checkpoint_fingerprint(spec: str, max_context: int | None = None, seed: int = 0) -> dict | None:
    """What identifies MODEL's weights without loading them (the compile cache's key); None if unknown.

    Reads files only (no torch): `foldline compile` asks the cache before importing the compiler.
    """
    path = Path(spec)
    if spec in SHIPPED_MODELS or path.suffix == ".gguf":
        gguf_path = locate_shipped(spec) if spec in SHIPPED_MODELS else path
        return file_fingerprint(gguf_path) if gguf_path.is_file() else None
    if path.is_dir():
        return directory_fingerprint(path)
    if path.suffix or "/" in spec:
        return None
    return preset_fingerprint(spec, max_context, seed)
