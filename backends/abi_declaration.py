"""Declare each entry point's tensor signature in the module, for the runtime to check at load.

Plain `func.func` inputs get an `iree.abi.declaration` from IREE; the torch
input path does not (its functions take `!hal.buffer_view`s and import them
inside). This pass over the input-level MLIR reads each `@name$async` body's
`hal.tensor.import`s and puts the same declaration on the synchronous `@name`,
which the runtime reads back (`VmFunction.reflection`) to compare with the
manifest's state buffers before the first call.
"""

from __future__ import annotations

import re

from ..runtime.bundle import DECLARATION_KEY

_FUNC_RE = re.compile(r"^  util\.func public @([\w$.]+)\(", re.M)
_IMPORT_RE = re.compile(r"hal\.tensor\.import [^\n]*?=> %arg(\d+) : !hal\.buffer_view -> tensor<([^>]*)>")
_EXPORT_RE = re.compile(r"hal\.tensor\.export [^\n]*?: tensor<([^>]*)> -> !hal\.buffer_view")
_STUB = "attributes {iree.abi.stub}"


def declare_entry_points(text: str) -> tuple[str, list[str]]:
    """The input-level MLIR with a declaration on every synchronous entry point; and their names."""
    starts = [(m.start(), m.group(1)) for m in _FUNC_RE.finditer(text)]
    bodies = {name: text[start: starts[i + 1][0] if i + 1 < len(starts) else len(text)]
              for i, (start, name) in enumerate(starts)}
    declared = []
    for name, body in bodies.items():
        if not name.endswith("$async"):
            continue
        sync = name[: -len("$async")]
        inputs = sorted((int(k), t) for k, t in _IMPORT_RE.findall(body))
        outputs = _EXPORT_RE.findall(body)
        if sync not in bodies or not inputs:
            continue
        args = ", ".join(f"%input{i}: tensor<{t}>" for i, (_k, t) in enumerate(inputs))
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
