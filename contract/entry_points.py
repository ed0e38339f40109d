"""The module's entry points: their names, the inputs each takes, and the check of a compiled module.

Every function of a bundle takes its step inputs, then every state buffer
(updated in place) and returns the next-token logits:

- `prefill(tokens[B,C] i64, start_pos[B] i64, n_valid[B] i64, kv_tiles[0,T] i8, state...)`;
- `decode(tokens[B,1] i64, pos[B] i64, pos_shape[0,pos[0]] i8, state...)` for one row;
- `decode(tokens[B,1] i64, pos[B] i64, n_valid[B] i64, state...)` for B > 1 rows: a row
  given n_valid 0 is left as it is, so a call can decode some rows while others
  wait (runtime/batch.py);
- `prefill_rows{k}` / `decode_rows{k}`: the same over the first k rows of the
  state buffers, for each row count of a batched bundle below its batch.

Shapes carry data the host knows (a position, a tile count) as empty tensors
whose second dimension is the value: the compiled code reads a dimension on
the host instead of device memory.
"""

from __future__ import annotations

import re

import numpy as np

from ..dtypes import DTYPES, FLOAT_DTYPES

ENTRY_POINTS = ("prefill", "decode")
# An ONNX module's graphs (backends/onnx/export.py, runtime/onnx_device.py): a state buffer's next
# value is the output named as its input plus NEXT_SUFFIX; the graph's metadata lists under
# INPLACE_STATE_KEY the state inputs whose next value may be bound to the input's own buffer.
NEXT_SUFFIX = ".next"
INPLACE_STATE_KEY = "foldline.inplace_state"
# What the manifest's `entry_points` field says of them, for a reader of manifest.json.
SIGNATURES = {
    "prefill": "prefill(tokens[B,C] i64, start_pos[B] i64, n_valid[B] i64, kv_tiles[0,T] i8, state...) "
               "-> logits[B,V] f32",
    "decode": "decode(tokens[B,1] i64, pos[B] i64, pos_shape[0,pos[0]] i8 (B = 1) or n_valid[B] i64 (B > 1), "
              "state...) -> logits[B,V] f32",
}
ROW_SIGNATURES = {"prefill_rows{k}, decode_rows{k}": "prefill and decode over the first k rows of the state "
                  "buffers (B = k), for k in row_counts below batch"}
DECLARATION_KEY = "iree.abi.declaration"  # the reflection entry holding an entry point's signature
DYNAMIC = -1  # a dynamic dimension (`?`) in an entry point's declared input shape
# Element types as MLIR spells them in an entry point's declaration.
MLIR_DTYPES = {d.mlir: d.name for d in DTYPES.values() if d.name in (*FLOAT_DTYPES, "int8", "int64")}
_INPUT_RE = re.compile(r"%input(\d+): tensor<([^>]*)>")
KV_TILE = 64  # cache slots per attention tile, when the cache length allows it


def signatures(batch: int) -> dict[str, str]:
    """The manifest's `entry_points` description for a bundle of `batch` rows."""
    return {**SIGNATURES, **(ROW_SIGNATURES if batch > 1 else {})}


def row_entry_name(entry: str, rows: int, batch: int) -> str:
    """The function that runs `entry` ("prefill" or "decode") over the first `rows` rows of a batch-`batch` bundle."""
    return entry if rows == batch else f"{entry}_rows{rows}"


def takes_position_shape(batch: int) -> bool:
    """Whether decode takes pos_shape (one-row functions), else n_valid (batched ones).

    A batched step's rows sit at different positions, so its cache writes take
    the general form and read no host position; IREE drops an input that nothing
    reads, and the entry point's signature would not match the manifest. Its
    rows take n_valid instead: 0 leaves a row's state as it is.
    """
    return batch == 1


def position_shape(position: int) -> np.ndarray:
    """decode's pos_shape input at `position`: no data, the position is its second dimension."""
    return np.empty((0, position), np.int8)


def kv_tile_size(slots: int) -> int:
    """Slots per tile of a full cache of `slots` slots: 64, or the largest power of two dividing `slots`.

    Prefill's attention reads a whole number of tiles (`kv_tiles`). A static tile
    size under the dynamic tile count lets IREE's CPU codegen keep its static
    tiles: the reads then cost what a static length does (docs/architecture.md).
    """
    tile = KV_TILE
    while slots % tile:
        tile //= 2
    return tile


def kv_tile_count(end: int, slots: int) -> int:
    """The tiles prefill's attention reads for a chunk whose last position is below `end`."""
    tile = kv_tile_size(slots)
    return min(max(1, -(-end // tile)), slots // tile)


def kv_tiles_input(end: int, slots: int) -> np.ndarray:
    """prefill's kv_tiles input: no data, the tile count is its second dimension."""
    return np.empty((0, kv_tile_count(end, slots)), np.int8)


def decode_inputs(tokens: np.ndarray, pos: np.ndarray, n_valid: np.ndarray) -> list[np.ndarray]:
    """decode's inputs before the state: tokens, pos and, for one row, pos_shape, else n_valid."""
    if takes_position_shape(tokens.shape[0]):
        return [tokens, pos, position_shape(int(pos[0]))]
    return [tokens, pos, n_valid]


def declared_inputs(declaration: str) -> list[tuple[list[int], str]]:
    """(shape, dtype) of each tensor input of an entry point's `iree.abi.declaration`, in order.

    The declaration reads `sync func @decode(%input0: tensor<1x1xi64>, ...) -> (...)`;
    only its inputs are parsed, never its outputs. A dynamic dimension reads as DYNAMIC.
    """
    head = declaration.split(") -> ", 1)[0]
    out = []
    for _index, spec in _INPUT_RE.findall(head):
        *dims, elem = spec.split("x")
        shape = [int(d) if d.isdigit() else DYNAMIC for d in dims if d.isdigit() or d == "?"]
        out.append((shape, MLIR_DTYPES.get(elem, elem)))
    return out
