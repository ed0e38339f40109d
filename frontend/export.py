"""torch.export of the two entry points of a bundle: `prefill` and `decode`.

Both call the same chunk forward; they differ only in the static chunk length
(C for prefill, 1 for decode). State buffers are arguments that the program
mutates in place: after functionalisation torch.export records them as
USER_INPUT_MUTATION outputs, which the MLIR importer turns into in-place
writes into the caller's buffers.

Each entry point is traced once, straight to the functional ATen graph the
passes read (`_export` with dispatch-level tracing). The public two-step route,
`torch.export.export` then `run_decompositions({})`, traces the model twice for
the same graph (docs/benchmarks.md, "Compile time"); `aten.linear` is kept as one
op, as `run_decompositions` keeps it, because the passes anchor on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.export import ExportedProgram
from torch.export._trace import _export
from torch.export.exported_program import (
    _override_composite_implicit_decomp,
    _special_op_to_preserve_cia,
)

from ..contract.entry_points import kv_tile_size, takes_position_shape
from ..contract.state import StateBuffer
from .model import CausalLM, new_state

ENTRY_POINTS = ("prefill", "decode")
STEP = "step"  # an ONNX Runtime GenAI model's one function (export_step)
# The attribute under which each entry point holds the CausalLM: its parameters are
# lifted as "model.<parameter name>".
MODEL_ATTR = "model"
POSITION_SHAPE_DTYPE = torch.int8
# Composite ops the traced graph keeps whole (the passes match them), as run_decompositions({}) would.
PRESERVED_COMPOSITES = (torch.ops.aten.linear.default,)


def parameter_target(param_name: str) -> str:
    """The lifted-parameter name of a CausalLM parameter in an exported entry point."""
    return f"{MODEL_ATTR}.{param_name}"


@dataclass
class EntryPoint:
    """One exported entry point and the static shapes it was traced with."""

    name: str
    program: ExportedProgram
    batch: int
    chunk: int
    state_specs: list[StateBuffer]


class _ChunkEntry(nn.Module):
    """Wraps the model so state buffers are plain positional arguments."""

    def __init__(self, model: CausalLM, n_state: int):
        super().__init__()
        setattr(self, MODEL_ATTR, model)
        self.n_state = n_state

    def forward(self, tokens, start_pos, n_valid, *state):
        return self.model(tokens, start_pos, n_valid, *state)


class _PrefillEntry(_ChunkEntry):
    """prefill(tokens[B,C], start_pos[B], n_valid[B], kv_tiles[0, T], state...).

    `kv_tiles` holds no data: its second dimension T says how many tiles of the
    full caches the chunk's attention reads (contract.entry_points.kv_tile_count), so
    the work follows the tokens held, not the cache size, from one function.
    """

    def forward(self, tokens, start_pos, n_valid, kv_tiles, *state):
        return self.model(tokens, start_pos, n_valid, *state, kv_tiles=kv_tiles.shape[1])


class _DecodeEntry(_ChunkEntry):
    """decode(tokens[1,1], pos[1], pos_shape[0, pos[0]], state...): one token of one row.

    `pos_shape` is an empty tensor whose second dimension is the position: a
    dynamic dimension reaches the compiled module as host metadata, so the cache
    writes take their slot from it with no read of device memory (reading `pos`
    itself would make each step wait for a transfer).
    """

    def forward(self, tokens, pos, pos_shape, *state):
        return self.model(tokens, pos, torch.ones_like(pos), *state, host_pos=pos_shape.shape[1])


class _BatchDecodeEntry(_ChunkEntry):
    """decode(tokens[B,1], pos[B], n_valid[B], state...) for B > 1: rows at different positions, no host
    position; a row given n_valid 0 keeps its state, so one call decodes the rows that generate while
    another row's prompt waits for its own call."""


class _StepEntry(_ChunkEntry):
    """step(tokens[1, S], start_pos[1], n_valid[1], state...) -> logits[1, S, V]: any number of tokens of
    one row, every position's logits. The one function of an ONNX Runtime GenAI model
    (backends/onnx/genai.py), which feeds a whole prompt, then one token a call."""

    def forward(self, tokens, start_pos, n_valid, *state):
        return self.model(tokens, start_pos, n_valid, *state, all_logits=True)


def position_shape(position: int) -> torch.Tensor:
    """decode's `pos_shape` input for row 0 at `position`: no data, the position is its shape."""
    return torch.empty((0, position), dtype=POSITION_SHAPE_DTYPE)


def kv_tiles_shape(tiles: int) -> torch.Tensor:
    """prefill's `kv_tiles` input reading `tiles` tiles: no data, the count is its shape."""
    return torch.empty((0, tiles), dtype=POSITION_SHAPE_DTYPE)


