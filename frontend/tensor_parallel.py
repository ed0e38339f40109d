"""A model's tensor-parallel form: each layer's mixer and MLP as parts, one set of heads or features each.

`foldline compile --devices N --scheme tensor` exports this form instead of the
reference one. Each part is an ordinary `Attention`, `GatedDeltaNet` or `MLP`
of its own heads or features (contract/tensor_split.py deals them), with its
rows of the input projections, its columns of the output projection and its
own state buffers; the layer adds the parts' outputs. A part computes exactly
what its heads compute in the whole layer, so the passes treat it as they
treat any mixer, and placement (passes/place_devices.py) only has to put each
part on its device: the sum of the parts is then the all-reduce, a move of
each part's output to device 0 and an add, and the normed hidden row moved to
every device is its broadcast.

The embedding, the final norm and the head stay whole on device 0.

Weights are cut, not copied: float weights by index, a checkpoint's blocks by
row or by whole groups of columns (quant.QuantizedTensor.take_rows /
take_columns), deferred weights stay deferred. Columns that cut a block group
(a part's input columns not whole groups) leave that part's weight as
floats, as a weight without blocks is (requantized with --weights int8/int4).
"""

from __future__ import annotations

import copy
import re
from dataclasses import replace

import numpy as np
import torch
from torch import Tensor, nn

from ..contract.tensor_split import (
    HeadPart,
    deal_runs,
    mixer_parts,
    mlp_part_devices,
    part_config,
    tensor_state,
)
from .config import ConfigError, ModelConfig
from .deferred_weights import blocks_of, defer, materialize
from .gdn import GatedDeltaNet, GatedRMSNorm
from .layers import RMSNorm
from .model import MLP, Attention, CausalLM, no_initialisers
from .quant import QuantizedTensor
from .types import ChunkContext

ROWS, COLUMNS = 0, 1
_CUT = re.compile(r"layers\.\d+\.(mixer|mlp)\.")  # the parameters the parts replace
# The modules a part may be cut from: anything else (a Hadamard wrapper around a projection) is refused.
_PLAIN = (nn.Linear, RMSNorm, GatedRMSNorm, Attention, GatedDeltaNet, MLP)


class MixerParts(nn.Module):
    """A layer's mixer as parts on their devices; the output is the sum of theirs."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    @property
    def state_count(self) -> int:
        return sum(p.state_count for p in self.parts)

    def forward(self, h: Tensor, ctx: ChunkContext, *state: Tensor) -> Tensor:
        out, start = None, 0
        for part in self.parts:
            y = part(h, ctx, *state[start : start + part.state_count])
            start += part.state_count
            out = y if out is None else out + y
        return out


class MLPParts(nn.Module):
    """A layer's MLP as runs of features on their devices; the output is the sum of theirs."""

    def __init__(self, parts: list[MLP]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: Tensor) -> Tensor:
        out = None
        for part in self.parts:
            y = part(x)
            out = y if out is None else out + y
        return out


class TensorParallelLM(CausalLM):
    """A CausalLM whose layers hold parts; its state is every part's buffers (contract.tensor_split)."""

    devices: int = 1

    def state_specs(self, batch: int):
        return [b for b, _device in tensor_state(self.cfg.to_dict(), batch, self.devices)]


def split_model(model: CausalLM, blocks: dict[str, QuantizedTensor], devices: int
                ) -> tuple[TensorParallelLM, dict[str, QuantizedTensor]]:
    """The tensor-parallel form of `model` over `devices`, and the checkpoint blocks of its parameters.

    `model` is left as it was: the new module shares its embedding, norms and head.
    """
    cfg = model.cfg
    whole = cfg.to_dict()
    split = copy.copy(model)
    split.__class__ = TensorParallelLM
    split.devices = devices
    split._modules = dict(model._modules)
    split.layers = nn.ModuleList()
    cut = _Cutter(blocks)
    for i, layer in enumerate(model.layers):
        _check_plain(layer.mixer, f"layers.{i}.mixer")
        _check_plain(layer.mlp, f"layers.{i}.mlp")
        new = copy.copy(layer)
        new._modules = dict(layer._modules)
        prefix = f"layers.{i}."
        mixers = []
        for p, part in enumerate(mixer_parts(whole, i, devices)):
            part_cfg = _config(cfg, part_config(whole, i, part))
            make = GatedDeltaNet if cfg.layer_types[i] == "gdn" else Attention
            mixers.append(cut.part(make, (part_cfg, i), layer.mixer, _mixer_index(cfg, i, part),
                                   prefix + "mixer.", f"{prefix}mixer.parts.{p}."))
        new.mixer = MixerParts(mixers)
        mlps = []
        runs = deal_runs(cfg.intermediate_size, devices)
        for j, device in enumerate(mlp_part_devices(whole, devices)):
            run = runs[device]
            features = np.arange(run.start, run.stop)
            index = {"gate_proj.weight": (ROWS, features), "up_proj.weight": (ROWS, features),
                     "down_proj.weight": (COLUMNS, features)}
            mlps.append(cut.part(MLP, (replace(cfg, intermediate_size=len(run)),), layer.mlp, index,
                                 prefix + "mlp.", f"{prefix}mlp.parts.{j}."))
        new.mlp = MLPParts(mlps)
        split.layers.append(new)
    kept = {name: b for name, b in blocks.items() if not _CUT.match(name)}  # the tables, the norms
    return split, {**kept, **cut.blocks}


