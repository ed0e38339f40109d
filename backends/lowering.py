"""Entry points -> core-aten programs for import, decomposed node by node.

`ExportedProgram.run_decompositions` retraces the whole program through
functionalisation, which made lowering slow (docs/benchmarks.md, "Compile
time"). The exported graph is already functional, so decomposing it needs no
retrace: every node whose op the decomposition table rewrites is expanded in
place from one trace of that op's decomposition per distinct argument signature (`expand_ops`).
A model's layers repeat, so a few dozen traces serve thousands of nodes.
`tests/backends/test_lowering.py` checks the result against `run_decompositions`:
the same ops and bit-identical eager logits and state.

Symbolic values (decode's host position, prefill's attention tile count)
reach a node as SymInt arguments; the decomposition is traced in the graph's
own fake mode with those SymInts as inputs, so the expanded nodes compute
from the graph's symbols.

Which attention ops stay ops for a hand-written kernel (decode entry points
of CPU targets, where kernels/attention.py covers the shape) and
which are expanded is decided per node, so a shape no kernel covers gets the
portable decomposed form instead of a failed compile.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.fx.experimental._config
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import ExportedProgram
from torch.fx import GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from ..frontend import quant  # noqa: F401  (registers foldline::qlinear)
from ..frontend.attention_ops import (
    CACHE_ATTENTION,
    KV_CACHE_WRITE,
    RING_DECODE_ATTENTION,
    RING_WRITE_TOKEN,
)
from ..frontend.device_ops import TO_DEVICE
from ..frontend.op_registry import DECOMPOSITIONS
from ..frontend.quant import QLINEAR
from ..passes.graph_edit import copy_graph_module, fake_mode, rebuild

# Custom ops that reach MLIR as `torch.operator` for a backend rewrite instead of being decomposed
# (kernels/qlinear.py lowers foldline::qlinear to a fused dequantize-matmul kernel;
# backends/iree/multi_device.py lowers foldline::to_device to a transfer between devices).
KEPT_OPS = (QLINEAR, TO_DEVICE)
# Kept in decode entry points for targets with a hand-written decode attention kernel
# (kernels/attention.py) where it covers the shape; expanded elsewhere.
DECODE_ATTENTION_OPS = (CACHE_ATTENTION, RING_DECODE_ATTENTION)
# Kept with them where the kernel makes the step's cache writes itself (kernels/attention.kernel_writes).
DECODE_WRITE_OPS = (KV_CACHE_WRITE, RING_WRITE_TOKEN)

# Shape queries of symbolic values: the table lists them, but they decompose to themselves.
SHAPE_QUERIES = (torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int, torch.ops.aten.sym_numel.default,
                 torch.ops.aten.sym_storage_offset.default)

# keep(entry point name, node) -> whether the node stays an op for a kernel
KeepRule = Callable[[str, Node], bool]


def decomposition_table() -> dict:
    """torch.export's core-aten table plus foldline's custom-op decompositions, less KEPT_OPS."""
    table = torch.export.default_decompositions()
    table.update(DECOMPOSITIONS)
    for op in KEPT_OPS:
        table.pop(op, None)
    return table


def is_decode_entry(name: str) -> bool:
    """Whether an entry point decodes one token per row: `decode`, or `decode_rows{k}` of a batched bundle.

    Every one of them takes the same decode attention kernel, so a row's logits do not depend
    on how many rows the call computes (docs/serving.md).
    """
    return name == "decode" or name.startswith("decode_rows")


def _describe(value: object) -> tuple:
    """What a decomposition traced for one argument depends on: a tensor's geometry, a SymInt's expression."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(str(d) for d in value.shape), tuple(str(s) for s in value.stride()), value.dtype)
    return ("sym", type(value).__name__, str(value))


def _signature(node: Node) -> tuple:
    """What a node's decomposition depends on: its op, constant arguments and the geometry of its values."""
    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    parts = [_describe(a.meta["val"]) if isinstance(a, Node) else ("const", type(a).__name__, a) for a in flat]
    return (node.target, str(spec), tuple(parts))


def _fresh(value: object) -> object:
    """A new tensor of a fake value's geometry (in the active fake mode); a SymInt as it is."""
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
    return value


def _trace_decomposition(node: Node, table: dict, mode: FakeTensorMode) -> GraphModule:
    """The core-aten graph of one op call, traced at its inputs' geometry; placeholders follow its Node args.

    Traced in the graph's own fake mode with its SymInts as inputs, so the traced
    nodes' values belong to that mode and compute from the graph's symbols.
    Views stay views (only mutations are functionalised): the graph is functional
    already, and a copied view would change the strides every later node was traced with.
    """
    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    node_at = [i for i, a in enumerate(flat) if isinstance(a, Node)]

    def call(*values):
        merged = list(flat)
        for i, v in zip(node_at, values):
            merged[i] = v
        args, kwargs = pytree.tree_unflatten(merged, spec)
        return node.target(*args, **kwargs)

    functional = torch.func.functionalize(call, remove="mutations")
    env = mode.shape_env
    guards_before = len(env.guards) if env is not None else 0
    # Size-oblivious: questions such as "is this cut contiguous" (true only at one tile count)
    # take their general answer instead of fixing the symbol at the traced value.
    with mode, torch.fx.experimental._config.patch(backed_size_oblivious=True):
        # Fresh tensors of the same geometry, never the meta values themselves: nodes copied from one
        # trace share their meta values, and make_fx would take two such inputs for one tensor.
        examples = [_fresh(flat[i].meta["val"]) for i in node_at]
        traced = make_fx(functional, decomposition_table=table, tracing_mode="symbolic")(*examples)
    if env is not None and len(env.guards) > guards_before:
        raise NotImplementedError(f"the decomposition of {node.target} specializes a symbolic value "
                                  f"({env.guards[-1].expr}); it would hold only for the traced example")
    if any(n.op == "get_attr" for n in traced.graph.nodes):
        raise NotImplementedError(f"the decomposition of {node.target} makes a tensor constant; "
                                  "it cannot be expanded in place")
    return traced


