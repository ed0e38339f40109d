"""fold-embedding-scale: `embedding(W, ids) * c` with a constant c becomes `embedding(c*W, ids)`.

The multiplier is applied once: every reader of the scaled embedding (the
residual stream and Ripple's value-residual seed alike) now reads the lookup
into the folded table, and the runtime multiply is gone. The folded table is
computed with the same aten multiply in the same dtype as the graph's, so for
each element it is the product the graph would have computed: the rewrite is
exact, not merely close.

A table with other readers (a head tied to the embedding, as in Gemma and
Llama) keeps the unscaled table for them and gets a new table for the lookup;
when that copy would exceed TIED_COPY_LIMIT_BYTES the site is declined (the
multiply costs d flops per token, a second table costs its full size).
A multiplier that is not a compile-time constant is left alone.
"""

from __future__ import annotations

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import GraphModule, Node

from ..frontend.deferred_weights import materialize
from .graph_edit import (
    ASSERT_OPS,
    LiftedInputs,
    copy_graph_module,
    placeholders_under,
    remove_dead_code,
)
from .registry import CompileUnit, PassResult, register_pass

NAME = "fold-embedding-scale"

# A second copy of a tied table is worth it only while it is small.
TIED_COPY_LIMIT_BYTES = 32 * 1024 * 1024

EMBEDDING = torch.ops.aten.embedding.default
MULS = (torch.ops.aten.mul.Tensor, torch.ops.aten.mul.Scalar)
# Pure ops a constant multiplier may pass through (casts, copies, views, arithmetic).
CONST_OPS = {
    torch.ops.aten.clone.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.lift_fresh_copy.default,
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten.squeeze.default,
    torch.ops.aten.squeeze.dim,
    torch.ops.aten.unsqueeze.default,
    torch.ops.aten.mul.Tensor,
    torch.ops.aten.mul.Scalar,
    torch.ops.aten.div.Tensor,
    torch.ops.aten.div.Scalar,
    torch.ops.aten.sqrt.default,
    torch.ops.aten.rsqrt.default,
    torch.ops.aten.reciprocal.default,
}
TABLE_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


class _NotConstant(Exception):
    pass


class _Program(LiftedInputs):
    """A program's lifted inputs, plus the compile-time value of a multiplier."""

    def constant(self, arg: object) -> object:
        """The compile-time value of `arg` (a python number or tensor), or raise _NotConstant."""
        if isinstance(arg, (int, float)) and not isinstance(arg, bool):
            return arg
        if not isinstance(arg, Node):
            raise _NotConstant
        if arg.op == "placeholder":
            spec = self.spec_of(arg)
            if spec is None or spec.kind != InputKind.CONSTANT_TENSOR:
                raise _NotConstant  # weights and user inputs are not compile-time constants here
            return self.value_of(spec)
        if arg.op != "call_function" or arg.target not in CONST_OPS:
            raise _NotConstant
        args = [self.constant(a) if isinstance(a, Node) else a for a in arg.args]
        kwargs = {k: self.constant(v) if isinstance(v, Node) else v for k, v in arg.kwargs.items()}
        return arg.target(*args, **kwargs)


def _fold_table(table: torch.Tensor, c: object) -> torch.Tensor:
    """c * table with the graph's own multiply (same promotion, same rounding)."""
    with torch.no_grad():
        out = torch.ops.aten.mul.Tensor(table, c)  # a python number stays a wrapped scalar
        return out.reshape(table.shape).contiguous()


def _fmt_c(c: object) -> str:
    return f"{float(c.reshape(()) if isinstance(c, torch.Tensor) else c):.8g}"


