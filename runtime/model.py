"""The embedded runtime: load a bundle, own the state buffers, prefill / decode / generate.

Imports only numpy, iree.runtime and (for text) tokenizers: never torch. State
buffers are allocated on the device once per session from the manifest and the
compiled module writes into them in place; they are never copied to the host
between steps.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from ..contract.errors import BundleError
from ..contract.manifest import Manifest
from ..contract.state import StateBuffer
from .batch import Batch, Snapshot
from .checks import ClosedOnExit, SessionStateError, TokenIdError, check_ids, check_usable
from .device import DeviceContext, open_device
from .generation import Generation
from .sampling import Sampler
from .session_file import bundle_identity, load_session_file
from .streaming import stream_pieces


class Model(ClosedOnExit):
    """A loaded bundle: the compiled module and its parameters, shared by sessions."""

    def __init__(self, manifest: Manifest, ctx: DeviceContext):
        self.manifest = manifest
        self._ctx: DeviceContext | None = ctx
        # Sessions on several threads share the module: their calls run one at a time.
        self.lock = threading.Lock()
        self.config = manifest.config
        self.vocab_size = manifest.vocab_size
        self.max_context = manifest.max_context
        self.chunk = manifest.prefill_chunk
        self.batch_size = manifest.batch
        self.eos_token_ids = tuple(self.config.get("eos_token_ids", ()))
        self._tokenizer = None
        self._text_tokenizer = None

    @classmethod
    def load(cls, bundle_dir: str | Path, device: str = "cpu", verify: bool = True,
             threads: int | None = None, cpu: str | None = None,
             cpu_features: str | Iterable[str] | None = None, ort_providers: Sequence[str] | None = None) -> Model:
        """Open a bundle on `device`.

        threads: CPU worker threads (None: IREE's default, one per physical core;
        1: run on the calling thread). IREE fixes the count for the process at the
        first CPU load; asking for another one later is an error.
        cpu: of a bundle with several CPU modules (`foldline compile --cpu x86-all`), load the
        one compiled for this --cpu name; by default the best one this CPU runs.
        cpu_features: the CPU flags to assume instead of this CPU's (cpuinfo spelling, a subset
        of them; default: $FOLDLINE_CPU_FEATURES, else the CPU's own).
        ort_providers: on the onnxruntime device, ONNX Runtime's execution providers in order of preference
        (`["cuda", "cpu"]`; default: cpu).
        """
        manifest = Manifest.load(bundle_dir)
        ctx = open_device(manifest, device, verify=verify, threads=threads, cpu=cpu, features=cpu_features,
                          ort_providers=ort_providers)
        return cls(manifest, ctx)

    @property
    def module_key(self) -> str:
        """The manifest's key of the loaded module (`cpu`, `cpu-x86-64-v3`, ...): manifest.modules[key]."""
        return self.ctx.module_key

    @property
    def cpu_fallback(self) -> str | None:
        """Why this host runs a float CPU module where the bundle has faster ones: the line the runtime
        logs on load (the CPU flags it lacks), or None."""
        return self.ctx.cpu_fallback

    def worker_seconds(self) -> list[float] | None:
        """CPU seconds each device's own workers have computed since load, for a bundle compiled for
        several CPU devices (None otherwise, or without /proc): how busy each device kept its cores."""
        worker_seconds = getattr(self.ctx, "worker_seconds", None)  # the onnxruntime device has none
        return worker_seconds() if worker_seconds is not None else None

    @property
    def ctx(self) -> DeviceContext:
        """The loaded module and its device; SessionStateError once the model is closed."""
        if self._ctx is None:
            raise SessionStateError(f"the model {self.manifest.root} is closed")
        return self._ctx

    @property
    def closed(self) -> bool:
        """Whether `close()` has released the module and the device."""
        return self._ctx is None

    def close(self) -> None:
        """Release the module and the device; sessions of this model stop working. Idempotent.

        Waits for a module call in progress on another thread (calls hold the model's lock),
        so no call loses its device halfway through.
        """
        with self.lock:
            if self._ctx is not None:
                self._ctx.close()  # the sessions, or the waiting thread (runtime/waiter.py)
            self._ctx = None

    @property
    def tokenizer(self):
        """The bundle's `tokenizers.Tokenizer`, loaded on first use; BundleError if it has none."""
        if self._tokenizer is None:
            path = self.manifest.tokenizer_path
            if path is None:
                raise BundleError(f"bundle {self.manifest.root} has no tokenizer; pass token ids instead")
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(path))
        return self._tokenizer

    @property
    def text_tokenizer(self):
        """A copy of the tokenizer that reads control-token text (`<|im_start|>`) as plain text: for
        what a user typed (runtime/chat.py). The model's own tokenizer keeps reading control tokens."""
        if self._text_tokenizer is None:
            from tokenizers import Tokenizer

            copy = Tokenizer.from_str(self.tokenizer.to_str())
            copy.encode_special_tokens = True
            self._text_tokenizer = copy
        return self._text_tokenizer

    def rows_for(self, rows: int) -> int:
        """The fewest rows an entry point of this bundle computes that cover the first `rows` rows."""
        return next(k for k in self.manifest.row_counts if k >= rows)

    def session(self) -> Session:
        """One sequence: row 0 of a batch of its own (on a batched bundle, through the one-row functions)."""
        return Session(self)

    def batch(self, checkpoints: int = 0) -> Batch:
        """All rows of the bundle (`foldline compile --batch N`), advanced together (runtime/batch.py);
        `checkpoints`: how many copies of its rings and recurrent state each row keeps for the prompt cache."""
        return Batch(self, checkpoints)

    def state_layout(self) -> list[StateBuffer]:
        """The state buffers over every row, in the module's argument order (from the manifest)."""
        return self.manifest.state

    def identity(self) -> dict:
        """What a saved session must share with this bundle: model config and parameter hashes."""
        params = self.manifest.params
        module = self.manifest.modules.get(self.module_key)
        return bundle_identity(self.config, params.sha256 if params else None, module and module.window_order)

    def row_layout(self) -> list[StateBuffer]:
        """The state buffers of one row: what a snapshot or a session file holds."""
        return [s.rows(1) for s in self.state_layout()]

    def read_snapshot(self, path: str | Path) -> Snapshot:
        """The row a session file holds (`Session.save`, `Batch.save_row`), checked against this bundle."""
        saved = load_session_file(path, self.identity(), self.row_layout(), self.max_context)
        return Snapshot(saved.position, saved.buffers, saved.tokens, saved.prefilled)

    def session_from(self, path: str | Path) -> Session:
        """A new session resumed from a file written by `Session.save` or `Batch.save_row` with a bundle
        of this model, weights and per-row state layout (any batch size)."""
        snap = self.read_snapshot(path)
        session = Session(self)
        session.restore(snap)
        return session

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """The token ids of `text`, after the model's BOS when `add_bos` and the model has one."""
        # encode_batch lets go of the GIL while it works (encode holds it), so a long prompt
        # tokenized on one thread does not stall the others (the server's event loop)
        ids = self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        bos = self.config.get("bos_token_id")
        if add_bos and bos is not None:
            ids = [bos, *ids]
        return ids

    def decode_text(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`, whole (for text as it is generated: `Session.generate`, `stream_text`)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


class Session(ClosedOnExit):
    """One sequence: row 0 of a `Batch` (runtime/batch.py), which owns the state buffers and calls the module.

    Thread model: several sessions of one Model may run on several threads (the
    model's lock runs their calls one at a time); one session is not for use from
    two threads at once.
    """

    ROW = 0

    def __init__(self, model: Model):
        self.model = model
        self._batch = Batch(model)
        self._batch.open_row(self.ROW)
        self._pending: int | None = None  # generated, not yet fed (`pending_token`)

    @property
    def ctx(self) -> DeviceContext:
        return self.model.ctx

    @property
    def buffers(self) -> list:
        """The state buffers on the device (every row of a batched bundle's; the session is row 0)."""
        return self._batch.buffers

    @property
    def position(self) -> int:
        """How many tokens the state holds (the pending token not among them)."""
        return self._batch.positions[self.ROW]

    @property
    def tokens(self) -> list[int]:
        """The token ids the state holds, in order (the pending token not among them)."""
        return self._batch.tokens[self.ROW]

    @property
    def broken(self) -> str | None:
        """Why the state no longer matches position and tokens (a failed call), else None."""
        return self._batch.broken

    @property
    def closed(self) -> bool:
        """Whether `close()` has freed the state buffers."""
        return self._batch.closed

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the state buffers on the device (every row of a batched bundle's)."""
        return sum(int(np.prod(b.shape)) * b.dtype.itemsize for b in self.buffers)

    def close(self) -> None:
        """Free the state buffers. Idempotent."""
        self._batch.close()

    # ---- checks ------------------------------------------------------------
    def _check_usable(self) -> None:
        check_usable("session", self.closed, self.broken, self.model, "reset() or restore() it")

    def _check_ids(self, ids: Sequence[int]) -> np.ndarray:
        self._check_usable()
        return check_ids(ids, self.model.vocab_size, self.position, self.model.max_context)

    # ---- steps -------------------------------------------------------------
    @property
    def pending_token(self) -> int | None:
        """The last generated token, which the state does not hold yet; the next step feeds it first."""
        return self._pending

    def _with_pending(self, ids: Sequence[int]) -> np.ndarray:
        """`ids` checked, after the pending token (if any)."""
        arr = self._check_ids(ids)
        if self._pending is None:
            return arr
        return self._check_ids(np.concatenate([np.array([self._pending], np.int64), arr]))

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        """Feed the pending token (if any) and `ids` in chunks (the last one padded); returns logits after the last."""
        arr = self._with_pending(ids)
        if arr.size == 0:
            raise TokenIdError("prefill needs at least one token")
        self._pending = None
        chunk = self.model.chunk
        logits = None
        for off in range(0, arr.size, chunk):
            logits = self._batch.step({self.ROW: arr[off : off + chunk]}, prompt_rows=(self.ROW,))[self.ROW]
        return logits

    def decode(self, token: int) -> np.ndarray:
        """Feed one token (after the pending one, if any); returns the next-token logits."""
        if isinstance(token, (list, tuple, np.ndarray)) and np.ndim(token) != 0:
            raise TokenIdError(f"decode takes one token id, got a sequence of {len(token)}; use prefill for several")
        arr = self._check_ids([token] if self._pending is None else [self._pending, token])
        if arr.size == 2:  # both checked together above, so a refused token feeds neither
            self._pending = None
            self._batch.step({self.ROW: arr[:1]})
        return self._batch.step({self.ROW: arr[-1:]})[self.ROW]

    def feed_pending(self) -> np.ndarray | None:
        """Feed the pending token with a decode step; its logits, or None when there was none."""
        if self._pending is None:
            return None
        arr = self._check_ids([self._pending])
        self._pending = None
        return self._batch.step({self.ROW: arr})[self.ROW]

    def drop_pending(self) -> int | None:
        """Forget the pending token (a stop token an app replaces with its own); returns it."""
        token, self._pending = self._pending, None
        return token

    def generate_ids(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampler: Sampler | None = None,
        stop_ids: Sequence[int] | None = None,
        on_logits=None,
    ) -> Generation[int]:
        """Continue the sequence: feed the pending token and `prompt_ids`, then yield new token ids.

        Stops at EOS or a stop id (finish_reason "stop"), max_new_tokens or a full context
        ("length"), or `cancel()` ("cancelled"). The last token yielded is not fed yet
        (`pending_token`): the next call, `snapshot` or `save` feeds it, so calls in a row make
        one sequence. A token that finds the context full is not kept.
        """
        sampler = sampler or Sampler()
        stops = set(self.model.eos_token_ids if stop_ids is None else stop_ids)

        def run(gen: Generation[int]) -> Iterator[int]:
            held = self.position
            logits = self.prefill(prompt_ids)
            gen.usage.cached_tokens, gen.usage.prompt_tokens = held, self.position
            for step in range(max_new_tokens):
                if on_logits is not None:
                    on_logits(logits)
                token = sampler(logits)
                full = self.position >= self.model.max_context  # no slot left to feed it in
                self._pending = None if full else int(token)
                gen.usage.completion_tokens += 1
                if token in stops:
                    gen.finish_reason = "stop"
                elif full or step == max_new_tokens - 1:
                    gen.finish_reason = "length"
                yield token
                if gen.finish_reason is not None:
                    return
                if gen.cancelled:
                    gen.finish_reason = "cancelled"
                    return
                logits = self.feed_pending()
            gen.finish_reason = "length"  # max_new_tokens == 0

        return Generation(run)

    def generate(
        self,
        prompt: str,
        max_new_tokens: int = 32,
        sampler: Sampler | None = None,
        stop_strings: Sequence[str] = (),
        add_bos: bool | None = None,
        on_logits=None,
    ) -> Generation[str]:
        """Stream text pieces continuing the sequence; the pieces concatenate to the decoded continuation.

        add_bos: None (the default) adds the model's BOS only to the start of a sequence
        (position 0), never in the middle of one. on_logits: called with each generated
        step's logits, before its token is sampled.
        """
        if add_bos is None:
            add_bos = self.position == 0 and self._pending is None
        ids = self.model.encode(prompt, add_bos=add_bos)
        return self.stream_text(ids, max_new_tokens, sampler, stop_strings, on_logits=on_logits)

    def stream_text(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampler: Sampler | None = None,
        stop_strings: Sequence[str] = (),
        on_logits=None,
        stop_ids: Sequence[int] | None = None,
    ) -> Generation[str]:
        """Generate from token ids and yield text as it becomes complete (runtime/streaming.py).

        Stops at EOS or a stop id (neither is part of the text), a stop string
        (no part of it is ever yielded; finish_reason "stop"), max_new_tokens or a
        full context; the pieces concatenate to the decoded continuation up to the stop.
        """
        stops = tuple(self.model.eos_token_ids if stop_ids is None else stop_ids)
        tokens = self.generate_ids(prompt_ids, max_new_tokens, sampler, stop_ids=stops, on_logits=on_logits)

        def run(gen: Generation[str]) -> Iterator[str]:
            try:
                by_string = yield from stream_pieces(tokens, self.model.tokenizer, stop_strings, stops)
            finally:
                tokens.close()
            gen.finish_reason = "stop" if by_string else tokens.finish_reason

        return Generation(run, inner=tokens)

    # ---- snapshots -----------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """An exact host copy of the session: its row of every state buffer, the position and the tokens.

        The pending token is fed first, so the copy holds every token generated so far.
        """
        self._check_usable()
        self.feed_pending()
        return self._batch.snapshot_row(self.ROW)

    def save(self, path: str | Path) -> Path:
        """Store the session (state buffers, position, tokens) in `path`; `Model.session_from` resumes it.

        The pending token is fed first, so the file holds every token generated so far. The
        file is written beside `path` and renamed over it, so an interrupted save leaves any
        earlier file intact.
        """
        self._check_usable()
        self.feed_pending()
        return self._batch.save_row(self.ROW, path)

    def restore(self, snap: Snapshot) -> None:
        """Put the session back to `snap` (a broken session included); refuses a snapshot of another model."""
        if self.closed:
            raise SessionStateError("this session is closed")
        self._batch.check_snapshot(snap)
        self._batch.broken = None  # a failed call left the state undefined: the session's one row is rewritten whole
        self._batch.restore_row(self.ROW, snap)
        self._pending = None

    def reset(self) -> None:
        """Back to an empty sequence (a broken session included)."""
        if self.closed:
            raise SessionStateError("this session is closed")
        self._batch.broken = None
        self._batch.release(self.ROW)
        self._batch.open_row(self.ROW)
        self._pending = None

    def rewind_for(self, ids: Sequence[int]) -> int:
        """Keep the longest prefix of `ids` the state still serves exactly and drop the rest; returns its length.

        The prompt cache's rules (runtime/prompt_cache.py): full caches keep any prefix their
        prefill computed; rings and recurrent state only a continuation of every held token, so
        where `ids` departs from what they hold, the session starts again from zero. A broken
        session starts again from zero too.
        """
        if self.closed:
            raise SessionStateError("this session is closed")
        self._pending = None
        if self.broken:
            self.reset()
            return 0
        self._batch.release(self.ROW)
        row, kept = self._batch.open_row_reusing(ids)
        if row != self.ROW:  # another row was chosen: only row 0 can hold anything, so nothing is kept
            self._batch.release(row)
            self._batch.open_row(self.ROW)
            kept = 0
        return kept
