"""The timing loop every benchmarked engine runs, foldline and its peers alike.

Self-contained (standard library and numpy only): bench/child.py sends this
file's text to child interpreters that have no foldline installed, so every
engine is timed by the same code.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def time_engine(prefill: Callable[[list[int]], Any], decode: Callable[[int], Any], ids: list[int],
                new_tokens: int) -> dict[str, float]:
    """Prefill `ids`, then decode `new_tokens` greedily; wall clock and process CPU time per phase.

    Wall clock is what a user sees; process CPU time (all threads) tells how much
    of it was this engine's work when other processes share the cores.
    """
    c0, t0 = time.process_time(), time.perf_counter()
    logits = prefill(ids)
    c1, t1 = time.process_time(), time.perf_counter()
    for _ in range(new_tokens):
        logits = decode(int(np.argmax(logits)))
    c2, t2 = time.process_time(), time.perf_counter()
    return {
        "prefill_s": t1 - t0,
        "decode_s": t2 - t1,
        "prefill_tok_s": len(ids) / (t1 - t0),
        "decode_tok_s": new_tokens / (t2 - t1) if new_tokens else float("nan"),
        "prefill_cpu_ms_tok": 1000 * (c1 - c0) / len(ids),
        "decode_cpu_ms_tok": 1000 * (c2 - c1) / new_tokens if new_tokens else float("nan"),
    }


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB
