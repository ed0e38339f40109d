"""Instantiating the kernels written as MLIR templates (kernels/templates/*.mlir).

A kernel of fixed structure is one `.mlir` file: its types are named aliases
(`!kv_memref = memref<...>`) defined at its head, and jinja2 fills in the
shapes, element types, constants and symbol names a call gives it (`{{ name }}`),
with loops only where the kernel repeats per vector of features. Small
spellings that several kernels share (an f16 widening, a multiply-add) are
templates of their own, included with `{% with %}`.

The text a kernel family adds to a module is one operation, parsed alone
(kernels/sites.py) or placed inside a `module { }` by the tests, where MLIR
accepts no alias definitions: `instantiate` resolves the aliases, so a
template reads with named types and its instance is self-contained.
"""

from __future__ import annotations

import re
from pathlib import Path

import jinja2

TEMPLATES = Path(__file__).parent / "templates"

_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(TEMPLATES),
    undefined=jinja2.StrictUndefined,  # a parameter the call forgot is an error, not an empty string
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,  # an included spelling ends its last line
    autoescape=False,
)
_ALIAS = re.compile(r"^!(\w+) = (.+)$")
_USE = re.compile(r"!(\w+)(?![\w.])")  # `!kv_memref`, never `!stream.binding`


class TemplateError(ValueError):
    """A template whose aliases do not resolve."""


def instantiate(name: str, /, **params: object) -> str:
    """The text of templates/{name}.mlir for these parameters (a kernel symbol may be one named
    `name` too), its type aliases resolved."""
    text = _ENV.get_template(f"{name}.mlir").render(**params)
    lines = text.rstrip("\n").split("\n")
    aliases: dict[str, str] = {}
    while lines and (m := _ALIAS.match(lines[0])):
        aliases[m.group(1)] = _resolve(m.group(2), aliases)
        lines.pop(0)
    while lines and not lines[0]:
        lines.pop(0)
    return _resolve("\n".join(lines), aliases)


def _resolve(text: str, aliases: dict[str, str]) -> str:
    def use(m: re.Match[str]) -> str:
        if m.group(1) not in aliases:
            raise TemplateError(f"type alias !{m.group(1)} is not defined")
        return aliases[m.group(1)]

    return _USE.sub(use, text)
