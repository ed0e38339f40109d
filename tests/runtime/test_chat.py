"""Chat templates in the runtime: rendering, message checks, a clear error without jinja2, no torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from foldline.contract.errors import BundleError
from foldline.runtime.chat import (
    ChatTemplateError,
    apply_chat_template,
    check_messages,
    render_chat_template,
)

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class _Tok:
    def id_to_token(self, i: int) -> str:
        return {2: "<bos>", 1: "<eos>"}[i]


def fake_model(template: str | None, bos: int | None = 2) -> SimpleNamespace:
    manifest = SimpleNamespace(chat_template=template, root=Path("bundle"), tokenizer_path=Path("t.json"))
    return SimpleNamespace(manifest=manifest, config={"bos_token_id": bos, "eos_token_ids": [1]}, tokenizer=_Tok())


def test_renders_user_turn_and_generation_prompt():
    out = apply_chat_template(fake_model(CHATML), "What is 2+2?")
    assert out == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    with_system = apply_chat_template(fake_model(CHATML), "hi", system="Be brief.")
    assert with_system.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi")


def test_bos_token_variable_comes_from_the_bundle():
    assert apply_chat_template(fake_model("{{ bos_token }}|{{ eos_token }}"), "x") == "<bos>|<eos>"
    assert apply_chat_template(fake_model("[{{ bos_token }}]", bos=None), "x") == "[]"


def test_missing_template_is_a_bundle_error():
    with pytest.raises(BundleError, match="no chat template"):
        apply_chat_template(fake_model(None), "hi")


def test_template_errors_are_reported():
    with pytest.raises(ChatTemplateError, match="only user turns"):
        render_chat_template("{{ raise_exception('only user turns') }}", [])
    with pytest.raises(ChatTemplateError, match="failed to render"):
        render_chat_template("{% for %}", [])


def test_sandbox_blocks_attribute_escape():
    with pytest.raises(ChatTemplateError):
        render_chat_template("{{ messages.__class__.__mro__[1].__subclasses__() }}", [])


def test_missing_jinja2_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "jinja2", None)
    monkeypatch.setitem(sys.modules, "jinja2.sandbox", None)
    with pytest.raises(ChatTemplateError, match="pip install jinja2"):
        render_chat_template(CHATML, [{"role": "user", "content": "hi"}])


def test_chat_module_does_not_import_torch():
    code = (
        "import sys\n"
        "from foldline.runtime.chat import render_chat_template\n"
        "render_chat_template('{{ messages[0].content }}', [{'role': 'user', 'content': 'x'}])\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_messages_must_be_role_and_content_strings():
    good = [{"role": "user", "content": "hi"}]
    assert check_messages(good) == good
    for bad, named in ((None, "list"), ([{"role": "user"}], "message 0"),
                       ([*good, {"role": "user", "content": ["parts"]}], "message 1")):
        with pytest.raises(ChatTemplateError, match=named):
            check_messages(bad)
