"""`foldline serve` against hostile clients, on a tiny model (gemma3-tiny, 2 rows, no tokenizer: prompts are ids).

A generation loop that outlives failing requests, a watchdog on /health,
cancellation of abandoned requests, time limits, schema validation naming the
bad field, body limits, logprobs, CORS, and a shutdown that cannot hang.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # compiles a tiny preset with IREE (the same bundle as runtime/test_batch.py)

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
from helpers.serve_common import RunningServer, slowed_calls, wait_for  # noqa: E402

PRESET, ROWS, MODEL = "gemma3-tiny", 2, "tiny"
PROMPT = [5, 17, 99, 3, 250]


@pytest.fixture(scope="module")
def bundle(bundle_factory):
    return bundle_factory(PRESET, batch=ROWS)


def _served(bundle, **options):
    from foldline.runtime import Model
    from foldline.server.app import ServedModel, ServeOptions

    return ServedModel(Model.load(bundle, threads=1), MODEL, options=ServeOptions(**options))


@pytest.fixture(scope="module")
def server(bundle) -> Iterator[RunningServer]:
    running = RunningServer(_served(bundle))
    yield running
    running.close()


@pytest.fixture
def fresh(bundle) -> Iterator[RunningServer]:
    """A server of its own, for tests that break or stop it."""
    running = RunningServer(_served(bundle))
    yield running
    running.close()


def post(server, body, path: str = "/v1/completions", timeout: float = 60, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=timeout, **kw)


def complete(**fields) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **fields}


def token_ids(choice: dict) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def healthy(server) -> bool:
    return httpx.get(f"{server.url}/health", timeout=10).status_code == 200


# ---- 1. a loop that cannot die ---------------------------------------------------------------------


def test_a_tiny_temperature_samples_like_greedy_and_the_loop_goes_on(server):
    """exp(x / 1e-300) overflowed to inf - inf = NaN probabilities, which killed the generation thread."""
    greedy = post(server, complete(logprobs=0)).json()["choices"][0]
    r = post(server, complete(logprobs=0, temperature=1e-300, seed=1), timeout=20)
    assert r.status_code == 200, r.text
    assert token_ids(r.json()["choices"][0]) == token_ids(greedy)
    assert post(server, complete(logprobs=0), timeout=20).json()["choices"][0] == greedy
    assert healthy(server)


def test_a_request_that_fails_ends_alone(server, monkeypatch):
    """One request's sampler raising ends that request with a JSON 500; the other row and the loop go on."""
    from foldline.runtime.sampling import Sampler

    real = Sampler.__call__

    def fragile(self, logits):
        if self.temperature == 0.5:
            raise FloatingPointError("probabilities are NaN")
        return real(self, logits)

    monkeypatch.setattr(Sampler, "__call__", fragile)
    want = post(server, complete(max_tokens=60, logprobs=0)).json()["choices"][0]
    with slowed_calls(server.served.model, 0.005), ThreadPoolExecutor(2) as pool:
        long = pool.submit(post, server, complete(max_tokens=60, logprobs=0))
        wait_for(lambda: server.served.scheduler.load[0] == 1, 10, "the long request to run")
        bad = post(server, complete(temperature=0.5), timeout=20)
        error = assert_error(bad, 500, code="generation_failed")
        assert "NaN" in error["message"]
        assert token_ids(long.result(60).json()["choices"][0]) == token_ids(want), "the other row went on"
    assert post(server, complete(temperature=0.7, seed=3), timeout=20).status_code == 200
    assert healthy(server)


def test_health_reports_a_stalled_loop(server):
    """A module call that never returns while work is queued: /health turns 503, and back once it moves."""
    model, scheduler = server.served.model, server.served.scheduler
    release = threading.Event()
    real = model.ctx.call
    model.ctx.call = lambda *a: (release.wait(60), real(*a))[1]
    before, scheduler.stall_timeout = scheduler.stall_timeout, 0.3
    try:
        with ThreadPoolExecutor(1) as pool:
            stuck = pool.submit(post, server, complete())
            wait_for(lambda: not healthy(server), 10, "/health to report the stall")
            body = httpx.get(f"{server.url}/health", timeout=10).json()
            assert body["status"] == "unhealthy" and "no progress" in body["reason"]
            release.set()
            assert stuck.result(30).status_code == 200
        assert healthy(server)
    finally:
        release.set()
        model.ctx.call = real
        scheduler.stall_timeout = before


