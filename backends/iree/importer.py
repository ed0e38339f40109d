"""ExportedProgram -> MLIR (torch dialect), with weights as named external parameters.

Uses IREE's bundled torch-mlir FX importer. Every entry point is imported into
one module; weights larger than a few elements become
`util.global @name = #flow.parameter.named<"model"::"name">`, shared by all
entry points, and are written to an IREE parameter archive (.irpa) instead of
being inlined into the vmfb. State buffers stay function arguments mutated in
place (`torch.overwrite.tensor.contents`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
from iree.compiler import ir
from iree.compiler.extras.fx_importer import FxImporter, FxImporterHooks
from torch.export import ExportedProgram

from ...frontend.deferred_weights import materialize
from ...frontend.types import MLIR_ELEMENTS
from ...kernels.attention import covers, kernel_writes
from ...passes.manager import TargetPasses
from ...passes.place_devices import COPY_SUFFIX
from ..lowering import DECODE_ATTENTION_OPS, DECODE_WRITE_OPS, KeepRule, Lowering, is_decode_entry

PARAM_SCOPE = "model"
INLINE_LIMIT = 64  # tensors with at most this many elements stay inline constants



def parameter_key(global_name: str) -> str:
    """The archive entry a weight's util.global reads: a weight's copy on another device reads its original's."""
    return global_name.split(COPY_SUFFIX)[0]


def named_parameter(scope: str, key: str, tensor_type: str) -> ir.Attribute:
    """`#flow.parameter.named<"scope"::"key">`, a util.global's initial value read from a parameter archive."""
    return ir.Attribute.parse(f'#flow.parameter.named<"{scope}"::"{key}"> : {tensor_type}')


@dataclass
class ExternalParams:
    """Weights lifted out of the program, by parameter name."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)  # util.global name -> the parameter it reads

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class _ParameterHooks(FxImporterHooks):
    """Turns large literals into util.globals backed by named parameters."""

    def __init__(self, module: ir.Module, params: ExternalParams, externalize: bool):
        self.module = module
        self.params = params
        self.externalize = externalize
        self.by_identity: dict[tuple[int, str | None], str] = {}
        self.globals: set[str] = set()

    def resolve_literal(self, gni, literal, info):
        if not self.externalize or not isinstance(literal, torch.Tensor):
            return None
        if literal.numel() <= INLINE_LIMIT or literal.dtype not in MLIR_ELEMENTS:
            return None
        name = self._name_for(literal, info)
        key = parameter_key(name)
        shape = "x".join(str(d) for d in literal.shape)
        tensor_type = f"tensor<{shape}x{MLIR_ELEMENTS[literal.dtype]}>"
        if name not in self.globals:
            self.globals.add(name)
            self.params.keys[name] = key
            if key not in self.params.tensors:
                self.params.tensors[key] = materialize(literal).detach().contiguous()
            op = ir.Operation.parse(
                f'util.global private @"{name}" = #flow.parameter.named<"{PARAM_SCOPE}"::"{key}"> : {tensor_type}'
            )
            ir.InsertionPoint.at_block_begin(self.module.body).insert(op)
        loaded = ir.Operation.create(
            "util.global.load",
            results=[ir.Type.parse(tensor_type)],
            attributes={"global": ir.FlatSymbolRefAttr.get(name)},
        ).result
        return ir.Operation.create(
            "torch_c.from_builtin_tensor",
            results=[gni._cc.tensor_to_vtensor_type(literal)],
            operands=[loaded],
        ).result

    def _name_for(self, literal: torch.Tensor, info) -> str:
        target = info.input_spec.target if info is not None and info.input_spec.target else None
        # One tensor may be lifted under two targets: a weight and its copy on another device.
        key = (id(literal), target if target is not None and COPY_SUFFIX in target else None)
        if key in self.by_identity:
            return self.by_identity[key]
        name = target if target is not None else f"constant_{len(self.by_identity)}"
        if name.startswith("model."):
            name = name[len("model.") :]
        if name in self.globals:  # another tensor under the same target
            name = f"{name}_{len(self.by_identity)}"
        self.by_identity[key] = name
        return name


def kernel_keep_rule(decode_attention_kernel: bool) -> KeepRule:
    """Which nodes stay ops: a decode entry point's attention, where the CPU kernel covers the shape, and
    the step's two cache writes it reads, where the kernel makes them too (kernels/attention.kernel_writes)."""
    def keep(name: str, node: torch.fx.Node) -> bool:
        if not (decode_attention_kernel and is_decode_entry(name)):
            return False
        if node.target in DECODE_ATTENTION_OPS:
            return covers(node)
        if node.target in DECODE_WRITE_OPS:
            return any(node in (kernel_writes(user) or ()) for user in node.users
                       if user.target in DECODE_ATTENTION_OPS)
        return False
    return keep


def import_programs(
    programs: Iterable[tuple[str, ExportedProgram]], externalize_params: bool = True,
    decode_attention_kernel: bool = False, lowering: Lowering | None = None,
    progress: Callable[[str], None] | None = None, target_passes: TargetPasses | None = None,
) -> tuple[str, ExternalParams]:
    """Lower named programs to core aten and import them into one MLIR module; returns (MLIR text, lifted weights).

    decode_attention_kernel: decode entry points keep their attention ops for
    kernels/attention.expand_decode_attention_ops (CPU targets only).
    lowering: shares its decomposition traces between imports (one per kind of target).
    target_passes: run on each lowered entry point before its import (a fused lowering's
    `fused-attention`, which makes the op the importer knows).
    """
    lowering = Lowering() if lowering is None else lowering
    keep = kernel_keep_rule(decode_attention_kernel)
    context = ir.Context()
    module = ir.Module.create(ir.Location.unknown(context))
    params = ExternalParams()
    hooks = _ParameterHooks(module, params, externalize_params)
    importer = FxImporter(module=module, config_check=False, hooks=hooks)
    for name, program in programs:
        lowered = lowering.program(name, program, keep)
        if target_passes is not None:
            lowered = target_passes.run(name, lowered)
        importer.import_program(lowered, func_name=name)
        if progress is not None:
            progress(name)
    return str(module), params


def params_to_numpy(t: torch.Tensor) -> np.ndarray:
    """Raw bytes of a tensor as a flat uint8 array (bf16 has no numpy dtype)."""
    return t.detach().contiguous().view(torch.uint8).reshape(-1).numpy()
