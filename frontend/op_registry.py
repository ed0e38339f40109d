"""The `foldline::` custom ops' one place of declaration, and their aten decompositions.

A custom op is declared once, from its eager kernel: the schema is read from
the kernel's signature, the kernel is the op's eager body and the
decomposition applied before MLIR import (`DECOMPOSITIONS`), and the returned
handle (an `OpOverload`) is what the reference modules call and what passes
and backends match graph nodes against. Nothing else spells an op's name or
signature again.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

NAMESPACE = "foldline"

# Custom op -> aten implementation, for `ExportedProgram.run_decompositions`.
DECOMPOSITIONS: dict[torch._ops.OpOverload, Callable[..., Any]] = {}


def shaped_like(impl: Callable[..., Any], *arguments: str) -> Callable[..., Any]:
    """A fake (shape-only) kernel whose outputs are empty tensors shaped like `impl`'s named arguments."""
    signature = inspect.signature(impl)

    def fake(*args: Any, **kwargs: Any) -> Tensor | tuple[Tensor, ...]:
        bound = signature.bind(*args, **kwargs).arguments
        outputs = tuple(bound[name].new_empty(bound[name].shape) for name in arguments)
        return outputs[0] if len(outputs) == 1 else outputs

    return fake


def declare_op(name: str, impl: Callable[..., Any], fake: Callable[..., Any] | Sequence[str],
               decompose: bool = True) -> torch._ops.OpOverload:
    """Declares `foldline::<name>` with `impl` (type-hinted, functional) as its kernel; returns its handle.

    `fake`: export's shape-only kernel, or the names of the arguments the outputs are shaped
    like. `decompose`: whether IREE lowering replaces the op by `impl` (a backend that keeps
    the op as its own node, as ONNX does for GroupQueryAttention, declares it with False).
    """
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", impl, mutates_args=())
    op.register_fake(fake if callable(fake) else shaped_like(impl, *fake))
    handle = getattr(getattr(torch.ops, NAMESPACE), name).default
    if decompose:
        DECOMPOSITIONS[handle] = impl
    return handle
