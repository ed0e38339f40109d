"""place-on-devices: every node of every entry point placed on one of N devices, by layers or by parts.

Two schemes, as `foldline plan --devices N --scheme ...` counts them (passes/shard_plan.py),
so the plan and the compiled bundle hold the same state per device:
- pipeline: device j runs a contiguous run of layers with their weights and state;
- tensor: the program is the tensor-parallel form (frontend/tensor_parallel.py),
  each layer's mixer and MLP in parts; each part runs on its device
  (contract/tensor_split.py), each device's vocabulary rows and logits on that
  device, the reductions' sums on device 0, and every other node (norms,
  residual adds) with its first computed input, so on device 0: each device's
  partial output is moved to device 0 and added (the all-reduce), the normed
  rows moved to each part's device.

Placement, node by node:
- pipeline: a node inside layer i (its module stack names `layers.i`) runs on layer i's device;
- tensor: a node inside a part (`layers.i.mixer.parts.p`, `layers.i.mlp.parts.p`) runs on the
  part's device, one inside `on_device.j`, `vocab.j` or `vocab_head.j` on device j;
- the token ids, positions and counts arrive on device 0; a state buffer on its layers' device;
- any other node follows its first input that is computed (not a weight): the
  embedding lookup runs on device 0 with the token ids, the final norm and the head
  on the last device with the last layer's output; a node computed from weights and
  constants alone (a norm's 1 + weight) runs where it is read;
- a weight lives where it is read; one read on several devices (a head tied to the
  embedding) gets a copy per device, `<name>@device<j>` (the parameter archive holds it once).

Where a value is read on a device other than its own, a `foldline::to_device` node
moves it there, once per value and device: the hidden rows at each boundary, plus
the few small tensors every layer reads (positions, counts, Ripple's embedded rows).
The op is the identity in eager, so the placed program computes exactly what the
unplaced one does; backends/iree/multi_device.py turns it into IREE's transfer.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

from ..contract.manifest import DevicePlacement, ParamsEntry
from ..contract.tensor_split import mixer_parts, mlp_part_devices, tensor_state
from ..frontend.config import ConfigError
from ..frontend.device_ops import TO_DEVICE
from .graph_edit import WEIGHT_KINDS, LiftedInputs, copy_graph_module
from .registry import CompileUnit, PassResult, register_pass
from .shard_plan import shard_plan

NAME = "place-on-devices"
PLACED = "placed"  # the unit option holding the Placement once the pass has run
SOURCE_DEVICE = "source_device"  # a move's meta: the device the value is moved from
COPY_SUFFIX = "@device"  # a weight's copy on another device: `<target>@device<j>`
# An integer tensor up to this size computed from the entry point's own inputs (positions, counts, slot
# indices) is computed again on each device that reads it rather than moved: a move is a queue transfer
# the reading device waits on, the computation a few integer ops.
RECOMPUTE_MAX_ELEMENTS = 4096
_INDEX_DTYPES = (torch.int64, torch.int32, torch.bool)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
_PART = re.compile(r"(?:^|\.)layers\.(\d+)\.(mixer|mlp)\.parts\.(\d+)(?:\.|$)")
# The tensor-parallel form's modules that name their device (frontend/tensor_parallel.py): the reductions'
# sums and the logits' concatenation (`on_device.0`), each device's vocabulary rows and logits.
_PINNED = re.compile(r"(?:^|\.)(?:on_device|vocab|vocab_head)\.(\d+)(?:\.|$)")


@dataclass
class Placement:
    """Where everything of a bundle compiled for several devices lives (recorded in its manifest)."""

    devices: int
    scheme: str  # "pipeline" or "tensor" (shard_plan.SCHEMES)
    layers: list[tuple[int, int]]  # per device: first and last layer it runs (tensor: every layer)
    state: list[int]  # per state buffer, in the entry points' argument order: its device
    weights: dict[str, int] = field(default_factory=dict)  # lifted weight target -> device
    inputs: dict[str, list[int | None]] = field(default_factory=dict)  # entry point -> device per user input
    result: int = 0  # the device the logits are computed on

    def manifest_entry(self, archives: list[ParamsEntry] | None = None) -> DevicePlacement:
        """What the manifest records: the runs, the state's devices, the logits' device, and the parameter
        archives of devices 1 .. N-1."""
        return DevicePlacement(self.devices, self.scheme, list(self.layers), list(self.state), self.result,
                               list(archives or []))


def layer_in_path(path: str) -> int | None:
    """The layer index a module path or parameter target names (`model.layers.3.mixer` -> 3)."""
    found = _LAYER.findall(path)
    return int(found[-1]) if found else None


def _module_paths(node: Node) -> list[str]:
    """The module paths a node was traced in, innermost first."""
    return [path for path, _cls in reversed(list((node.meta.get("nn_module_stack") or {}).values()))]


def _node_layer(node: Node) -> int | None:
    for path in _module_paths(node):
        layer = layer_in_path(path)
        if layer is not None:
            return layer
    return None


def node_part(node: Node) -> tuple[int, str, int] | None:
    """(layer, "mixer" or "mlp", part index) of a node traced inside a tensor-parallel part."""
    for path in _module_paths(node):
        found = _PART.findall(path)
        if found:
            layer, block, part = found[-1]
            return int(layer), block, int(part)
    return None


# Where a node runs by the module it was traced in, or None: where its first computed input is.
NodeHome = Callable[[Node], "int | None"]


def pipeline_home(layer_device: list[int]) -> NodeHome:
    def home(node: Node) -> int | None:
        layer = _node_layer(node)
        return None if layer is None else layer_device[layer]
    return home


def tensor_home(unit: CompileUnit, devices: int) -> NodeHome:
    whole = unit.config.to_dict()
    mixer = [[p.device for p in mixer_parts(whole, i, devices)] for i in range(unit.config.num_layers)]
    mlp = mlp_part_devices(whole, devices)

    def home(node: Node) -> int | None:
        part = node_part(node)
        if part is not None:
            layer, block, index = part
            return mixer[layer][index] if block == "mixer" else mlp[index]
        return node_pin(node)
    return home


def node_pin(node: Node) -> int | None:
    """The device a tensor-parallel node is pinned to by its module (`on_device.<j>`, `vocab.<j>`), or None."""
    for path in _module_paths(node):
        found = _PINNED.findall(path)
        if found:
            return int(found[-1])
    return None


def _is_tensor(node: object) -> bool:
    return isinstance(node, Node) and isinstance(node.meta.get("val"), torch.Tensor)


class _Placer:
    """Places one program's nodes and inserts the moves between devices."""

    def __init__(self, program: ExportedProgram, placement: Placement, home: NodeHome):
        self.program = program
        self.placement = placement
        self.home = home
        self.gm: GraphModule = copy_graph_module(program)
        self.lifted = LiftedInputs(program)
        self.device: dict[Node, int] = {}
        self.moves = 0
        self.recomputed = 0
        self._user_inputs: set[Node] = set()
        self._recomputable: dict[Node, bool] = {}
        self._on_device: dict[tuple[Node, int], Node] = {}  # (value, device) -> its move or recomputation
        self._copies: set[Node] = set()  # recomputations (their inputs are already on their device)

    def run(self) -> tuple[ExportedProgram, list[int | None], int, int]:
        user_devices = self._place_inputs()
        weights = [n for n in self.gm.graph.nodes if n.op == "placeholder" and self._is_weight(n)]
        free = []
        for node in self.gm.graph.nodes:
            if node.op == "call_function":
                device = self._place_op(node)
                if device is None:
                    free.append(node)
                else:
                    self.device[node] = device
        for node in reversed(free):  # computed from weights and constants alone: where it is read
            readers = [self.device[u] for u in node.users if u in self.device]
            self.device[node] = min(readers, default=0)
        self._place_weights(weights)
        self._insert_moves()
        self.gm.graph.eliminate_dead_code()
        return self.lifted.rebuild_with(self.gm), user_devices, self.moves, self.recomputed

    def _is_weight(self, node: Node) -> bool:
        spec = self.lifted.spec_of(node)
        return spec is not None and spec.kind in WEIGHT_KINDS

    def _place_inputs(self) -> list[int | None]:
        """User inputs: state buffers on their layers' device, everything else on device 0."""
        user = [s for s in self.program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
        n_state = len(self.placement.state)
        by_name = {n.name: n for n in self.gm.graph.nodes if n.op == "placeholder"}
        devices: list[int | None] = []
        for i, spec in enumerate(user):
            node = by_name[spec.arg.name]
            j = i - (len(user) - n_state)
            self.device[node] = self.placement.state[j] if j >= 0 else 0
            if j < 0:
                self._user_inputs.add(node)
            devices.append(self.device[node] if _is_tensor(node) else None)
        return devices

    def _place_op(self, node: Node) -> int | None:
        """Its module's device, else its first computed input's; None when it reads only weights and constants."""
        device = self.home(node)
        if device is not None:
            return device
        for arg in node.all_input_nodes:
            if arg in self.device and not (arg.op == "placeholder" and self._is_weight(arg)):
                return self.device[arg]
        return None

    def _place_weights(self, weights: list[Node]) -> None:
        """Each weight on the device of its readers; a copy per further device that reads it."""
        for node in weights:
            spec = self.lifted.spec_of(node)
            readers: dict[int, list[Node]] = {}
            for user in node.users:
                readers.setdefault(self.device.get(user, 0), []).append(user)
            if not readers:
                continue
            home, *others = sorted(readers)
            self.device[node] = home
            self.placement.weights[spec.target] = home
            for j in others:
                value = self.lifted.value_of(spec, materialized=False)
                copy = self.lifted.add_beside(self.gm, node, f"{spec.target}{COPY_SUFFIX}{j}", value,
                                              f"_device{j}")
                self.device[copy] = j
                self.placement.weights[f"{spec.target}{COPY_SUFFIX}{j}"] = j
                for user in readers[j]:
                    user.replace_input_with(node, copy)

    def _insert_moves(self) -> None:
        for node in list(self.gm.graph.nodes):
            if node.op != "call_function" or node.target is TO_DEVICE or node in self._copies:
                continue
            here = self.device[node]
            for arg in node.all_input_nodes:
                if _is_tensor(arg) and self.device.get(arg, here) != here:
                    node.replace_input_with(arg, self._value_on(arg, here, node))

    def _value_on(self, value: Node, device: int, before: Node) -> Node:
        """`value` on `device`, inserted before `before`: computed again there when it is a small integer
        tensor of the entry point's inputs, else moved; once per value and device."""
        if self.device.get(value, device) == device:
            return value
        key = (value, device)
        if key not in self._on_device:
            if self._is_recomputable(value):
                args, kwargs = map_arg((value.args, value.kwargs), lambda a: self._value_on(a, device, before))
                with self.gm.graph.inserting_before(before):
                    copy = self.gm.graph.call_function(value.target, args, kwargs)
                copy.meta = dict(value.meta)
                self._copies.add(copy)
                self.recomputed += 1
            else:
                with self.gm.graph.inserting_before(before):
                    copy = self.gm.graph.call_function(TO_DEVICE, (value, device))
                copy.meta = {"val": value.meta["val"], "nn_module_stack": before.meta.get("nn_module_stack", {}),
                             SOURCE_DEVICE: self.device[value]}
                self.moves += 1
            self.device[copy] = device
            self._on_device[key] = copy
        return self._on_device[key]

    def _is_recomputable(self, node: Node) -> bool:
        """A small integer tensor computed from the entry point's own inputs (not state, not weights)."""
        if node not in self._recomputable:
            val = node.meta.get("val")
            numel = val.numel() if isinstance(val, torch.Tensor) else None
            self._recomputable[node] = (
                node.op == "call_function" and isinstance(numel, int) and numel <= RECOMPUTE_MAX_ELEMENTS
                and val.dtype in _INDEX_DTYPES
                and all(a in self._user_inputs or self._is_recomputable(a) for a in node.all_input_nodes))
        return self._recomputable[node]


def pipeline_runs(unit: CompileUnit, devices: int) -> list[tuple[int, int]]:
    """The layer runs `foldline plan MODEL --devices N --scheme pipeline` prints for this model."""
    plan = shard_plan(unit.config, devices, batch=unit.state_specs[0].shape[0], scheme="pipeline")
    return [d.layers for d in plan.devices]


def place(unit: CompileUnit, devices: int, scheme: str = "pipeline") -> tuple[Placement, int, int]:
    """Place every entry point of `unit` (in place) on `devices` devices; returns the placement, the moves
    and the values computed again on another device instead of moved."""
    if scheme == "tensor":
        placement, home = _tensor_placement(unit, devices)
    else:
        placement, home = _pipeline_placement(unit, devices)
    moves = recomputed = 0
    for name, program in list(unit.programs.items()):
        unit.programs[name], placement.inputs[name], count, again = _Placer(program, placement, home).run()
        moves, recomputed = moves + count, recomputed + again
    return placement, moves, recomputed


def _pipeline_placement(unit: CompileUnit, devices: int) -> tuple[Placement, NodeHome]:
    runs = pipeline_runs(unit, devices)
    layer_device = [0] * unit.config.num_layers
    for j, (first, last) in enumerate(runs):
        for i in range(first, last + 1):
            layer_device[i] = j
    state = []
    for spec in unit.state_specs:
        held = {layer_device[i] for i in spec.layers}
        if len(held) != 1:
            raise ConfigError(f"state buffer {spec.name} holds layers {list(spec.layers)}, which the pipeline "
                              f"puts on devices {sorted(held)}: a buffer must live on one device")
        state.append(held.pop())
    return Placement(devices, "pipeline", runs, state, result=devices - 1), pipeline_home(layer_device)


def _tensor_placement(unit: CompileUnit, devices: int) -> tuple[Placement, NodeHome]:
    cfg = unit.config
    expected = tensor_state(cfg.to_dict(), unit.state_specs[0].shape[0], devices)
    if [b.name for b, _ in expected] != [s.name for s in unit.state_specs]:
        raise ConfigError(f"--scheme tensor places the tensor-parallel form of {cfg.name} over {devices} devices; "
                          "these programs were exported from another form (frontend/tensor_parallel.split_model)")
    layers = [(0, cfg.num_layers - 1)] * devices
    return (Placement(devices, "tensor", layers, [d for _, d in expected], result=0),
            tensor_home(unit, devices))


@register_pass(NAME, "places layers (pipeline) or layer parts (tensor) on N devices, with moves where values cross")
def place_on_devices(unit: CompileUnit) -> PassResult:
    devices = int(unit.options.get("devices", 1))
    if devices <= 1 or unit.options.get(PLACED) is not None:
        return PassResult(changed=False, notes=["one device" if devices <= 1 else "already placed"])
    scheme = unit.options.get("scheme", "pipeline")
    placement, moves, recomputed = place(unit, devices, scheme)
    unit.options[PLACED] = placement
    if scheme == "tensor":
        runs = f"every layer in parts, state per device {[placement.state.count(j) for j in range(devices)]} buffers"
    else:
        runs = "layers " + ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in placement.layers)
    copies = sum(COPY_SUFFIX in t for t in placement.weights)
    notes = [f"{devices} devices, {scheme}: {runs}", f"{moves} move(s) over {len(unit.programs)} entry point(s)",
             f"{recomputed} index value(s) computed again on the device that reads them"]
    if copies:
        notes.append(f"{copies} weight(s) copied to a second device")
    return PassResult(changed=True, sites=moves, notes=notes, details=placement.manifest_entry().to_json())