def test_a_dead_loop_answers_everyone_and_health_says_so(fresh):
    """Even a fault the loop cannot survive leaves no client waiting: each gets an answer, /health 503."""
    scheduler = fresh.served.scheduler

    def die() -> None:
        raise SystemExit("the loop was killed")

    with slowed_calls(fresh.served.model, 0.02), ThreadPoolExecutor(3) as pool:
        running = [pool.submit(post, fresh, complete(max_tokens=100)) for _ in range(3)]  # two run, one waits
        wait_for(lambda: scheduler.load == (2, 1), 10, "two running and one waiting")
        scheduler._step = die
        for f in running:
            assert_error(f.result(20), 500)
    assert not scheduler.alive
    r = httpx.get(f"{fresh.url}/health", timeout=10)
    assert r.status_code == 503 and "stopped" in r.json()["reason"]
    assert_error(post(fresh, complete(), timeout=10), 503, code="unavailable")


# ---- 2. cancellation and limits ---------------------------------------------------------------------


def test_an_abandoned_non_streaming_request_frees_its_row(server):
    scheduler = server.served.scheduler
    with slowed_calls(server.served.model, 0.02):  # 120 tokens: 2.4 s to the end
        with pytest.raises(httpx.ReadTimeout):
            post(server, complete(max_tokens=120), timeout=0.5)
        freed = wait_for(lambda: scheduler.load == (0, 0), 5, "the abandoned row to be freed")
    assert freed < 1.0, f"the row was held {freed:.2f} s after the client left"


def test_max_tokens_beyond_the_context_is_refused(server):
    room = server.served.model.max_context - len(PROMPT)
    assert_error(post(server, complete(max_tokens=room + 1)), 400, param="max_tokens", code="context_length_exceeded")
    r = post(server, complete(max_tokens=room, logprobs=0))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == room


def test_time_limits_end_requests_with_length(server):
    with slowed_calls(server.served.model, 0.02):
        start = time.monotonic()
        r = post(server, complete(max_tokens=120, timeout=0.3))
        took = time.monotonic() - start
        choice, usage = r.json()["choices"][0], r.json()["usage"]
        assert r.status_code == 200 and choice["finish_reason"] == "length" and 0 < usage["completion_tokens"] < 60
        assert took < 1.5
        server.served.options.request_timeout = 0.3
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", timeout=10,
                              json=complete(max_tokens=120, stream=True)) as s:
                events = [line for line in s.iter_lines() if line.startswith("data:")]
        finally:
            server.served.options.request_timeout = None
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
    assert_error(post(server, complete(timeout=0)), 400, param="timeout")


# ---- 4. validation by the schema ------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
BAD = [  # (path, body, status, param)
    ("/v1/completions", complete(max_tokens="5"), 400, "max_tokens"),
    ("/v1/completions", complete(max_tokens=True), 400, "max_tokens"),
    ("/v1/completions", complete(max_tokens=0), 400, "max_tokens"),
    ("/v1/completions", complete(temperature="hot"), 400, "temperature"),
    ("/v1/completions", complete(temperature=2.5), 400, "temperature"),
    ("/v1/completions", complete(top_p=0), 400, "top_p"),
    ("/v1/completions", complete(seed=1.5), 400, "seed"),
    ("/v1/completions", complete(stop=5), 400, "stop"),
    ("/v1/completions", complete(stream="yes"), 400, "stream"),
    ("/v1/completions", complete(stream_options="usage"), 400, "stream_options"),
    ("/v1/completions", complete(stream_options={"include_usage": "yes"}), 400, "stream_options.include_usage"),
    ("/v1/completions", complete(n=3), 400, "n"),
    ("/v1/completions", complete(n=0), 400, "n"),
    ("/v1/completions", complete(logprobs=21), 400, "logprobs"),
    ("/v1/completions", complete(frequency_penalty=1), 400, "frequency_penalty"),
    ("/v1/completions", complete(echo=True), 400, "echo"),
    ("/v1/completions", complete(prompt=[]), 400, "prompt"),
    ("/v1/completions", complete(prompt=[[1, 2], [3]]), 400, "prompt"),
    ("/v1/completions", complete(prompt=[-1]), 400, "prompt"),
    ("/v1/completions", complete(prompt=[1.5]), 400, "prompt"),
    ("/v1/completions", complete(prompt={"text": "hi"}), 400, "prompt"),
    ("/v1/completions", complete(prompt=None), 400, "prompt"),
    ("/v1/completions", {"prompt": PROMPT}, 400, "model"),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", "hello", 400, None),
    (CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content"),
    (CHAT, {"model": MODEL, "messages": []}, 400, "messages"),
    (CHAT, {"model": MODEL, "messages": "hi"}, 400, "messages"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     400, "top_logprobs"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1}, 400,
     "max_completion_tokens"),
    # bounded work: at most 4 stop strings of at most 256 characters, 1024 messages
    ("/v1/completions", complete(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    ("/v1/completions", complete(stop=["x" * 100_000]), 400, "stop"),
    ("/v1/completions", complete(stop="x" * 257), 400, "stop"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 1025}, 400, "messages"),
    # what the server does not do is refused, never ignored
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}, 400,
     "tool_choice"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "parallel_tool_calls": False}, 400,
     "parallel_tool_calls"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]}, 400,
     "functions"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "function_call": "auto"}, 400,
     "function_call"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": None}]}, 400, "messages[0].content"),
    ("/v1/completions", complete(stream_options={"include_usage": True}), 400, "stream_options"),
    ("/v1/completions", complete(stream=False, stream_options={"include_usage": True}), 400, "stream_options"),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_malformed_values_get_a_400_naming_the_field(server, path, body, status, param):
    assert_error(post(server, body, path), status, param=param)


