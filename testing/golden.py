"""Golden tests for passes: run a CompileUnit before and after a pass in torch eager.

Both sides start from zero state and are driven through the same steps (prompt
chunks, then decodes), each keeping its own state in its own layout. After
every step the logits are compared, and the state of the side before the pass
is mapped into the layout after it (a full cache becomes a ring: slot s holds
the newest position p < pos with p % W == s) and compared too.

Errors are scaled by the magnitude of the terms that produced the value:
a logit's error by sum_j |W_ij| |h_j| of the head's dot product (measured on
the side before the pass), a state buffer's error by the largest magnitude in
that buffer. A value near zero made of large terms legitimately carries a
large absolute rounding error; a relative error would flag it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.fx import GraphModule, Node
from torch.fx.graph import CodeGen

from ..contract.entry_points import kv_tile_count, takes_position_shape
from ..contract.state import SEQ_DIM, StateBuffer
from ..frontend.export import kv_tiles_shape, position_shape
from ..frontend.types import TORCH_DTYPES
from ..passes.manager import CompileUnit, run_pipeline

# Scaled-error tolerances per dtype: fp32 rounding differences of reordered sums
# through a few layers stay far below these; a wrong mask or a doubled scale
# lands orders of magnitude above.
GOLDEN_TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 4e-3}

_PASS_THROUGH = {
    torch.ops.aten._to_copy.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten.squeeze.dim,
    torch.ops.aten.squeeze.dims,
    torch.ops.aten.select.int,
    torch.ops.aten.mul.Tensor,
    torch.ops.aten.div.Tensor,
    torch.ops.aten.tanh.default,
}
_HEADS = {torch.ops.aten.linear.default, torch.ops.aten.mm.default, torch.ops.aten.matmul.default}


@dataclass
class Step:
    """One call of an entry point: prefill(tokens, start_pos, n_valid) or decode(tokens, pos[, pos_shape])."""

    entry: str
    tokens: Tensor
    start_pos: Tensor
    n_valid: Tensor | None = None

    def args(self, slots: int) -> tuple[Tensor, ...]:
        """The entry point's inputs before the state, for full caches of `slots` slots."""
        if self.entry == "prefill":
            return (self.tokens, self.start_pos, self.n_valid, kv_tiles_shape(kv_tile_count(int(self.end_pos.max()), slots)))
        if not takes_position_shape(self.tokens.shape[0]):
            n_valid = torch.ones_like(self.start_pos) if self.n_valid is None else self.n_valid
            return (self.tokens, self.start_pos, n_valid)
        return (self.tokens, self.start_pos, position_shape(int(self.start_pos[0])))

    @property
    def end_pos(self) -> Tensor:
        """Per row: the number of positions held after this step."""
        return self.start_pos + (self.n_valid if self.n_valid is not None else 1)


def make_steps(
    prompt_lens: Sequence[int],
    chunk: int,
    decode_steps: int,
    vocab_size: int,
    seed: int = 0,
) -> list[Step]:
    """Prompt chunks for every row (rows may differ in length: padded, or empty chunks), then decodes.

    Row b's prompt has prompt_lens[b] tokens; a row whose prompt is done gets
    n_valid = 0 in later chunks, which must leave its state untouched.
    """
    gen = torch.Generator().manual_seed(seed)
    lens = torch.tensor(list(prompt_lens), dtype=torch.int64)
    batch = lens.numel()
    steps: list[Step] = []
    for off in range(0, int(lens.max()), chunk):
        start = lens.clamp(max=off)
        n_valid = (lens - off).clamp(0, chunk)
        tokens = torch.randint(0, vocab_size, (batch, chunk), generator=gen)
        steps.append(Step("prefill", tokens, start, n_valid))
    pos = lens.clone()
    for _ in range(decode_steps):
        steps.append(Step("decode", torch.randint(0, vocab_size, (batch, 1), generator=gen), pos.clone()))
        pos = pos + 1
    return steps


