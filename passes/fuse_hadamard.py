"""fuse-hadamard: fold activation rotations into float weights, or keep them online and shared.

The frontend emits `foldline::hadamard_rotate(x, signs, block, hd, rep)` before
each linear whose weight is stored rotated, and
`foldline::hadamard_unrotate(embedding(Z, ids), signs, block)` for a rotated table.

fold (default): for a linear reading a float lifted weight W_s,
`linear(rotate(x), W_s)` becomes `linear(x, W_s H D P)`, and
`unrotate(embedding(Z))` becomes `embedding(Z H D)`. New weights are computed
in float64 and rounded once; one folded copy is shared by every reader of the
same (weight, rotation) in every entry point, so a tied table stays one table.
No online transform remains.

online: rotations stay in the graph (what a quantized weight needs). Rotation
nodes with the same input, signs, block and permutation are merged into one, so
q/k/v (or gate/up) rotate their shared input once. They lower through the
op's decomposition: a log2(block)-stage butterfly of adds and subtracts, never
a dense n x n matmul.

The mode is the CompileUnit option "hadamard" (`foldline compile --hadamard`),
else $FOLDLINE_HADAMARD_MODE, else "fold". Both modes are idempotent.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule, Node

from ..errors import FoldlineError
from ..frontend import hadamard
from ..frontend.hadamard.transform import HADAMARD_ROTATE, HADAMARD_UNROTATE
from .graph_edit import ASSERT_OPS, LiftedInputs, copy_graph_module, remove_dead_code
from .registry import CompileUnit, PassResult, register_pass

NAME = "fuse-hadamard"
MODES = ("fold", "online")
ENV_MODE = "FOLDLINE_HADAMARD_MODE"

ROTATE = HADAMARD_ROTATE
UNROTATE = HADAMARD_UNROTATE
LINEAR = torch.ops.aten.linear.default
EMBEDDING = torch.ops.aten.embedding.default
FOLDABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class HadamardModeError(FoldlineError, ValueError):
    """An unknown fuse-hadamard mode."""


def hadamard_mode(unit: CompileUnit) -> str:
    """The mode for this compile: unit option, then environment, then fold."""
    options = getattr(unit, "options", None) or {}
    mode = options.get("hadamard") or os.environ.get(ENV_MODE) or "fold"
    if mode not in MODES:
        raise HadamardModeError(f"unknown Hadamard mode {mode!r}; expected one of {MODES}")
    return mode


@dataclass
class _Counts:
    folded: int = 0
    shared: int = 0
    online: int = 0
    notes: list[str] = field(default_factory=list)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().to(torch.float32).contiguous().numpy().tobytes()).hexdigest()[:16]


class _Fuser:
    """Rewrites every entry point, sharing folded weights between them."""

    def __init__(self, mode: str):
        self.mode = mode
        self.counts = _Counts()
        self.folded: dict[tuple, tuple[str, torch.Tensor]] = {}  # (weight target, rotation) -> new weight

    # -- helpers --------------------------------------------------------------
    def _rotation_key(self, lifted: LiftedInputs, node: Node) -> tuple | None:
        signs = lifted.weight_value(node.args[1])
        if signs is None:
            return None
        return (_digest(signs), *[int(a) for a in node.args[2:]])

    def _folded_weight(self, target: str, weight: torch.Tensor, signs: torch.Tensor, rot: tuple) -> tuple[str, torch.Tensor]:
        key = (target, rot)
        if key not in self.folded:
            block, hd, rep = rot[1:4]  # rot = (signs digest, block, perm_head_dim, perm_rep)
            taken = {n for n, _ in self.folded.values()}
            name = f"{target}_unrotated"
            while name in taken:
                name += "_"
            with torch.no_grad():
                folded = hadamard.fold_weight(weight.detach(), signs, block, hd, rep)
            self.folded[key] = (name, torch.nn.Parameter(folded, requires_grad=False))
        return self.folded[key]

    # -- the rewrite ----------------------------------------------------------
    def run(self, entry: str, program: ExportedProgram) -> ExportedProgram:
        gm = copy_graph_module(program)
        lifted = LiftedInputs(program)
        changed = self._share(gm, lifted)
        if self.mode == "fold":
            changed |= self._fold(entry, gm, lifted)
        self.counts.online += sum(1 for n in gm.graph.nodes if n.op == "call_function"
                                  and n.target in (ROTATE, UNROTATE) and n.users)
        if not changed:
            return program
        remove_dead_code(gm)
        lifted.drop_unused(gm)  # weights and sign vectors nothing reads any more
        return lifted.rebuild_with(gm)

    def _share(self, gm: GraphModule, lifted: LiftedInputs) -> bool:
        """One rotation per (activation, signs, block, permutation)."""
        first: dict[tuple, Node] = {}
        merged = 0
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.target != ROTATE:
                continue
            rot = self._rotation_key(lifted, node)
            if rot is None:
                continue
            key = (node.args[0], *rot)
            if key in first:
                node.replace_all_uses_with(first[key])
                gm.graph.erase_node(node)
                merged += 1
            else:
                first[key] = node
        self.counts.shared += merged
        return merged > 0

    def _fold(self, entry: str, gm: GraphModule, lifted: LiftedInputs) -> bool:
        folded = 0
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.target not in (ROTATE, UNROTATE):
                continue
            signs = lifted.weight_value(node.args[1])
            rot = self._rotation_key(lifted, node)
            if signs is None or rot is None:
                self.counts.notes.append(f"{entry}: {node.name} has signs that are not a compile-time constant; "
                                         "left online")
                continue
            if node.target == ROTATE:
                folded += self._fold_rotate(gm, lifted, node, signs, rot)
            else:
                folded += self._fold_unrotate(gm, lifted, node, signs, rot)
        self.counts.folded += folded
        return folded > 0

    def _foldable_weight(self, lifted: LiftedInputs, weight: object) -> torch.Tensor | None:
        value = lifted.weight_value(weight)
        if value is None or value.dtype not in FOLDABLE_DTYPES:
            return None
        return value

    def _fold_rotate(self, gm: GraphModule, lifted: LiftedInputs, node: Node, signs: torch.Tensor, rot: tuple) -> int:
        """linear(rotate(x), W_s, b) -> linear(x, W_s H D P, b) for each foldable reader."""
        count = 0
        for user in list(node.users):
            if user.target in ASSERT_OPS:
                continue
            if user.target != LINEAR or user.args[0] is not node:
                continue
            weight_node = user.args[1]
            weight = self._foldable_weight(lifted, weight_node)
            if weight is None:
                continue
            name, value = self._folded_weight(lifted.spec_of(weight_node).target, weight, signs, rot)
            new_w = lifted.add_beside(gm, weight_node, name, value, suffix="_unrotated")
            user.args = (node.args[0], new_w, *user.args[2:])
            count += 1
        if all(u.target in ASSERT_OPS for u in node.users):
            for u in list(node.users):
                gm.graph.erase_node(u)
            gm.graph.erase_node(node)
        return count

    def _fold_unrotate(self, gm: GraphModule, lifted: LiftedInputs, node: Node, signs: torch.Tensor, rot: tuple) -> int:
        """unrotate(embedding(Z, ids)) -> embedding(Z H D, ids)."""
        lookup = node.args[0]
        if not isinstance(lookup, Node) or lookup.target != EMBEDDING:
            return 0
        table_node = lookup.args[0]
        table = self._foldable_weight(lifted, table_node)
        if table is None:
            return 0
        # The same key as a tied head's fold of this table: both readers share one unrotated table.
        name, value = self._folded_weight(lifted.spec_of(table_node).target, table, signs, (*rot, 0, 1))
        new_table = lifted.add_beside(gm, table_node, name, value, suffix="_unrotated")
        with gm.graph.inserting_before(node):
            new_lookup = gm.graph.call_function(EMBEDDING, (new_table, *lookup.args[1:]), dict(lookup.kwargs))
        new_lookup.meta = dict(node.meta)
        node.replace_all_uses_with(new_lookup)
        gm.graph.erase_node(node)
        return 1


@register_pass(NAME, "fold Hadamard rotations into float weights (or keep them online, shared, as a butterfly)")
def fuse_hadamard(unit: CompileUnit) -> PassResult:
    mode = hadamard_mode(unit)
    fuser = _Fuser(mode)
    for name, program in list(unit.programs.items()):
        unit.programs[name] = fuser.run(name, program)
    c = fuser.counts
    entries = len(unit.programs)
    notes = [f"mode {mode}", f"folded {c.folded}", f"shared {c.shared}", f"left online {c.online}",
             f"over {entries} entry point(s)"] + c.notes
    details = {"mode": mode, "folded": c.folded, "shared": c.shared, "online": c.online,
               "new_weights": sorted(n for n, _ in fuser.folded.values())}
    return PassResult(changed=(c.folded + c.shared) > 0, sites=c.folded + c.shared, notes=notes, details=details)
