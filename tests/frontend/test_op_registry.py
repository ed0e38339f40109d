"""Every `foldline::` custom op is declared once (frontend/op_registry.declare_op), from its eager kernel."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import Tensor

import foldline
from foldline.backends.iree import fused_attention
from foldline.backends.onnx import gqa
from foldline.frontend import attention_ops, device_ops, gdn_ops, quant
from foldline.frontend.hadamard import transform
from foldline.frontend.op_registry import DECOMPOSITIONS, declare_op

ROOT = Path(foldline.__file__).parent
HANDLE_MODULES = (attention_ops, gdn_ops, device_ops, quant, transform, gqa, fused_attention)


def _toy_impl(x: Tensor, scale: float, rows: int | None = None, mode: str = "a") -> tuple[Tensor, Tensor]:
    return x * scale, x[:1].clone()


def test_the_schema_is_read_from_the_kernel_and_the_kernel_is_its_decomposition():
    op = declare_op("registry_toy", _toy_impl, lambda x, scale, rows=None, mode="a": (x.new_empty(x.shape),
                                                                                     x.new_empty((1, *x.shape[1:]))))
    assert str(op._schema) == ('foldline::registry_toy(Tensor x, float scale, SymInt? rows=None, str mode="a") '
                               '-> (Tensor, Tensor)')
    assert DECOMPOSITIONS[op] is _toy_impl
    y, first = op(torch.ones(3, 2), 2.0)
    assert torch.equal(y, torch.full((3, 2), 2.0)) and first.shape == (1, 2)

    class Calls(torch.nn.Module):
        def forward(self, x):
            return op(x, 0.5, None, "b")

    program = torch.export.export(Calls(), (torch.ones(4, 2),))
    (node,) = [n for n in program.graph.nodes if n.op == "call_function" and n.target is op]
    assert [tuple(v.shape) for v in node.meta["val"]] == [(4, 2), (1, 2)]


def test_a_kernel_without_type_hints_is_refused():
    def untyped(x, scale):
        return x * scale

    with pytest.raises(ValueError):
        declare_op("registry_untyped", untyped, ["x"])


def test_ops_a_backend_keeps_are_not_decomposed():
    assert gqa.GQA_ATTENTION not in DECOMPOSITIONS and fused_attention.BIASED_ATTENTION not in DECOMPOSITIONS
    assert DECOMPOSITIONS[attention_ops.CACHE_ATTENTION] is attention_ops.cache_attention_impl
    assert DECOMPOSITIONS[gdn_ops.GDN_CHUNK] is gdn_ops.gdn_chunk_impl


def _package_sources() -> list[Path]:
    return [p for folder in ROOT.iterdir() if folder.is_dir() and (folder / "__init__.py").exists()
            and folder.name != "tests" for p in folder.rglob("*.py")]


def _declarations(path: Path) -> list[tuple[str, str]]:
    """(handle name, op name) of each module-level `HANDLE = declare_op("op", ...)` in `path`."""
    found = []
    for node in ast.parse(path.read_text()).body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "id", None) == "declare_op"):
            found.append((node.targets[0].id, node.value.args[0].value))
    return found


def test_every_foldline_op_is_declared_once_and_its_handle_lives_beside_its_kernel():
    declarations = [(path, handle, op) for path in _package_sources() for handle, op in _declarations(path)]
    ops = [op for _, _, op in declarations]
    assert len(ops) == len(set(ops)), sorted(ops)
    assert {op for op in torch.ops.foldline} - {"registry_toy", "registry_untyped"} == set(ops)
    by_file = {module.__file__: module for module in HANDLE_MODULES}
    for path, handle, op in declarations:
        module = by_file[str(path)]
        assert getattr(module, handle) is getattr(torch.ops.foldline, op).default, (path, handle)


def _spells_an_op(path: Path) -> list[str]:
    """Lines of `path` that declare a custom op or spell a handle through torch.ops.foldline."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "custom_op":
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} torch.library.custom_op")
        if (isinstance(node, ast.Attribute) and node.attr == "foldline" and isinstance(node.value, ast.Attribute)
                and node.value.attr == "ops"):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} torch.ops.foldline")
    return found


def test_no_module_but_the_registry_declares_an_op_or_spells_its_name():
    sources = [p for p in _package_sources() if p.relative_to(ROOT).as_posix() != "frontend/op_registry.py"]
    offenders = [line for path in sources for line in _spells_an_op(path)]
    assert not offenders, offenders
