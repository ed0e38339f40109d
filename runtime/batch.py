"""Many sequences through one module call: the rows of a batched bundle.

A bundle compiled with `--batch N` takes N rows per call, each with its own
position and, in a prefill chunk, its own number of valid tokens. `Batch` owns
the N rows of state and advances any subset of them in one call:

- every fed row takes one token (decode) or up to `chunk` tokens (prefill);
- when every fed row takes exactly one token and none of them a prompt token,
  the call is `decode` (the cheap entry point), else `prefill`;
- rows in the call that take nothing, open or free, get n_valid = 0, which
  leaves every kind of their state untouched (the module's padding rules,
  docs/architecture.md), so a long prompt can be fed chunk by chunk in prefill
  calls between the decode calls of the other rows, each row always computed
  by the same kind of call (runtime/scheduler.py). They ride along at their
  own position: a ring reads its start position to know which slot holds
  which token, so a kept row fed nothing at position 0 would lose its window.

Opening a row zeroes its slice of every state buffer in place: the other rows'
state is never touched. A released row keeps its state and tokens:
`open_row_reusing(prompt)` reopens the free row that serves the longest
prefix of a new prompt (the prompt cache), else the lowest free row.

One row's state travels on its own: `snapshot_row` copies that row's slice of
every buffer to the host, `restore_row` writes one back into any row (in place
on the device where it allows) without touching the others, and
`save_row` / `load_row` go through a session file (runtime/session_file.py),
so a row saved from one bundle continues in any row of any bundle of the same
model, weights and per-row state layout (a `Session` is such a row). A row's
kept tokens are about to be lost when it is zeroed, rewound or overwritten;
`before_evict` (the server's slot store, runtime/slots.py) is told first.

With checkpoints (`Batch(model, checkpoints=N)`, runtime/prompt_cache.py), a
row whose prompt is prefilled from position 0 in whole chunks keeps a host
copy of its ring and recurrent state at each chunk boundary (the latest N);
a prompt that leaves what the row holds after one of them resumes there. Only
those buffers are copied: full caches keep their slots below any position.

A bundle compiled with row counts below its batch (`row_counts` in the
manifest; by default 1) has entry points over the first k rows of the same
state buffers: each call takes the fewest rows that cover the rows it feeds,
so one stream on a batch-8 bundle costs one row, not eight.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..contract.entry_points import decode_inputs, kv_tiles_input, row_entry_name
from ..contract.state import RECURRENT_KINDS, SEQ_DIM
from ..errors import InputError
from .checks import ClosedOnExit, ContextFullError, SessionStateError, check_ids, check_usable
from .prompt_cache import ReuseRule
from .session_file import held_spec, save_session_file


class RowError(InputError):
    """A row that does not exist, is not open, or is given more tokens than a call takes."""


@dataclass
class Snapshot:
    """An exact host copy of one row: its slice of every state buffer ([1, ...] each), position and tokens.

    prefilled: how many leading tokens the prefill entry point computed (what the prompt cache may
    serve of full caches, runtime/prompt_cache.py); 0 claims none, which is always exact.
    """

    position: int
    buffers: list[np.ndarray]
    tokens: list[int]
    prefilled: int = 0


@dataclass(frozen=True)
class Checkpoint:
    """A row's rings and recurrent state (host copies, in `Batch.volatile` order) after its first `position` tokens."""

    position: int
    buffers: list[np.ndarray]


