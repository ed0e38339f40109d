"""The error format of the OpenAI API and the generation parameters a validated body asks for.

Validation (server/schema.py) happens before anything is queued: a bad
request gets a 4xx with an OpenAI-style error body and costs the scheduler
nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import FoldlineError

DEFAULT_MAX_STOP = 4  # stop strings in one request, as OpenAI (foldline serve --max-stop)
RETRY_AFTER_S = 1  # what every 503 tells its client to wait before trying again


class ApiError(FoldlineError):
    """An error answered in the OpenAI format: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        """Retry-After on every 503: the refusal (a full queue, a shutdown, too many connections) is temporary."""
        return {"retry-after": str(RETRY_AFTER_S)} if self.status == 503 else {}


@dataclass
class GenerationParams:
    """What a completion or chat completion asks for, once checked.

    `max_tokens_param` names the field the budget came from, for errors;
    `logprobs` is None (not asked) or the number of most likely tokens to
    report beside each chosen one; `timeout` is the body's own time limit.
    """

    model: str
    max_tokens: int | None
    max_tokens_param: str
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    logprobs: int | None
    timeout: float | None
    n: int = 1  # choices, each sampled on its own row from the same prompt
    cache_key: str | None = None  # prompt_cache_key: the conversation whose row the prompt cache prefers


def generation_params(body: Any, served_model: str, chat: bool, max_stop: int = DEFAULT_MAX_STOP) -> GenerationParams:
    """The parameters of a validated CompletionBody or ChatBody; the model must be the one served, and
    at most `max_stop` stop strings (each one is searched for in every new piece of text)."""
    if body.model != served_model:
        raise ApiError(404, f"the model '{body.model}' does not exist; this server serves '{served_model}'",
                       param="model", code="model_not_found")
    if chat:
        max_tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        max_tokens_param, logprobs = "max_tokens", body.logprobs
        max_tokens = 16 if body.max_tokens is None else body.max_tokens  # the OpenAI default for completions
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > max_stop:
        raise ApiError(400, f"'stop' holds {len(stop)} strings; this server takes at most {max_stop}", param="stop")
    options = body.stream_options
    return GenerationParams(
        model=body.model,
        max_tokens=max_tokens,
        max_tokens_param=max_tokens_param,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=None if body.seed is None else body.seed % 2**64,  # numpy's generators take non-negative seeds
        stop=[s for s in stop if s],
        stream=bool(body.stream),
        include_usage=bool(options is not None and options.include_usage),
        logprobs=logprobs,
        timeout=body.timeout,
        n=1 if body.n is None else body.n,
        cache_key=body.prompt_cache_key,
    )
