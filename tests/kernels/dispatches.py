"""What a compiled module's dispatches read and write, from IREE's dumped executable sources.

`iree-compile --iree-hal-dump-executable-sources-to=DIR` writes one MLIR file
per executable (dispatch). Each binding appears as
`hal.interface.binding.subspan ... : !iree_tensor_ext.dispatch.tensor<ACCESS:tensor<SHAPExTYPE>>`.
From those we can prove that a quantized weight is never materialised as a
float tensor, and that the contraction reads its narrow codes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

_BINDING = re.compile(r"dispatch\.tensor<(readonly|writeonly|readwrite):tensor<([0-9x]+)x([a-z]+[0-9]*)>")
FLOAT_TYPES = ("f32", "f16", "bf16")


@dataclass(frozen=True)
class Binding:
    access: str
    shape: tuple[int, ...]
    element: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Dispatch:
    file: str
    bindings: list[Binding]
    contracts: bool  # holds a reduction that multiplies (a matmul or a fused dequantize-matmul)


def read_dispatches(dump_dir: str | Path) -> list[Dispatch]:
    out = []
    for path in sorted(Path(dump_dir).glob("*.mlir")):
        text = path.read_text()
        bindings = [Binding(m.group(1), tuple(int(d) for d in m.group(2).split("x")), m.group(3))
                    for line in text.splitlines() if "hal.interface.binding.subspan" in line
                    for m in [_BINDING.search(line)] if m]
        contracts = bool(re.search(r"linalg\.(matmul|batch_matmul|mmt4d|batch_mmt4d)\b", text)) or (
            "linalg.generic" in text and '"reduction"' in text and ("arith.mulf" in text or "math.fma" in text))
        out.append(Dispatch(path.name, bindings, contracts))
    return out


def float_copies_of(dispatches: list[Dispatch], n: int, k: int, group: int) -> list[str]:
    """Float bindings shaped like a dequantized [N, K] weight ([N, K], [K, N] or [N, K/g, g])."""
    shapes = {(n, k), (k, n), (n, k // group, group)}
    return [f"{d.file}: {b.access} {b.shape} {b.element}" for d in dispatches for b in d.bindings
            if b.element in FLOAT_TYPES and b.shape in shapes]


def contractions_reading_codes(dispatches: list[Dispatch], n: int, k: int, fmt: str) -> list[str]:
    """Contracting dispatches that read the packed codes: i8 [N, K] (q8), i8 [N, K/2] or i4 [N, K] (q4)."""
    wanted = {("i8", n * k)} if fmt == "q8" else {("i8", n * k // 2), ("i4", n * k)}
    return [d.file for d in dispatches if d.contracts and any(
        b.access == "readonly" and (b.element, b.numel) in wanted for b in d.bindings)]
