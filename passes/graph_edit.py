"""Helpers that let a pass edit an ExportedProgram without touching the original.

A pass works on a copy of the graph, edits it, then rebuilds an ExportedProgram
with a consistent signature, state_dict and constants. The original program is
left intact, so golden tests can run before and after side by side.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputSpec,
    TensorArgument,
)
from torch.fx import Graph, GraphModule, Node
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from ..frontend.deferred_weights import materialize

# Nodes that return nothing but must not be dead-code eliminated by fx.
ASSERT_OPS = (torch.ops.aten._assert_tensor_metadata.default,)


def copy_graph_module(program: ExportedProgram) -> GraphModule:
    """A new GraphModule whose nodes (and meta dicts) are copies of the program's."""
    graph = Graph()
    value_map: dict[Node, Node] = {}
    result, old_out = graph.graph_copy(program.graph, value_map, return_output_node=True)
    out = graph.output(result)
    out.meta = copy.copy(old_out.meta)
    return GraphModule(program.graph_module, graph)


def placeholders(gm: GraphModule) -> dict[str, Node]:
    return {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}


def state_placeholder_names(program: ExportedProgram, n_state: int) -> list[str]:
    """The last n_state user inputs are the state buffers, in state_specs order."""
    users = [s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    if n_state > len(users):
        raise ValueError(f"program has {len(users)} user inputs, fewer than {n_state} state buffers")
    return users[len(users) - n_state :]


def placeholders_under(node: Node) -> set[str]:
    """The names of the placeholders `node` reads, directly or through other nodes."""
    seen, stack, out = set(), [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            out.add(n.name)
        stack.extend(a for a in n.all_input_nodes)
    return out


def remove_dead_code(gm: GraphModule) -> None:
    """Remove unused nodes, including metadata asserts on values nothing else reads."""
    changed = True
    while changed:
        changed = False
        for node in reversed(list(gm.graph.nodes)):
            if node.op != "call_function" or node.target not in ASSERT_OPS:
                continue
            subject = node.args[0]
            if isinstance(subject, Node) and all(u.target in ASSERT_OPS for u in subject.users):
                gm.graph.erase_node(node)
                changed = True
        gm.graph.eliminate_dead_code()


def refresh_fake_meta(gm: GraphModule, overrides: dict[str, torch.Tensor] | None = None) -> None:
    """Re-run fake tensor propagation so every node's meta['val'] matches its inputs.

    `overrides` maps placeholder names to tensors (real or fake) giving their
    new shape and dtype; other placeholders keep their current meta['val'].
    """
    overrides = overrides or {}
    mode = fake_mode(gm) or FakeTensorMode()
    args = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = overrides.get(node.name, node.meta.get("val"))
        if isinstance(val, torch.Tensor) and not (isinstance(val, FakeTensor) and val.fake_mode is mode):
            with mode:  # an empty tensor of the same geometry, owned by this fake mode
                val = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
        node.meta["val"] = val
        args.append(val)
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*args)
    for node in gm.graph.nodes:
        if "tensor_meta" in node.meta and isinstance(node.meta.get("val"), torch.Tensor):
            node.meta["tensor_meta"] = _extract_tensor_metadata(node.meta["val"])


def fake_mode(gm: GraphModule) -> FakeTensorMode | None:
    vals = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder" and "val" in n.meta]
    return torch._guards.detect_fake_mode(vals)


def fake_of(program_gm: GraphModule, tensor: torch.Tensor, like: Node | None = None) -> torch.Tensor:
    """A fake tensor for `tensor` in the fake mode of the graph's placeholders (that of `like`, one of
    them, when given: finding it from all of them costs a walk over every input, per call)."""
    val = like.meta.get("val") if like is not None else None
    mode = val.fake_mode if isinstance(val, FakeTensor) else fake_mode(program_gm)
    if mode is None:
        return tensor
    return mode.from_tensor(tensor, static_shapes=True)


def rebuild(
    program: ExportedProgram,
    gm: GraphModule,
    input_specs: Iterable[InputSpec] | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
    constants: dict[str, torch.Tensor] | None = None,
    example_inputs: tuple | None = None,
) -> ExportedProgram:
    """A new ExportedProgram from an edited graph; the constructor re-verifies it.

    Output specs follow the graph's output node, so a pass may replace the node
    that produces an output (the head's linear, say).
    """
    gm.graph.lint()
    gm.recompile()
    sig = program.graph_signature
    new_sig = ExportGraphSignature(
        input_specs=list(input_specs) if input_specs is not None else copy.copy(sig.input_specs),
        output_specs=_output_specs(gm, sig.output_specs),
    )
    return ExportedProgram(
        root=gm,
        graph=gm.graph,
        graph_signature=new_sig,
        state_dict=dict(state_dict if state_dict is not None else program.state_dict),
        range_constraints=copy.deepcopy(program.range_constraints),
        module_call_graph=copy.deepcopy(program.module_call_graph),
        example_inputs=example_inputs if example_inputs is not None else program.example_inputs,
        constants=dict(constants if constants is not None else program.constants),
        verifiers=program.verifiers,
    )


def _output_specs(gm: GraphModule, specs: list[OutputSpec]) -> list[OutputSpec]:
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return [
        dataclasses.replace(spec, arg=TensorArgument(name=node.name))
        if isinstance(spec.arg, TensorArgument) and isinstance(node, Node) else spec
        for spec, node in zip(specs, outputs)
    ]


# Lifted inputs that hold weights or constants (what a pass may read at compile time).
WEIGHT_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


class LiftedInputs:
    """Working copies of a program's input specs, state_dict and constants, edited beside its graph.

    Passes read the compile-time value behind a placeholder, add a new lifted
    weight next to an existing one, and drop the ones nothing reads any more;
    `rebuild_with` then makes the new ExportedProgram. The original program is
    never touched.
    """

    def __init__(self, program: ExportedProgram):
        self.program = program
        self.specs: list[InputSpec] = list(program.graph_signature.input_specs)
        self.state_dict: dict[str, torch.Tensor] = dict(program.state_dict)
        self.constants: dict[str, torch.Tensor] = dict(program.constants)
        # placeholder name -> its spec, kept with self.specs (a pass over a large model asks thousands of times)
        self._by_name = {getattr(s.arg, "name", None): s for s in self.specs}

    def spec_of(self, node: object) -> InputSpec | None:
        """The input spec of a placeholder node (or placeholder name)."""
        return self._by_name.get(node.name if isinstance(node, Node) else node)

    def value_of(self, spec: InputSpec, materialized: bool = True) -> torch.Tensor:
        """The tensor behind a lifted input; with `materialized=False` possibly a deferred weight
        (frontend/deferred_weights.py) whose values are not made yet: for its shape and dtype only."""
        if spec.kind == InputKind.CONSTANT_TENSOR or (spec.kind == InputKind.BUFFER and not spec.persistent):
            value = self.constants[spec.target]
        else:
            value = self.state_dict[spec.target]
        return materialize(value) if materialized else value

    def weight_value(self, node: object) -> torch.Tensor | None:
        """The tensor behind a lifted weight/buffer/constant placeholder; None for anything else."""
        if not isinstance(node, Node) or node.op != "placeholder":
            return None
        spec = self.spec_of(node)
        if spec is None or spec.kind not in WEIGHT_KINDS:
            return None
        return self.value_of(spec)

    def add_beside(self, gm: GraphModule, original: Node, target: str, value: torch.Tensor, suffix: str) -> Node:
        """A placeholder for a new lifted tensor `target`, right after `original`, of the same kind.

        Parameters stay parameters (one Parameter object shared by every entry
        point, so the importer writes it once); anything else becomes a constant.
        Adding the same target twice returns the first placeholder.
        """
        existing = next((s for s in self.specs if s.target == target), None)
        if existing is not None:
            return next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == existing.arg.name)
        spec = self.spec_of(original)
        with gm.graph.inserting_after(original):
            node = gm.graph.placeholder(original.name + suffix)  # FX makes the name unique in the graph
        ph_name = node.name
        node.meta = dict(original.meta)
        node.meta["val"] = fake_of(gm, value, like=original)
        kind = InputKind.PARAMETER if spec.kind == InputKind.PARAMETER else InputKind.CONSTANT_TENSOR
        at = next(i for i, s in enumerate(self.specs) if s is spec)  # by identity: equality compares fields
        added = InputSpec(kind=kind, arg=TensorArgument(name=ph_name), target=target, persistent=None)
        self.specs.insert(at + 1, added)
        self._by_name[ph_name] = added
        if kind == InputKind.PARAMETER:
            if not isinstance(value, torch.nn.Parameter):
                value = torch.nn.Parameter(value, requires_grad=False)
            self.state_dict[target] = value
        else:
            self.constants[target] = value.detach()
        return node

    def drop_unused(self, gm: GraphModule, only: set[str] | None = None) -> None:
        """Remove lifted weights/constants that no node reads (restricted to placeholder names in `only`)."""
        dropped: list[InputSpec] = []
        for node in [n for n in gm.graph.nodes if n.op == "placeholder" and not n.users]:
            if only is not None and node.name not in only:
                continue
            spec = self.spec_of(node)
            if spec is None or spec.kind not in WEIGHT_KINDS:
                continue
            dropped.append(spec)
            del self._by_name[node.name]
            gm.graph.erase_node(node)
        if not dropped:
            return
        gone = {id(s) for s in dropped}  # by identity: equality compares fields
        self.specs = [s for s in self.specs if id(s) not in gone]
        held = {s.target for s in self.specs}
        for spec in dropped:
            if spec.target not in held:  # no other placeholder reads the same tensor
                self.state_dict.pop(spec.target, None)
                self.constants.pop(spec.target, None)

    def rebuild_with(self, gm: GraphModule) -> ExportedProgram:
        return rebuild(self.program, gm, input_specs=self.specs, state_dict=self.state_dict,
                       constants=self.constants)
