"""torch.export of the two entry points of a bundle: `prefill` and `decode`.

Both call the same chunk forward; they differ only in the static chunk length
(C for prefill, 1 for decode). State buffers are arguments that the program
mutates in place: after functionalisation torch.export records them as
USER_INPUT_MUTATION outputs, which the MLIR importer turns into in-place
writes into the caller's buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.export import ExportedProgram

from ..runtime.bundle import takes_position_shape
from .model import CausalLM, StateSpec, new_state

ENTRY_POINTS = ("prefill", "decode")
# The attribute under which each entry point holds the CausalLM: its parameters are
# lifted as "model.<parameter name>".
MODEL_ATTR = "model"
POSITION_SHAPE_DTYPE = torch.int8
MAX_POSITION = 1 << 30  # bound of decode's dynamic position dimension (any real context is below)


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
    state_specs: list[StateSpec]


class _ChunkEntry(nn.Module):
    """Wraps the model so state buffers are plain positional arguments."""

    def __init__(self, model: CausalLM, n_state: int):
        super().__init__()
        setattr(self, MODEL_ATTR, model)
        self.n_state = n_state

    def forward(self, tokens, start_pos, n_valid, *state):
        return self.model(tokens, start_pos, n_valid, *state)


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
    """decode(tokens[B,1], pos[B], state...) for B > 1: rows at different positions, no host position."""

    def forward(self, tokens, pos, *state):
        return self.model(tokens, pos, torch.ones_like(pos), *state)


def position_shape(position: int) -> torch.Tensor:
    """decode's `pos_shape` input for row 0 at `position`: no data, the position is its shape."""
    return torch.empty((0, position), dtype=POSITION_SHAPE_DTYPE)


def example_inputs(model: CausalLM, name: str, batch: int, chunk: int) -> tuple:
    specs = model.state_specs(batch)
    state = new_state(model.cfg, batch, specs)
    tokens = torch.zeros((batch, chunk if name == "prefill" else 1), dtype=torch.int64)
    pos = torch.zeros((batch,), dtype=torch.int64)
    if name == "prefill":
        return (tokens, pos, torch.full((batch,), chunk, dtype=torch.int64), *state)
    if not takes_position_shape(batch):
        return (tokens, pos, *state)
    # torch.export specialises a dynamic dimension traced at size 0 or 1: trace at 2.
    return (tokens, pos, position_shape(2), *state)


def _dynamic_shapes(name: str, batch: int, n_args: int) -> tuple | None:
    """One-row decode's pos_shape has a dynamic second dimension (the position); all else is static."""
    if name == "prefill" or not takes_position_shape(batch):
        return None
    position = torch.export.Dim("position", min=0, max=MAX_POSITION)
    return (None, None, {1: position}, (None,) * (n_args - 3))  # *state is one argument, a tuple


def export_entry_point(model: CausalLM, name: str, batch: int = 1, chunk: int = 16) -> EntryPoint:
    """Trace one entry point and functionalise it (custom foldline ops are kept)."""
    if name not in ENTRY_POINTS:
        raise ValueError(f"unknown entry point {name!r}; expected one of {ENTRY_POINTS}")
    specs = model.state_specs(batch)
    if name == "prefill":
        wrapper_cls = _ChunkEntry
    else:
        wrapper_cls = _DecodeEntry if takes_position_shape(batch) else _BatchDecodeEntry
    wrapper = wrapper_cls(model, len(specs)).eval()
    args = example_inputs(model, name, batch, chunk)
    with torch.no_grad():
        program = torch.export.export(wrapper, args, dynamic_shapes=_dynamic_shapes(name, batch, len(args)), strict=False)
    # An empty table only functionalises: in-place state writes become
    # USER_INPUT_MUTATION outputs, and our custom ops survive for the passes.
    program = program.run_decompositions(decomp_table={})
    return EntryPoint(name, program, batch, chunk if name == "prefill" else 1, specs)


def export_model(model: CausalLM, batch: int = 1, chunk: int = 16) -> dict[str, EntryPoint]:
    return {name: export_entry_point(model, name, batch, chunk) for name in ENTRY_POINTS}
