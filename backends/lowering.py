"""Entry points -> core-aten programs for import, each graph decomposed once.

`ExportedProgram.run_decompositions` retraces the whole program: on SmolLM2
it costs about as much as the rest of the compile before iree-compile. The
length variants of kv-length-buckets (prefill_256, decode_512, ...) differ
from their base entry point only in the `length` argument of their attention
ops, so they are not decomposed again. Each base is decomposed once with its
attention ops kept as leaves; every variant is a copy of that graph with the
lengths set, and its attention ops are then expanded in place, node by node,
from one trace of the op's decomposition per distinct argument signature
(`expand_ops`). The result is the graph `run_decompositions` gives the
variant, at a fraction of the cost (tests/test_lowering.py runs both).

Which attention ops stay ops for a hand-written kernel (decode entry points
of CPU targets, where backends/attention_kernels.py covers the shape) and
which are expanded is decided per node, so a shape no kernel covers gets the
portable decomposed form instead of a failed compile.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from ..frontend import quant  # noqa: F401  (registers foldline::qlinear)
from ..frontend.ops import DECOMPOSITIONS
from ..passes.graph_edit import copy_graph_module, rebuild
from ..passes.kv_length_buckets import ATTENTION_OPS, Variant, set_attention_length

# Custom ops that reach MLIR as `torch.operator` for a backend rewrite instead of being decomposed
# (backends/quant_kernels.py lowers foldline::qlinear to a fused dequantize-matmul kernel).
KEPT_OPS = (torch.ops.foldline.qlinear.default,)
# Kept in decode entry points (`decode`, `decode_<L>`) for targets with a hand-written decode
# attention kernel (backends/attention_kernels.py) where it covers the shape; expanded elsewhere.
DECODE_ATTENTION_OPS = (torch.ops.foldline.cache_attention.default, torch.ops.foldline.ring_decode_attention.default)

# keep(entry point name, attention node) -> whether the node stays an op for a kernel
KeepRule = Callable[[str, Node], bool]


def decomposition_table() -> dict:
    """torch.export's core-aten table plus foldline's custom-op decompositions, less KEPT_OPS."""
    table = torch.export.default_decompositions()
    table.update(DECOMPOSITIONS)
    for op in KEPT_OPS:
        table.pop(op, None)
    return table


def lower_to_aten(program: ExportedProgram, keep: tuple = ()) -> ExportedProgram:
    """Decompose foldline custom ops (and everything else) to core aten for import, but KEPT_OPS and `keep`."""
    table = decomposition_table()
    for op in keep:
        table.pop(op, None)
    return program.run_decompositions(table)


def is_decode_entry(name: str) -> bool:
    return name == "decode" or name.startswith("decode_")


def _signature(node: Node) -> tuple:
    """What a node's decomposition depends on: its op, constant arguments and tensor geometry."""
    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    parts = []
    for a in flat:
        if isinstance(a, Node):
            v = a.meta["val"]
            parts.append(("tensor", tuple(v.shape), tuple(v.stride()), v.dtype))
        else:
            parts.append(("const", type(a).__name__, a))
    mode = torch._guards.detect_fake_mode([a.meta["val"] for a in flat if isinstance(a, Node)])
    return (node.target, str(spec), tuple(parts), id(mode))


def _trace_decomposition(node: Node, table: dict) -> GraphModule:
    """The core-aten graph of one op call, traced at its tensors' geometry; placeholders follow its tensor args."""
    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    tensor_at = [i for i, a in enumerate(flat) if isinstance(a, Node)]

    def call(*tensors):
        values = list(flat)
        for i, t in zip(tensor_at, tensors):
            values[i] = t
        args, kwargs = pytree.tree_unflatten(values, spec)
        return node.target(*args, **kwargs)

    # Traced in the graph's own fake mode, so the copied nodes' meta values belong to it.
    mode = torch._guards.detect_fake_mode([flat[i].meta["val"] for i in tensor_at])
    functional = torch.func.functionalize(call, remove="mutations_and_views")
    with mode:
        examples = [torch.empty_strided(flat[i].meta["val"].shape, flat[i].meta["val"].stride(),
                                        dtype=flat[i].meta["val"].dtype) for i in tensor_at]
        traced = make_fx(functional, decomposition_table=table, tracing_mode="real")(*examples)
    if any(n.op == "get_attr" for n in traced.graph.nodes):
        raise NotImplementedError(f"the decomposition of {node.target} makes a tensor constant; "
                                  "it cannot be expanded in place")
    return traced


