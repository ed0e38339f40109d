"""A content-addressed cache of compiled bundles under $FOLDLINE_CACHE/compiled.

`foldline compile` with inputs it has seen before copies the bundle it wrote
then instead of compiling again. The key is a SHA-256 over everything that
shapes a bundle:

- the checkpoint (frontend/fingerprint.py): a file up to 64 MiB by its full
  SHA-256; a larger one by its size, its modification time and the SHA-256 of
  16 evenly spaced 1 MiB samples (a multi-GB GGUF is not read whole on every
  compile; an edit that keeps size and mtime and misses every sample would
  go unseen, which no tool writing GGUF files does); a preset by its name,
  config and weight seed;
- the build options;
- foldline's compiler sources (every file under frontend/, passes/ and
  backends/, plus the bundle format), so any change to the compiler misses;
- the torch and IREE versions;
- each target's iree-compile flags and the CPU features they resolve to
  (`--cpu host` on another CPU is another key).

An entry is written to a temporary directory and renamed into place, so
concurrent writers never expose a partial entry (the first rename wins, the
loser discards its copy). Two compiles of the same inputs at once do not both
compile: the second waits on the first's lock (an advisory `flock` on
.locks/KEY.lock, released however its holder ends) and then copies its bundle. An entry holds the bundle's own files (its manifest,
the files the manifest lists, model.mlir when kept), never other files that lay
in the output directory. The cache holds foldline's own outputs only and is
bounded (FOLDLINE_CACHE_MAX_GB, default 20): the least recently used entries
go first. It also leaves the disk FOLDLINE_CACHE_MIN_FREE_GB (default 2) free:
older entries go to make room for a new one, and a bundle that would still
cut into that floor is not stored (the compile's own output is unaffected).
`foldline cache ls|clear` lists and empties it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from ..frontend.shipped import cache_dir

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
SOURCE_FOLDERS = ("contract", "frontend", "passes", "kernels", "backends")
SOURCE_FILES = ("dtypes.py",)
DEFAULT_MAX_GB = 20.0
DEFAULT_MIN_FREE_GB = 2.0
ENTRY_FILE = "entry.json"
BUNDLE_DIR = "bundle"


def _sha256(*parts: Any) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else json.dumps(part, sort_keys=True, default=str).encode())
    return h.hexdigest()


def compiler_source_hash() -> str:
    """SHA-256 of every foldline source that can change a bundle, with the torch and IREE versions."""
    h = hashlib.sha256()
    files = [f for folder in SOURCE_FOLDERS for f in sorted((PACKAGE_ROOT / folder).rglob("*.py"))]
    for f in [*files, *(PACKAGE_ROOT / name for name in SOURCE_FILES)]:
        h.update(str(f.relative_to(PACKAGE_ROOT)).encode())
        h.update(f.read_bytes())
    for pkg in ("torch", "iree-base-compiler"):
        h.update(_version(pkg).encode())
    return h.hexdigest()


def _version(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "unknown"


def cache_key(checkpoint: dict[str, Any], options: dict[str, Any], targets: list[dict[str, Any]]) -> str:
    """The entry's name: a SHA-256 of the checkpoint, options, compiler sources, versions and targets."""
    return _sha256({"checkpoint": checkpoint, "options": options, "targets": targets,
                    "compiler": compiler_source_hash(), "iree": _version("iree-base-compiler"),
                    "torch": _version("torch")})


@dataclass
class CacheEntry:
    key: str
    path: Path
    info: dict[str, Any]
    size: int
    last_used: float


