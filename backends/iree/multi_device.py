"""A placed program (passes/place_devices.py) as one IREE module over N devices.

IREE compiles one program for several devices when it is told where values
live; it then schedules each dispatch on the device of its operands and
lowers the moves between devices to queue transfers. This module tells it:

- each `foldline::to_device` op becomes `flow.tensor.transfer` to that device;
- each entry point's tensor arguments (token ids and counts on device 0, state
  buffers on their layers' device) and its logits carry `iree.abi.affinity`;
- each weight's `util.global` carries `stream.affinity`, so the parameter is
  loaded into the memory of the device that reads it, and reads it from that
  device's parameter scope: device 0's weights are `params.irpa` (scope
  `model`), device j's `params.device<j>.irpa` (scope `device<j>`), so each
  device's weights can be shipped and opened on their own;
- the target's `--iree-hal-target-backends` flag becomes one
  `--iree-hal-target-device` per device, all of the target's backend.

Devices are named `__device_0` .. `__device_{N-1}`; the runtime opens as many,
in order (runtime/device.py).
"""

from __future__ import annotations

from iree.compiler import ir

from ...kernels.sites import SiteError, shape_and_type, torch_operators
from ...passes.place_devices import Placement
from .importer import PARAM_SCOPE, named_parameter, parameter_key

TO_DEVICE_OPERATOR = "torch.foldline.to_device"
_BACKENDS_FLAG = "--iree-hal-target-backends="
_DEVICE_KINDS = {"cuda": "cuda", "vulkan-spirv": "vulkan"}  # an IREE backend -> its HAL device; else local
_ELEMENTS = {"f32": "f32", "f16": "f16", "bf16": "bf16", "f64": "f64", "si64": "i64", "si32": "i32", "si16": "i16",
             "si8": "i8", "ui8": "i8", "i1": "i1"}


class PlacementError(RuntimeError):
    """A placed module that cannot be expressed for several devices (a bug, not a user error)."""


def device_symbol(index: int) -> str:
    return f"__device_{index}"


def device_promise(index: int) -> ir.Attribute:
    return ir.Attribute.parse(f"#hal.device.promise<@{device_symbol(index)}>")


def device_scope(index: int) -> str:
    """The parameter scope (and file) of a device's weights: device 0 keeps the one-device `model`."""
    return PARAM_SCOPE if index == 0 else f"device{index}"


def weight_device(global_name: str, placement: Placement) -> int | None:
    """The device a weight's util.global lives on (the importer drops the `model.` of a target); None for
    a constant the placement does not name, which IREE places by its uses (its parameter: device 0's)."""
    return placement.weights.get(global_name, placement.weights.get(f"model.{global_name}"))


def parameters_by_device(keys: dict[str, str], placement: Placement) -> list[set[str]]:
    """Per device, the parameters its weights read (`keys`: util.global name -> parameter). A table read
    on two devices (a tied head's copy) is in both."""
    found: list[set[str]] = [set() for _ in range(placement.devices)]
    for name, key in keys.items():
        found[weight_device(name, placement) or 0].add(key)
    return found


def multi_device_flags(flags: list[str], devices: int) -> list[str]:
    """A target's iree-compile flags for `devices` local devices of its backend."""
    backends = [f for f in flags if f.startswith(_BACKENDS_FLAG)]
    if len(backends) != 1:
        raise PlacementError(f"expected one {_BACKENDS_FLAG} flag, got {backends}")
    backend = backends[0][len(_BACKENDS_FLAG):]
    kind = _DEVICE_KINDS.get(backend, "local")
    devices_flags = [f"--iree-hal-target-device={device_symbol(j)}={kind}[{j}]" for j in range(devices)]
    if kind == "local":
        devices_flags.append(f"--iree-hal-local-target-device-backends={backend}")
    return [f for f in flags if not f.startswith(_BACKENDS_FLAG)] + devices_flags


