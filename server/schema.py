"""The request bodies of OpenAI's completions and chat completions APIs, as pydantic models.

Validation is strict (no "5" for 5, no true for 1) and every optional field
takes an explicit null. Fields of the API that foldline does not implement
are accepted at their neutral value and refused otherwise, so a client is
never silently given something other than what it asked for; fields the API
does not know are ignored, as vendor extensions are. `timeout` is such an
extension: a time limit in seconds for this request.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .protocol import ApiError

MAX_TOP_LOGPROBS = 20

PositiveInt = Annotated[int, Field(ge=1)]
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]


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


class _Common(_Model):
    """Fields both endpoints share."""

    model: Annotated[str, Field(min_length=1)]
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: PositiveInt | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    timeout: Seconds | None = None

    def refuse_unsupported(self) -> None:
        """A 400 for a field set to something foldline does not do."""
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0):
                raise ApiError(400, f"'{name}' is not supported (only 0)", param=name)
        if self.logit_bias:
            raise ApiError(400, "'logit_bias' is not supported", param="logit_bias")


class CompletionBody(_Common):
    """POST /v1/completions: `prompt` is text or token ids (one prompt per request)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool | None = None
    best_of: PositiveInt | None = None
    suffix: str | None = None

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

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.tools:
            raise ApiError(400, "'tools' are not supported", param="tools")
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
