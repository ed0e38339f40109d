"""ExportedProgram -> MLIR (torch dialect), with weights as named external parameters.

Uses IREE's bundled torch-mlir FX importer. Every entry point is imported into
one module; weights larger than a few elements become
`util.global @name = #flow.parameter.named<"model"::"name">`, shared by all
entry points, and are written to an IREE parameter archive (.irpa) instead of
being inlined into the vmfb. State buffers stay function arguments mutated in
place (`torch.overwrite.tensor.contents`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
from iree.compiler import ir
from iree.compiler.extras.fx_importer import FxImporter, FxImporterHooks
from torch.export import ExportedProgram

from ..dtypes import DTYPES
from ..frontend import quant  # noqa: F401  (registers foldline::qlinear)
from ..frontend.ops import DECOMPOSITIONS

PARAM_SCOPE = "model"
INLINE_LIMIT = 64  # tensors with at most this many elements stay inline constants

_MLIR_ELEMENT = {getattr(torch, d.name): d.mlir for d in DTYPES.values()}


@dataclass
class ExternalParams:
    """Weights lifted out of the program, by parameter name."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class _ParameterHooks(FxImporterHooks):
    """Turns large literals into util.globals backed by named parameters."""

    def __init__(self, module: ir.Module, params: ExternalParams, externalize: bool):
        self.module = module
        self.params = params
        self.externalize = externalize
        self.by_identity: dict[int, str] = {}

    def resolve_literal(self, gni, literal, info):
        if not self.externalize or not isinstance(literal, torch.Tensor):
            return None
        if literal.numel() <= INLINE_LIMIT or literal.dtype not in _MLIR_ELEMENT:
            return None
        name = self._name_for(literal, info)
        shape = "x".join(str(d) for d in literal.shape)
        tensor_type = f"tensor<{shape}x{_MLIR_ELEMENT[literal.dtype]}>"
        if name not in self.params.tensors:
            self.params.tensors[name] = literal.detach().contiguous()
            op = ir.Operation.parse(
                f'util.global private @"{name}" = #flow.parameter.named<"{PARAM_SCOPE}"::"{name}"> : {tensor_type}'
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
        key = id(literal)
        if key in self.by_identity:
            return self.by_identity[key]
        if info is not None and info.input_spec.target:
            name = info.input_spec.target
        else:
            name = f"constant_{len(self.by_identity)}"
        if name.startswith("model."):
            name = name[len("model.") :]
        if name in self.params.tensors and self.params.tensors[name] is not literal:
            name = f"{name}_{len(self.by_identity)}"
        self.by_identity[key] = name
        return name


# Custom ops that reach MLIR as `torch.operator` for a backend rewrite instead of being decomposed
# (backends/quant_kernels.py lowers foldline::qlinear to a fused dequantize-matmul kernel).
KEPT_OPS = (torch.ops.foldline.qlinear.default,)
# Kept in decode entry points (`decode`, `decode_<L>`) for targets with a hand-written decode
# attention kernel (backends/attention_kernels.py); every other program decomposes them.
DECODE_ATTENTION_OPS = (torch.ops.foldline.cache_attention.default, torch.ops.foldline.ring_decode_attention.default)


def lower_to_aten(program: ExportedProgram, keep: tuple = ()) -> ExportedProgram:
    """Decompose foldline custom ops (and everything else) to core aten for import, but KEPT_OPS and `keep`."""
    table = torch.export.default_decompositions()
    table.update(DECOMPOSITIONS)
    for op in (*KEPT_OPS, *keep):
        table.pop(op, None)
    return program.run_decompositions(table)


def is_decode_entry(name: str) -> bool:
    return name == "decode" or name.startswith("decode_")


def import_programs(
    programs: Iterable[tuple[str, ExportedProgram]], externalize_params: bool = True,
    decode_attention_kernel: bool = False,
) -> tuple[str, ExternalParams]:
    """Import named programs into one MLIR module; returns (MLIR text, lifted weights).

    decode_attention_kernel: decode entry points keep their attention ops for
    backends/attention_kernels.expand_decode_attention_ops (CPU targets only).
    """
    context = ir.Context()
    module = ir.Module.create(ir.Location.unknown(context))
    params = ExternalParams()
    hooks = _ParameterHooks(module, params, externalize_params)
    importer = FxImporter(module=module, config_check=False, hooks=hooks)
    for name, program in programs:
        keep = DECODE_ATTENTION_OPS if decode_attention_kernel and is_decode_entry(name) else ()
        importer.import_program(lower_to_aten(program, keep), func_name=name)
    return str(module), params


def params_to_numpy(t: torch.Tensor) -> np.ndarray:
    """Raw bytes of a tensor as a flat uint8 array (bf16 has no numpy dtype)."""
    return t.detach().contiguous().view(torch.uint8).reshape(-1).numpy()
