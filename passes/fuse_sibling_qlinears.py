"""fuse-sibling-qlinears: quantized projections that read the same activation become one.

Attention's q, k and v projections read the same normed hidden state, and so do
an MLP's gate and up projections. As separate `foldline::qlinear` calls each is
its own decode dispatch (plus the small one that adds its lanes), and a
projection with few rows (a 192-row k or v) leaves cores idle. This pass
concatenates the blocks of such siblings along N into one weight, so one call
computes them all, and slices its output back:

    q = qlinear(x, Wq); k = qlinear(x, Wk); v = qlinear(x, Wv)
      ->  qkv = qlinear(x, [Wq; Wk; Wv]);  q, k, v = qkv[..., :Nq], qkv[..., Nq:Nq+Nk], ...

Each output element still reads only its own row of codes, so the result is
the same computation; the bundle holds the concatenated blocks in place of the
separate ones (the same bytes). Siblings fuse only when their blocks share a
format, group, scale dtype and min layout (a GGUF may mix Q4_K and Q6_K in one
layer); the rest stay as they are. In a tensor-parallel program, only siblings of one part fuse: the parts
run on different devices. Runs after quantize-weights.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import Node
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from ..frontend.quant import QLINEAR
from .graph_edit import LiftedInputs, copy_graph_module, remove_dead_code
from .place_devices import node_part
from .registry import CompileUnit, PassResult, register_pass

NAME = "fuse-sibling-qlinears"
PARTS = ("codes", "scales", "mins")


def _part_values(lifted: LiftedInputs, node: Node) -> list[torch.Tensor | None] | None:
    """The lifted codes / scales / mins tensors of a qlinear, or None if any is not a plain parameter."""
    values: list[torch.Tensor | None] = []
    for arg in node.args[1:4]:
        if arg is None:
            values.append(None)
            continue
        spec = lifted.spec_of(arg) if isinstance(arg, Node) else None
        if spec is None or spec.kind != InputKind.PARAMETER:
            return None
        values.append(lifted.value_of(spec))
    return values


def _signature(node: Node, values: list[torch.Tensor | None]) -> tuple:
    """What must agree for two qlinears to share one weight: format, group, K, part dtypes, min presence."""
    codes, scales, mins = values
    return (node.args[4], node.args[5], codes.shape[1], codes.dtype, scales.dtype,
            None if mins is None else mins.dtype)


def _fused_target(lifted: LiftedInputs, node: Node) -> str:
    spec = lifted.spec_of(node.args[1])
    return spec.target.rsplit(".", 2)[0]  # "<layer>.<proj>.weight.codes" -> "<layer>.<proj>"


def _widened(val: torch.Tensor, rows: int) -> torch.Tensor:
    """The fused call's value: a sibling's, with `rows` output features (its slices keep the siblings' values,
    so the graph needs no new propagation)."""
    with val.fake_mode:
        return torch.empty((*val.shape[:-1], rows), dtype=val.dtype)


class _Fuser:
    def __init__(self):
        # One Parameter per fused array, shared by every entry point (the importer writes it once).
        self.tensors: dict[str, torch.nn.Parameter] = {}
        self.groups: dict[str, list[str]] = {}

    def run(self, program: ExportedProgram) -> tuple[ExportedProgram, int]:
        gm = copy_graph_module(program)
        lifted = LiftedInputs(program)
        by_input: dict[tuple, list[tuple[Node, list]]] = defaultdict(list)
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target == QLINEAR and isinstance(node.args[0], Node):
                values = _part_values(lifted, node)
                if values is not None:
                    by_input[(node.args[0], _signature(node, values), node_part(node))].append((node, values))
        fused = 0
        for (x, _, _), members in by_input.items():
            if len(members) < 2:
                continue
            self._fuse(gm, lifted, x, members)
            fused += 1
        if not fused:
            return program, 0
        remove_dead_code(gm)
        lifted.drop_unused(gm)  # the separate blocks nothing reads any more
        return lifted.rebuild_with(gm), fused

    def _fuse(self, gm, lifted: LiftedInputs, x: Node, members: list[tuple[Node, list]]) -> None:
        nodes = [m[0] for m in members]
        first = nodes[0]
        names = [_fused_target(lifted, n) for n in nodes]
        target = "+".join(names)
        self.groups[target] = names
        parts = []
        for i, part in enumerate(PARTS):
            arrays = [m[1][i] for m in members]
            if arrays[0] is None:
                parts.append(None)
                continue
            name = f"{target}.{part}"
            if name not in self.tensors:
                self.tensors[name] = torch.nn.Parameter(torch.cat([a.detach() for a in arrays], dim=0),
                                                        requires_grad=False)
            parts.append(lifted.add_beside(gm, first.args[1 + i], name, self.tensors[name], suffix=f"_fused_{part}"))
        with gm.graph.inserting_before(first):
            whole = gm.graph.call_function(QLINEAR, (x, *parts, first.args[4], first.args[5]))
            whole.meta = dict(first.meta)
            whole.meta["val"] = _widened(first.meta["val"], sum(values[0].shape[0] for _, values in members))
            if "tensor_meta" in whole.meta:
                whole.meta["tensor_meta"] = _extract_tensor_metadata(whole.meta["val"])
            start = 0
            for node, values in members:
                rows = values[0].shape[0]
                piece = gm.graph.call_function(torch.ops.aten.slice.Tensor, (whole, -1, start, start + rows))
                piece.meta = dict(node.meta)
                node.replace_all_uses_with(piece)
                start += rows
        for node in nodes:
            gm.graph.erase_node(node)


@register_pass(NAME, "quantized projections reading the same activation (q/k/v, gate/up) become one matmul")
def fuse_sibling_qlinears(unit: CompileUnit) -> PassResult:
    fuser = _Fuser()
    total = 0
    for name, program in list(unit.programs.items()):
        unit.programs[name], fused = fuser.run(program)
        total = max(total, fused)
    notes = [f"{len(fuser.groups)} group(s) of sibling projections fused"]
    return PassResult(changed=total > 0, sites=total, notes=notes,
                      details={"groups": {t: names for t, names in sorted(fuser.groups.items())}})
