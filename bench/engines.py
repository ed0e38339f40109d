"""foldline's own engines, each run in a child process (bench/child.py): the compiled bundle through the
embedded runtime, and the torch reference module (what compiling buys; not a peer)."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from .timer import peak_rss, run_engine


def random_ids(rng: np.random.Generator, vocab: int, n: int) -> list[int]:
    """`n` random token ids above the low ids, where vocabularies keep their control tokens."""
    return rng.integers(min(1000, vocab // 2), vocab, size=n).tolist()


def prompt_ids(vocab: int, n: int, seed: int) -> list[int]:
    return random_ids(np.random.default_rng(seed), vocab, n)


def bench_compiled(bundle: str, device: str, prompt_len: int, new_tokens: int, seed: int,
                   threads: int | None = None, cpu: str | None = None) -> dict[str, Any]:
    """Runs in the child process: the embedded runtime only, on `threads` threads (None: IREE's default),
    the CPU module compiled for `cpu` (None: the best one this CPU runs)."""
    from ..runtime import Model

    t0 = time.perf_counter()
    model = Model.load(bundle, device=device, verify=False, threads=threads if device in ("cpu", "onnxruntime") else None,
                       **({"cpu": cpu} if device == "cpu" else {}))
    load_s = time.perf_counter() - t0
    ids = prompt_ids(model.vocab_size, prompt_len, seed)
    session = model.session()
    # reset: the same buffers, zeroed: one session's state at the peak, as an app holds
    out = run_engine(session.prefill, session.decode, session.reset, ids, new_tokens)
    out.update(load_s=load_s, **peak_rss(), chunk=model.chunk, max_context=model.max_context,
               threads=threads or os.cpu_count(), module=model.module_key)
    return out


def bench_eager(spec: str, max_context: int, chunk: int, prompt_len: int, new_tokens: int, seed: int,
                threads: int | None = None) -> dict[str, Any]:
    """Runs in the child process: the torch reference module, chunked like the runtime."""
    import torch

    from ..frontend.sources import load_model
    from ..testing.parity import EagerRunner

    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    loaded = load_model(spec, max_context=max_context)
    load_s = time.perf_counter() - t0
    ids = prompt_ids(loaded.config.vocab_size, prompt_len, seed)
    runner: list[EagerRunner | None] = [EagerRunner(loaded.module, chunk)]

    def fresh() -> None:
        runner[0] = None  # the warm-up's state freed before the next is made: one state at the peak
        runner[0] = EagerRunner(loaded.module, chunk)

    out = run_engine(lambda t: runner[0].prefill(t), lambda t: runner[0].decode(t), fresh, ids, new_tokens)
    out.update(load_s=load_s, **peak_rss(), threads=torch.get_num_threads())
    return out
