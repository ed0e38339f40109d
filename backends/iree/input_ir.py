"""The text of an input-level module edited between iree-compile's two steps.

`build.compile_torch_module` stops iree-compile at the `input` phase, edits
that module through IREE's MLIR bindings (inplace_state, abi_declaration) and
compiles on from the edited text. The text keeps the module's locations, as
iree-compile printed them, so an edit loses no debug information.
"""

from __future__ import annotations

from iree.compiler import ir


def module_text(module: ir.Module) -> str:
    """`module` verified (an edit that broke it fails here, naming the op) and printed with its locations."""
    module.operation.verify()
    return module.operation.get_asm(enable_debug_info=True, assume_verified=True)
