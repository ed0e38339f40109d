"""Soak of `foldline serve`: many clients, mixed and misbehaving, against one server on a tiny model.

gemma3-tiny at batch 2 (context 128), max_queue 4, 6 client threads. Each
request is, at random: a non-streaming completion, a stream read to the end,
a stream dropped after its first chunk, a non-streaming request whose client
gives up after 50 ms, or a malformed body. Checked: every request is
accounted for (answered, abandoned by its client, or refused with a JSON 4xx
/ 503), the scheduler finished every request it queued, the rows are free at
the end, and resident memory after warm-up stays within RSS_GROWTH_BOUND.
"""

from __future__ import annotations

import collections
import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from reliability.reliability_common import record, rss_bytes, scaled

pytestmark = pytest.mark.slow  # compiles a tiny preset with IREE (shared with runtime/test_batch.py)

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
from helpers.serve_common import RunningServer, wait_for  # noqa: E402

MODEL = "tiny"
CLIENTS = 6
# Resident memory may grow by at most this much after warm-up: far above the allocator's drift
# (docs/reliability.md), while a leaked logits vector per token (2 KiB, ~20 tokens a request) crosses
# the bound within ~100 requests, a leak of 2 KiB per request within the full run of 2000.
RSS_GROWTH_BOUND = 4 << 20
KINDS = ["plain", "stream", "drop_stream", "give_up", "malformed"]


_clients = threading.local()


def _client() -> httpx.Client:
    """One client per thread: the process measured is the server's, so its clients should not churn."""
    if not hasattr(_clients, "client"):
        _clients.client = httpx.Client(timeout=60)
    return _clients.client


def one_request(url: str, kind: str, rng: random.Random) -> str:
    """Run one request of `kind`; returns how it ended: answered, abandoned or refused (anything else fails)."""
    prompt = [rng.randrange(512) for _ in range(rng.randint(1, 40))]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": rng.randint(1, 40), "temperature": rng.choice([0, 1])}
    path = f"{url}/v1/completions"
    if kind == "malformed":
        body[rng.choice(["max_tokens", "temperature", "prompt", "stop"])] = rng.choice([-5, [None], {}, True])
    if kind in ("plain", "malformed"):
        r = _client().post(path, json=body)
        if r.status_code == 200:
            usage = r.json()["usage"]
            assert kind == "plain" and usage["completion_tokens"] == body["max_tokens"], r.text
            return "answered"
        assert r.status_code in (400, 503) and r.json()["error"]["message"], r.text
        return "refused"
    if kind == "give_up":
        body["max_tokens"] = 128 - len(prompt) - 1  # most of the context: it runs past the client's patience
        try:
            r = _client().post(path, json=body, timeout=0.05)
        except httpx.TimeoutException:
            return "abandoned"
        assert r.status_code in (200, 503), r.text
        return "answered" if r.status_code == 200 else "refused"
    body["stream"] = True
    with _client().stream("POST", path, json=body) as s:
        if s.status_code != 200:
            s.read()
            assert s.status_code == 503 and json.loads(s.text)["error"]["code"] == "queue_full", s.text
            return "refused"
        events = []
        for line in s.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if kind == "drop_stream":
                    return "abandoned"
        assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        return "answered"


def test_serve_soak_accounts_for_every_request_with_flat_memory(bundle_factory):
    from foldline.runtime import Model
    from foldline.server.app import ServedModel, ServeOptions

    total = scaled(200, 2000)
    warmup = max(40, total // 10)
    served = ServedModel(Model.load(bundle_factory("gemma3-tiny", batch=2), threads=1), MODEL,
                         options=ServeOptions(max_queue=4))
    server = RunningServer(served)
    rng = random.Random(7)
    plan = [(i, rng.choice(KINDS), random.Random(i)) for i in range(total)]
    ends: collections.Counter[str] = collections.Counter()
    by_kind: collections.Counter[tuple[str, str]] = collections.Counter()
    rss: list[int] = []
    lock = threading.Lock()

    def run(item) -> None:
        i, kind, item_rng = item
        end = one_request(server.url, kind, item_rng)
        with lock:
            ends[end] += 1
            by_kind[kind, end] += 1
            done = sum(ends.values())
            if done >= warmup and done % 20 == 0:
                rss.append(rss_bytes())

    try:
        with ThreadPoolExecutor(CLIENTS) as pool:
            for future in [pool.submit(run, item) for item in plan]:
                future.result()  # any request that ended otherwise fails the soak here
        scheduler = served.scheduler
        wait_for(lambda: scheduler.load == (0, 0), 30, "every row to be free")
        assert httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "ok"
    finally:
        server.close()
    assert sum(ends.values()) == total, f"requests lost: {total - sum(ends.values())}"
    assert scheduler.submitted == sum(scheduler.finished.values()), scheduler.finished
    assert set(scheduler.finished) <= {"length", "cancelled"}, scheduler.finished
    assert ends["answered"] and ends["abandoned"] and ends["refused"]
    growth = max(rss) - rss[0]
    for key, n in sorted(by_kind.items()):
        record(f"serve soak {key[0]} -> {key[1]}", n)
    record("serve soak requests", total)
    record(f"serve soak RSS after warm-up {rss[0] >> 20} MiB, peak growth KiB", growth >> 10)
    record(f"serve soak scheduler {dict(scheduler.finished)} queued", scheduler.submitted)
    assert growth <= RSS_GROWTH_BOUND, f"RSS grew {growth >> 10} KiB after warm-up (bound {RSS_GROWTH_BOUND >> 10})"