def _check_plain(module: nn.Module, path: str) -> None:
    for name, sub in module.named_modules():
        if not isinstance(sub, _PLAIN) or (isinstance(sub, nn.Linear) and type(sub) is not nn.Linear):
            raise ConfigError(f"{path}.{name} is a {type(sub).__name__}: a tensor-parallel split cuts plain "
                              "projections only (compile a Hadamard-rotated checkpoint with --scheme pipeline)")


def _config(cfg: ModelConfig, part: dict) -> ModelConfig:
    whole = cfg.to_dict()
    return replace(cfg, **{k: v for k, v in part.items() if whole.get(k) != v})


def _heads(heads: tuple[int, ...], width: int, offset: int = 0) -> np.ndarray:
    """The rows of `heads` in a projection whose heads are `width` rows each, starting at row `offset`."""
    return np.concatenate([offset + h * width + np.arange(width) for h in heads])


def _mixer_index(cfg: ModelConfig, layer: int, part: HeadPart) -> dict[str, tuple[int, np.ndarray]]:
    """Each cut parameter of one part: the axis it is cut along and the indices it keeps, in order."""
    if cfg.layer_types[layer] == "gdn":
        dk, dv, nk = cfg.gdn_head_k_dim, cfg.gdn_head_v_dim, cfg.gdn_num_k_heads
        channels = np.concatenate([_heads(part.shared, dk), _heads(part.shared, dk, nk * dk),
                                   _heads(part.query, dv, 2 * nk * dk)])
        values = np.asarray(part.query)
        return {"in_proj_qkv.weight": (ROWS, channels), "conv1d_weight": (ROWS, channels),
                "in_proj_z.weight": (ROWS, _heads(part.query, dv)), "in_proj_b.weight": (ROWS, values),
                "in_proj_a.weight": (ROWS, values), "dt_bias": (ROWS, values), "A_log": (ROWS, values),
                "out_proj.weight": (COLUMNS, _heads(part.query, dv))}
    hd = cfg.head_dim
    q = _heads(part.query, hd * (2 if cfg.attn_output_gate == "fused_q" else 1))
    kv = _heads(part.shared, hd)
    return {"q_proj.weight": (ROWS, q), "q_proj.bias": (ROWS, q), "k_proj.weight": (ROWS, kv),
            "k_proj.bias": (ROWS, kv), "v_proj.weight": (ROWS, kv), "v_proj.bias": (ROWS, kv),
            "gate_proj.weight": (ROWS, _heads(part.query, hd)), "o_proj.weight": (COLUMNS, _heads(part.query, hd))}


class _Cutter:
    """Cuts parts out of whole modules; collects the blocks of the parts' parameters."""

    def __init__(self, blocks: dict[str, QuantizedTensor]):
        self.source = blocks
        self.blocks: dict[str, QuantizedTensor] = {}

    def part(self, make, args: tuple, whole: nn.Module, index: dict[str, tuple[int, np.ndarray]],
             whole_prefix: str, part_prefix: str) -> nn.Module:
        with torch.device("meta"), no_initialisers():
            part = make(*args)
        params = dict(whole.named_parameters())
        state = {}
        for name, meta in part.named_parameters():
            source = params[name]
            axis, keep = index.get(name, (None, None))
            value, blocks = self._cut(source, self.source.get(whole_prefix + name), axis, keep)
            if tuple(value.shape) != tuple(meta.shape):
                raise ConfigError(f"{part_prefix}{name}: cut to {tuple(value.shape)}, the part needs "
                                  f"{tuple(meta.shape)}")
            state[name] = value
            if blocks is not None:
                self.blocks[part_prefix + name] = blocks
        part.load_state_dict(state, strict=True, assign=True)
        return part.eval()

    @staticmethod
    def _cut(source: nn.Parameter, blocks: QuantizedTensor | None, axis: int | None, keep: np.ndarray | None
             ) -> tuple[nn.Parameter, QuantizedTensor | None]:
        if axis is None:  # a norm, a scalar: every part holds its own copy
            return nn.Parameter(materialize(source).detach().clone(), requires_grad=False), blocks
        part_blocks = None
        if blocks is not None:
            part_blocks = blocks.take_rows(keep) if axis == ROWS else blocks.take_columns(keep)
        if part_blocks is not None and blocks_of(source) is not None:
            shape = list(source.shape)
            shape[axis] = len(keep)
            return defer(tuple(shape), part_blocks, source.dtype), part_blocks
        value = materialize(source).detach().index_select(axis, torch.from_numpy(keep)).contiguous()
        return nn.Parameter(value, requires_grad=False), part_blocks
