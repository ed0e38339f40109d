"""Placement over several devices (passes/place_devices.py): a value moved to device `device`.

The identity in eager; IREE's `flow.tensor.transfer` in a module compiled for
several devices (backends/iree/multi_device.py), where lowering keeps the op.
"""

from __future__ import annotations

from torch import Tensor

from .op_registry import declare_op


def to_device_impl(x: Tensor, device: int) -> Tensor:
    """One device's view of a move: the value itself (a target without several devices decomposes it)."""
    return x.clone()


TO_DEVICE = declare_op("to_device", to_device_impl, ["x"])