def _inline(gm: GraphModule, node: Node, sub: GraphModule) -> None:
    """Replace `node` by a copy of `sub`'s nodes fed by the node's own tensor arguments."""
    flat, _ = pytree.tree_flatten((node.args, node.kwargs))
    inputs = [a for a in flat if isinstance(a, Node)]
    env: dict[Node, Node] = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    for ph, arg in zip(placeholders, inputs, strict=True):
        env[ph] = arg
    result = None
    with gm.graph.inserting_before(node):
        for sn in sub.graph.nodes:
            if sn.op == "placeholder":
                continue
            if sn.op == "output":
                result = torch.fx.map_arg(sn.args[0], lambda n: env[n])
                break
            env[sn] = gm.graph.node_copy(sn, lambda n: env[n])
    if not isinstance(result, Node):
        raise NotImplementedError(f"{node.target} returns {type(result).__name__}; only one tensor can be expanded")
    result.meta = {**result.meta, **{k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack")}}
    node.replace_all_uses_with(result)
    gm.graph.erase_node(node)


def expand_ops(gm: GraphModule, expand: Callable[[Node], bool], table: dict | None = None,
               traces: dict | None = None) -> int:
    """Decompose, in place, every call_function node for which `expand(node)` holds; returns how many.

    `traces` memoizes one decomposition per signature across calls (every layer of a
    model, and every variant of an entry point, share a handful).
    """
    table = decomposition_table() if table is None else table
    traces = {} if traces is None else traces
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not expand(node):
            continue
        key = _signature(node)
        if key not in traces:
            traces[key] = _trace_decomposition(node, table)
        _inline(gm, node, traces[key])
        count += 1
    if count:
        gm.graph.eliminate_dead_code()
    return count


@dataclass
class LoweredEntries:
    """Programs ready for import: bases decomposed once with their attention ops kept, and the variants."""

    decomposed: dict[str, ExportedProgram]  # base name -> core aten but ATTENTION_OPS and KEPT_OPS
    order: list[str]  # every entry point name, in the order given
    variants: dict[str, Variant]  # variant name -> its base and attention length
    table: dict  # the decomposition table every expansion traces with
    traces: dict  # decomposition traces shared by every expansion

    def program(self, name: str, keep: KeepRule) -> ExportedProgram:
        """The core-aten program of entry point `name`, attention ops kept where `keep` says so."""
        variant = self.variants.get(name)
        base = self.decomposed[variant.base if variant else name]
        gm = copy_graph_module(base)
        if variant is not None:
            set_attention_length(gm, variant.length)
        expand_ops(gm, lambda n: n.target in ATTENTION_OPS and not keep(name, n), self.table, self.traces)
        return rebuild(base, gm)


def lower_entries(programs: Iterable[tuple[str, ExportedProgram]],
                  variants: Mapping[str, Variant] | None = None) -> LoweredEntries:
    """Decompose every entry point that is not a variant of another one (the expensive step, once)."""
    programs = list(programs)
    by_name = dict(programs)
    derived = {name: v for name, v in (variants or {}).items() if v.derives(by_name)}
    decomposed = {name: lower_to_aten(p, keep=ATTENTION_OPS) for name, p in programs if name not in derived}
    return LoweredEntries(decomposed, [name for name, _ in programs], derived, decomposition_table(), {})
