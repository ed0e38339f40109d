"""The request bodies of OpenAI's completions and chat completions APIs, as pydantic models.

Validation is strict (no "5" for 5, no true for 1; 2.0 is 2) and every optional field
takes an explicit null. Fields of the API that foldline does not implement
are accepted at their neutral value and refused otherwise (tool calling among
them), so a client is never silently given something other than what it asked
for; fields the API does not know are ignored, as vendor extensions are. `timeout` is such an
extension: a time limit in seconds for this request.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, WithJsonSchema
from pydantic.json_schema import models_json_schema

from .protocol import ApiError

MAX_TOP_LOGPROBS = 20  # as OpenAI
MAX_MESSAGES = 1024  # turns in one chat request
MAX_CACHE_KEY_CHARS = 256  # a prompt_cache_key
MAX_STOP_CHARS = 256  # the length of one stop string (their number: ServeOptions.max_stop)



def _integral(value: Any) -> Any:
    """A float with no fraction as that int: JSON does not tell 2.0 from 2, nor does JSON Schema's integer."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# strict otherwise ("5" and true are not integers); constraints go before the validator, or the published
# schema would lose them
Int = Annotated[int, BeforeValidator(_integral)]
PositiveInt = Annotated[int, Field(ge=1), BeforeValidator(_integral)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), BeforeValidator(_integral)]
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]


def _published(schema: dict[str, Any]) -> WithJsonSchema:
    """What /openapi.json says a field takes (or null) where validation takes more: the fields foldline
    serves only at their neutral value are validated over the API's whole range, so that anything else
    is refused by `refuse_unsupported` with a message naming the field, but published as what is served."""
    return WithJsonSchema({"anyOf": [schema, {"type": "null"}]})


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Model):
    include_usage: bool | None = None


class TextPart(_Model):
    type: Literal["text"]
    text: str


class Message(_Model):
    # "developer" is OpenAI's newer name for "system"; tool and function turns are not served
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def refuse_unsupported(self, index: int) -> None:
        if self.content is None and self.role != "assistant":  # OpenAI allows null only beside tool calls
            raise ApiError(400, f"a {self.role} message needs 'content'", param=f"messages[{index}].content")


class _Common(_Model):
    """Fields both endpoints share."""

    model: Annotated[str, Field(min_length=1)]
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: PositiveInt | None = None
    frequency_penalty: Annotated[Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] | None,
                                 _published({"const": 0})] = None
    presence_penalty: Annotated[Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] | None,
                                _published({"const": 0})] = None
    logit_bias: Annotated[dict[str, float] | None, _published({"type": "object", "maxProperties": 0})] = None
    user: str | None = None
    # OpenAI's name for a conversation's cache bucket: a free row last used under the key is taken back
    prompt_cache_key: Annotated[str, Field(max_length=MAX_CACHE_KEY_CHARS)] | None = None
    timeout: Seconds | None = None

    def refuse_unsupported(self) -> None:
        """A 400 for a field set to something foldline does not do."""
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0):
                raise ApiError(400, f"'{name}' is not supported (only 0)", param=name)
        if self.logit_bias:
            raise ApiError(400, "'logit_bias' is not supported", param="logit_bias")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        longest = max(map(len, stops), default=0)
        if longest > MAX_STOP_CHARS:
            raise ApiError(400, f"'stop' holds a string of {longest} characters; at most {MAX_STOP_CHARS}",
                           param="stop")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")


class CompletionBody(_Common):
    """POST /v1/completions: `prompt` is text or token ids (one prompt per request)."""

    prompt: str | list[Int] | list[str] | list[list[Int]]
    logprobs: TopLogprobs | None = None
    echo: Annotated[bool | None, _published({"const": False})] = None
    best_of: Annotated[PositiveInt | None, _published({"const": 1})] = None
    suffix: Annotated[str | None, _published({"const": ""})] = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise ApiError(400, "'echo' is not supported", param="echo")
        if self.best_of not in (None, 1):
            raise ApiError(400, "'best_of' > 1 is not supported", param="best_of")
        if self.suffix:
            raise ApiError(400, "'suffix' is not supported", param="suffix")

    def single_prompt(self) -> str | list[int]:
        """The one prompt, a batch of one unwrapped; an empty prompt is refused here, naming `prompt`."""
        prompt: Any = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError(400, f"'prompt' holds {len(prompt)} prompts; send one prompt per request",
                               param="prompt")
            prompt = prompt[0]
        if len(prompt) == 0:
            raise ApiError(400, "'prompt' is empty", param="prompt")
        return prompt


class ChatBody(_Common):
    """POST /v1/chat/completions."""

    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    tools: Annotated[list[Any] | None, _published({"type": "array", "maxItems": 0})] = None
    tool_choice: Annotated[Any, _published({"const": "none"})] = None
    parallel_tool_calls: Annotated[Any, WithJsonSchema({"type": "null"})] = None
    functions: Annotated[list[Any] | None, _published({"type": "array", "maxItems": 0})] = None
    function_call: Annotated[Any, _published({"const": "none"})] = None
    response_format: Annotated[dict[str, Any] | None, _published({
        "type": "object", "properties": {"type": {"const": "text"}}, "required": ["type"],
        "additionalProperties": False})] = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        for index, message in enumerate(self.messages):
            message.refuse_unsupported(index)
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise ApiError(400, f"'{name}' are not supported: this server does not call tools", param=name)
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                raise ApiError(400, f"'{name}' is not supported (only \"none\"): this server does not call tools",
                               param=name)
        if self.parallel_tool_calls is not None:
            raise ApiError(400, "'parallel_tool_calls' is not supported: this server does not call tools",
                           param="parallel_tool_calls")
        if self.response_format not in (None, {"type": "text"}):
            raise ApiError(400, "'response_format' other than text is not supported", param="response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")

    def conversation(self) -> list[dict[str, str]]:
        """role/content dicts for the chat template, text parts joined, developer turns as system turns."""
        out = []
        for m in self.messages:
            content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
            out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
        return out