def _inline(gm: GraphModule, node: Node, sub: GraphModule) -> None:
    """Replace `node` by a copy of `sub`'s nodes fed by the node's own Node arguments."""
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
    keep_meta = {k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack")}
    if isinstance(result, Node):
        result.meta = {**result.meta, **keep_meta}
        node.replace_all_uses_with(result)
    else:  # several results: the node's users are getitem(node, i)
        for user in list(node.users):
            if user.op != "call_function" or user.target is not operator.getitem:
                raise NotImplementedError(f"{node.target} returns {len(result)} values and is read whole by {user}")
            user.replace_all_uses_with(result[user.args[1]])
            gm.graph.erase_node(user)
    gm.graph.erase_node(node)


def expand_ops(gm: GraphModule, expand: Callable[[Node], bool], table: dict | None = None,
               traces: dict | None = None) -> int:
    """Decompose, in place, every call_function node for which `expand(node)` holds; returns how many.

    `traces` memoizes one decomposition per signature across calls.
    """
    table = decomposition_table() if table is None else table
    traces = {} if traces is None else traces
    mode = fake_mode(gm)
    if mode is None:
        raise ValueError("the graph's placeholders carry no fake values: it was not made by torch.export")
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not expand(node):
            continue
        key = (*_signature(node), id(mode))
        if key not in traces:
            traces[key] = _trace_decomposition(node, table, mode)
        _inline(gm, node, traces[key])
        count += 1
    if count:
        gm.graph.eliminate_dead_code()
    return count


# Above any size a bundle computes: the minimum below divides by it, a constant (module docstring of spell_min).
_SPAN = 2**30


def spell_min(gm: GraphModule) -> int:
    """Rewrite each `torch.sym_min(a, N)` (N a constant) as integer arithmetic IREE's importer takes; how many.

    A decomposition takes the minimum of a symbolic size and a constant with `sym_min`, so that torch
    proves the cut it makes in range (ops._first_ring_slots), but the FX importer knows only +, -, *
    and //. For a >= 0: over = a // (N + 1) is 0 where a <= N and from 1 to 2^30 above, so
    min(a, N) = a - (a - N) * ((over + 2^30 - 1) // 2^30), every divisor a constant.
    """
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.sym_min:
            continue
        a, cap = node.args
        if isinstance(cap, Node):
            a, cap = cap, a
        if isinstance(cap, Node) or not isinstance(cap, int):
            raise NotImplementedError(f"sym_min of two symbolic sizes ({node.args}) has no spelling for the importer")
        steps = [(operator.floordiv, cap + 1), (operator.add, _SPAN - 1), (operator.floordiv, _SPAN)]
        with gm.graph.inserting_before(node):
            above = a
            for op, constant in steps:
                above = _int_node(gm, op, above, constant)
            excess = _int_node(gm, operator.sub, a, cap)
            cut = _int_node(gm, operator.mul, excess, above)
            result = _int_node(gm, operator.sub, a, cut)
        node.replace_all_uses_with(result)
        gm.graph.erase_node(node)
        count += 1
    return count


def _int_node(gm: GraphModule, op: Callable, left: Node, right: Node | int) -> Node:
    """A call of a Python integer operator, with its symbolic value computed from its operands'."""
    value = op(left.meta["val"], right.meta["val"] if isinstance(right, Node) else right)
    node = gm.graph.call_function(op, (left, right))
    node.meta["val"] = value
    return node


class Lowering:
    """Decomposes entry points to core aten for import, sharing the table and the traces between them.

    decompositions: entries that replace the default table's for their ops, e.g. the IREE targets'
    fused prefill attention (backends/iree/fused_attention.py).
    """

    def __init__(self, decompositions: dict | None = None) -> None:
        self.table = decomposition_table()
        self.table.update(decompositions or {})
        for op in SHAPE_QUERIES:
            self.table.pop(op, None)
        self.traces: dict = {}

    def decomposes(self, node: Node) -> bool:
        return node.op == "call_function" and node.target in self.table

    def program(self, name: str, program: ExportedProgram, keep: KeepRule) -> ExportedProgram:
        """The core-aten program of entry point `name`: every op the table rewrites expanded, but KEPT_OPS
        and the nodes `keep` holds."""
        gm = copy_graph_module(program)
        expand_ops(gm, lambda n: self.decomposes(n) and not keep(name, n), self.table, self.traces)
        spell_min(gm)
        return rebuild(program, gm)


def lower_to_aten(program: ExportedProgram, keep: tuple = ()) -> ExportedProgram:
    """The reference lowering: `run_decompositions` over the whole program, KEPT_OPS and `keep` left as ops."""
    table = decomposition_table()
    for op in keep:
        table.pop(op, None)
    return program.run_decompositions(table)
