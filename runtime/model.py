"""The embedded runtime: load a bundle, own the state buffers, prefill / decode / generate.

Imports only numpy, iree.runtime and (for text) tokenizers: never torch. State
buffers are allocated on the device once per session from the manifest and the
compiled module writes into them in place; they are never copied to the host
between steps.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .bundle import BundleError, Manifest
from .device import DeviceContext, open_device
from .sampling import Sampler

NP_DTYPES = {"float32": np.float32, "float16": np.float16}


class ContextFullError(RuntimeError):
    """The session has no room for more tokens."""


@dataclass
class Snapshot:
    """An exact host copy of a session: every state buffer and the position."""

    position: int
    buffers: list[np.ndarray]
    tokens: list[int]


class Model:
    """A loaded bundle: the compiled module and its parameters, shared by sessions."""

    def __init__(self, manifest: Manifest, ctx: DeviceContext):
        self.manifest = manifest
        self.ctx = ctx
        self.config = manifest.config
        self.vocab_size = manifest.vocab_size
        self.max_context = manifest.max_context
        self.chunk = manifest.prefill_chunk
        self.kv_lengths = manifest.kv_lengths
        self.eos_token_ids = tuple(self.config.get("eos_token_ids", ()))
        self._tokenizer = None

    @classmethod
    def load(cls, bundle_dir: str | Path, device: str = "cpu", verify: bool = True) -> Model:
        manifest = Manifest.load(bundle_dir)
        if manifest.batch != 1:
            raise BundleError(f"this runtime drives batch-1 bundles; {bundle_dir} has batch {manifest.batch}")
        ctx = open_device(manifest, device, verify=verify)
        return cls(manifest, ctx)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            path = self.manifest.tokenizer_path
            if path is None:
                raise BundleError(f"bundle {self.manifest.root} has no tokenizer; pass token ids instead")
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(path))
        return self._tokenizer

    def session(self) -> Session:
        return Session(self)

    def entry_point(self, entry: str, end: int) -> str:
        """The entry point for a chunk whose positions end below `end`: the shortest attention length.

        Work per step then follows the tokens held: a bundle for a long context
        costs what a short one does until the conversation grows.
        """
        length = next((n for n in self.kv_lengths if end <= n), None)
        return entry if length is None else f"{entry}_{length}"

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        bos = self.config.get("bos_token_id")
        if add_bos and bos is not None:
            ids = [bos, *ids]
        return ids

    def decode_text(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


class Session:
    """One sequence: owns its state buffers on the device and its position."""

    def __init__(self, model: Model):
        self.model = model
        self.ctx = model.ctx
        self.buffers = [self.ctx.zeros(s.shape, NP_DTYPES[s.dtype]) for s in model.manifest.state]
        self.position = 0
        self.tokens: list[int] = []

    @property
    def allocated_bytes(self) -> int:
        return sum(int(np.prod(b.shape)) * b.dtype.itemsize for b in self.buffers)

    # ---- checks ------------------------------------------------------------
    def _check_ids(self, ids: Sequence[int]) -> np.ndarray:
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        bad = arr[(arr < 0) | (arr >= self.model.vocab_size)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} is out of range for vocabulary size {self.model.vocab_size}")
        if self.position + arr.size > self.model.max_context:
            raise ContextFullError(
                f"context full: {self.position} tokens held + {arr.size} new > max_context {self.model.max_context}"
            )
        return arr

    # ---- steps -------------------------------------------------------------
    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        """Feed tokens in chunks (the last one padded); returns logits after the last token."""
        arr = self._check_ids(ids)
        if arr.size == 0:
            raise ValueError("prefill needs at least one token")
        chunk = self.model.chunk
        logits = None
        for off in range(0, arr.size, chunk):
            piece = arr[off : off + chunk]
            tokens = np.zeros((1, chunk), dtype=np.int64)
            tokens[0, : piece.size] = piece
            out = self.ctx.call(
                self.model.entry_point("prefill", self.position + piece.size),
                [tokens, np.array([self.position], np.int64), np.array([piece.size], np.int64)],
                self.buffers,
            )
            self.position += piece.size
            logits = out
        self.tokens.extend(int(t) for t in arr)
        return logits.reshape(-1)

    def decode(self, token: int) -> np.ndarray:
        """Feed one token; returns the next-token logits."""
        arr = self._check_ids([token])
        out = self.ctx.call(self.model.entry_point("decode", self.position + 1), [arr.reshape(1, 1), np.array([self.position], np.int64)], self.buffers)
        self.position += 1
        self.tokens.append(int(token))
        return out.reshape(-1)

    def generate_ids(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampler: Sampler | None = None,
        stop_ids: Sequence[int] | None = None,
        on_logits=None,
    ) -> Iterator[int]:
        """Yield new token ids; stops at EOS, a stop id, max_new_tokens or a full context."""
        sampler = sampler or Sampler()
        stops = set(self.model.eos_token_ids if stop_ids is None else stop_ids)
        logits = self.prefill(prompt_ids)
        for step in range(max_new_tokens):
            if on_logits is not None:
                on_logits(logits)
            token = sampler(logits)
            yield token
            if token in stops or step == max_new_tokens - 1:
                return
            if self.position >= self.model.max_context:
                return
            logits = self.decode(token)

    def generate(
        self,
        prompt: str,
        max_new_tokens: int = 32,
        sampler: Sampler | None = None,
        stop_strings: Sequence[str] = (),
        add_bos: bool = True,
    ) -> Iterator[str]:
        """Stream text pieces; the pieces concatenate to the decoded continuation."""
        ids = self.model.encode(prompt, add_bos=add_bos)
        yield from self.stream_text(ids, max_new_tokens, sampler, stop_strings)

    def stream_text(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampler: Sampler | None = None,
        stop_strings: Sequence[str] = (),
        on_logits=None,
    ) -> Iterator[str]:
        """Generate from token ids and yield decoded text as it becomes complete."""
        produced: list[int] = []
        emitted = ""
        for token in self.generate_ids(prompt_ids, max_new_tokens, sampler, on_logits=on_logits):
            if token in self.model.eos_token_ids:
                break
            produced.append(token)
            text = self.model.decode_text(produced)
            if text.endswith("\ufffd"):
                continue  # an incomplete multi-byte character: wait for the next token
            piece = text[len(emitted) :]
            hit = next((s for s in stop_strings if s in text), None)
            if hit is not None:
                kept = text[: text.index(hit)]
                if len(kept) > len(emitted):
                    yield kept[len(emitted) :]
                return
            emitted = text
            if piece:
                yield piece

    # ---- snapshots -----------------------------------------------------------
    def snapshot(self) -> Snapshot:
        return Snapshot(self.position, [self.ctx.to_host(b) for b in self.buffers], list(self.tokens))

    def restore(self, snap: Snapshot) -> None:
        if len(snap.buffers) != len(self.buffers):
            raise ValueError("snapshot does not belong to this model")
        self.buffers = [self.ctx.upload(a) for a in snap.buffers]
        self.position = snap.position
        self.tokens = list(snap.tokens)

    def reset(self) -> None:
        self.buffers = [self.ctx.fill_zero(b) for b in self.buffers]
        self.position = 0
        self.tokens = []
