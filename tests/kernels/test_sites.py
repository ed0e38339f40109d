"""The rewrite loop's bookkeeping (kernels/sites.py) that no kernel's numbers would show."""

from __future__ import annotations

from iree.compiler import ir

from foldline.kernels.sites import _add_once


def test_each_kernel_symbol_is_added_once_after_those_already_there():
    with ir.Context():
        module = ir.Module.parse("util.func private @shared() {\n  util.return\n}")
        texts = [f"util.func private @{name}() {{\n  util.return\n}}" for name in ("a", "shared", "b", "a")]
        _add_once(module, iter(texts))
        names = [ir.SymbolTable.get_symbol_name(op).value for op in module.body.operations]
    assert names == ["shared", "a", "b"]