def test_malformed_json_and_constants(server):
    for raw in (b"{not json", b'{"model": "tiny", "prompt": [1], "temperature": NaN}', b"\xff\xfe", b"[" * 100000):
        r = httpx.post(f"{server.url}/v1/completions", content=raw, timeout=30,
                       headers={"content-type": "application/json"})
        assert_error(r, 400)
    assert healthy(server)


def test_undecodable_bytes_and_huge_token_ids_are_400s_naming_the_problem(server):
    raw = b'{"model": "tiny", "prompt": "\xed\xa0\x80"}'  # UTF-8 for a surrogate, which is not UTF-8
    r = httpx.post(f"{server.url}/v1/completions", content=raw, timeout=30, headers={"content-type": "application/json"})
    assert "UTF-8" in assert_error(r, 400)["message"]
    error = assert_error(post(server, complete(prompt=[5, 2**63])), 400, param="prompt")
    assert "vocabulary" in error["message"] and "prompt[1]" in error["message"], error
    assert healthy(server)


SURROGATES = [  # a lone surrogate (a JSON escape) is not text: (path, body, param)
    ("/v1/completions", complete(prompt="\ud800"), "prompt"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi \ud800"}]}, "messages[0].content"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "a\udfff"}]}]},
     "messages[0].content[0].text"),
]


def post_escaped(server, body, path: str) -> httpx.Response:
    """The body as ASCII JSON: lone surrogates sent as \\uXXXX escapes, as a client's JSON encoder may."""
    return httpx.post(f"{server.url}{path}", content=json.dumps(body), timeout=30,
                      headers={"content-type": "application/json"})


def test_lone_surrogates_are_400s_naming_the_field(server):
    for path, body, param in SURROGATES:
        assert "surrogate" in assert_error(post_escaped(server, body, path), 400, param=param)["message"]


def test_tool_choice_none_is_honoured(server):
    """"none" asks for what the server does anyway: no tool calls."""
    r = post(server, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tool_choice": "none"}, CHAT)
    assert_error(r, 400, param="messages")  # past validation: this bundle has no tokenizer for chat


def test_explicit_nulls_are_accepted(server):
    nulls = {k: None for k in ("max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
                               "n", "logprobs", "user", "frequency_penalty", "presence_penalty", "logit_bias",
                               "echo", "best_of", "suffix", "timeout")}
    r = post(server, {"model": MODEL, "prompt": PROMPT, **nulls})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16  # the completions default


def test_seeds_beyond_numpy_range_are_served(server):
    """A negative seed reached numpy's generator, which raised: a plain-text 500."""
    for seed in (-1, 2**70):
        runs = [post(server, complete(temperature=1, seed=seed, logprobs=0)) for _ in range(2)]
        assert [r.status_code for r in runs] == [200, 200], runs[0].text
        assert token_ids(runs[0].json()["choices"][0]) == token_ids(runs[1].json()["choices"][0]), "seeded"


def test_prompt_errors_name_the_prompt(server):
    too_long = list(range(1, server.served.model.max_context + 1))
    assert_error(post(server, complete(prompt=too_long)), 400, param="prompt", code="context_length_exceeded")
    assert_error(post(server, complete(prompt="")), 400, param="prompt")


def test_completion_tokens_do_not_count_the_end_of_turn(server, monkeypatch):
    model = server.served.model
    sampled = complete(temperature=2, seed=0, max_tokens=32, logprobs=0)
    ids = token_ids(post(server, sampled).json()["choices"][0])
    cut = next((i for i in range(1, len(ids)) if ids[i] not in ids[:i]), None)
    assert cut is not None, f"the sampled run needs a token that is new after the first: {ids}"
    monkeypatch.setattr(model, "eos_token_ids", (ids[cut],))  # that token now ends the turn
    r = post(server, sampled).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] == cut and token_ids(r["choices"][0]) == ids[:cut]


