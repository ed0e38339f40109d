"""Random JSON at every endpoint of `foldline serve` (gemma3-tiny, 2 rows): never a 5xx, always JSON, still serving.

Bodies are drawn three ways: any JSON value, a valid body with random fields
replaced by any JSON value, and a valid body with plausible but random values
(so generation runs, streaming included). The examples are derandomized, so
CI sees the same ones every run.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

pytestmark = pytest.mark.slow  # compiles a tiny preset with IREE (the same bundle as runtime/test_batch.py)

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from helpers.serve_common import RunningServer  # noqa: E402

MODEL = "tiny"
EXAMPLES = 120  # per endpoint and strategy kind

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
          "stop", "stream", "stream_options", "n", "logprobs", "top_logprobs", "frequency_penalty",
          "presence_penalty", "logit_bias", "user", "timeout", "echo", "best_of", "suffix", "tools",
          "response_format"]

leaves = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.integers(-3, 300)
          | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
json_values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=10)
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "wizard", ""])
messages = st.lists(st.fixed_dictionaries({"role": roles | json_values},
                                          optional={"content": st.text(max_size=20) | json_values}), max_size=3)
plausible = {
    "prompt": st.lists(st.integers(-2, 600), max_size=40) | st.text(max_size=20) | st.just([]),
    "messages": messages,
    "max_tokens": st.none() | st.integers(-1, 200),
    "temperature": st.none() | st.floats(-0.5, 2.5) | st.sampled_from([1e-300, 1e-30, 0.0]),
    "top_p": st.none() | st.floats(-0.1, 1.1),
    "seed": st.none() | st.integers(-(2**70), 2**70),
    "stop": st.none() | st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3),
    "stream": st.none() | st.booleans(),
    "stream_options": st.none() | st.fixed_dictionaries({"include_usage": st.none() | st.booleans()}),
    "logprobs": st.none() | st.booleans() | st.integers(-1, 25),
    "top_logprobs": st.none() | st.integers(-1, 25),
    "n": st.none() | st.integers(0, 3),
    "timeout": st.none() | st.floats(-1, 2),
}


def valid(chat: bool) -> dict:
    if chat:
        return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4}


def replaced(chat: bool):
    """A valid body with some fields set to arbitrary JSON (or removed)."""
    return st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=4).map(lambda d: {**valid(chat), **d})


def plausible_bodies(chat: bool):
    keys = [k for k in plausible if k != ("prompt" if chat else "messages")]
    return st.fixed_dictionaries({}, optional={k: plausible[k] for k in keys}).map(lambda d: {**valid(chat), **d})


@pytest.fixture(scope="module")
def server(bundle_factory) -> Iterator[RunningServer]:
    from foldline.runtime import Model
    from foldline.server.app import ServedModel, ServeOptions

    served = ServedModel(Model.load(bundle_factory("gemma3-tiny", batch=2), threads=1), MODEL,
                         options=ServeOptions(request_timeout=2.0))
    running = RunningServer(served)
    yield running
    running.close()


def check(server, path: str, **request) -> None:
    r = httpx.post(f"{server.url}{path}", timeout=30, **request)
    assert r.status_code < 500, r.text
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for event in events[:-1]:
            assert isinstance(json.loads(event), dict)
    else:
        body = r.json()
        assert ("error" in body) == (r.status_code >= 400), body
        if r.status_code >= 400:
            assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]


SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
PATHS = ["/v1/completions", "/v1/chat/completions"]


@pytest.mark.parametrize("path", PATHS)
@SETTINGS
@given(body=json_values)
def test_any_json(server, path, body):
    check(server, path, json=body)


@pytest.mark.parametrize("path", PATHS)
@SETTINGS
@given(data=st.data())
def test_valid_bodies_with_random_fields(server, path, data):
    chat = "chat" in path
    check(server, path, json=data.draw(replaced(chat) | plausible_bodies(chat)))


@pytest.mark.parametrize("path", [*PATHS, "/health", "/v1/models"])
@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=64))
def test_raw_bytes(server, path, raw):
    check(server, path, content=raw, headers={"content-type": "application/json"})


def test_still_serving_after_the_fuzz(server):
    assert httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "ok"
    r = httpx.post(f"{server.url}/v1/completions", json=valid(False), timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert server.served.scheduler.load == (0, 0)
    scheduler = server.served.scheduler
    assert scheduler.submitted == sum(scheduler.finished.values()), "every queued request was finished"