class _Folder:
    """Folds the sites of all entry points, sharing each folded table between them."""

    def __init__(self) -> None:
        self.tables: dict[tuple, tuple[str, torch.Tensor]] = {}
        self.notes: list[str] = []
        self.sites = 0
        self.extra_bytes = 0

    def _table_for(self, target: str, table: torch.Tensor, c: object) -> tuple[str, torch.Tensor, bool]:
        """The folded table, shared by all entry points (one parameter after import); fresh if new."""
        if isinstance(c, torch.Tensor):
            c_key: tuple = (tuple(c.detach().reshape(-1).tolist()), str(c.dtype), tuple(c.shape))
        else:
            c_key = (type(c).__name__, c)
        key = (target, id(table), c_key)
        fresh = key not in self.tables
        if fresh:
            names = {n for n, _ in self.tables.values()}
            name = f"{target}_scaled"
            while name in names:
                name += "_"
            scaled = _fold_table(table, c)
            if isinstance(table, torch.nn.Parameter):  # one object for every entry point's state_dict
                scaled = torch.nn.Parameter(scaled, requires_grad=False)
            self.tables[key] = (name, scaled)
        return (*self.tables[key], fresh)

    def fold(self, entry: str, program: ExportedProgram) -> ExportedProgram:
        gm = copy_graph_module(program)
        view = _Program(program)
        touched: set[str] = set()
        folded = 0
        # Until nothing changes: a lookup scaled twice (x * a * b) folds both factors in one run.
        while self._fold_one(entry, gm, view, touched):
            folded += 1
        if not folded:
            return program
        self.sites += folded
        remove_dead_code(gm)
        view.drop_unused(gm, only=touched)  # the multiplier's constants, and the table if nothing else reads it
        return view.rebuild_with(gm)

    def _fold_one(self, entry: str, gm: GraphModule, view: _Program, touched: set[str]) -> bool:
        """Fold the first foldable site; False when none is left."""
        for emb in [n for n in gm.graph.nodes if n.op == "call_function" and n.target == EMBEDDING]:
            weight = emb.args[0]
            spec = view.spec_of(weight) if isinstance(weight, Node) else None
            if spec is None or spec.kind not in TABLE_KINDS:
                continue
            for mul in [u for u in emb.users if u.target in MULS]:
                other = mul.args[1] if mul.args[0] is emb else mul.args[0]
                try:
                    c = view.constant(other)
                except _NotConstant:
                    continue  # a runtime value (e.g. a norm's rsqrt): nothing to fold
                if isinstance(c, torch.Tensor) and c.numel() != 1:
                    self._note(f"{entry}: {mul.name} multiplier has {c.numel()} elements; left alone")
                    continue
                table = view.value_of(spec, materialized=False)  # shape and dtype; values once it folds
                new_val, emb_val = mul.meta.get("val"), emb.meta.get("val")
                if new_val is None or emb_val is None or tuple(new_val.shape) != tuple(emb_val.shape):
                    self._note(f"{entry}: {mul.name} broadcasts beyond the lookup; left alone")
                    continue
                other_readers = [u for u in weight.users if u is not emb] + [
                    u for u in emb.users if u is not mul and u.target not in ASSERT_OPS
                ]
                nbytes = table.numel() * table.element_size()
                if other_readers and nbytes > TIED_COPY_LIMIT_BYTES:
                    self._note(
                        f"{entry}: declined: {spec.target} is also read by "
                        f"{', '.join(u.name for u in other_readers)} (a tied head); a scaled copy would add "
                        f"{nbytes:,} bytes, over the {TIED_COPY_LIMIT_BYTES:,}-byte limit, so the multiply "
                        "stays at runtime"
                    )
                    continue
                name, scaled, fresh = self._table_for(spec.target, materialize(table), c)
                if scaled.dtype != new_val.dtype:
                    self._note(f"{entry}: {mul.name} changes dtype in a way the table cannot; left alone")
                    continue
                new_ph = view.add_beside(gm, weight, name, scaled, suffix="_scaled")
                with gm.graph.inserting_before(mul):
                    lookup = gm.graph.call_function(EMBEDDING, (new_ph, *emb.args[1:]), dict(emb.kwargs))
                lookup.meta = dict(mul.meta)
                mul.replace_all_uses_with(lookup)
                gm.graph.erase_node(mul)
                if other_readers:
                    self._note(
                        f"{entry}: {spec.target} is also read by {', '.join(u.name for u in other_readers)}: "
                        f"they keep the unscaled table; the lookup reads {name}"
                    )
                    if fresh:
                        self.extra_bytes += nbytes
                self._note(f"{entry}: folded x{_fmt_c(c)} into {name}")
                touched.add(weight.name)
                if isinstance(other, Node):
                    touched |= placeholders_under(other)
                return True
        return False

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)


@register_pass(NAME, "fold a constant embedding multiplier into the lookup table (applied once)")
def fold_embedding_scale(unit: CompileUnit) -> PassResult:
    folder = _Folder()
    for name, program in list(unit.programs.items()):
        unit.programs[name] = folder.fold(name, program)
    details = {"tables": sorted({n for n, _ in folder.tables.values()}), "extra_weight_bytes": folder.extra_bytes}
    return PassResult(changed=folder.sites > 0, sites=folder.sites, notes=folder.notes, details=details)
