"""kv-length-buckets: attention whose work follows the tokens held, not max_context.

A full-length cache of max_context slots makes every step score every slot,
whatever the position: a bundle compiled for a model's trained context pays for
it from the first token. This pass copies each entry point once per length L of
a short ladder (256, 512, ..., below max_context) and sets every
`cache_attention` in the copy to read only the first L slots:

    prefill, decode              attend over max_context slots (unchanged)
    prefill_256, decode_256      attend over slots [0, 256)
    prefill_512, decode_512      ...

The copies share every weight and take the same state buffers, so a bundle
holds one set of parameters and one cache; the runtime calls the shortest
entry point whose length holds the chunk's last position. Static lengths keep
every dispatch static (IREE tiles and vectorises them as before) at the price
of at most 2x the exact work, and of one function per length in the module
(the dispatches other than attention are identical, and IREE compiles each
distinct dispatch once).

Sliding-window layers rewritten into rings by ring-buffer-swa hold W slots;
a length L below W reads only the ring's first L (position p sits in slot
p % W, so below L every slot from L on is empty): Gemma 3's 512-slot rings
are read over 256 slots by prefill_256 and decode_256.

Runs last: it multiplies programs, so the passes before it see two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule

from ..frontend import ops  # noqa: F401  (registers torch.ops.foldline.*)
from ..frontend.export import ENTRY_POINTS
from .graph_edit import copy_graph_module, rebuild
from .registry import CompileUnit, PassResult, register_pass
from .state_layout import SEQ_DIM

NAME = "kv-length-buckets"
CACHE_ATTN = torch.ops.foldline.cache_attention.default
LENGTH_ARG = 7  # cache_attention(q, k, v, start_pos, window, scale, kv_mapping, length)
# ring attention op -> the index of its optional trailing `length` (the last of its arguments)
RING_LENGTH_ARG = {
    torch.ops.foldline.ring_attention.default: 10,  # (q, ring_k, ring_v, k, v, start_pos, n_valid, window, ...)
    torch.ops.foldline.ring_decode_attention.default: 7,  # (q, ring_k, ring_v, start_pos, window, scale, map)
}
# ... and of its `window`
RING_WINDOW_ARG = {torch.ops.foldline.ring_attention.default: 7, torch.ops.foldline.ring_decode_attention.default: 4}
# Every attention op whose reads a length cuts (the backends keep them as leaves through decomposition).
ATTENTION_OPS = (CACHE_ATTN, *RING_LENGTH_ARG)
SMALLEST_LENGTH = 256


@dataclass(frozen=True, eq=False)
class Variant:
    """An entry point that is its base with every attention read cut to `length` slots.

    The backends derive a variant from the base's decomposed graph instead of
    decomposing it again (backends/lowering.py); `derives` says whether a set of
    programs still holds exactly the two programs this pass made and left.
    """

    name: str
    base: str
    length: int
    base_program: ExportedProgram
    program: ExportedProgram

    def derives(self, programs: dict[str, ExportedProgram]) -> bool:
        return programs.get(self.base) is self.base_program and programs.get(self.name) is self.program


def length_ladder(max_context: int, smallest: int = SMALLEST_LENGTH) -> list[int]:
    """Attention lengths below max_context, doubling from `smallest`; max_context itself is implied."""
    lengths, length = [], smallest
    while length < max_context:
        lengths.append(length)
        length *= 2
    return lengths


def variant_name(entry: str, length: int) -> str:
    """The entry point that attends over the first `length` cache slots."""
    return f"{entry}_{length}"


def _attention_nodes(program_or_module) -> list[torch.fx.Node]:
    return [n for n in program_or_module.graph.nodes if n.op == "call_function" and n.target == CACHE_ATTN]


def _ring_nodes(program_or_module) -> list[torch.fx.Node]:
    """Every ring attention read (`_with_length` cuts those whose window is longer than the length)."""
    return [n for n in program_or_module.graph.nodes if n.op == "call_function" and n.target in RING_LENGTH_ARG]


def set_attention_length(gm: GraphModule, length: int) -> int:
    """Cut every attention read of `gm` to `length` slots, in place; returns how many ring reads were cut.

    Works on the exported graph and on a decomposed one that kept the attention ops.
    """
    for node in _attention_nodes(gm):
        cache_len = node.args[1].meta["val"].shape[SEQ_DIM]
        args = list(node.args)
        args[LENGTH_ARG] = min(length, cache_len)
        node.args = tuple(args)
    rings = 0
    for node in _ring_nodes(gm):
        if length < node.args[RING_WINDOW_ARG[node.target]]:
            at = RING_LENGTH_ARG[node.target]
            node.args = (*node.args[:at], length)
            rings += 1
    return rings


def _with_length(program, length: int) -> tuple[object, int]:
    """The program with every attention read cut to `length` slots, and how many ring reads were cut."""
    gm = copy_graph_module(program)
    rings = set_attention_length(gm, length)
    return rebuild(program, gm), rings


@register_pass(NAME, "one entry point per attention length (256, 512, ...): work follows the tokens held")
def kv_length_buckets(unit: CompileUnit) -> PassResult:
    lengths = unit.options.get("kv_lengths")
    if lengths is None:
        lengths = length_ladder(unit.config.max_context)
    lengths = sorted({int(n) for n in lengths if 0 < int(n) < unit.config.max_context})
    # Idempotent: variants are always rebuilt from the plain entry points.
    for name in [n for n in unit.programs if n not in ENTRY_POINTS]:
        del unit.programs[name]
    bases = {name: p for name, p in unit.programs.items() if _attention_nodes(p)}
    if not bases or not lengths:
        why = "no full-cache attention" if not bases else f"max_context {unit.config.max_context} is short"
        unit.kv_lengths = []
        unit.variants = {}
        return PassResult(changed=False, notes=[f"{why}: one length per entry point"])
    sites = 0
    unit.variants = {}
    for name, program in bases.items():
        sites += len(_attention_nodes(program)) * len(lengths)
        for length in lengths:
            variant = variant_name(name, length)
            unit.programs[variant], rings = _with_length(program, length)
            unit.variants[variant] = Variant(variant, name, length, program, unit.programs[variant])
            sites += rings
    unit.kv_lengths = lengths
    return PassResult(
        changed=True,
        sites=sites,
        notes=[f"attention lengths {lengths} + {unit.config.max_context} for {sorted(bases)}"],
        details={"lengths": lengths},
    )
