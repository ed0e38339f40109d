"""kernels/builder.py: the ops the int8 kernels are built from, and the executable around them."""

from __future__ import annotations

import pytest
from iree.compiler import ir

from foldline.kernels.builder import Builder, stream_executable


def _parsed(text: str) -> ir.Operation:
    with ir.Context():
        return ir.Operation.parse(text)


def test_an_executable_exports_its_function_with_a_fixed_workgroup_count_and_its_bindings():
    def body(b: Builder, args: list[ir.Value]) -> None:
        c0 = b.index(0)
        x = b.subspan(args[0], c0, b.memref((16,), "f32"))
        y = b.subspan(args[1], c0, b.memref((16,), "f32"))
        v = b.load(b.vector(16, "f32"), x, [c0])
        b.store(b.fma(v, v, b.const(1.0, b.vector(16, "f32"))), y, [c0])

    text = stream_executable("k", 6, 2, body)
    assert text.startswith("stream.executable private @k_exe")
    assert "stream.executable.export public @k workgroups()" in text
    assert "%c6 = arith.constant 6 : index" in text and "stream.return %c6, %c1, %c1" in text
    assert "func.func @k(%arg0: !stream.binding, %arg1: !stream.binding)" in text
    assert "math.fma" in text
    assert ir.StringAttr(_parsed(text).attributes["sym_name"]).value == "k_exe"


def test_a_shared_constant_asked_for_inside_a_loop_is_made_once_at_the_top_of_the_function():
    def body(b: Builder, args: list[ir.Value]) -> None:
        c0, c1, c4 = b.index(0), b.index(1), b.index(4)
        out = b.subspan(args[0], c0, b.memref((4, 16), "i32"))

        def step(i: ir.Value, acc: ir.Value) -> list[ir.Value]:
            total = b.addi(acc, b.shared(3, b.vector(16, "i32")))
            return [b.addi(total, b.shared(3, b.vector(16, "i32")))]

        last, = b.loop(c0, c4, c1, step, [b.const(0, b.vector(16, "i32"))])
        b.store(last, out, [c0, c0])

    text = stream_executable("k", 1, 1, body)
    body_lines = text.split("func.func")[1].splitlines()
    assert sum("dense<3>" in line for line in body_lines) == 1
    assert "dense<3>" in body_lines[1], "made before the function's first op"
    assert "scf.for" in text and "iter_args" in text


def test_an_op_of_mismatched_types_fails_when_the_executable_is_built():
    def body(b: Builder, args: list[ir.Value]) -> None:
        b.addi(b.const(1, b.vector(16, "i32")), b.const(1, b.vector(64, "i8")))

    with pytest.raises(ir.MLIRError):
        stream_executable("k", 1, 1, body)


def test_an_intrinsic_call_names_its_instruction_and_types():
    def body(b: Builder, args: list[ir.Value]) -> None:
        v = b.const(1, b.vector(16, "i8"))
        b.intrinsic("llvm.aarch64.neon.sdot.v4i32.v16i8", b.vector(4, "i32"), b.const(0, b.vector(4, "i32")), v, v)

    text = stream_executable("k", 1, 1, body)
    assert ('llvm.call_intrinsic "llvm.aarch64.neon.sdot.v4i32.v16i8"(%cst_0, %cst, %cst) '
            ": (vector<4xi32>, vector<16xi8>, vector<16xi8>) -> vector<4xi32>") in text
