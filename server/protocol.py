"""The OpenAI request fields foldline serves, validated into one typed value, and the error format.

Validation happens before anything is queued: a bad request gets a 4xx with an
OpenAI-style error body and costs the scheduler nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import FoldlineError


class ApiError(FoldlineError):
    """An error answered in the OpenAI format: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class GenerationParams:
    """What a completion or chat completion asks for, once checked."""

    model: str
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ApiError(400, f"'{name}' must be a number", param=name)
    if value < low or value > high or (low_open and value == low):
        raise ApiError(400, f"'{name}' must be {'>' if low_open else '>='} {low} and <= {high}, got {value}",
                       param=name)
    return float(value)


def parse_params(body: Any, served_model: str, max_tokens_key: tuple[str, ...]) -> GenerationParams:
    """The shared fields of /v1/completions and /v1/chat/completions, or an ApiError naming the bad one."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required", param="model")
    if model != served_model:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves '{served_model}'",
                       param="model", code="model_not_found")
    max_tokens = next((body[k] for k in max_tokens_key if body.get(k) is not None), None)
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ApiError(400, f"'{max_tokens_key[0]}' must be a positive integer, got {max_tokens!r}",
                       param=max_tokens_key[0])
    n = body.get("n", 1)
    if n != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError(400, "'seed' must be an integer", param="seed")
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    return GenerationParams(
        model=model,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        seed=seed,
        stop=[s for s in stop if s],
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
    )


def chat_messages(body: dict) -> list[dict[str, str]]:
    """The conversation, with content parts flattened to text (the only modality served)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a 'role'", param="messages")
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, f"messages[{i}]: only text content parts are supported", param="messages")
                parts.append(part["text"])
            content = "".join(parts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")
        out.append({"role": message["role"], "content": content})
    return out


def completion_prompt(body: dict) -> str | list[int]:
    """The prompt of /v1/completions: text, or token ids (one prompt; batches of prompts are refused)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise ApiError(400, "'prompt' must be a string or a list of token ids (one prompt per request)", param="prompt")
