"""A multi-turn chat at the token level: what the prompt cache saves, foldline beside llama.cpp.

Each turn sends the whole conversation so far plus `user_tokens` new ones (random
ids, fixed seed), and the engine answers with `reply_tokens` tokens. The
answers are forced, not sampled: every engine decodes the same reply ids (a
decode step per token, as generating them costs), so every engine sees the same
conversation and the turns are comparable. Per turn, the time to the first
answer token (prefill of what is not cached) and to the last are taken.

foldline runs the conversation through the serving scheduler (runtime/scheduler.py),
with its prompt cache on and off. llama.cpp (llama-cpp-python, in its own
process as in bench/peers.py) reuses the longest common prefix of the
tokens its context holds, as llama-server's `cache_prompt` does, and is also
run with a reset every turn.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np

from .child import BenchError, run_script
from .engines import random_ids
from .timer import WARMUP_DECODE_STEPS


def chat_script(vocab: int, turns: int, user_tokens: int, reply_tokens: int, seed: int) -> list[dict[str, list[int]]]:
    """Per turn, the user's new ids and the reply's ids (random, above the ids kept for control tokens)."""
    rng = np.random.default_rng(seed)
    return [{"user": random_ids(rng, vocab, user_tokens), "reply": random_ids(rng, vocab, reply_tokens)}
            for _ in range(turns)]


def chat_warmup(vocab: int, user_tokens: int, seed: int) -> list[int]:
    """What every chat engine is warmed up on: a first turn's worth of ids the chat does not start with (so
    a prompt cache serves it nothing), then WARMUP_DECODE_STEPS answer tokens."""
    return random_ids(np.random.default_rng([seed, 1]), vocab, user_tokens + WARMUP_DECODE_STEPS + 1)


def check_fits(script: list[dict[str, list[int]]], max_context: int) -> None:
    total = sum(len(t["user"]) + len(t["reply"]) for t in script)
    if total > max_context:
        raise BenchError(f"the chat takes {total} tokens; this bundle's context is {max_context}: "
                       "fewer --chat turns, or a shorter --prompt-len / --new-tokens")


class _ForcedReply:
    """A sampler that answers with the given ids in order, whatever the logits."""

    def __init__(self, reply: list[int]):
        self.reply, self.next = reply, 0

    def __call__(self, _logits: np.ndarray) -> int:
        token = self.reply[self.next]
        self.next += 1
        return token


def bench_chat_foldline(bundle: str, device: str, script: list[dict[str, list[int]]], warmup: list[int],
                        prompt_cache: bool, threads: int | None = None, cpu: str | None = None) -> dict[str, Any]:
    """Runs in the child process: the conversation through the serving scheduler, one turn at a time."""
    from ..runtime import Model
    from ..runtime.scheduler import Request, Scheduler

    model = Model.load(bundle, device=device, verify=False,
                       **({"threads": threads, "cpu": cpu} if device == "cpu" else {}))
    check_fits(script, model.max_context)
    scheduler = Scheduler(model, prompt_cache=prompt_cache).start()
    try:
        # the warm-up every chat engine gets (chat_warmup): a prefill, then its decode steps
        split = len(warmup) - WARMUP_DECODE_STEPS - 1
        _turn(scheduler, Request, warmup[:split], warmup[split:])
        conversation: list[int] = []
        out = []
        for turn in script:
            conversation += turn["user"]
            request, first_s, total_s = _turn(scheduler, Request, conversation, turn["reply"])
            out.append({"prompt": len(conversation), "prefilled": len(conversation) - request.cached_tokens,
                        "first_token_ms": 1e3 * first_s, "turn_ms": 1e3 * total_s})
            conversation += turn["reply"]
    finally:
        scheduler.stop()
    return {"turns": out, "threads": threads or os.cpu_count(), "module": model.module_key,
            "warmup": {"prefill_tokens": split, "decode_steps": WARMUP_DECODE_STEPS}}


def _turn(scheduler, request_cls, prompt: list[int], reply: list[int]) -> tuple[Any, float, float]:
    """One request answered with `reply`; (request, seconds to its first token, seconds to its end)."""
    done = threading.Event()
    marks: list[float] = []
    errors: list[str] = []

    def on_finish(reason: str, error: str | None) -> None:
        if reason != "length":
            errors.append(error or reason)
        done.set()

    request = request_cls(list(prompt), len(reply), lambda _t, _lp: marks.append(time.perf_counter()), on_finish,
                          sampler=_ForcedReply(reply))
    t0 = time.perf_counter()
    scheduler.submit(request)
    done.wait()
    if errors or len(marks) != len(reply):
        raise RuntimeError(f"a chat turn ended early: {errors or len(marks)}")
    return request, marks[0] - t0, marks[-1] - t0


_LLAMA_CPP_CHAT = '''
import inspect
from importlib.metadata import version

from llama_cpp import Llama

script, warmup, threads, reuse = args["script"], args["warmup"], args["threads"], args["reuse"]
params = inspect.signature(Llama.__init__).parameters
settings = {k: v for k, v in (("flash_attn", True), ("swa_full", False)) if k in params}
n_ctx = args["n_ctx"]
llm = Llama(model_path=args["gguf"], n_ctx=n_ctx, n_batch=min(n_ctx, 512), n_ubatch=min(n_ctx, 512),
            n_threads=threads, n_threads_batch=threads, logits_all=False, verbose=False, **settings)
split = len(warmup) - WARMUP_DECODE_STEPS - 1  # the warm-up every chat engine gets: a prefill, its decode steps
llm.eval(warmup[:split])
for token in warmup[split:-1]:
    llm.eval([token])
llm.reset()

def common_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n

held, conversation, out = [], [], []
for turn in script:
    conversation += turn["user"]
    t0 = time.perf_counter()
    keep = min(common_prefix(held, conversation), len(conversation) - 1) if reuse else 0
    llm.n_tokens = keep  # Llama.eval drops the cache past n_tokens, as llama-server's cache_prompt reuse
    llm.eval(conversation[keep:])
    first = time.perf_counter()
    for token in turn["reply"][:-1]:
        llm.eval([token])
    end = time.perf_counter()
    held = conversation + turn["reply"][:-1]
    out.append({"prompt": len(conversation), "prefilled": len(conversation) - keep,
                "first_token_ms": 1e3 * (first - t0), "turn_ms": 1e3 * (end - t0)})
    conversation += turn["reply"]
print("BENCH " + json.dumps({"turns": out, "threads": threads, "version": version("llama-cpp-python"),
                             "settings": {**settings, "n_ctx": n_ctx},
                             "warmup": {"prefill_tokens": split, "decode_steps": WARMUP_DECODE_STEPS}}))
'''


def bench_chat_llama_cpp(gguf: str, script: list[dict[str, list[int]]], warmup: list[int], threads: int,
                         n_ctx: int, reuse: bool, python: str | None = None) -> dict[str, Any]:
    return run_script(_LLAMA_CPP_CHAT, {"gguf": gguf, "script": script, "warmup": warmup, "threads": threads,
                                        "n_ctx": n_ctx, "reuse": reuse}, "llama.cpp chat", python, peer=True)
