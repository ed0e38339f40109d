"""`foldline serve` held to its own /openapi.json by schemathesis: no 5xx, nothing the schema does not declare.

A live `foldline serve` process (gemma3-tiny, 2 rows, the bundle of test_robust.py)
gets bodies generated from the published schema, valid and invalid. Each answer
must not be a server error, its status code and content type must be ones the
schema declares for that route, its JSON body must match the declared schema,
a body the schema forbids must be refused with a 4xx, and a valid completion
steered to what the bundle can run (the served model, a short token-id prompt)
must be served. A method a route does not take gets 405 with `Allow`. Bounded:
a fixed number of derandomized examples per route, short generations, a timeout
on each request.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # compiles a tiny preset with IREE (the same bundle as test_robust.py)

schemathesis = pytest.importorskip("schemathesis")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    positive_data_acceptance,
    response_schema_conformance,
    status_code_conformance,
)

PRESET, ROWS, MODEL = "gemma3-tiny", 2, "tiny"
EXAMPLES = 50  # per route
MAX_TOKENS = 4  # generated budgets above this are lowered to it: short generations keep the test fast
REQUEST_TIMEOUT_S = 30
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def live_server(bundle_factory) -> Iterator[tuple[str, int]]:
    """`foldline serve` on a free loopback port: (its URL, the bundle's vocabulary size)."""
    bundle = bundle_factory(PRESET, batch=ROWS)
    vocab = json.loads((Path(bundle) / "manifest.json").read_text())["model"]["vocab_size"]
    port = _free_port()
    command = [sys.executable, "-m", "foldline.tools.cli", "serve", str(bundle), "--port", str(port),
               "--model-id", MODEL, "--threads", "1"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, f"foldline serve exited: {proc.stderr.read()}"
        assert time.monotonic() < deadline, "foldline serve did not start in 120 s"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
    yield url, vocab
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def api_schema(live_server):
    url, _ = live_server
    return schemathesis.openapi.from_url(f"{url}/openapi.json")


def _integral(value: object) -> bool:
    """An integer as JSON Schema counts them: 5 and 5.0 (but not true)."""
    return type(value) is int or (type(value) is float and value.is_integer())


def _cap(body: dict, vocab: int) -> None:
    """Keep any body cheap to run, and on the same side of the schema's line: budgets lowered to
    MAX_TOKENS, token ids wrapped into the vocabulary."""
    for key in ("max_tokens", "max_completion_tokens"):
        if _integral(body.get(key)) and body[key] > MAX_TOKENS:
            body[key] = MAX_TOKENS
    prompt = body.get("prompt")
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        body["prompt"] = [t % vocab for t in prompt]


def _runnable(body: dict, vocab: int) -> None:
    """Turn a body the schema allows into one this server runs (rather than refusing it with a 400), so
    that the completions themselves are checked too: the served model, one short prompt of token ids
    (the bundle has no tokenizer), no more choices than rows, and the rules the schema cannot state
    (`stream_options` only when streaming, `top_logprobs` only with `logprobs`, the server's stop limits)."""
    body["model"] = MODEL
    if not body.get("stream"):
        body.pop("stream_options", None)
    if not body.get("logprobs"):
        body.pop("top_logprobs", None)
    if _integral(body.get("n")):
        body["n"] = min(body["n"], ROWS)
    if isinstance(body.get("stop"), list):
        body["stop"] = [stop[:32] for stop in body["stop"][:4]]
    prompt = body.get("prompt")
    if prompt is not None and not (isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)):
        text = json.dumps(prompt)
        body["prompt"] = [ord(c) for c in text]
    if isinstance(body.get("prompt"), list):
        body["prompt"] = body["prompt"][:32]


ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
          ("GET", "/health"), ("GET", "/openapi.json")]


@pytest.mark.parametrize(("method", "path"), ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
def test_every_answer_is_one_the_schema_declares(api_schema, live_server, method, path):
    """Valid and invalid bodies (invalid ones only where a route takes a body), EXAMPLES of them; valid
    completions are made runnable here and must then be served (200)."""
    _, vocab = live_server
    operation = api_schema[path][method]
    modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if method == "POST" else [])
    cases = st.one_of(*(operation.as_strategy(generation_mode=mode) for mode in modes))

    @given(case=cases)
    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def answers_conform(case):
        checks = CHECKS
        if isinstance(case.body, dict):
            if case.meta.generation.mode.is_positive and path == "/v1/completions":
                _runnable(case.body, vocab)
                checks = [*CHECKS, positive_data_acceptance]  # steered to what runs: it must be served
            _cap(case.body, vocab)
        case.call_and_validate(checks=checks, timeout=REQUEST_TIMEOUT_S)

    answers_conform()


@pytest.mark.parametrize(("method", "path"), ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
def test_a_method_a_route_does_not_take_gets_405_naming_the_ones_it_does(live_server, method, path):
    """HTTP requires `Allow` on a 405 (schemathesis's unsupported-method check asks for it too)."""
    url, _ = live_server
    r = httpx.request("TRACE", f"{url}{path}", timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 405 and r.json()["error"]["message"] == f"TRACE is not allowed on {path}"
    assert method in r.headers["allow"].split(", "), r.headers
