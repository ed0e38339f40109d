"""What a generation call returns: its stream, then why it ended and how many tokens it took.

A generation is an iterator (token ids or text pieces), as before, that also
carries its outcome once the stream ends, as onnxruntime-genai's Generator and
llama-cpp-python's completions do: `finish_reason` and `usage`. Callers that
only iterate see no difference.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

T = TypeVar("T")

# stop: an end-of-sequence or stop id, or a stop string; length: max_new_tokens or a full context;
# cancelled: the caller asked the generation to stop (`Generation.cancel`, Ctrl-C in `foldline chat`)
FinishReason = Literal["stop", "length", "cancelled"]


@dataclass
class Usage:
    """Token counts of one call, in OpenAI's sense.

    prompt_tokens: the tokens the answer follows (held before the call plus those it fed);
    cached_tokens: of those, the ones the session already held, not computed again;
    completion_tokens: the tokens generated.
    """

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    @property
    def fed_tokens(self) -> int:
        """The prompt tokens this call computed."""
        return self.prompt_tokens - self.cached_tokens

    @property
    def total_tokens(self) -> int:
        """prompt_tokens + completion_tokens, as OpenAI's usage counts them."""
        return self.prompt_tokens + self.completion_tokens


class Generation(Iterator[T], Generic[T]):
    """An iterator over a generation's output with its outcome: `finish_reason` (None until it ends), `usage`.

    `run(generation)` makes the underlying iterator; it fills in the outcome as it goes.
    """

    def __init__(self, run: Callable[[Generation[T]], Iterator[T]], inner: Generation | None = None):
        """inner: the generation this one is built on (text over token ids): it shares its usage and cancel."""
        self.finish_reason: FinishReason | None = None
        self.usage = inner.usage if inner is not None else Usage()
        self.cancelled = False
        self._inner = inner
        self._items = run(self)

    def __iter__(self) -> Generation[T]:
        return self

    def __next__(self) -> T:
        return next(self._items)

    def cancel(self) -> None:
        """Ask the generation to end after the token in progress (safe from a signal handler)."""
        self.cancelled = True
        if self._inner is not None:
            self._inner.cancel()

    def close(self) -> None:
        """End the generation now; what it generated so far stays in the session."""
        close = getattr(self._items, "close", None)
        if close is not None:
            close()