class Batch(ClosedOnExit):
    """The rows of a batched bundle; one call advances any subset of them.

    Not for use from two threads at once (the scheduler drives it from one);
    its calls take the model's lock, so sessions of the same model may run
    beside it.
    """

    def __init__(self, model: Any, checkpoints: int = 0):
        self.model = model  # a runtime Model (not imported: model.py builds batches)
        self.rows = model.batch_size
        layout = model.state_layout()
        self.buffers = [model.ctx.zeros(s.shape, s.host_dtype, model.manifest.state_device(i))
                        for i, s in enumerate(layout)]
        self._row_bytes = [s.row_nbytes for s in layout]
        self.positions = [0] * self.rows
        self.tokens: list[list[int]] = [[] for _ in range(self.rows)]
        # per row, how many leading tokens the prefill entry point computed (prompt_cache.py: a rewind
        # to them gives the state a prefill from scratch gives, to the bit)
        self.prefilled = [0] * self.rows
        self.open = [False] * self.rows
        self._written = [False] * self.rows  # rows a call computed since they were last zeroed
        self.reuse = ReuseRule.for_state(model.manifest.state, model.max_context)
        # the buffers a position does not index (rings, recurrent state): what a checkpoint copies
        self.volatile = [i for i, s in enumerate(layout) if self.reuse.whole_only and not _position_indexed(s, model)]
        if type(checkpoints) is not int or checkpoints < 0:
            raise InputError(f"checkpoints must be a count of 0 or more, not {checkpoints!r}")
        self.max_checkpoints = checkpoints if self.volatile else 0
        self.checkpoints: list[list[Checkpoint]] = [[] for _ in range(self.rows)]
        # per row: every token so far fed by prefill calls that start at multiples of the chunk, from 0, as a
        # prefill from scratch feeds them: a checkpoint taken then is that prefill's state, to the bit
        self._aligned = [True] * self.rows
        # called with a row whose kept tokens are about to be lost, while its state still holds them
        self.before_evict: Callable[[int], None] | None = None
        self.broken: str | None = None
        self.closed = False

    @property
    def buffers(self) -> list[Any]:
        """The state buffers on the device, every row."""
        return self._buffers

    @buffers.setter
    def buffers(self, buffers: list[Any]) -> None:
        self._buffers = list(buffers)
        self._views: dict[int, list[Any]] = {}  # rows -> views of the first rows of each buffer

    def _state_for(self, rows: int) -> list[Any]:
        """The state a call over the first `rows` rows takes: views made once per set of buffers."""
        if rows not in self._views:
            self._views[rows] = [self.model.ctx.first_rows(b, rows) for b in self._buffers]
        return self._views[rows]

    # ---- rows ----------------------------------------------------------------
    def free_rows(self) -> list[int]:
        """The rows not open, lowest first (a released row keeps its state for the prompt cache)."""
        return [r for r in range(self.rows) if not self.open[r]]

    def open_row(self, row: int | None = None) -> int:
        """Start a new sequence on `row` (default: the lowest free one) with zeroed state; returns the row."""
        self._check_usable()
        if row is None:
            free = self.free_rows()
            if not free:
                raise RowError(f"all {self.rows} rows are in use")
            row = free[0]
        self._check_row(row)
        self._losing(row, keep=0)
        if self._written[row]:  # a row no call has computed is still the zeros it was allocated as
            self.buffers = [self.model.ctx.fill_zero_range(buf, row * nbytes, nbytes)
                            for buf, nbytes in zip(self.buffers, self._row_bytes)]
            self._written[row] = False
        self.positions[row], self.tokens[row], self.prefilled[row], self.open[row] = 0, [], 0, True
        self.checkpoints[row], self._aligned[row] = [], True
        return row

    def open_row_reusing(self, prompt: Sequence[int], row: int | None = None) -> tuple[int, int]:
        """Open a free row for `prompt`: `row`, or the one whose kept state serves its longest prefix;
        (row, tokens reused).

        With nothing to reuse, the row (by default the lowest free one) is zeroed and opened: a
        call computes the rows up to the highest one it feeds (`Model.rows_for`), so at low load
        the work stays on the first rows.
        """
        self._check_usable()
        free = self.free_rows()
        if not free:
            raise RowError(f"all {self.rows} rows are in use")
        if row is None:
            best, reused = self.best_kept_row(prompt)
        elif row not in free:
            raise RowError(f"row {row} is not free")
        else:
            best, reused = row, self.usable(row, prompt)
        if reused == 0:
            return self.open_row(free[0] if row is None else row), 0
        row = best
        self._losing(row, reused)
        self._rewind_open(row, reused)
        return row, reused

    def usable(self, row: int, prompt: Sequence[int]) -> int:
        """How many leading tokens of `prompt` the kept `row` serves (runtime/prompt_cache.py)."""
        return self.reuse.usable(self.tokens[row], prompt, self.prefilled[row], self.checkpoint_positions(row))

    def served(self, row: int) -> int:
        """The most leading tokens of what `row` holds that any prompt can reuse."""
        return self.reuse.served(self.tokens[row], self.prefilled[row])

    def checkpoint_positions(self, row: int) -> list[int]:
        """The positions at which `row` keeps a checkpoint, oldest first."""
        return [c.position for c in self.checkpoints[row]]

    def best_kept_row(self, prompt: Sequence[int]) -> tuple[int, int]:
        """The free row whose kept state serves the longest prefix of `prompt`, and how many tokens (0: none)."""
        reused, row = max(((self.usable(r, prompt), r) for r in self.free_rows()), default=(0, -1))
        return row, reused

    def _rewind_open(self, row: int, keep: int) -> None:
        """Open `row` holding only its first `keep` tokens (the rest is written over as the row is fed).

        Rings and recurrent state that do not already follow those tokens are rewound to the
        checkpoint at `keep` (the prompt cache served no more than one).
        """
        if self.volatile and keep != len(self.tokens[row]):
            self._write_checkpoint(row, next(c for c in self.checkpoints[row] if c.position == keep))
            self._aligned[row] = True
        else:
            self._aligned[row] = self._aligned[row] and keep % self.model.chunk == 0 and keep <= self.prefilled[row]
        self.positions[row], self.tokens[row], self.open[row] = keep, self.tokens[row][:keep], True
        self.prefilled[row] = min(self.prefilled[row], keep)
        self.checkpoints[row] = [c for c in self.checkpoints[row] if c.position <= keep]

    def _write_checkpoint(self, row: int, checkpoint: Checkpoint) -> None:
        """Put a checkpoint's rings and recurrent state back into `row`'s slice of those buffers."""
        self._write_row(row, zip(self.volatile, checkpoint.buffers))

    def _take_checkpoint(self, row: int) -> None:
        """Copy `row`'s rings and recurrent state to the host at its position, keeping the latest few."""
        copies = [self._read_row(row, i) for i in self.volatile]
        kept = [c for c in self.checkpoints[row] if c.position < self.positions[row]]
        self.checkpoints[row] = [*kept, Checkpoint(self.positions[row], copies)][-self.max_checkpoints:]

    def _read_row(self, row: int, index: int) -> np.ndarray:
        """A host copy of `row`'s slice of state buffer `index`: only that slice crosses to the host."""
        spec = self.model.row_layout()[index]
        raw = self.model.ctx.read_range(self.buffers[index], row * spec.row_nbytes, spec.row_nbytes)
        return raw.view(spec.host_dtype).reshape(spec.shape)

    def _write_row(self, row: int, slices: Iterable[tuple[int, np.ndarray]]) -> None:
        """Write host data into `row`'s slice of the state buffers given by index, leaving other rows alone."""
        ctx, layout, buffers = self.model.ctx, self.model.row_layout(), list(self.buffers)
        for i, data in slices:
            buffers[i] = ctx.write_range(buffers[i], row * layout[i].row_nbytes, data)
        if any(new is not old for new, old in zip(buffers, self.buffers)):
            self.buffers = buffers  # a device that could not write in place gave fresh buffers
        self._written[row] = True

    def checkpoint_nbytes(self) -> int:
        """The bytes one checkpoint of one row holds (0 when the bundle has nothing to checkpoint)."""
        layout = self.model.row_layout()
        return sum(layout[i].row_nbytes for i in self.volatile) if self.max_checkpoints else 0

    def _losing(self, row: int, keep: int) -> None:
        """Tell `before_evict` when `row` is about to keep only `keep` of its tokens and held more worth serving."""
        if self.before_evict is not None and self.served(row) > keep:
            self.before_evict(row)

    def release(self, row: int) -> None:
        """End the sequence on `row`; its state and tokens are kept for `open_row_reusing`."""
        self._check_row(row)
        self.open[row] = False

    def _ride_along_position(self, row: int) -> int:
        """Where a free row rides along in a call: after its kept tokens, or at 0 when it holds a full
        context (n_valid 0 still writes padding into the slot at its position, which must be free)."""
        if self.tokens[row] and self.positions[row] < self.model.max_context:
            return self.positions[row]
        self._losing(row, keep=0)
        self.positions[row], self.tokens[row], self.prefilled[row] = 0, [], 0  # what it held is overwritten now
        self.checkpoints[row] = []
        return 0

    # ---- steps ---------------------------------------------------------------
    def step(self, feeds: Mapping[int, Sequence[int]], prompt_rows: Collection[int] = ()) -> dict[int, np.ndarray]:
        """Feed each listed open row its tokens in one module call; returns each fed row's next-token logits.

        Rows in `prompt_rows` are fed prompt tokens: the call is a prefill even when each takes one
        token, so a prompt's state is the same however much of it a kept row already held.
        """
        self._check_usable()
        if not feeds:
            raise RowError("a step needs at least one row with tokens")
        checked: dict[int, np.ndarray] = {}
        for row, ids in feeds.items():
            self._check_row(row)
            if not self.open[row]:
                raise RowError(f"row {row} is not open; open_row() it first")
            checked[row] = check_ids(ids, self.model.vocab_size, self.positions[row], self.model.max_context)
            if checked[row].size == 0:
                raise RowError(f"row {row} was given no tokens")
            if checked[row].size > self.model.chunk:
                raise RowError(f"row {row} was given {checked[row].size} tokens; a call takes at most "
                               f"{self.model.chunk} (the prefill chunk): feed the rest in later steps")
        # The call computes the first `rows` rows: the fewest an entry point covers every fed row with.
        # Rows past them are not in the call at all, so their state is untouched.
        rows = self.model.rows_for(max(checked) + 1)
        open_rows = [r for r in range(rows) if self.open[r]]
        is_decode = all(ids.size == 1 for ids in checked.values()) and not set(prompt_rows) & set(checked)
        width = 1 if is_decode else self.model.chunk
        tokens = np.zeros((rows, width), np.int64)
        start = np.zeros(rows, np.int64)
        n_valid = np.zeros(rows, np.int64)
        for r in open_rows:
            if r not in checked and self.positions[r] >= self.model.max_context:
                raise ContextFullError(f"row {r} holds a full context; release it before feeding other rows "
                                       "(a row that takes no tokens still needs one free slot)")
            start[r] = self.positions[r]
        for r in range(rows):
            if not self.open[r]:
                start[r] = self._ride_along_position(r)
        for r, ids in checked.items():
            tokens[r, : ids.size] = ids
            n_valid[r] = ids.size
        end = max(int(start[r] + max(n_valid[r], 1)) for r in open_rows)
        if is_decode:
            entry, inputs = "decode", decode_inputs(tokens, start, n_valid)
        else:
            entry, inputs = "prefill", [tokens, start, n_valid, kv_tiles_input(end, self.model.max_context)]
        name = row_entry_name(entry, rows, self.rows)
        self._written[:rows] = [True] * rows
        try:
            with self.model.lock:
                logits = self.model.ctx.call(name, inputs, self._state_for(rows))
        except BaseException as e:
            self.broken = f"{name} failed: {type(e).__name__}: {e}"
            raise
        out = {}
        chunk = self.model.chunk
        for r, ids in checked.items():
            if not is_decode and self.prefilled[r] == self.positions[r]:
                self.prefilled[r] += ids.size
            self._aligned[r] = self._aligned[r] and not is_decode and self.positions[r] % chunk == 0
            self.positions[r] += ids.size
            self.tokens[r].extend(int(t) for t in ids)
            if self.max_checkpoints and self._aligned[r] and self.positions[r] % chunk == 0:
                self._take_checkpoint(r)
            out[r] = logits[r].reshape(-1)
        return out

    # ---- state ---------------------------------------------------------------
    def snapshot_row(self, row: int) -> Snapshot:
        """An exact host copy of `row` (open or kept): only its slice of each buffer crosses to the host."""
        self._check_usable()
        self._check_row(row)
        buffers = [self._read_row(row, i) for i in range(len(self.buffers))]
        return Snapshot(self.positions[row], buffers, list(self.tokens[row]), self.prefilled[row])

    def restore_row(self, row: int, snap: Snapshot) -> None:
        """Put `snap` into `row` and open it there, continuing from the snapshot's position.

        Whatever the row held is replaced (`before_evict` is told first); only its slice of each
        buffer is written, in place on the device where it allows, so every other row, open or
        kept, is untouched. The snapshot is checked before anything is written.
        """
        self._check_usable()
        self._check_row(row)
        self.check_snapshot(snap)
        self._losing(row, keep=0)
        self._write_row(row, enumerate(snap.buffers))
        self.positions[row], self.tokens[row], self.open[row] = snap.position, list(snap.tokens), True
        self.prefilled[row] = snap.prefilled
        self.checkpoints[row], self._aligned[row] = [], False

    def open_row_from(self, row: int, snap: Snapshot, prompt: Sequence[int]) -> int:
        """Open the free `row` from `snap` (a saved conversation) for `prompt`; returns the prompt tokens it serves.

        The row is rewound to them, as `open_row_reusing` rewinds a kept row; a snapshot that
        serves nothing of `prompt` is not written, and the row opens zeroed.
        """
        self._check_row(row)
        if self.open[row]:
            raise RowError(f"row {row} is open; release it before opening it from a snapshot")
        reused = self.reuse.usable(snap.tokens, prompt, snap.prefilled)
        if reused == 0:
            self.open_row(row)
            return 0
        self.restore_row(row, snap)
        self._rewind_open(row, reused)
        return reused

    def save_row(self, row: int, path: str | Path) -> Path:
        """Write the slots `row` holds to a session file (owner-only, atomically); `load_row` or
        `Model.session_from` continue it."""
        return save_session_file(path, self.model.identity(), self.model.row_layout(), self.held_state(row),
                                 self.positions[row], self.tokens[row], self.prefilled[row])

    def held_state(self, row: int) -> list[np.ndarray]:
        """Host copies of the slots of each buffer that `row` holds (session_file.held_spec): a file's
        contents. Only those bytes cross to the host, not the row's whole context."""
        self._check_usable()
        self._check_row(row)
        ctx, out = self.model.ctx, []
        for buf, spec in zip(self.buffers, self.model.row_layout()):
            held = held_spec(spec, self.positions[row])
            start = row * spec.row_nbytes
            if held.shape == spec.shape:
                raw = ctx.read_range(buf, start, spec.row_nbytes)
            else:  # each head's first slots: [1, heads, slots, head dim], slots cut
                span, kept = spec.row_nbytes // spec.shape[1], held.row_nbytes // spec.shape[1]
                raw = np.concatenate([ctx.read_range(buf, start + head * span, kept) for head in range(spec.shape[1])])
            out.append(raw.view(spec.host_dtype).reshape(held.shape))
        return out

    def load_row(self, row: int, path: str | Path) -> None:
        """Restore `row` from a session file saved by any row of a bundle of the same model and layout;
        the slots the file does not hold are zeroed, as in a fresh row."""
        self.restore_row(row, self.model.read_snapshot(path))

    def check_snapshot(self, snap: Snapshot) -> None:
        """Refuse a snapshot that does not fit one row of this bundle, naming what differs."""
        layout = self.model.row_layout()
        if len(snap.buffers) != len(layout):
            raise SessionStateError(f"the snapshot has {len(snap.buffers)} state buffers; this model has {len(layout)}")
        for spec, buf in zip(layout, snap.buffers):
            if (tuple(buf.shape), buf.dtype) != (spec.shape, spec.host_dtype):
                many_rows = buf.ndim == len(spec.shape) and buf.shape[0] > 1 and tuple(buf.shape[1:]) == spec.shape[1:]
                every = " (a copy of every row: snapshot_row copies one)" if many_rows else ""
                raise SessionStateError(f"snapshot buffer {spec.name!r} is {buf.dtype}{list(buf.shape)}{every}; "
                                        f"one row of this model's is {spec.host_dtype}{list(spec.shape)}")
        if not 0 <= snap.position <= self.model.max_context or len(snap.tokens) != snap.position:
            raise SessionStateError(f"the snapshot's position {snap.position} does not match its "
                                    f"{len(snap.tokens)} tokens or this model's max_context {self.model.max_context}")
        if type(snap.prefilled) is not int or not 0 <= snap.prefilled <= snap.position:
            raise SessionStateError(f"the snapshot's prefilled count {snap.prefilled!r} is not between 0 and "
                                    f"its position {snap.position}")

    # ---- lifetime ------------------------------------------------------------
    def close(self) -> None:
        self.buffers, self.closed = [], True
        self.checkpoints = [[] for _ in range(self.rows)]

    def _check_usable(self) -> None:
        check_usable("batch", self.closed, self.broken, self.model, "its rows' state is undefined")

    def _check_row(self, row: int) -> None:
        if type(row) is not int or not 0 <= row < self.rows:
            raise RowError(f"row {row!r} does not exist; this bundle has rows 0..{self.rows - 1}")


def _position_indexed(spec: Any, model: Any) -> bool:
    """Whether a state buffer holds one slot per position of the whole context (a full cache): a row
    rewound below what it holds finds every lower slot intact."""
    return spec.kind not in RECURRENT_KINDS and spec.kind.endswith("_kv") and spec.shape[SEQ_DIM] >= model.max_context
