"""Declare each entry point's tensor signature in the module, for the runtime to check at load.

Plain `func.func` inputs get an `iree.abi.declaration` from IREE; the torch
input path does not (its functions take `!hal.buffer_view`s and import them
inside). This pass over the input-level MLIR puts a declaration on each
synchronous entry point `@name`, which the runtime reads back
(`VmFunction.reflection`) to compare with the manifest before the first call.
The inputs come from the torch-dialect function the module was compiled from
(every argument, read or not: IREE imports only the arguments a function
reads, yet the caller passes them all); the outputs from the `@name$async`
body's `hal.tensor.export`s.
"""

from __future__ import annotations

import re

from ..contract.entry_points import DECLARATION_KEY

_FUNC_RE = re.compile(r"^  util\.func public @([\w$.]+)\(", re.M)
_TORCH_FUNC_RE = re.compile(r"^\s*func\.func @([\w$.]+)\((.*?)\) ->", re.M)
_TORCH_ARG_RE = re.compile(r"%arg\d+: !torch\.v?tensor<\[([-0-9,?]*)\],(\w+)>")
_EXPORT_RE = re.compile(r"hal\.tensor\.export [^\n]*?: tensor<([^>]*)> -> !hal\.buffer_view")
_STUB = "attributes {iree.abi.stub}"


def torch_inputs(torch_mlir: str) -> dict[str, list[str]]:
    """function name -> the tensor type of each argument (`1x2x128x16xf32`, `0x?xi8`), from torch-dialect MLIR."""
    out = {}
    for name, args in _TORCH_FUNC_RE.findall(torch_mlir):
        types = []
        for dims, elem in _TORCH_ARG_RE.findall(args):
            shape = ["?" if d in ("?", "-1") else d for d in dims.split(",") if d]
            elem = re.sub(r"^[su]i(\d+)$", r"i\1", elem)  # torch's si64 is IREE's i64
            types.append("x".join([*shape, elem]))
        out[name] = types
    return out


def declare_entry_points(text: str, torch_mlir: str) -> tuple[str, list[str]]:
    """The input-level MLIR with a declaration on every synchronous entry point; and their names.

    `torch_mlir` is the torch-dialect module `text` was converted from: its functions' arguments.
    """
    inputs_of = torch_inputs(torch_mlir)
    starts = [(m.start(), m.group(1)) for m in _FUNC_RE.finditer(text)]
    bodies = {name: text[start: starts[i + 1][0] if i + 1 < len(starts) else len(text)]
              for i, (start, name) in enumerate(starts)}
    declared = []
    for name, body in bodies.items():
        if not name.endswith("$async"):
            continue
        sync = name[: -len("$async")]
        inputs = inputs_of.get(sync)
        outputs = _EXPORT_RE.findall(body)
        if sync not in bodies or not inputs:
            continue
        args = ", ".join(f"%input{i}: tensor<{t}>" for i, t in enumerate(inputs))
        results = ", ".join(f"%output{i}: tensor<{t}>" for i, t in enumerate(outputs))
        declaration = f"sync func @{sync}({args}) -> ({results})"
        header_end = text.index("\n", text.index(f"  util.func public @{sync}("))
        header = text[: header_end]
        line_start = header.rindex("\n") + 1
        line = header[line_start:]
        if _STUB not in line:
            continue
        reflected = line.replace(_STUB, f'attributes {{iree.abi.stub, iree.reflection = {{{DECLARATION_KEY} = '
                                        f'"{declaration}"}}}}')
        text = text[:line_start] + reflected + text[header_end:]
        declared.append(sync)
    return text, declared
