"""Chat prompts: render the bundle's chat template (a Jinja2 template, as in HF and GGUF).

jinja2 is optional for the runtime: only chat formatting needs it. Rendering
runs in jinja2's immutable sandbox, as HF transformers does, because a chat
template ships with the model file and is code from its author.
"""

from __future__ import annotations

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
