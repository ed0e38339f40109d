"""Float weights of a block-quantized checkpoint, made only when something reads them.

`foldline compile` keeps a GGUF's own blocks (the quantize-weights pass) and
never reads the float32 dequantization of those weights, which is most of a
model's memory (Gemma 3 270M: 1.07 GB of floats beside 0.28 GB of blocks).
A model loaded for compiling therefore holds, for each such weight, an
uninitialised tensor of the right shape (`defer`): torch.export traces it
without reading it, and its pages are never touched, so it costs no resident
memory. Whatever does need the values (a pass that folds a rotation into a
weight, the importer writing a weight that stayed float) calls `materialize`,
which dequantizes the blocks into the tensor first.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_BLOCKS = "_foldline_deferred_blocks"


def defer(shape: tuple[int, ...], blocks: Any, dtype: torch.dtype = torch.float32) -> nn.Parameter:
    """A parameter of `shape` whose values are `blocks.dequantize()`, made on first `materialize`."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    setattr(param, _BLOCKS, blocks)
    return param


def is_deferred(tensor: torch.Tensor) -> bool:
    return getattr(tensor, _BLOCKS, None) is not None


def blocks_of(tensor: torch.Tensor) -> Any:
    """The blocks a deferred tensor's values come from, or None when its values are made."""
    return getattr(tensor, _BLOCKS, None)


def mark_deferred(tensor: torch.Tensor, blocks: Any) -> None:
    """Declare `tensor`'s values unmade again (its data was swapped back to an unwritten one)."""
    setattr(tensor, _BLOCKS, blocks)


def materialize(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor with its values in place (dequantized now if they were deferred); returns it."""
    blocks = getattr(tensor, _BLOCKS, None)
    if blocks is not None:
        with torch.no_grad():
            tensor.data.copy_(torch.from_numpy(blocks.dequantize()).to(tensor.dtype))
        setattr(tensor, _BLOCKS, None)
    return tensor


def materialize_module(module: nn.Module) -> int:
    """Materialize every deferred parameter of `module` (before running it eagerly); returns how many."""
    deferred = [p for p in module.parameters() if is_deferred(p)]
    for p in deferred:
        materialize(p)
    return len(deferred)
