"""foldline passes: the registered graph passes, one line each, default pipeline marked.

The pass modules import torch, which the runtime-only install lacks; their names and
descriptions are read from their `@register_pass(NAME, "description")` lines instead,
so the list is the same with or without the compiler extra.
"""

from __future__ import annotations

import ast
from importlib import resources

REGISTER = "register_pass"


def add_parser(sub) -> None:
    p = sub.add_parser("passes", help="list the graph passes and the default pipeline")
    p.set_defaults(func=run)


def _literal(node: ast.expr, constants: dict[str, str]) -> str | None:
    """A string argument: a literal, or a module-level NAME = "literal"."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    return None


def _registrations(source: str) -> dict[str, str]:
    """name -> description of each `@register_pass(name, description)` in a module's source."""
    tree = ast.parse(source)
    constants = {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                 for target in node.targets if isinstance(target, ast.Name)}
    found = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef):
            continue
        for call in node.decorator_list:
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == REGISTER
                    and len(call.args) == 2):
                name, description = (_literal(a, constants) for a in call.args)
                if name is not None and description is not None:
                    found[name] = description
    return found


def registered_passes() -> dict[str, str]:
    """name -> description of every built-in pass, without importing the pass modules."""
    package = resources.files(f"{__package__.rpartition('.')[0]}.passes")
    passes: dict[str, str] = {}
    for module in sorted((f for f in package.iterdir() if f.name.endswith(".py")), key=lambda f: f.name):
        passes.update(_registrations(module.read_text(encoding="utf-8")))
    return passes


def run(args) -> int:
    from ..passes.pipeline import DEFAULT_PIPELINE

    passes = registered_passes()
    pipeline = list(DEFAULT_PIPELINE)
    width = max((len(n) for n in passes), default=0)
    for name in pipeline + sorted(set(passes) - set(pipeline)):
        if name in pipeline:
            mark = f"[default {pipeline.index(name) + 1}]"
        else:
            mark = "[optional]"
        print(f"{name:<{width}}  {mark:<11}  {passes[name]}")
    print(f"default pipeline: {' -> '.join(pipeline) if pipeline else '(none)'}")
    return 0
