"""quantize-weights: linear layers and embedding lookups read block-quantized weights.

`aten.linear(x, W)` becomes `foldline::qlinear(x, codes, scales, mins)` and
`aten.embedding(W, ids)` becomes `foldline::qembedding(codes, scales, mins, ids)`,
with the codes, scales and mins lifted as parameters in place of W. A backend
lowers both ops so that the dequantization happens inside the matmul (or the
gather), and no float copy of W is ever written.

Where the blocks come from, per `CompileUnit.options["weights"]`:

- `auto` (default): the checkpoint's own blocks (`CompileUnit.source_blocks`,
  repacked exactly from GGUF by the loader); weights stored as floats stay floats.
  5-bit blocks are widened exactly to q8 where the unit's `five_bit_codes`
  option is false: no module of the bundle has kernels that read them as they lie.
- `int8` / `int4`: every 2-D weight in that format, the checkpoint's blocks
  where they already are in it (5-bit blocks widened exactly for `int8`), else
  groupwise round-to-nearest from the float weight (`options["group"]`, default 32); the error of each is reported.
- `f32`: nothing changes.

A weight read by several nodes (a head tied to the embedding table) or by
several entry points is quantized once and stored once.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import GraphModule, Node

from ..errors import FoldlineError
from ..frontend import quant
from ..frontend.deferred_weights import materialize
from ..frontend.quant import QEMBEDDING, QLINEAR
from .graph_edit import LiftedInputs, copy_graph_module, remove_dead_code
from .registry import CompileUnit, PassResult, register_pass

NAME = "quantize-weights"
FIVE_BIT_CODES = "five_bit_codes"  # unit option: False widens q5 checkpoint blocks to q8 (backends/policy.keeps_five_bit_codes)
MODES = ("auto", "f32", "int8", "int4")
FORMAT_OF_MODE = {"int8": "q8", "int4": "q4"}
DEFAULT_GROUP = 32

LINEAR = torch.ops.aten.linear.default
EMBEDDING = torch.ops.aten.embedding.default


class WeightsModeError(FoldlineError, ValueError):
    """An unknown --weights mode or group size."""


def weights_mode(unit: CompileUnit) -> tuple[str, int]:
    mode = unit.options.get("weights") or "auto"
    group = int(unit.options.get("group") or DEFAULT_GROUP)
    if mode not in MODES:
        raise WeightsModeError(f"unknown weights mode {mode!r}; expected one of {MODES}")
    if group < 2 or group % 2:
        raise WeightsModeError(f"quantization group {group} must be an even number >= 2")
    return mode, group


@dataclass
class _Choice:
    """The blocks chosen for one weight, and how they were obtained."""

    blocks: quant.QuantizedTensor
    origin: str  # "checkpoint" or "requantized"
    max_abs_error: float = 0.0
    rel_rms_error: float = 0.0


@dataclass
class _Report:
    linears: int = 0
    embeddings: int = 0
    float_bytes: int = 0
    quant_bytes: int = 0
    widened: int = 0  # 5-bit checkpoint blocks stored as q8
    notes: list[str] = field(default_factory=list)


class _Quantizer:
    def __init__(self, unit: CompileUnit):
        self.mode, self.group = weights_mode(unit)
        self.sources = unit.source_blocks
        self.five_bit = unit.options.get(FIVE_BIT_CODES, True)
        self.chosen: dict[str, _Choice | None] = {}
        # One Parameter per lifted array, shared by every entry point (the importer writes it once).
        self.tensors: dict[str, torch.nn.Parameter] = {}
        self.report = _Report()

    def choose(self, target: str, weight: torch.Tensor) -> _Choice | None:
        """The blocks for lifted weight `target`, or None to keep it as it is."""
        if target in self.chosen:
            return self.chosen[target]
        choice = None
        source = self.sources.get(target)
        wanted = FORMAT_OF_MODE.get(self.mode)
        if source is not None and source.format == "q5" and (not self.five_bit or wanted == "q8"):
            source = source.as_q8()  # exact; with --weights int8 it is then the checkpoint's q8
            if not self.five_bit:
                self.report.widened += 1
        if weight.dim() == 2 and weight.is_floating_point():
            if source is not None and (self.mode == "auto" or source.format == wanted):
                choice = _Choice(source, "checkpoint")
            elif wanted is not None and weight.shape[1] % self.group == 0:
                w = materialize(weight).detach().to(torch.float32).numpy()
                blocks = quant.quantize(w, wanted, self.group)
                err = blocks.dequantize() - w
                rms = float(np.sqrt(np.mean(err * err)) / max(np.sqrt(np.mean(w * w)), 1e-30))
                choice = _Choice(blocks, "requantized", float(np.abs(err).max()), rms)
            elif wanted is not None:
                self.report.notes.append(f"{target}: row length {weight.shape[1]} is not a multiple of the "
                                         f"group {self.group}; left as {weight.dtype}")
        if choice is not None:
            if tuple(choice.blocks.shape) != tuple(weight.shape):
                raise ValueError(f"{target}: blocks of shape {choice.blocks.shape} for a weight of shape "
                                 f"{tuple(weight.shape)}")
            self.report.float_bytes += weight.numel() * weight.element_size()
            self.report.quant_bytes += choice.blocks.nbytes
        self.chosen[target] = choice
        return choice

    def _lift(self, gm: GraphModule, lifted: LiftedInputs, weight: Node, target: str,
              blocks: quant.QuantizedTensor) -> tuple[Node, Node, Node | None]:
        parts = [("codes", blocks.codes), ("scales", blocks.scales), ("mins", blocks.mins)]
        nodes = []
        for part, array in parts:
            if array is None:
                nodes.append(None)
                continue
            name = f"{target}.{part}"
            if name not in self.tensors:
                self.tensors[name] = torch.nn.Parameter(torch.from_numpy(np.ascontiguousarray(array)),
                                                        requires_grad=False)
            nodes.append(lifted.add_beside(gm, weight, name, self.tensors[name], suffix=f"_{part}"))
        return nodes[0], nodes[1], nodes[2]

    def run(self, program: ExportedProgram) -> ExportedProgram:
        if self.mode == "f32":
            return program
        gm = copy_graph_module(program)
        lifted = LiftedInputs(program)
        changed = 0
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.target not in (LINEAR, EMBEDDING):
                continue
            weight = node.args[1] if node.target == LINEAR else node.args[0]
            spec = lifted.spec_of(weight) if isinstance(weight, Node) else None
            if spec is None or spec.kind != InputKind.PARAMETER:
                continue
            choice = self.choose(spec.target, lifted.value_of(spec, materialized=False))
            if choice is None:
                continue
            b = choice.blocks
            codes, scales, mins = self._lift(gm, lifted, weight, spec.target, b)
            with gm.graph.inserting_before(node):
                if node.target == LINEAR:
                    new = gm.graph.call_function(QLINEAR, (node.args[0], codes, scales, mins, b.format, b.group))
                    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
                    if bias is not None:
                        new.meta = dict(node.meta)
                        new = gm.graph.call_function(torch.ops.aten.add.Tensor, (new, bias))
                    self.report.linears += 1
                else:
                    new = gm.graph.call_function(QEMBEDDING, (codes, scales, mins, node.args[1], b.format, b.group))
                    self.report.embeddings += 1
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            changed += 1
        if not changed:
            return program
        remove_dead_code(gm)
        lifted.drop_unused(gm)  # the float weights nothing reads any more
        return lifted.rebuild_with(gm)


@register_pass(NAME, "linear layers and embedding lookups read block-quantized weights (dequantized in the matmul)")
def quantize_weights(unit: CompileUnit) -> PassResult:
    q = _Quantizer(unit)
    for name, program in list(unit.programs.items()):
        unit.programs[name] = q.run(program)
    r = q.report
    chosen = {t: c for t, c in q.chosen.items() if c is not None}
    requantized = {t: c for t, c in chosen.items() if c.origin == "requantized"}
    notes = [f"mode {q.mode}", f"{len(chosen)} weight(s) quantized ({len(requantized)} requantized)",
             f"{r.float_bytes:,} float bytes -> {r.quant_bytes:,} quantized bytes"]
    if requantized:
        worst = max(requantized.items(), key=lambda kv: kv[1].rel_rms_error)
        notes.append(f"worst requantization: {worst[0]} relative RMS error {worst[1].rel_rms_error:.3g}")
    formats = Counter(c.blocks.format for c in chosen.values())
    if formats:
        notes.append("formats: " + ", ".join(f"{count} {fmt}" for fmt, count in sorted(formats.items())))
    if r.widened:
        notes.append(f"{r.widened} weight(s) of 5-bit blocks widened to q8: no module of this bundle reads "
                     "5-bit codes with int8 activations")
    notes += r.notes
    details = {
        "mode": q.mode,
        "group": q.group,
        "float_bytes": r.float_bytes,
        "quantized_bytes": r.quant_bytes,
        "weights": {t: {"format": c.blocks.format, "group": c.blocks.group, "origin": c.origin,
                        "max_abs_error": c.max_abs_error, "rel_rms_error": c.rel_rms_error}
                    for t, c in sorted(chosen.items())},
    }
    sites = r.linears + r.embeddings
    return PassResult(changed=sites > 0, sites=sites, notes=notes, details=details)
