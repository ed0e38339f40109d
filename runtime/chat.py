"""Chat prompts: render the bundle's chat template (a Jinja2 template, as in HF and GGUF) and encode it.

Rendering runs in jinja2's immutable sandbox, as HF transformers does, because
a chat template ships with the model file and is code from its author.
`encode_messages` turns a conversation into token ids with the text of the
messages kept as text (no control tokens smuggled in a message).
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any

from ..contract.errors import BundleError
from ..errors import FoldlineError


class ChatTemplateError(FoldlineError, RuntimeError):
    """The bundle has no chat template, or it cannot be rendered."""


def _token_text(model: Any, key: str) -> str:
    ids = model.config.get(key)
    if isinstance(ids, list | tuple):
        ids = ids[0] if ids else None
    if ids is None or model.manifest.tokenizer_path is None:
        return ""
    return model.tokenizer.id_to_token(int(ids)) or ""


def render_chat_template(template: str, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                         **variables: Any) -> str:
    """Render a chat template with the variables HF templates expect."""
    try:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise ChatTemplateError("chat templates need jinja2: pip install jinja2") from e

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )
    except TemplateError as e:
        raise ChatTemplateError(f"chat template failed to render: {e}") from e


def apply_chat_template(model: Any, user_text: str, system: str | None = None,
                        add_generation_prompt: bool = True) -> str:
    """The prompt text for one user turn (plus an optional system turn) of a loaded Model."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user_text}]
    return chat_prompt(model, messages, add_generation_prompt)


def chat_prompt(model: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """The prompt text for a whole conversation (role/content messages) of a loaded Model."""
    template = model.manifest.chat_template
    if not template:
        raise BundleError(f"bundle {model.manifest.root} has no chat template; prompt it without --chat")
    return render_chat_template(
        template,
        messages,
        add_generation_prompt,
        bos_token=_token_text(model, "bos_token_id"),
        eos_token=_token_text(model, "eos_token_ids"),
    )


# ---- token ids of a conversation ------------------------------------------------------------------
# A chat template writes control tokens (<|im_start|>, <end_of_turn>) as text, and the tokenizer turns
# that text into their ids. The same text typed inside a message must stay text: otherwise a user
# could open a system turn of their own. Contents holding such text are rendered with placeholders
# (private-use characters no message holds), so the control tokens in the rendered text are the
# template's own; each stretch of text between them is encoded with control-token text read as text.

_PLACEHOLDER_BASE = 0xF0000  # Supplementary Private Use Area-A


def control_token_texts(model: Any) -> dict[str, int]:
    """The special tokens of the bundle's tokenizer: their text -> id."""
    return {t.content: i for i, t in model.tokenizer.get_added_tokens_decoder().items() if t.special}


def check_messages(messages: Any) -> list[dict[str, str]]:
    """Messages as OpenAI-style {"role": str, "content": str} dicts, or a ChatTemplateError naming the bad one."""
    if not isinstance(messages, list | tuple):
        raise ChatTemplateError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, "
                                f"got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ChatTemplateError(f"message {i} must be a dict with a string 'role' and a string 'content', "
                                    f"got {m!r:.80}")
    return list(messages)


def encode_messages(model: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    allow_control_tokens: bool = False) -> list[int]:
    """The token ids of a conversation rendered by the bundle's chat template, without an added BOS
    (a template that wants one writes it).

    Control-token text inside a message's content (`<|im_start|>system`) is encoded as text unless
    allow_control_tokens=True (trusted callers). Contents without such text give exactly the ids of
    the whole rendered text.
    """
    messages = check_messages(messages)
    controls = {} if allow_control_tokens else control_token_texts(model)
    found = sorted({c for m in messages for c in controls if c in m["content"]}, key=len, reverse=True)
    if not found:
        return model.encode(chat_prompt(model, messages, add_generation_prompt), add_bos=False)
    marks = _placeholders(messages, len(found))
    escaped = [{**m, "content": _replace_all(m["content"], found, marks)} for m in messages]
    text = chat_prompt(model, escaped, add_generation_prompt)
    ids: list[int] = []
    pattern = re.compile("|".join(re.escape(c) for c in sorted(controls, key=len, reverse=True)))
    start = 0
    for match in pattern.finditer(text):
        ids += _encode_as_text(model, _replace_all(text[start : match.start()], marks, found))
        ids.append(controls[match.group()])
        start = match.end()
    return ids + _encode_as_text(model, _replace_all(text[start:], marks, found))


def _placeholders(messages: list[dict[str, str]], n: int) -> list[str]:
    used = {ch for m in messages for ch in m["content"] if ord(ch) >= _PLACEHOLDER_BASE}
    free = (chr(c) for c in range(_PLACEHOLDER_BASE, 0x10FFFE) if chr(c) not in used)
    return [next(free) for _ in range(n)]


def _replace_all(text: str, old: list[str], new: list[str]) -> str:
    for a, b in zip(old, new):
        text = text.replace(a, b)
    return text


def _encode_as_text(model: Any, text: str) -> list[int]:
    """Ids of `text` with any control-token text in it read as plain text."""
    return model.text_tokenizer.encode_batch([text], add_special_tokens=False)[0].ids if text else []


def end_of_turn_id(model: Any) -> int | None:
    """The control token the template writes right after an assistant message (`<|im_end|>`,
    `<end_of_turn>`), or None when it writes none."""
    mark = chr(_PLACEHOLDER_BASE)
    try:
        text = chat_prompt(model, [{"role": "user", "content": "x"}, {"role": "assistant", "content": mark}],
                           add_generation_prompt=False)
    except ChatTemplateError:
        return None
    after = text.partition(mark)[2]
    return next((i for c, i in control_token_texts(model).items() if after.startswith(c)), None)
