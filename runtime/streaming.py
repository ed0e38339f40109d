"""Token ids to text as they are generated: constant work per token, exact stop strings.

`IncrementalDetokenizer` decodes only a short window of recent ids at each step
(the technique of text-generation-inference and vLLM): the text a new token adds
is decode(window) minus decode(window without it), held back while it ends in an
incomplete UTF-8 character. Concatenating everything it yields, flush included,
gives exactly `tokenizer.decode(all ids)` for the tokenizers foldline ships
(byte-level BPE and SentencePiece with byte fallback; tests/runtime/test_streaming.py).

`StopStringFilter` never emits text that might be the start of a stop string:
a tail that is a prefix of one is held until the next piece decides it.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from typing import Protocol

REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Feed ids one at a time; get back the text each one completes."""

    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = 0  # ids before this have been emitted as text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token: int) -> str:
        """The text `token` completes; "" while a multi-byte character is still open."""
        self.ids.append(int(token))
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        if len(text) > len(prefix) and not text.endswith(REPLACEMENT):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes to U+FFFD, as a full decode does)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix) :] if len(text) > len(prefix) else ""


class StopStringFilter:
    """Pass text through until a stop string appears; never emit any part of one."""

    def __init__(self, stop_strings: Sequence[str]):
        self.stops = [s for s in stop_strings if s]
        self.held = ""
        self.stopped = False

    def _hold_length(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def push(self, piece: str) -> str:
        """The part of `piece` that is certainly not (part of) a stop string."""
        if self.stopped or not piece:
            return ""
        text = self.held + piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self.held = ""
            return text[: min(hits)]
        keep = self._hold_length(text)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The held tail, once the stream has ended without completing a stop string."""
        out, self.held = ("" if self.stopped else self.held), ""
        return out


def stream_pieces(tokens: Iterator[int], tokenizer: Decoder, stop_strings: Sequence[str] = (),
                  stop_ids: Sequence[int] = ()) -> Generator[str, None, bool]:
    """Text pieces for a stream of token ids, ending at a stop id or a stop string.

    Returns (the generator's return value, for `yield from`) whether a stop string ended it.
    """
    detok, stops = IncrementalDetokenizer(tokenizer), StopStringFilter(stop_strings)
    stop_set = set(stop_ids)
    for token in tokens:
        if token in stop_set:
            break
        piece = stops.push(detok.push(token))
        if piece:
            yield piece
        if stops.stopped:
            return True
    tail = stops.push(detok.flush())
    if not stops.stopped:
        tail += stops.flush()
    if tail:
        yield tail
    return stops.stopped
