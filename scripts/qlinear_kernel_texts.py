"""Record, or check against a record, the MLIR text of every qlinear kernel over a matrix of shapes.

A change to how the kernels are written (Python, templates) that should leave
what they emit alone is checked by recording before it and checking after:

    python scripts/qlinear_kernel_texts.py record /tmp/qlinear.json
    ... the change ...
    python scripts/qlinear_kernel_texts.py check /tmp/qlinear.json

The matrix: q4 / q5 / q8 codes, f16 / f32 scales, with and without mins, group
sizes giving the half-group and the horizontal decode forms, one to eight
activation rows and prefill chunks, and the float CPU variants (hardware, no
FMA, no F16C, narrow registers, none of them); each float kernel on the CPU and
GPU paths, and the int8 decode (with its fusions) and prefill kernels where the
shape takes them. Every text is also parsed alone, as kernels/sites.py does.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from iree.compiler import ir

from foldline.kernels import qlinear as qk
from foldline.kernels.int8_decode import RowNorm
from foldline.kernels.mlir import FloatIsa

ISAS = {
    "hardware": FloatIsa(),
    "no-fma": FloatIsa(fma=False),
    "no-f16c": FloatIsa(f16=False),
    "narrow": FloatIsa(wide_registers=False),
    "x86-64-v2": FloatIsa(fma=False, f16=False, wide_registers=False),
}
# (k, group, n): two or more groups of an even size (half-group form), one group, an odd group, three groups.
SHAPES = [(256, 32, 64), (2048, 32, 32), (256, 64, 48), (32, 32, 64), (96, 6, 32), (144, 48, 32), (128, 16, 64),
          (512, 32, 6)]
ROWS = [(), (1,), (1, 1), (2,), (4,), (2, 3), (8,), (1, 64), (64,)]


def _specs() -> Iterator[qk.QLinearSpec]:
    for fmt in ("q4", "q5", "q8"):
        for scale_type in ("f16", "f32"):
            for has_min in (True, False):
                if fmt != "q8" and not has_min:
                    continue
                for k, group, n in SHAPES:
                    if fmt == "q5" and group % 16:
                        continue
                    for rows in ROWS:
                        yield qk.QLinearSpec(fmt, group, scale_type, has_min, (*rows, k), n)


def texts() -> Iterator[tuple[str, str]]:
    """(case, text) of every kernel in the matrix."""
    for spec in _specs():
        for isa_name, isa in ISAS.items():
            yield f"{spec.name} matmul cpu {isa_name}", qk.dequantize_matmul_mlir(spec, True, isa)
            yield f"{spec.name} matmul gpu {isa_name}", qk.dequantize_matmul_mlir(spec, False, isa)
            if qk.fuses_rows(spec):
                for i, text in enumerate(qk.fused_rows_code(spec, isa)):
                    yield f"{spec.name} rows {isa_name} {i}", text
            if spec.m == 1 and qk._half_lanes(spec):  # the horizontal form where the half-group one is taken
                yield f"{spec.name} horizontal {isa_name}", qk.horizontal_matvec_mlir(spec, isa)
        if qk.uses_int8_dot(spec):
            for norm in (None, RowNorm(1e-6, None), RowNorm(1e-6, 1.0)):
                for residual in (False, True):
                    for gate in (None, "silu", "gelu_tanh") if norm is None else (None,):
                        shape = qk.int8_dot_shape(spec, norm, residual, gate)
                        for i, text in enumerate(qk.int8_dot_mlir(spec, shape)):
                            yield f"{spec.name} int8 {shape.name} {i}", text
        if qk.uses_int8_gemm(spec):
            for i, text in enumerate(qk.int8_gemm_mlir(spec)):
                yield f"{spec.name} int8 gemm {i}", text


def _parses(text: str) -> None:
    with ir.Context() as ctx:
        ctx.allow_unregistered_dialects = True
        ir.Operation.parse(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=("record", "check"))
    parser.add_argument("path", type=Path)
    args = parser.parse_args()
    made = {}
    for case, text in texts():
        if case in made and made[case] != text:
            raise SystemExit(f"two texts for {case}")
        _parses(text)
        made[case] = text
    if args.mode == "record":
        args.path.write_text(json.dumps(made, indent=0, sort_keys=True))
        print(f"{len(made)} kernel texts recorded in {args.path}")
        return 0
    recorded = json.loads(args.path.read_text())
    differ = sorted(case for case in set(made) | set(recorded) if made.get(case) != recorded.get(case))
    for case in differ[:20]:
        print(f"differs: {case}")
    print(f"{len(made) - len(differ)} of {len(made)} kernel texts as recorded ({len(recorded)} recorded)")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