BodyT = TypeVar("BodyT", CompletionBody, ChatBody)

_TYPE_TAG = re.compile(r"^[a-z_][a-z0-9_]*$")
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param(loc: tuple[int | str, ...]) -> str | None:
    """`messages[0].role` from pydantic's location, union member tags (`str`, `list[int]`) left out."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _TYPE_TAG.match(part) and part not in _TYPE_NAMES:
            out += f".{part}" if out else part
    return out or None


def parse_body(cls: type[BodyT], data: Any) -> BodyT:
    """The validated body, or an ApiError 400 naming the first bad field as `param`."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        body = cls.model_validate(data)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        param = _param(first["loc"])
        raise ApiError(400, f"{param or 'body'}: {first['msg']}", param=param) from None
    body.refuse_unsupported()
    return body


# ---- what the server answers: declared in /openapi.json so that a client (or a checker) can hold it to them ----

FinishReason = Literal["stop", "length"]


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Answer):
    cached_tokens: int


class Usage(_Answer):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionChoice(_Answer):
    index: int
    text: str
    finish_reason: FinishReason
    logprobs: dict[str, Any] | None


class Completion(_Answer):
    """A text completion; with `stream: true` the same fields arrive as server-sent events."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(_Answer):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Answer):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: dict[str, Any] | None


class ChatCompletion(_Answer):
    """A chat completion; with `stream: true`, chat.completion.chunk server-sent events instead."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(_Answer):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(_Answer):
    object: Literal["list"]
    data: list[ModelCard]


class Health(_Answer):
    status: Literal["ok", "unhealthy", "shutting_down"]
    running: int
    waiting: int
    rows: int
    reason: str | None = None


class ErrorDetail(_Answer):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(_Answer):
    """Every error, whatever its status: OpenAI's format."""

    error: ErrorDetail


# The errors each kind of route can answer, and why (docs/serving.md).
_ERRORS = {
    "400": "bad input: invalid JSON or HTTP, a field out of range or not supported, a Host not allowed",
    "403": "a cross-origin request from an origin not allowed (--cors)",
    "404": "no such route, or a model other than the one served",
    "405": "a method the route does not take",
    "408": "the request headers or body did not arrive in time",
    "413": "the request body is larger than --max-body-bytes",
    "500": "this request's generation failed, or a bug in the server (the other requests go on)",
    "503": "the queue is full, the connection limit is reached or the server is shutting down (see Retry-After)",
}
_GET_ERRORS = ("400", "403", "404", "405", "408", "500", "503")


# One server-sent event, as OpenAPI 3.1 tools read a text/event-stream schema (per event; 3.2 calls it
# itemSchema): `data` holds a JSON chunk, an error body, or the closing `[DONE]`.
SSE_EVENT: dict[str, Any] = {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                   "retry": {"type": "integer", "minimum": 0}},
}


def openapi_schema(version: str) -> dict[str, Any]:
    """The OpenAPI 3.1 description of the server (GET /openapi.json), its bodies from the models above."""
    refs, defs = models_json_schema(
        [(ChatBody, "validation"), (CompletionBody, "validation"), (ChatCompletion, "serialization"),
         (Completion, "serialization"), (ModelList, "serialization"), (Health, "serialization"),
         (ErrorBody, "serialization")],
        ref_template="#/components/schemas/{model}")

    def json_body(model: type[BaseModel], mode: str = "serialization") -> dict[str, Any]:
        return {"application/json": {"schema": refs[(model, mode)]}}

    def errors(statuses: tuple[str, ...] | None = None) -> dict[str, Any]:
        return {status: {"description": why, "content": json_body(ErrorBody)}
                for status, why in _ERRORS.items() if statuses is None or status in statuses}

    def generation(body: type[BaseModel], answer: type[BaseModel], summary: str) -> dict[str, Any]:
        ok = {"description": "the completion (JSON), or server-sent events with `stream: true`",
              "content": json_body(answer) | {"text/event-stream": {"schema": SSE_EVENT}}}
        return {"post": {"summary": summary,
                         "requestBody": {"required": True, "content": json_body(body, "validation")},
                         "responses": {"200": ok, **errors()}}}

    def get(summary: str, answer: dict[str, Any], statuses: tuple[str, ...] = _GET_ERRORS) -> dict[str, Any]:
        return {"get": {"summary": summary, "responses": {"200": {"description": summary, "content": answer},
                                                          **errors(statuses)}}}

    health = get("whether the server is serving", json_body(Health))
    health["get"]["responses"]["503"] = {"description": "not serving: stalled, failed or shutting down "
                                                        "(`reason` says which)", "content": {"application/json": {"schema": {
        "anyOf": [refs[(Health, "serialization")], refs[(ErrorBody, "serialization")]]}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "foldline serve", "version": version,
                 "description": "An OpenAI-compatible API over a foldline bundle (docs/serving.md)."},
        "paths": {"/v1/chat/completions": generation(ChatBody, ChatCompletion, "a chat completion"),
                  "/v1/completions": generation(CompletionBody, Completion, "a text completion"),
                  "/v1/models": get("the model served", json_body(ModelList)),
                  "/health": health,
                  "/openapi.json": get("this description of the API", {"application/json": {
                      "schema": {"type": "object"}}})},
        "components": {"schemas": defs.get("$defs", {})},
    }