def _tree_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class CompileCache:
    """Bundles by key under `root` (default $FOLDLINE_CACHE/compiled), at most `max_bytes` in all."""

    def __init__(self, root: Path | None = None, max_bytes: int | None = None, min_free_bytes: int | None = None):
        self.root = Path(root) if root is not None else cache_dir() / "compiled"
        if max_bytes is None:
            max_bytes = int(float(os.environ.get("FOLDLINE_CACHE_MAX_GB", DEFAULT_MAX_GB)) * (1 << 30))
        if min_free_bytes is None:
            min_free_bytes = int(float(os.environ.get("FOLDLINE_CACHE_MIN_FREE_GB", DEFAULT_MIN_FREE_GB)) * (1 << 30))
        self.max_bytes = max_bytes
        self.min_free_bytes = min_free_bytes

    def free_bytes(self) -> int:
        """Free space on the cache's disk."""
        return shutil.disk_usage(self.root if self.root.exists() else self.root.parent).free

    def _entry_dir(self, key: str) -> Path:
        return self.root / key

    @contextmanager
    def claimed(self, key: str, waiting: Callable[[], None] = lambda: None) -> Iterator[None]:
        """Held while one process asks the cache for `key` and, on a miss, compiles and stores it; calls
        `waiting()` once when another process holds it. No lock where the OS has no flock."""
        try:
            import fcntl
        except ImportError:  # not POSIX: concurrent compiles of the same inputs both compile
            yield
            return
        locks = self.root / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        with open(locks / f"{key}.lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                waiting()
                fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def fetch(self, key: str, out_dir: Path) -> bool:
        """Copy the bundle stored under `key` into out_dir; False when there is none."""
        entry = self._entry_dir(key)
        bundle = entry / BUNDLE_DIR
        if not (bundle / "manifest.json").is_file():
            return False
        out_dir.mkdir(parents=True, exist_ok=True)
        for f in bundle.iterdir():
            shutil.copy2(f, out_dir / f.name)  # copies: a user may edit or damage their bundle
        os.utime(entry / ENTRY_FILE)  # least-recently-used order
        return True

    def store(self, key: str, bundle_dir: Path, info: dict[str, Any], files: Iterable[str]) -> bool:
        """Keep a copy of a freshly written bundle's `files` (names in bundle_dir: the bundle's own, never
        whatever else lies beside them); atomic against concurrent writers, then bounded. False when the
        disk has no room for it above the free-space floor, even with every older entry dropped."""
        if (self._entry_dir(key) / ENTRY_FILE).is_file():
            return True
        self.root.mkdir(parents=True, exist_ok=True)
        files = list(files)
        size = sum((Path(bundle_dir) / name).stat().st_size for name in files)
        reclaimable = sum(e.size for e in self.entries())
        if self.free_bytes() + reclaimable < self.min_free_bytes + size:
            return False  # no room even with every entry gone: keep the entries
        self.evict(need=size)
        tmp = self.root / f".tmp-{uuid.uuid4().hex}"
        try:
            (tmp / BUNDLE_DIR).mkdir(parents=True)
            for name in files:
                shutil.copy2(Path(bundle_dir) / name, tmp / BUNDLE_DIR / name)
            (tmp / ENTRY_FILE).write_text(json.dumps({**info, "key": key, "created": time.time()}, indent=2))
            try:
                os.rename(tmp, self._entry_dir(key))
            except OSError:  # another writer stored the same key first
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.evict()
        return True

    def entries(self) -> list[CacheEntry]:
        """Complete entries, most recently used first."""
        if not self.root.is_dir():
            return []
        out = []
        for d in self.root.iterdir():
            meta = d / ENTRY_FILE
            if d.name.startswith(".") or not meta.is_file():
                continue
            try:
                info = json.loads(meta.read_text())
            except (OSError, json.JSONDecodeError):
                info = {}
            out.append(CacheEntry(d.name, d, info, _tree_size(d), meta.stat().st_mtime))
        return sorted(out, key=lambda e: e.last_used, reverse=True)

    def evict(self, need: int = 0) -> list[str]:
        """Drop least recently used entries until the cache fits its bound and the disk has the free-space
        floor plus `need` bytes free; returns their keys."""
        entries, dropped = self.entries(), []
        total = sum(e.size for e in entries)
        while entries and (total > self.max_bytes or self.free_bytes() < self.min_free_bytes + need):
            e = entries.pop()
            shutil.rmtree(e.path, ignore_errors=True)
            total -= e.size
            dropped.append(e.key)
        return dropped

    def clear(self) -> int:
        """Remove every entry (and abandoned temporaries); returns the bytes freed."""
        if not self.root.is_dir():
            return 0
        freed = _tree_size(self.root)
        shutil.rmtree(self.root, ignore_errors=True)
        return freed
