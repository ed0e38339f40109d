"""Kernels written as MLIR templates (kernels/templates/, kernels/template.py) or built as ops
(kernels/builder.py), and which are not yet.

A kernel of fixed structure lives in a `.mlir` file with named types; Python
gives it shapes, types and symbol names. A generated kernel (the int8 ones)
makes its ops through IREE's Python bindings. The first test holds the kernels'
Python to that: an MLIR op spelt in a string literal of kernels/ is an error,
except in the definitions listed below, which still write their kernels as
text. The list must match exactly, so it can only shrink: a definition
converted has to leave it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import jinja2
import pytest

from foldline.kernels import template
from foldline.kernels.attention import (
    DecodeAttentionShape,
    decode_attention_combine_executable,
    decode_attention_executable,
    decode_attention_function,
)
from foldline.kernels.mlir import FloatIsa

KERNELS = Path(template.__file__).parent
# Dialect op prefixes a kernel spelt as text would hold; a type or attribute (`!stream.binding`,
# `#vector.kind`) is no op, and kernels/builder.py names the types it makes.
_OP_TEXT = re.compile(r"(?<![!#])\b(func\.func|util\.func|linalg\.|arith\.|vector\.|math\.|scf\.|memref\.|tensor\.[a-z]|"
                      r"flow\.|stream\.)")

# The top-level definitions (functions, classes) of kernels/ that still spell MLIR ops in Python strings.
NOT_YET_TEMPLATES = {
}


def _definitions_spelling_ops(source: str) -> set[str]:
    """The top-level definitions (or "<module>") holding a string literal, docstrings aside, with MLIR op text."""
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    found: set[str] = set()
    for top in tree.body:
        owner = top.name if isinstance(top, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) else "<module>"
        for node in ast.walk(top):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                    and _OP_TEXT.search(node.value)):
                found.add(owner)
    return found


def test_the_scan_sees_op_text_in_strings_and_f_strings_but_not_docstrings():
    source = '"""arith.addf in the module\'s docstring"""\n' \
             'def f(t):\n    """vector.load in prose"""\n    return [f"%x = arith.addf %a, %b : {t}"]\n' \
             'def g():\n    return "tensor<4xf32>"\n' \
             'def h():\n    return "!stream.binding"\n' \
             'def k(b):\n    return b.parse("%y = stream.binding.subspan %b[%c0]")\n'
    assert _definitions_spelling_ops(source) == {"f", "k"}


def test_converted_kernels_hold_no_mlir_outside_templates():
    found = {}
    for path in sorted(KERNELS.rglob("*.py")):
        names = _definitions_spelling_ops(path.read_text())
        if names:
            found[path.relative_to(KERNELS).as_posix()] = names
    for module in sorted(set(found) | set(NOT_YET_TEMPLATES)):
        new = found.get(module, set()) - NOT_YET_TEMPLATES.get(module, set())
        assert not new, f"kernels/{module}: {sorted(new)} spell MLIR ops in Python strings; write a template or build the ops (kernels/builder.py)"
        gone = NOT_YET_TEMPLATES.get(module, set()) - found.get(module, set())
        assert not gone, f"kernels/{module}: {sorted(gone)} no longer spell MLIR; remove them from NOT_YET_TEMPLATES"


SHAPE = DecodeAttentionShape(2, 4, 2, 32, 48, 40, 8, "interleaved", "f16", 0.125, "bf16")


@pytest.mark.parametrize("isa", [FloatIsa(), FloatIsa(fma=False, f16=False)], ids=["hardware", "soft"])
def test_an_instance_is_one_self_contained_op_with_its_aliases_resolved(isa):
    from iree.compiler import ir

    for text in (decode_attention_executable(SHAPE, isa), decode_attention_combine_executable(SHAPE, isa),
                 decode_attention_function(SHAPE)):
        assert not re.search(r"!\w+(?![\w.])", text), "an alias left unresolved"
        assert "{{" not in text and "{%" not in text
        with ir.Context() as ctx:
            ctx.allow_unregistered_dialects = True
            op = ir.Operation.parse(text)
        assert ir.StringAttr(op.attributes["sym_name"]).value.startswith(SHAPE.name)


def test_a_parameter_left_out_is_an_error():
    with pytest.raises(jinja2.UndefinedError):
        template.instantiate("decode_attention_call", name="f", batch=1)


def test_an_undefined_alias_is_an_error():
    with pytest.raises(template.TemplateError, match="!missing"):
        template._resolve("%x = arith.addf %a, %b : !missing", {"vf": "vector<16xf32>"})
