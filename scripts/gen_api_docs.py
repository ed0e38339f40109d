"""Write docs/api.md, the Python API reference of the embedded runtime, from its docstrings.

    .venv/bin/python scripts/gen_api_docs.py           # rewrite docs/api.md
    .venv/bin/python scripts/gen_api_docs.py --check   # exit 1 if docs/api.md is stale (tests/runtime/test_api_docs.py)

The reference is generated so it cannot drift from the code: each documented
name's signature and docstring come from the installed package, and the
examples are the files under docs/examples/, which tests/runtime/test_api_docs.py runs
as written. Only `foldline.runtime` is imported: no torch, as in an app.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "api.md"
EXAMPLES = ROOT / "docs" / "examples"

INTRO = """\
# Python API

The runtime an app embeds: `foldline.runtime`. It imports numpy, `iree.runtime`,
tokenizers and jinja2 (chat templates), never torch. Install it from the tree
with `pip install .` (docs/runtime.md, "Install"); compile bundles with the
`compiler` extra.

This page is generated from the docstrings by `scripts/gen_api_docs.py`
(`--check` fails when it is stale); docs/runtime.md explains the thread model,
saved sessions, errors and the command line.
"""

# (section, intro line, dotted names in the order they are documented)
SECTIONS: list[tuple[str, str, list[str]]] = [
    ("Models and sessions",
     "A `Model` is a loaded bundle; a `Session` is one sequence with its own state on the device.",
     ["foldline.runtime.Model", "foldline.runtime.Session", "foldline.runtime.Snapshot"]),
    ("Conversations",
     "Chat on a session: messages in, streamed text out; only the new messages are rendered and fed.",
     ["foldline.runtime.Conversation", "foldline.runtime.chat.encode_messages"]),
    ("Generations",
     "What `generate`, `stream_text` and `Conversation.send` return: an iterator that carries its outcome.",
     ["foldline.runtime.generation.Generation", "foldline.runtime.generation.Usage"]),
    ("Sampling",
     "How the next token is picked from the logits.",
     ["foldline.runtime.Sampler"]),
    ("Streaming",
     "Text pieces as they become complete UTF-8, with stop strings held back until they cannot match.",
     ["foldline.runtime.streaming.stream_pieces", "foldline.runtime.streaming.IncrementalDetokenizer",
      "foldline.runtime.streaming.StopStringFilter"]),
    ("Batches",
     "All rows of a bundle compiled with `--batch N`, advanced together (what `foldline serve` runs).",
     ["foldline.runtime.Batch"]),
    ("Errors",
     "Every error the runtime raises for bad input is a `FoldlineError` with a message naming the problem.",
     ["foldline.errors.FoldlineError", "foldline.runtime.BundleError", "foldline.runtime.TokenIdError",
      "foldline.runtime.ContextFullError", "foldline.runtime.SessionStateError",
      "foldline.runtime.SessionFileError"]),
]

# (file under docs/examples, what it shows)
EXAMPLE_FILES = [
    ("embed.py", "Embedding the runtime in an app: load a bundle, generate, save and resume a session."),
    ("chat_loop.py", "A chat loop on the conversation API, reading the user's lines from standard input."),
    ("stream_stop.py", "Streaming with stop strings, sampling settings and the finish reason."),
]


def _resolve(dotted: str) -> object:
    module, _, name = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"gen_api_docs: cannot document {dotted}: {e}") from e


def _annotation(value: object) -> str:
    """An annotation as the source spells it (postponed annotations are already strings)."""
    return value if isinstance(value, str) else inspect.formatannotation(value)


def _signature(obj: object, name: str) -> str:
    """`name(a: int, b: str = 'x') -> T`, without self or cls."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return name
    params = []
    for i, p in enumerate(sig.parameters.values()):
        if i == 0 and p.name in ("self", "cls"):
            continue
        text = p.name
        if p.kind is p.VAR_POSITIONAL:
            text = f"*{text}"
        elif p.kind is p.VAR_KEYWORD:
            text = f"**{text}"
        elif p.kind is p.KEYWORD_ONLY and not any(q.startswith("*") for q in params):
            params.append("*")
        if p.annotation is not p.empty:
            text += f": {_annotation(p.annotation)}"
        if p.default is not p.empty:
            text += f" = {p.default!r}" if p.annotation is not p.empty else f"={p.default!r}"
        params.append(text)
    result = "" if sig.return_annotation is sig.empty else f" -> {_annotation(sig.return_annotation)}"
    return f"{name}({', '.join(params)}){result}"


def _doc(obj: object) -> str:
    return inspect.getdoc(obj) or ""


def _members(cls: type) -> list[tuple[str, object]]:
    """Public methods and properties defined on the class itself, in source order."""
    out = []
    for name, value in cls.__dict__.items():
        if name.startswith("_") and name != "__call__":
            continue
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property) or inspect.isfunction(value):
            out.append((name, value))
    return out


def _render_member(cls_name: str, name: str, value: object) -> list[str]:
    if isinstance(value, property):
        head = f"`{cls_name}.{name}` (property)"
        doc = _doc(value.fget) if value.fget else ""
    else:
        head = f"`{cls_name}.{_signature(value, name)}`"
        doc = _doc(value)
    lines = [f"- {head}"]
    if doc:
        lines += [f"  {line}" if line else "" for line in doc.splitlines()]
    return lines


def _render(dotted: str) -> list[str]:
    obj = _resolve(dotted)
    name = dotted.rpartition(".")[2]
    kind = "class" if inspect.isclass(obj) else "function"
    lines = [f"### `{name}`", "", "```python", f"{kind} {_signature(obj, name)}" if kind == "function"
             else f"class {_signature(obj, name)}", "```", ""]
    if _doc(obj):
        lines += [_doc(obj), ""]
    if inspect.isclass(obj) and not issubclass(obj, BaseException):
        members = _members(obj)
        if members:
            for member, value in members:
                lines += _render_member(name, member, value)
            lines.append("")
    return lines


def render() -> str:
    lines = [INTRO, "## Examples", ""]
    for file, what in EXAMPLE_FILES:
        source = (EXAMPLES / file).read_text()
        lines += [f"### {what}", "", f"`docs/examples/{file}`:", "", "```python", source.rstrip(), "```", ""]
    for title, intro, names in SECTIONS:
        lines += [f"## {title}", "", intro, ""]
        for dotted in names:
            lines += _render(dotted)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md differs from what would be written")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run `python scripts/gen_api_docs.py`", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