def _max_tiles(model: CausalLM) -> int:
    return model.cfg.max_context // kv_tile_size(model.cfg.max_context)


def example_inputs(model: CausalLM, name: str, batch: int, chunk: int) -> tuple:
    specs = model.state_specs(batch)
    state = new_state(model.cfg, batch, specs)
    tokens = torch.zeros((batch, chunk if name == "prefill" else 1), dtype=torch.int64)
    pos = torch.zeros((batch,), dtype=torch.int64)
    if name == "prefill":
        # torch.export specialises a dynamic dimension traced at size 0 or 1: trace at 2 where it varies.
        tiles = min(2, _max_tiles(model))
        return (tokens, pos, torch.full((batch,), chunk, dtype=torch.int64), kv_tiles_shape(tiles), *state)
    if not takes_position_shape(batch):
        return (tokens, pos, torch.ones((batch,), dtype=torch.int64), *state)
    # torch.export specialises a dynamic dimension traced at size 0 or 1, and so does a decomposition
    # the tile count it implies (position // tile + 1): trace at the second tile where there is one.
    tile = kv_tile_size(model.cfg.max_context)  # 1 for an odd context: trace at 2 then
    return (tokens, pos, position_shape(tile if model.cfg.max_context > tile > 1 else 2), *state)


def _dynamic_shapes(model: CausalLM, name: str, batch: int, n_args: int) -> tuple | None:
    """prefill's kv_tiles and one-row decode's pos_shape have a dynamic second dimension; all else is static.

    A cache of one tile keeps kv_tiles static ([0, 1]): a dimension cannot vary over one value.
    """
    if name == "prefill":
        tiles = _max_tiles(model)
        if tiles < 2:
            return None
        return (None, None, None, {1: torch.export.Dim("kv_tiles", min=1, max=tiles)}, (None,) * (n_args - 4))
    if not takes_position_shape(batch):
        return None
    position = torch.export.Dim("position", min=0, max=model.cfg.max_context - 1)
    return (None, None, {1: position}, (None,) * (n_args - 3))  # *state is one argument, a tuple


def export_entry_point(model: CausalLM, name: str, batch: int = 1, chunk: int = 16) -> EntryPoint:
    """Trace one entry point and functionalise it (custom foldline ops are kept)."""
    if name not in ENTRY_POINTS:
        raise ValueError(f"unknown entry point {name!r}; expected one of {ENTRY_POINTS}")
    specs = model.state_specs(batch)
    if name == "prefill":
        wrapper_cls = _PrefillEntry
    else:
        wrapper_cls = _DecodeEntry if takes_position_shape(batch) else _BatchDecodeEntry
    wrapper = wrapper_cls(model, len(specs)).eval()
    args = example_inputs(model, name, batch, chunk)
    dynamic = _dynamic_shapes(model, name, batch, len(args))
    # Traced at dispatch level and functionalised in one go: in-place state writes become
    # USER_INPUT_MUTATION outputs, and our custom ops survive for the passes.
    with torch.no_grad(), _override_composite_implicit_decomp(
            {op: _special_op_to_preserve_cia for op in PRESERVED_COMPOSITES}):
        program = _export(wrapper, args, dynamic_shapes=dynamic, strict=False, pre_dispatch=False)
    return EntryPoint(name, program, batch, chunk if name == "prefill" else 1, specs)


def export_step(model: CausalLM) -> EntryPoint:
    """The `step` function (_StepEntry), its token count a dynamic dimension up to the context."""
    specs = model.state_specs(1)
    wrapper = _StepEntry(model, len(specs)).eval()
    # torch.export specialises a dynamic dimension traced at size 0 or 1: trace at 2.
    traced = min(2, model.cfg.max_context)
    args = (torch.zeros((1, traced), dtype=torch.int64), torch.zeros((1,), dtype=torch.int64),
            torch.full((1,), traced, dtype=torch.int64), *new_state(model.cfg, 1, specs))
    tokens = torch.export.Dim("sequence", min=1, max=model.cfg.max_context)
    dynamic = ({1: tokens}, None, None, (None,) * len(specs))
    with torch.no_grad(), _override_composite_implicit_decomp(
            {op: _special_op_to_preserve_cia for op in PRESERVED_COMPOSITES}):
        program = _export(wrapper, args, dynamic_shapes=dynamic, strict=False, pre_dispatch=False)
    return EntryPoint(STEP, program, 1, model.cfg.max_context, specs)


def export_model(model: CausalLM, batch: int = 1, chunk: int = 16) -> dict[str, EntryPoint]:
    return {name: export_entry_point(model, name, batch, chunk) for name in ENTRY_POINTS}
