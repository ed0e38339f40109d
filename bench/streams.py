"""Aggregate decode throughput with N concurrent streams on a batched bundle (continuous batching).

The streams go through the same scheduler `foldline serve` uses
(runtime/scheduler.py), without HTTP: the figure is the engine's. Each stream
has its own random prompt and generates exactly `new_tokens` greedy tokens (no
stop ids), all submitted at once. The aggregate counts the tokens the streams'
callbacks received; each stream's rate runs from submission to its own end.
On a bundle compiled for several CPU devices, each device's busy share is its
own workers' CPU seconds over the wall time (runtime/worker_time.py): 1.0 is a
core kept busy all along, more than 1 is more than one core.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from .child import BenchError
from .engines import random_ids


def parse_streams(text: str, rows: int) -> list[int]:
    try:
        streams = [int(t) for t in text.split(",") if t.strip()]
    except ValueError as e:
        raise BenchError(f"--streams takes comma-separated counts, got {text!r}") from e
    if not streams or any(n < 1 for n in streams):
        raise BenchError("--streams values must be positive")
    return streams


def warm_up(model: Any, prompt_len: int, rng: np.random.Generator) -> None:
    """Page in the weights and run every row count's prefill and decode function once, on a batch of its own.

    The timed streams then start on a fresh scheduler with empty rows: a warm-up request kept by
    the prompt cache would push a lone stream to row 1, whose calls compute more rows than a
    stream alone on an idle server does (docs/serving.md, "How requests share the rows").
    """
    batch = model.batch()
    try:
        for rows in model.manifest.row_counts:
            for row in range(rows):
                if batch.open[row]:
                    batch.release(row)
                batch.open_row(row)
            batch.step({row: random_ids(rng, model.vocab_size, min(prompt_len, model.chunk)) for row in range(rows)},
                       prompt_rows=range(rows))
            batch.step({row: random_ids(rng, model.vocab_size, 1) for row in range(rows)})
    finally:
        batch.close()


def bench_streams(bundle: str, device: str, streams: list[int], prompt_len: int, new_tokens: int,
                  seed: int) -> list[dict[str, Any]]:
    """Per stream count: a fresh scheduler (empty rows) after a shared warm-up (`warm_up`)."""
    from ..runtime import Model
    from ..runtime.scheduler import Request, Scheduler

    model = Model.load(bundle, device=device, verify=False)
    if prompt_len + new_tokens > model.max_context:
        raise BenchError(f"--prompt-len {prompt_len} + --new-tokens {new_tokens} exceeds max_context {model.max_context}")
    rng = np.random.default_rng(seed)
    warm_up(model, prompt_len, rng)
    results = []
    for n in streams:
        scheduler = Scheduler(model, max_queue=n).start()
        try:
            done = threading.Event()
            finished: list[str] = []
            tokens = [0] * n  # tokens each stream received, counted in its own callback
            ends = [0.0] * n  # when each stream finished

            def on_finish(reason: str, error: str | None, i: int, n=n, done=done, finished=finished,
                          ends=ends) -> None:
                ends[i] = time.perf_counter()
                finished.append(error or reason)  # called on the scheduler thread, one at a time
                if len(finished) == n:
                    done.set()

            def on_token(_t, _lp, i: int, tokens=tokens) -> None:
                tokens[i] += 1

            requests = [Request(random_ids(rng, model.vocab_size, prompt_len), new_tokens,
                                lambda t, lp, i=i: on_token(t, lp, i), lambda r, e, i=i: on_finish(r, e, i))
                        for i in range(n)]
            busy0 = model.worker_seconds()
            steps0, t0 = scheduler.steps, time.perf_counter()
            for request in requests:
                scheduler.submit(request)
            done.wait()
            wall = time.perf_counter() - t0
            busy1 = model.worker_seconds()
            if any(f != "length" for f in finished):
                raise RuntimeError(f"a stream ended early: {finished}")
            # aggregate: every token the streams received over the whole wall time; per stream: the median
            # stream's tokens over its own time from submission to its last token
            per_stream = float(np.median([k / (end - t0) for k, end in zip(tokens, ends)]))
            results.append({"streams": n, "rows": model.batch_size, "wall_s": wall, "tokens": sum(tokens),
                            "aggregate_tok_s": sum(tokens) / wall, "per_stream_tok_s": per_stream,
                            "module_calls": scheduler.steps - steps0,
                            # per device of a multi-device CPU bundle: its workers' CPU seconds over the wall
                            "device_busy": None if busy0 is None or busy1 is None
                            else [(b - a) / wall for a, b in zip(busy0, busy1)]})
        finally:
            scheduler.stop()
    return results
