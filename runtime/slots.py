"""Conversations the rows cannot keep, kept on disk: `foldline serve --slots-dir DIR`.

The prompt cache (runtime/prompt_cache.py) keeps a finished request's state in
its row until a new request needs that row. With a slot store the row is saved
first: when a free row whose kept tokens could serve a later prompt is about
to be zeroed, rewound or overwritten (`Batch.before_evict`), its state goes to
a session file in DIR (runtime/session_file.py: the slots the row holds,
owner-only, written atomically), so a file costs the K/V of its tokens, not
of the bundle's whole context.
When a saved file serves a new prompt better than any kept row
(`ReuseRule.usable` on the file's tokens), the scheduler restores it into a
free row and prefills only the rest. The restored bytes are the ones the row
held, so the answer is the one the row would have given had it never been
evicted, to the bit.

The store owns the files named `slot-*.npz` in DIR. At startup it reads their
headers (tokens and prefilled count) and skips, with a warning, those of
another model, weights or state layout, leaving them alone. It keeps at most
`max_files` of its own, dropping the least recently saved or restored; a file
that a newer one serves entirely (the same conversation, further on) is
dropped at once. Only the scheduler's thread uses a store.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError
from .prompt_cache import ReuseRule
from .session_file import SessionFileError, held_nbytes, read_session_header

log = logging.getLogger("foldline.slots")

DEFAULT_MAX_FILES = 32
PATTERN = "slot-*.npz"


class SlotDirError(InputError):
    """A --slots-dir that is not a writable directory, or a bound that keeps no file."""


def check_slots_dir(path: str | Path) -> Path:
    """The directory, or a SlotDirError naming why the server could not keep its files there."""
    path = Path(path)
    if not path.exists():
        raise SlotDirError(f"--slots-dir {path} does not exist: create it first")
    if not path.is_dir():
        raise SlotDirError(f"--slots-dir {path} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise SlotDirError(f"--slots-dir {path} is not writable: {e.strerror or e}") from e
    return path


@dataclass
class SlotFile:
    """One saved row: where it is and what it can serve."""

    path: Path
    tokens: list[int]
    prefilled: int


class SlotStore:
    """The saved rows of one model in one directory, least recently used first."""

    def __init__(self, directory: str | Path, model: Any, max_files: int = DEFAULT_MAX_FILES):
        if type(max_files) is not int or max_files < 1:
            raise SlotDirError(f"--slots-max must be a positive number of files, got {max_files!r}")
        self.dir = check_slots_dir(directory)
        self.model = model  # a runtime Model
        self.max_files = max_files
        self.rule = ReuseRule.for_state(model.manifest.state, model.max_context)
        self._identity, self._layout = model.identity(), model.row_layout()
        self.files: OrderedDict[Path, SlotFile] = OrderedDict()
        self.saves = 0  # rows written
        self.restores = 0  # files restored into rows
        self.skipped = 0  # files of DIR that belong to another bundle
        self._index()

    @property
    def file_nbytes(self) -> int:
        """The state bytes of the largest file: a row holding the whole context."""
        return held_nbytes(self._layout, self.model.max_context)

    @property
    def token_nbytes(self) -> int:
        """The state bytes a file grows by per token held (until its rings are full), from its first token."""
        return held_nbytes(self._layout, 1) - held_nbytes(self._layout, 0)

    def _index(self) -> None:
        """Read the headers of DIR's slot files, oldest first; skip (and keep) those of another bundle."""
        for path in sorted(self.dir.glob(PATTERN), key=_mtime):
            try:
                saved = read_session_header(path, self._identity, self._layout, self.model.max_context)
            except SessionFileError as e:
                log.warning("--slots-dir: skipping %s: %s", path.name, e)
                self.skipped += 1
                continue
            self.files[path] = SlotFile(path, saved.tokens, saved.prefilled)
        self._trim()

    def best(self, prompt: Sequence[int]) -> tuple[SlotFile | None, int]:
        """The file that serves the longest prefix of `prompt`, and how many tokens (None, 0: none does)."""
        best, most = None, 0
        for slot in self.files.values():
            served = self.rule.usable(slot.tokens, prompt, slot.prefilled)
            if served > most:
                best, most = slot, served
        return best, most

    def save(self, batch: Any, row: int) -> Path | None:
        """Write `row` of `batch` unless a file already serves all it could; returns the file that holds it."""
        tokens, prefilled = list(batch.tokens[row]), batch.prefilled[row]
        if self.rule.served(tokens, prefilled) == 0:
            return None
        for slot in self.files.values():
            if self.rule.covers(slot.tokens, slot.prefilled, tokens, prefilled):
                self._touch(slot)
                return slot.path
        digest = hashlib.sha256(np.asarray(tokens, np.int64).tobytes()).hexdigest()[:32]
        path = batch.save_row(row, self.dir / f"slot-{digest}.npz")  # only the held slots leave the device
        for slot in [s for s in self.files.values() if self.rule.covers(tokens, prefilled, s.tokens, s.prefilled)]:
            self._drop(slot)  # the same conversation, further on: the new file serves all it did
        self.files[path] = SlotFile(path, tokens, prefilled)
        self.saves += 1
        self._trim()
        return path

    def restore(self, batch: Any, row: int, slot: SlotFile, prompt: Sequence[int]) -> int:
        """Open the free `row` of `batch` from `slot` for `prompt`; returns the prompt tokens it serves.

        A file that can no longer be read (removed or changed behind the server) leaves the index
        and raises SessionFileError; the row is then untouched.
        """
        try:
            snap = self.model.read_snapshot(slot.path)
        except SessionFileError:
            self.files.pop(slot.path, None)
            raise
        self._touch(slot)  # before the row's own content is saved, which may drop the oldest file
        served = batch.open_row_from(row, snap, prompt)
        self.restores += 1
        return served

    def _touch(self, slot: SlotFile) -> None:
        """Most recently used, here and for the next server's index (the file's mtime)."""
        self.files.move_to_end(slot.path)
        try:
            os.utime(slot.path)
        except OSError:
            pass  # gone: the index still serves from memory until a restore finds it missing

    def _drop(self, slot: SlotFile) -> None:
        self.files.pop(slot.path, None)
        try:
            slot.path.unlink(missing_ok=True)
        except OSError as e:
            log.warning("--slots-dir: could not remove %s: %s", slot.path.name, e)

    def _trim(self) -> None:
        while len(self.files) > self.max_files:
            self._drop(next(iter(self.files.values())))


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