def _builtin_type(value: ir.Value) -> str:
    """A static `!torch.vtensor<[1,8,64],f32>` value's builtin type, `tensor<1x8x64xf32>`."""
    try:
        shape, element = shape_and_type(value)
    except SiteError as e:
        raise PlacementError(f"cannot move a value of type {value.type} between devices") from e
    if element not in _ELEMENTS:
        raise PlacementError(f"cannot move a value of type {value.type} between devices")
    return f"tensor<{''.join(f'{d}x' for d in shape)}{_ELEMENTS[element]}>"


def _device_of(op: ir.Operation) -> int:
    const = op.operands[1].owner
    if const.name != "torch.constant.int":
        raise PlacementError(f"{TO_DEVICE_OPERATOR}'s device is not a constant: {const}")
    return ir.IntegerAttr(const.attributes["value"]).value


def _lower_moves(module: ir.Module) -> int:
    moves = torch_operators(module, (TO_DEVICE_OPERATOR,))
    for op in moves:
        source = op.operands[0]
        builtin = ir.Type.parse(_builtin_type(source))
        with ir.InsertionPoint(op), op.location:
            value = ir.Operation.create("torch_c.to_builtin_tensor", results=[builtin], operands=[source]).result
            moved = ir.Operation.create("flow.tensor.transfer", results=[builtin], operands=[value],
                                        attributes={"target": device_promise(_device_of(op))}).result
            back = ir.Operation.create("torch_c.from_builtin_tensor", results=[op.results[0].type], operands=[moved])
        op.results[0].replace_all_uses_with(back.result)
        op.erase()
    return len(moves)


def _read_from_device_scope(weight: ir.Operation, name: str, device: int) -> None:
    """Point a weight's util.global at its parameter in `device`'s scope, when it reads one (the importer's
    `model` scope); a global with any other initial value keeps it."""
    if "initial_value" not in weight.attributes:
        return
    tensor_type = str(ir.TypeAttr(weight.attributes["type"]).value)
    key = parameter_key(name)
    initial = weight.attributes["initial_value"]
    if initial == named_parameter(PARAM_SCOPE, key, tensor_type):
        weight.attributes["initial_value"] = named_parameter(device_scope(device), key, tensor_type)
    elif initial.typeid == named_parameter(PARAM_SCOPE, key, tensor_type).typeid:
        raise PlacementError(f"util.global @{name} reads {initial}, not the importer's parameter {key!r}")


def _affinities(devices: list[int | None]) -> ir.ArrayAttr:
    return ir.ArrayAttr.get([ir.DictAttr.get({} if d is None else {"iree.abi.affinity": device_promise(d)})
                             for d in devices])


def place_module(mlir: str, placement: Placement) -> tuple[str, int]:
    """The torch-dialect module with every placement spelled for IREE; returns (text, moves lowered)."""
    with ir.Context() as ctx:
        ctx.allow_unregistered_dialects = True
        module = ir.Module.parse(mlir)
        for op in module.body.operations:
            op = op.operation
            if op.name == "util.global":
                name = ir.StringAttr(op.attributes["sym_name"]).value
                device = weight_device(name, placement)
                if device is None:
                    continue
                op.attributes["stream.affinity"] = device_promise(device)
                if device:
                    _read_from_device_scope(op, name, device)
            elif op.name == "func.func":
                name = ir.StringAttr(op.attributes["sym_name"]).value
                inputs = placement.inputs.get(name)
                function_type = ir.FunctionType(ir.TypeAttr(op.attributes["function_type"]).value)
                if inputs is None or len(inputs) != len(function_type.inputs):
                    raise PlacementError(f"entry point {name}: {len(function_type.inputs)} arguments, placement "
                                         f"for {None if inputs is None else len(inputs)}")
                op.attributes["arg_attrs"] = _affinities(inputs)
                op.attributes["res_attrs"] = _affinities([placement.result] * len(function_type.results))
        moves = _lower_moves(module)
        return str(module), moves
