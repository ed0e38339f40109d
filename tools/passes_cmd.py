"""foldline passes: the registered graph passes, one line each, default pipeline marked.

The pass modules import torch, which the runtime-only install lacks; their names,
descriptions and targets are read from their `@register_pass(NAME, "description")`
lines instead, so the list is the same with or without the compiler extra. The
model pipeline's passes live in passes/; target passes (`target="onnx"`) live with
their backend under backends/ and are listed with the target they apply to. The
ONNX graph rewrites (`@register_graph_rewrite`, backends/onnx/graph_rewrites.py), a
level below on the exported ONNX graph, follow under "onnx graph".
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from importlib import resources

REGISTER = "register_pass"
REGISTER_GRAPH_REWRITE = "register_graph_rewrite"
# The packages whose modules register passes: the model pipeline's, and each backend's target passes.
PASS_PACKAGES = ("passes", "backends.iree", "backends.onnx")
GRAPH_REWRITE_PACKAGES = ("backends.onnx",)


@dataclass(frozen=True)
class ListedPass:
    description: str
    target: str | None = None  # a target pass: the targets it applies to


def add_parser(sub) -> None:
    p = sub.add_parser("passes", help="list the graph passes, the default pipeline and the target passes")
    p.set_defaults(func=run)


def _literal(node: ast.expr, constants: dict[str, str]) -> str | None:
    """A string argument: a literal, or a module-level NAME = "literal"."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    return None


def _registrations(source: str, register: str = REGISTER) -> dict[str, ListedPass]:
    """name -> description and target of each `@register_pass(name, description[, target=...])` in a
    module's source."""
    tree = ast.parse(source)
    constants = {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                 for target in node.targets if isinstance(target, ast.Name)}
    found = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef):
            continue
        for call in node.decorator_list:
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == register
                    and len(call.args) == 2):
                name, description = (_literal(a, constants) for a in call.args)
                target = next((_literal(k.value, constants) for k in call.keywords if k.arg == "target"), None)
                if name is not None and description is not None:
                    found[name] = ListedPass(description, target)
    return found


def registered_passes(packages: tuple[str, ...] = PASS_PACKAGES, register: str = REGISTER) -> dict[str, ListedPass]:
    """name -> description (and target) of every built-in pass, without importing the pass modules."""
    root = __package__.rpartition(".")[0]
    passes: dict[str, ListedPass] = {}
    for package_name in packages:
        package = resources.files(f"{root}.{package_name}")
        for module in sorted((f for f in package.iterdir() if f.name.endswith(".py")), key=lambda f: f.name):
            passes.update(_registrations(module.read_text(encoding="utf-8"), register))
    return passes


def run(args) -> int:
    from ..passes.pipeline import DEFAULT_PIPELINE

    passes = registered_passes()
    pipeline = list(DEFAULT_PIPELINE)
    model = [n for n in passes if passes[n].target is None]
    targets = sorted((n for n in passes if passes[n].target is not None), key=lambda n: (passes[n].target, n))
    rows = []
    for name in pipeline + sorted(set(model) - set(pipeline)):
        rows.append((name, f"[default {pipeline.index(name) + 1}]" if name in pipeline else "[optional]"))
    rows += [(name, f"[target: {passes[name].target}]") for name in targets]
    graph_rewrites = registered_passes(GRAPH_REWRITE_PACKAGES, REGISTER_GRAPH_REWRITE)
    width = max((len(n) for n in [*(n for n, _ in rows), *graph_rewrites]), default=0)
    mark_width = max((len(m) for _, m in rows), default=0)
    for name, mark in rows:
        print(f"{name:<{width}}  {mark:<{mark_width}}  {passes[name].description}")
    print(f"default pipeline: {' -> '.join(pipeline) if pipeline else '(none)'}")
    if targets:
        print("target passes run where their target needs them, on the programs its backend makes; "
              "--dump-after NAME writes their output too")
    if graph_rewrites:
        print("onnx graph: rewrites of each exported ONNX graph into ONNX Runtime's operators")
        for name in sorted(graph_rewrites):
            print(f"  {name:<{width}}  {graph_rewrites[name].description}")
    return 0
