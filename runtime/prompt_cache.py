"""Which of a released row's tokens its state still serves: the rules of the prompt cache.

A row the scheduler releases keeps its state and the tokens it was fed. A
new prompt that begins with some of them reuses the row: only the rest is
prefilled. How much can be reused depends on the kinds of state the bundle
holds:

- full caches (global attention, or a windowed layer kept at full length)
  index their slots by position, and nothing is written below the position a
  row is fed at: any prefix of the held tokens is intact;
- a ring (a windowed layer holding only its window) has overwritten the slots
  of the oldest positions with later ones: only a continuation of every held
  token is exact, not a shorter prefix;
- recurrent state (gated delta net, its convolution) sums every token fed:
  again only a continuation of every held token.

A batched decode call feeds every row, so a free row rides along on a pad
token (runtime/batch.py). Fed at its next position, the pad lands in a slot
that the row's next real token overwrites before anything reads it, so
attention state keeps its prefix; recurrent state does not, and such a row
forgets what it held.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

RECURRENT_KINDS = ("gdn_recurrent", "gdn_conv")
SEQ_DIM = 2  # KV caches are [rows, kv heads, slots, head dim]


@dataclass(frozen=True)
class ReuseRule:
    """What a released row's state can serve, from the kinds of state the bundle holds."""

    whole_only: bool  # a ring or recurrent state: only a prompt that continues every held token
    ride_along_keeps: bool  # a pad token fed at the row's next position leaves its prefix intact

    @classmethod
    def for_state(cls, state: Sequence[Any], max_context: int) -> ReuseRule:
        """From the manifest's state buffers (each with `kind` and `shape`)."""
        recurrent = any(s.kind in RECURRENT_KINDS for s in state)
        ring = any(s.kind == "local_kv" and s.shape[SEQ_DIM] < max_context for s in state)
        return cls(whole_only=recurrent or ring, ride_along_keeps=not recurrent)

    def usable(self, held: Sequence[int], prompt: Sequence[int]) -> int:
        """How many leading tokens of `prompt` a row holding `held` serves; one is always left to feed."""
        shared = common_prefix(held, prompt)
        limit = len(prompt) - 1  # the last prompt token is fed, for the logits of the first new one
        if self.whole_only:
            return len(held) if shared == len(held) <= limit else 0
        return min(shared, limit)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
    return int(differ[0]) if differ.size else n
