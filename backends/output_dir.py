"""Where `foldline compile -o DIR` writes: never over a user's files, and never half a bundle.

A compile writes into a sibling temporary directory (`.DIR.tmp-XXXX`, same file
system) and only a finished bundle is renamed to DIR; an existing bundle there
(replaced only when asked) is renamed aside first and removed afterwards. A
compile that fails or is interrupted leaves DIR as it was and removes its
temporary directory. A non-empty directory that is not a bundle is refused:
nothing in it is touched.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..contract.manifest import FORMAT, MANIFEST
from ..errors import InputError


class OutputDirError(InputError):
    """An output directory that a compile must not write into."""


def is_bundle(path: Path) -> bool:
    """Whether `path` holds a foldline bundle's manifest (whole or not: a damaged bundle is still one)."""
    try:
        data = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("format") == FORMAT


def check_output_dir(path: Path, force: bool) -> None:
    """Refuse an output that is a file, a non-empty directory that is not a bundle, or a bundle without `force`."""
    if not path.exists() and not path.is_symlink():
        return
    if path.is_symlink():  # the swap would replace the link, not what it points to
        raise OutputDirError(f"{path} is a symbolic link; name the directory itself")
    if not path.is_dir():
        raise OutputDirError(f"{path} exists and is not a directory; name a new or empty directory, "
                             "or an existing bundle with --force")
    if not any(path.iterdir()):
        return
    if not is_bundle(path):
        raise OutputDirError(f"{path} is not empty and holds no foldline bundle ({MANIFEST}); nothing was "
                             "written: name a new or empty directory")
    if not force:
        raise OutputDirError(f"{path} already holds a bundle; --force replaces it (the old one stays until "
                             "the new one is complete)")


@contextmanager
def staged_output(path: Path) -> Iterator[Path]:
    """A fresh sibling directory to write the bundle into; on success it replaces `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    staging = path.parent / f".{path.name}.tmp-{tag}"
    staging.mkdir()
    try:
        yield staging
        _swap_in(staging, path, path.parent / f".{path.name}.old-{tag}")
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _swap_in(staging: Path, path: Path, aside: Path) -> None:
    """Rename `staging` to `path`; whatever was at `path` is renamed aside, then removed."""
    if not path.exists():
        os.rename(staging, path)
        return
    os.rename(path, aside)
    try:
        os.rename(staging, path)
    except OSError:
        os.rename(aside, path)  # put the old bundle back
        raise
    shutil.rmtree(aside, ignore_errors=True)