# ---- 5. off the event loop, body limit ------------------------------------------------------------------


def test_a_body_over_the_limit_gets_413(server):
    limit = server.served.options.max_body_bytes
    big = complete(prompt=[1] * (limit // 2))
    assert len(json.dumps(big)) > limit
    assert_error(post(server, big), 413, code="request_too_large")
    chunked = httpx.post(f"{server.url}/v1/completions", timeout=30, headers={"content-type": "application/json"},
                         content=iter([json.dumps(big).encode()]))  # no content-length: counted as read
    assert_error(chunked, 413, code="request_too_large")
    assert healthy(server)


# ---- 6. logprobs, CORS -------------------------------------------------------------------------------


def test_logprobs_are_the_models_log_softmax(server):
    from foldline.runtime import Model

    r = post(server, complete(logprobs=5, max_tokens=6, temperature=0.8, seed=2)).json()
    choice = r["choices"][0]
    lp, ids = choice["logprobs"], token_ids(choice)
    assert len(ids) == r["usage"]["completion_tokens"] == 6
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(6)]
    # against the runtime: the logits of each prefix, log_softmax, unchanged by the temperature
    with Model.load(server.served.model.manifest.root, threads=1) as model, model.session() as session:
        logits = session.prefill(PROMPT)
        for token, got, top in zip(ids, lp["token_logprobs"], lp["top_logprobs"]):
            x = logits.astype(np.float64)
            want = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
            assert got == pytest.approx(want[token], abs=1e-3)
            assert len(top) == 5 and list(top.values()) == sorted(top.values(), reverse=True)
            best = np.argsort(-want, kind="stable")[:5]
            assert [int(t.removeprefix("token_id:")) for t in top] == best.tolist()
            assert list(top.values()) == pytest.approx(want[best].tolist(), abs=1e-3)
            logits = session.decode(token)
    # streaming gives the same, spread over the chunks (on another row, whose call may round differently:
    # the first request's row holds its answer, which the prompt cache keeps while an empty row is free)
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30,
                      json=complete(logprobs=5, max_tokens=6, temperature=0.8, seed=2, stream=True)) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert sum((c["tokens"] for c in streamed), []) == lp["tokens"]
    assert sum((c["token_logprobs"] for c in streamed), []) == pytest.approx(lp["token_logprobs"], abs=1e-4)
    assert sum((c["text_offset"] for c in streamed), []) == lp["text_offset"]
    assert post(server, complete()).json()["choices"][0]["logprobs"] is None


def test_n_choices_are_sampled_on_their_own_rows(server):
    """n=2 on a 2-row bundle: two choices, each what a single request with seed + index gives;
    usage counts the prompt once and every choice's tokens; streaming sends both, by index."""
    body = complete(max_tokens=6, temperature=0.9, seed=11, logprobs=0)
    both = post(server, {**body, "n": 2}).json()
    assert [c["index"] for c in both["choices"]] == [0, 1]
    solo = [post(server, {**body, "seed": 11 + i}).json()["choices"][0] for i in range(2)]
    assert [token_ids(c) for c in both["choices"]] == [token_ids(c) for c in solo]
    usage = both["usage"]
    cached = usage.pop("prompt_tokens_details")["cached_tokens"]
    assert usage == {"prompt_tokens": len(PROMPT), "completion_tokens": 12, "total_tokens": len(PROMPT) + 12}
    assert 0 <= cached < len(PROMPT), "kept rows serve at most all but the last prompt token"
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30,
                      json={**body, "n": 2, "stream": True, "stream_options": {"include_usage": True}}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    for i, choice in enumerate(solo):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert sum((c["logprobs"]["tokens"] for c in mine if c["logprobs"]), []) == choice["logprobs"]["tokens"]
        assert [c["finish_reason"] for c in mine][-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    chat = post(server, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2}, CHAT)
    assert chat.status_code in (200, 400)  # no tokenizer in this bundle: a 400 naming messages, never a 500
    assert healthy(server)


