"""The runtime's input checks and the errors they raise, shared by sessions and batches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Self

import numpy as np

from ..errors import FoldlineError, InputError


class ClosedOnExit:
    """`with obj:` closes obj: the context-manager half of every runtime object holding device memory."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ContextFullError(FoldlineError, RuntimeError):
    """The session has no room for more tokens."""


class TokenIdError(InputError):
    """A token id that is not an integer in [0, vocab_size)."""


class SessionStateError(FoldlineError, RuntimeError):
    """A closed model or session, a session left broken by a failed call, or a snapshot that does not fit."""


def check_ids(ids: Sequence[int], vocab_size: int, position: int, max_context: int) -> np.ndarray:
    """Token ids as a flat int64 array, or a clear error: non-integers, out of range, over the context."""
    try:
        arr = np.asarray(ids)
    except ValueError as e:  # ragged nesting
        raise TokenIdError(f"token ids must be a flat sequence of integers: {e}") from None
    if arr.ndim != 1:
        raise TokenIdError(f"token ids must be a flat sequence of integers, got an array of shape {arr.shape}")
    if arr.dtype == object or (arr.size and arr.dtype.kind not in "iu"):
        raise TokenIdError(f"token ids must be integers, got {arr.dtype} values such as {arr[0]!r}")
    arr = arr.astype(np.int64)
    bad = arr[(arr < 0) | (arr >= vocab_size)]
    if bad.size:
        raise TokenIdError(f"token id {int(bad[0])} is out of range for vocabulary size {vocab_size}")
    if position + arr.size > max_context:
        raise ContextFullError(
            f"context full: {position} tokens held + {arr.size} new > max_context {max_context}"
        )
    return arr


def check_usable(what: str, closed: bool, broken: str | None, model, remedy: str) -> None:
    """Refuse a step on a closed or broken session or batch, or on a closed model (`what` names which)."""
    if closed:
        raise SessionStateError(f"this {what} is closed")
    if broken is not None:
        raise SessionStateError(f"this {what} is broken ({broken}); {remedy}")
    if model.closed:
        raise SessionStateError(f"the model {model.manifest.root} is closed")