def ring_from_full(full: Tensor, held: Tensor, window: int) -> Tensor:
    """What a W-slot ring holds, given the full cache and the positions held per row."""
    last = held[:, None] - 1
    slots = torch.arange(window, dtype=held.dtype)[None, :]
    newest = last - torch.remainder(last - slots, window)  # [B, W]; < 0: never written
    b, h, _, d = full.shape
    index = newest.clamp(min=0)[:, None, :, None].expand(b, h, window, d)
    picked = torch.gather(full, SEQ_DIM, index)
    return torch.where((newest >= 0)[:, None, :, None], picked, torch.zeros_like(picked))


def held_slots(full: Tensor, held: Tensor) -> Tensor:
    """A full-length cache with the slots past each row's held positions zeroed.

    Those slots hold no position: a row given an empty chunk writes padding into
    slot start_pos (ops.kv_cache_write), whose value depends on the padded
    queries, which no pass has to keep.
    """
    slots = torch.arange(full.shape[SEQ_DIM], dtype=held.dtype)[None, :]
    keep = (slots < held[:, None])[:, None, :, None]
    return torch.where(keep, full, torch.zeros_like(full))


def state_mapper(before: Sequence[StateBuffer], after: Sequence[StateBuffer]) -> Callable[[list[Tensor], Tensor], list[Tensor]]:
    """Maps state in the layout before a pass into the layout after it."""
    if len(before) != len(after):
        raise ValueError(f"the pass changed the number of state buffers ({len(before)} -> {len(after)})")
    plans: list[int | None] = []
    for b, a in zip(before, after):
        if tuple(b.shape) == tuple(a.shape):
            plans.append(None)
        elif (
            a.kind == "local_kv"
            and len(a.shape) == 4
            and a.shape[:SEQ_DIM] == b.shape[:SEQ_DIM]
            and a.shape[SEQ_DIM + 1 :] == b.shape[SEQ_DIM + 1 :]
            and a.shape[SEQ_DIM] < b.shape[SEQ_DIM]
        ):
            plans.append(a.shape[SEQ_DIM])
        else:
            raise ValueError(f"no known state mapping {b.name}: {b.shape} -> {a.name}: {a.shape}")

    def convert(state: list[Tensor], held: Tensor) -> list[Tensor]:
        return [t if w is None else ring_from_full(t, held, w) for t, w in zip(state, plans)]

    return convert


def _find_head(gm: GraphModule) -> Node | None:
    """The matmul whose result becomes the logits, through casts, views and a softcap."""
    out = gm.graph.output_node().args[0]
    node = out[0] if isinstance(out, (tuple, list)) else out
    while isinstance(node, Node) and node.op == "call_function":
        if node.target in _HEADS:
            return node
        if node.target not in _PASS_THROUGH:
            return None
        node = node.args[0]
    return None


def _term_scale(operands: tuple[Tensor, Tensor] | None, head: Node | None, logits: Tensor) -> Tensor:
    if operands is None or head is None:
        return logits.abs().amax(dim=-1, keepdim=True).expand_as(logits)
    h, w = (t.detach().double().abs() for t in operands)
    terms = h @ w.T if head.target == torch.ops.aten.linear.default else h @ w
    return terms.reshape(logits.shape)


def _with_head_outputs(gm: GraphModule) -> tuple[GraphModule, Node | None]:
    """Make the module also return the head's operands, with flat positional arguments."""
    head = _find_head(gm)
    gm.graph._codegen = CodeGen()  # flat args in, a flat tuple out
    out = gm.graph.output_node()
    flat = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    extra = list(head.args[:2]) if head is not None else []
    out.args = (tuple(flat + extra),)
    gm.recompile()
    return gm, head


class UnitRunner:
    """Runs a CompileUnit's entry points in eager, owning state in the unit's layout."""

    def __init__(self, unit: CompileUnit):
        self.modules: dict[str, GraphModule] = {}
        self.heads: dict[str, Node | None] = {}
        for name, program in unit.programs.items():
            self.modules[name], self.heads[name] = _with_head_outputs(program.module())
        self.specs = list(unit.state_specs)
        self.state = [torch.zeros(s.shape, dtype=TORCH_DTYPES[s.dtype]) for s in self.specs]
        self.slots = unit.config.max_context

    @torch.no_grad()
    def step(self, step: Step) -> tuple[Tensor, Tensor]:
        """(logits, their term scale) after one step; the state is updated in place."""
        out = self.modules[step.entry](*step.args(self.slots), *self.state)
        head = self.heads[step.entry]
        logits = out[0]
        operands = (out[1], out[2]) if head is not None else None
        return logits, _term_scale(operands, head, logits)


