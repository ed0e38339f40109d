"""The warm-up and timing loop every benchmarked engine runs, foldline and its peers alike.

Self-contained (standard library and numpy only): bench/child.py sends this
file's text to child interpreters that have no foldline installed, so every
engine is warmed up, timed and measured by the same code.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from typing import Any

import numpy as np

# Decode steps of every engine's warm-up, after a prefill of the run's whole prompt.
WARMUP_DECODE_STEPS = 4


def run_engine(prefill: Callable[[list[int]], Any], decode: Callable[[int], Any], fresh: Callable[[], Any],
               ids: list[int], new_tokens: int) -> dict[str, Any]:
    """Warm up, start a fresh conversation, then time it: what every engine runs.

    The warm-up is the same for every engine (the run's whole prompt, then
    WARMUP_DECODE_STEPS decode steps, fewer when the run decodes fewer), so
    each has compiled, allocated and paged in what the timed run uses. `fresh()` gives the engine an empty
    conversation (a reset cache, a new generator) outside the timer: building
    one is set-up, not prefill.
    """
    steps = min(WARMUP_DECODE_STEPS, new_tokens)  # the warm-up never holds more than the timed run
    logits = prefill(ids)
    for _ in range(steps):
        logits = decode(int(np.argmax(logits)))
    fresh()
    out = time_engine(prefill, decode, ids, new_tokens)
    out["warmup"] = {"prefill_tokens": len(ids), "decode_steps": steps}
    return out


def time_engine(prefill: Callable[[list[int]], Any], decode: Callable[[int], Any], ids: list[int],
                new_tokens: int) -> dict[str, float]:
    """Prefill `ids`, then decode `new_tokens` greedily; wall clock and process CPU time per phase.

    Wall clock is what a user sees; process CPU time (all threads) tells how much
    of it was this engine's work when other processes share the cores.
    `timer_start` is the perf_counter reading the timer started at (what a
    test compares an engine's set-up against).
    """
    c0, t0 = time.process_time(), time.perf_counter()
    logits = prefill(ids)
    c1, t1 = time.process_time(), time.perf_counter()
    for _ in range(new_tokens):
        logits = decode(int(np.argmax(logits)))
    c2, t2 = time.process_time(), time.perf_counter()
    return {
        "timer_start": t0,
        "prefill_s": t1 - t0,
        "decode_s": t2 - t1,
        "prefill_tok_s": len(ids) / (t1 - t0),
        "decode_tok_s": new_tokens / (t2 - t1) if new_tokens else float("nan"),
        "prefill_cpu_ms_tok": 1000 * (c1 - c0) / len(ids),
        "decode_cpu_ms_tok": 1000 * (c2 - c1) / new_tokens if new_tokens else float("nan"),
    }


def peak_rss() -> dict[str, Any]:
    """This process's peak resident set: VmHWM from /proc/self/status, in MiB, and where it came from.

    Not getrusage's ru_maxrss: Linux carries the high-water mark of the
    process that spawned this one across exec, so a child of a large parent
    would report the parent's peak. Without /proc (not Linux), ru_maxrss.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return {"peak_rss_mib": int(line.split()[1]) / 1024.0, "rss_source": "VmHWM"}
    except OSError:
        pass
    return {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, "rss_source": "ru_maxrss"}
