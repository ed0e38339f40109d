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

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # compiles a tiny preset with IREE (the same bundle as test_batch.py)

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
from serve_common import RunningServer, slowed_calls, wait_for  # noqa: E402

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
    # streaming gives the same, spread over the chunks
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30,
                      json=complete(logprobs=5, max_tokens=6, temperature=0.8, seed=2, stream=True)) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert sum((c["tokens"] for c in streamed), []) == lp["tokens"]
    assert sum((c["token_logprobs"] for c in streamed), []) == lp["token_logprobs"]
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
    finally:
        running.close()


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
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
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
        assert time.monotonic() - start < 1 + 3 + 3, "exited within the shutdown timeout and the flush grace"
        held.close()
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