@dataclass
class GoldenReport:
    """Worst scaled errors over all steps, and where they happened."""

    steps: int = 0
    worst_logit_error: float = 0.0
    worst_state_error: float = 0.0
    worst_logit_step: int = -1
    worst_state: str = ""
    per_step: list[tuple[float, float]] = field(default_factory=list)

    def ok(self, tol: float) -> bool:
        return self.worst_logit_error <= tol and self.worst_state_error <= tol

    def summary(self) -> str:
        return (
            f"{self.steps} steps: worst scaled logit error {self.worst_logit_error:.2e} (step "
            f"{self.worst_logit_step}), worst scaled state error {self.worst_state_error:.2e} {self.worst_state}"
        )


def scaled_error(got: Tensor, want: Tensor, scale: Tensor | float) -> float:
    err = (got.double() - want.double()).abs()
    scale_t = torch.as_tensor(scale, dtype=torch.float64).clamp(min=1e-30)
    return float((err / scale_t).max()) if err.numel() else 0.0


def compare_units(before: CompileUnit, after: CompileUnit, steps: Sequence[Step]) -> GoldenReport:
    """Drive both units through `steps`; compare logits and (mapped) state after every step."""
    ref, new = UnitRunner(before), UnitRunner(after)
    to_after = state_mapper(ref.specs, new.specs)
    report = GoldenReport()
    for i, step in enumerate(steps):
        want, scale = ref.step(step)
        got, _ = new.step(step)
        if got.shape != want.shape:
            raise AssertionError(f"step {i}: logits shape {tuple(got.shape)} != {tuple(want.shape)}")
        rows = step.n_valid > 0 if step.n_valid is not None else torch.ones(got.shape[0], dtype=torch.bool)
        # A row with no valid token in this chunk has no defined logits; its state must still hold.
        logit_err = scaled_error(got[rows], want[rows], scale[rows])
        state_err = 0.0
        for ref_spec, spec, mapped, actual in zip(ref.specs, new.specs, to_after(ref.state, step.end_pos), new.state):
            if mapped.shape != actual.shape:
                raise AssertionError(f"step {i}: state {spec.name} shape {tuple(actual.shape)} != {tuple(mapped.shape)}")
            if spec.kind.endswith("_kv") and tuple(spec.shape) == tuple(ref_spec.shape):  # full-length caches
                mapped, actual = held_slots(mapped, step.end_pos), held_slots(actual, step.end_pos)
            magnitude = float(mapped.detach().abs().max()) if mapped.numel() else 0.0
            err = scaled_error(actual, mapped, max(magnitude, 1e-30))
            if err > report.worst_state_error:
                report.worst_state_error, report.worst_state = err, f"({spec.name} at step {i})"
            state_err = max(state_err, err)
        if logit_err > report.worst_logit_error:
            report.worst_logit_error, report.worst_logit_step = logit_err, i
        report.per_step.append((logit_err, state_err))
        report.steps += 1
    return report


def copy_unit(unit: CompileUnit) -> CompileUnit:
    """A shallow copy: passes replace programs and specs, they never edit them in place; the options
    are the copy's own (a pass records what it did there, as place-on-devices its placement)."""
    return dataclasses.replace(unit, programs=dict(unit.programs), state_specs=list(unit.state_specs),
                               options=dict(unit.options))


def golden_check(
    unit: CompileUnit, passes: Sequence[str], steps: Sequence[Step]
) -> tuple[CompileUnit, GoldenReport, list[dict]]:
    """Run `passes` on a copy of `unit`, then compare it with `unit` on `steps`.

    Returns the transformed unit, the comparison and the pass report.
    """
    after = copy_unit(unit)
    pass_report = run_pipeline(after, list(passes), progress=lambda _msg: None)
    return after, compare_units(unit, after, steps), pass_report