def test_more_choices_than_rows_are_refused(server):
    error = assert_error(post(server, complete(n=3)), 400, param="n")
    assert "at most 2 choices" in error["message"] and "--batch 3" in error["message"]
    assert healthy(server)


def test_cors_origin(bundle):
    running = RunningServer(_served(bundle, cors_origins=["http://app.example"]))
    try:
        preflight = httpx.options(f"{running.url}/v1/chat/completions", timeout=10, headers={
            "origin": "http://app.example", "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://app.example"
        r = post(running, complete(), headers={"origin": "http://app.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
        other = post(running, complete(), headers={"origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers
        assert_error(other, 403, code="origin_not_allowed")
        preflight = httpx.options(f"{running.url}/v1/chat/completions", timeout=10, headers={
            "origin": "http://evil.example", "access-control-request-method": "POST"})
        assert_error(preflight, 403, code="origin_not_allowed")  # was text/plain 400
        preflight = httpx.options(f"{running.url}/v1/chat/completions", timeout=10, headers={
            "origin": "http://app.example", "access-control-request-method": "DELETE"})
        assert_error(preflight, 400, code="method_not_allowed")
    finally:
        running.close()


# ---- 5. an open network: hosts, origins, slow and many connections ------------------------------------


def _connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.settimeout(10)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (bounded by the socket's timeout)."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def _json_answer(raw: bytes) -> tuple[int, dict[str, str], dict]:
    """(status, headers, JSON body) of the last response in `raw` (interim 1xx answers skipped)."""
    head, _, body = raw.split(b"HTTP/1.1 ")[-1].partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[0]), headers, json.loads(body)


@contextmanager
def _options(server, **values):
    """Change the live limits of the module's server for one test."""
    options = server.served.options
    before = {k: getattr(options, k) for k in values}
    for k, v in values.items():
        setattr(options, k, v)
    try:
        yield
    finally:
        for k, v in before.items():
            setattr(options, k, v)


def test_routes_answer_with_a_trailing_slash_without_redirecting(server):
    r = post(server, complete(), "/v1/completions/", follow_redirects=False)
    assert r.status_code == 200 and r.json()["choices"], r.text
    assert httpx.get(f"{server.url}/v1/models/", timeout=10).json()["data"][0]["id"] == MODEL
    assert_error(post(server, complete(), "/v1/nothing/"), 404, code="not_found")


def test_the_openapi_schema_describes_the_bodies(server):
    schema = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    assert schema["openapi"].startswith("3.") and {"/v1/completions", "/v1/chat/completions"} <= set(schema["paths"])
    components = schema["components"]["schemas"]
    refs = [part.split('"')[0] for part in json.dumps(schema).split('"$ref": "#/components/schemas/')[1:]]
    assert refs and all(ref in components for ref in refs), "every reference resolves"
    chat = components["ChatBody"]
    assert {"model", "messages"} <= set(chat["required"]) and "stop" in chat["properties"]
    assert "prompt" in components["CompletionBody"]["required"]


def test_a_foreign_host_header_is_refused(server):
    """DNS rebinding: a page's own name resolving to 127.0.0.1 reaches the server with that name as Host."""
    error = assert_error(post(server, complete(), headers={"host": "evil.example"}), 400, param="host",
                         code="host_not_allowed")
    assert "--allowed-hosts evil.example" in error["message"]
    assert post(server, complete(), headers={"host": f"localhost:{server.port}"}).status_code == 200


def test_allowed_hosts_widen_the_list_and_idle_connections_close(bundle):
    running = RunningServer(_served(bundle, allowed_hosts=["models.lan"], keep_alive_timeout=0.3))
    try:
        assert post(running, complete(), headers={"host": "models.lan:8000"}).status_code == 200
        assert_error(post(running, complete(), headers={"host": "other.lan"}), 400, code="host_not_allowed")
        idle = _connect(running)
        idle.settimeout(3)  # well past --keep-alive-timeout, well before uvicorn's default 5 s
        idle.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        assert _read_all(idle).startswith(b"HTTP/1.1 200"), "answered, then closed while idle"
        idle.close()
    finally:
        running.close()


def test_cross_origin_requests_are_refused_without_cors(server):
    """A page on another site may POST text/plain without a preflight: refused whatever the content type."""
    body = json.dumps(complete()).encode()
    for content_type in ("text/plain", "application/json"):
        r = httpx.post(f"{server.url}/v1/completions", content=body, timeout=30,
                       headers={"origin": "http://evil.example", "content-type": content_type})
        assert_error(r, 403, code="origin_not_allowed")
    same = httpx.post(f"{server.url}/v1/completions", content=body, timeout=30,
                      headers={"origin": server.url, "content-type": "application/json"})
    assert same.status_code == 200, same.text


def test_slow_headers_and_bodies_get_408(server):
    with _options(server, header_timeout=0.3, body_timeout=0.3):
        slow_headers = _connect(server)
        slow_headers.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n")
        slow_body = _connect(server)
        slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                          b"content-length: 1000\r\n\r\n{\"model\":")
        for sock in (slow_headers, slow_body):
            status, _, body = _json_answer(_read_all(sock))
            assert status == 408 and body["error"]["code"] == "request_timeout", body
            sock.close()
    assert healthy(server)


def test_connections_past_the_limit_get_503_json(server):
    held = []
    try:
        with _options(server, max_connections=2):
            held = [_connect(server) for _ in range(2)]
            wait_for(lambda: len(server.server.server_state.connections) >= 2, 5, "the connections to open")
            extra = _connect(server)
            status, headers, body = _json_answer(_read_all(extra))
            extra.close()
            assert status == 503 and body["error"]["code"] == "too_many_connections", body
            assert headers["retry-after"] == "1"
    finally:
        for sock in held:
            sock.close()
    wait_for(lambda: healthy(server), 5, "the server to answer again")


def test_a_client_that_half_closes_still_gets_its_answer(server):
    body = json.dumps(complete()).encode()
    sock = _connect(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(body), body))
    sock.shutdown(socket.SHUT_WR)
    status, _, answer = _json_answer(_read_all(sock))
    sock.close()
    assert status == 200 and answer["usage"]["completion_tokens"] == 8, answer


def test_client_errors_log_one_line_without_a_traceback(server, caplog):
    import logging

    from foldline.server.connection import client_error_log

    client_error_log._last.clear()
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            sock = _connect(server)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: 100\r\n\r\n{")
            sock.close()
            garbage = _connect(server)
            garbage.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            status, _, body = _json_answer(_read_all(garbage))
            garbage.close()
            assert status == 400 and body["error"]["code"] == "invalid_http"
        wait_for(lambda: healthy(server), 5, "the server")
    assert not [r for r in caplog.records if r.exc_info], "no traceback"
    truncated = [r for r in caplog.records if "body was complete" in r.getMessage()]
    invalid = [r for r in caplog.records if "invalid HTTP" in r.getMessage()]
    assert len(truncated) == 1 and len(invalid) == 1, caplog.text


def test_running_out_of_file_descriptors_logs_one_line_per_interval(caplog):
    """asyncio calls the loop's exception handler (a traceback each) for every accept that fails."""
    import asyncio
    import errno
    import logging

    from foldline.server.connection import client_error_log, install_accept_backoff

    client_error_log._last.clear()
    loop = asyncio.new_event_loop()
    try:
        install_accept_backoff(loop)
        with caplog.at_level(logging.WARNING):
            for _ in range(1000):
                loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                             "exception": OSError(errno.EMFILE, "Too many open files")})
    finally:
        loop.close()
    assert len(caplog.records) == 1 and "Too many open files" in caplog.records[0].getMessage()
    assert caplog.records[0].exc_info is None


# ---- 3. shutdown ----------------------------------------------------------------------------------------


def test_shutdown_refuses_new_work_and_cuts_running_work_at_the_deadline(fresh):
    served = fresh.served
    with slowed_calls(served.model, 0.02), ThreadPoolExecutor(1) as pool:
        running = pool.submit(post, fresh, complete(max_tokens=120))
        wait_for(lambda: served.scheduler.load[0] == 1, 10, "the request to run")
        served.begin_shutdown(timeout=0.3)
        assert_error(post(fresh, complete()), 503, code="shutting_down")
        assert httpx.get(f"{fresh.url}/health", timeout=10).json()["status"] == "shutting_down"
        assert_error(running.result(10), 503, code="shutting_down")
    wait_for(lambda: served.scheduler.load == (0, 0), 5, "the rows to be freed")


DEADLINE_S = 1.0


@pytest.fixture(scope="module")
def shutdown_phases(bundle) -> dict:
    """One shutdown (SIGTERM's steps: drain, then uvicorn stops) with a request in every phase: what each got.

    Rows are slowed, so two requests generate (one streaming) and one waits in the queue; one client is
    in its body, one in its headers, one idle on a kept-alive connection.
    """
    running = RunningServer(_served(bundle, shutdown_timeout=DEADLINE_S))
    served, got = running.served, {}
    try:
        with slowed_calls(served.model, 0.05), ThreadPoolExecutor(3) as pool:
            def stream() -> list[str]:
                with httpx.stream("POST", f"{running.url}/v1/completions", timeout=30,
                                  json=complete(max_tokens=100, stream=True)) as s:
                    return [line for line in s.iter_lines() if line.startswith("data:")]

            streaming = pool.submit(stream)
            generating = pool.submit(post, running, complete(max_tokens=100))
            wait_for(lambda: served.scheduler.load[0] == 2, 10, "two requests to generate")
            queued = pool.submit(post, running, complete(max_tokens=100))
            wait_for(lambda: served.scheduler.load[1] == 1, 10, "a request to wait")
            idle = _connect(running)
            idle.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
            answer = b""
            while not answer.endswith(b"}"):  # the whole answer, then nothing more until the close
                answer += idle.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200")
            in_body = _connect(running)
            in_body.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: 1000\r\n\r\n{")
            in_headers = _connect(running)
            in_headers.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n")
            time.sleep(0.2)
            start = time.monotonic()
            served.begin_shutdown()  # what GracefulServer.handle_exit does on SIGTERM
            running.server.should_exit = True
            got["headers"] = (_read_all(in_headers), time.monotonic() - start)
            got["idle"] = _read_all(idle)
            got["body"] = (_read_all(in_body), time.monotonic() - start)
            got["queue"] = queued.result(30)
            got["generation"] = (generating.result(30), streaming.result(30))
            running.thread.join(30)
            got["stopped_after"] = time.monotonic() - start
            got["alive"] = running.thread.is_alive()
    finally:
        running.close()
    return got


def assert_shutting_down(status: int, headers, body: dict) -> None:
    assert status == 503 and body["error"]["code"] == "shutting_down", body
    assert headers["retry-after"] == "1"


def test_shutdown_answers_a_request_in_its_headers_at_once(shutdown_phases):
    raw, after = shutdown_phases["headers"]
    assert_shutting_down(*_json_answer(raw))
    assert after < DEADLINE_S


def test_shutdown_closes_an_idle_kept_alive_connection(shutdown_phases):
    assert shutdown_phases["idle"] == b"", "closed cleanly, nothing sent"


def test_shutdown_answers_a_request_in_its_body_by_the_deadline(shutdown_phases):
    raw, after = shutdown_phases["body"]
    assert_shutting_down(*_json_answer(raw))
    assert after < DEADLINE_S + 1


def test_shutdown_answers_a_queued_request_by_the_deadline(shutdown_phases):
    r = shutdown_phases["queue"]
    assert_shutting_down(r.status_code, r.headers, r.json())


def test_shutdown_ends_generating_requests_with_503_or_the_streams_error_event(shutdown_phases):
    plain, events = shutdown_phases["generation"]
    assert_shutting_down(plain.status_code, plain.headers, plain.json())
    assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["error"]["code"] == "shutting_down"
    assert not shutdown_phases["alive"] and shutdown_phases["stopped_after"] < DEADLINE_S + 3


def test_scheduler_stop_returns_on_a_stuck_loop(fresh):
    """stop() must not wait on a module call that never returns; the caller still gets its answer."""
    model, scheduler = fresh.served.model, fresh.served.scheduler
    release = threading.Event()
    real = model.ctx.call
    model.ctx.call = lambda *a: (release.wait(30), real(*a))[1]
    try:
        with ThreadPoolExecutor(1) as pool:
            stuck = pool.submit(post, fresh, complete())
            wait_for(lambda: scheduler.load[0] == 1, 10, "the request to run")
            start = time.monotonic()
            scheduler.stop(timeout=0.5)
            assert time.monotonic() - start < 2
            assert_error(stuck.result(10), 503, code="shutting_down")
    finally:
        release.set()
        model.ctx.call = real


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_process(bundle, *args: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    code = "import sys; from foldline.tools.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", str(bundle), "--port", str(port), "--threads", "1",
                             "--model-id", MODEL, *args], env=os.environ.copy(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, proc.stdout.read()
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    wait_for(up, 60, "foldline serve to start")
    return proc, url


def _refused(url: str) -> bool:
    """A new request is refused: the connection (the socket is closed) or with 503 (a request already in)."""
    try:
        r = httpx.post(f"{url}/v1/completions", json=complete(), timeout=5)
    except httpx.TransportError:
        return True
    return r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"


def _hold_a_connection(url: str) -> socket.socket:
    """A client that sends half of its body and waits: a request the server cannot finish by itself."""
    port = int(url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                 b"content-length: 1000\r\n\r\n{\"model\":")
    return sock


def test_sigterm_finishes_in_flight_work_and_exits_0(bundle):
    proc, url = _serve_process(bundle, "--shutdown-timeout", "1")
    try:
        held = _hold_a_connection(url)
        with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                          json=complete(max_tokens=100, stream=True)) as s:
            lines = s.iter_lines()
            assert next(lines).startswith("data: {")
            start = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]", "the running stream was finished"
        assert _refused(url), "no longer accepting"
        assert proc.wait(15) == 0, proc.stdout.read()
        assert time.monotonic() - start < 1 + 3, "exited within the shutdown timeout and the flush grace"
        assert b"HTTP/1.1 503" in held.recv(65536), "the client still sending its body was answered"
        held.close()
        output = proc.stdout.read()
        assert "leaked" not in output and "Traceback" not in output, output
    finally:
        proc.kill()
        proc.wait()


def test_a_second_signal_exits_at_once(bundle):
    proc, url = _serve_process(bundle, "--shutdown-timeout", "30")
    try:
        held = _hold_a_connection(url)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proc.poll() is None, "the first signal waits for the held request"
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(5) == 128 + signal.SIGTERM
        assert time.monotonic() - start < 2
        held.close()
    finally:
        proc.kill()
        proc.wait()


def test_an_edited_prompt_resumes_from_a_checkpoint(bundle):
    """gemma3-tiny's rings (16 slots) wrap in a 75-token prompt, so without checkpoints an edited prompt is
    prefilled in full. With them (the default, 4 per row), a prompt edited at token 53 under its conversation's
    `prompt_cache_key` resumes from its row's checkpoint at 48 (`cached_tokens`), another conversation takes
    the empty row, and every answer equals a server without the prompt cache."""
    cached, plain = RunningServer(_served(bundle)), RunningServer(_served(bundle, prompt_cache=False))
    try:
        assert cached.served.scheduler.batch.max_checkpoints == 4
        rng = np.random.default_rng(15)
        prompt = rng.integers(1, 250, 75).tolist()
        edited = [*prompt[:53], *rng.integers(1, 250, 6).tolist()]

        def ask(server, ids, **fields) -> tuple[list[int], int]:
            body = post(server, complete(prompt=ids, logprobs=0, max_tokens=5, **fields)).json()
            return token_ids(body["choices"][0]), body["usage"]["prompt_tokens_details"]["cached_tokens"]

        first, hit = ask(cached, prompt, prompt_cache_key="chat-1")
        assert hit == 0 and first == ask(plain, prompt)[0]
        answer, hit = ask(cached, edited, prompt_cache_key="chat-1")
        assert hit == 48, "the row's last checkpoint before the edit"
        assert answer == ask(plain, edited)[0]
        assert cached.served.scheduler.batch.checkpoint_positions(0) == [16, 32, 48], "the edit's own chunks"
        other = [*prompt[:40], *rng.integers(1, 250, 6).tolist()]
        reply, hit = ask(cached, other, prompt_cache_key="chat-2")
        assert hit == 0, "another conversation sharing 40 tokens takes the empty row"
        assert reply == ask(plain, other)[0]
        follow = [*edited, *answer, 7]
        reply, hit = ask(cached, follow)
        assert hit == len(edited) + len(answer) - 1, "a continuation of a row (all its answer's fed tokens) needs no key"
        assert reply == ask(plain, follow)[0]
    finally:
        cached.close()
        plain.close()
