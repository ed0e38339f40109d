"""A model's tensor-parallel form: each layer's mixer and MLP as parts, one set of heads or features each.

`foldline compile --devices N --scheme tensor` exports this form instead of the
reference one. Each part is an ordinary `Attention`, `GatedDeltaNet` or `MLP`
of its own heads or features (contract/tensor_split.py deals them), with its
rows of the input projections, its columns of the output projection and its
own state buffers; the layer adds the parts' outputs. A part computes exactly
what its heads compute in the whole layer, so the passes treat it as they
treat any mixer, and placement (passes/place_devices.py) only has to put each
part on its device, and each reduction's sum on device 0 (below).

The residual stream, the norms and the sums stay on device 0: each device
adds its parts' outputs in part order, device 0 adds the devices' sums in
device order 0, 1, ..., N-1 (a fixed order, so the result is the same on
every run), and the normed row goes to each device that reads it.

The token embedding and the LM head are split by vocabulary rows (a tied
head reads the same rows): each device looks up the ids in its rows, zeros
for the others, and device 0 adds the devices' rows (one non-zero term per
element, so the sum is exact); each device computes the logits of its rows
from the final normed row and device 0 concatenates them.

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
import torch.nn.functional as F
from torch import Tensor, nn

from ..contract.entry_points import kv_tile_size
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
from .model import MLP, Attention, CausalLM, no_initialisers, scale_embedding
from .quant import QuantizedTensor
from .types import ChunkContext

ROWS, COLUMNS = 0, 1
_CUT = re.compile(r"layers\.\d+\.(mixer|mlp)\.")  # the parameters the parts replace
_TABLES = ("embed_tokens.weight", "lm_head.weight")  # replaced by their vocabulary rows
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


class OnDevice(nn.Module):
    """Runs what it is given on one device: placement reads the device from the module path `on_device.<j>`."""

    def forward(self, fn, *args):
        return fn(*args)


class VocabRows(nn.Module):
    """One device's run of vocabulary rows of the embedding table (and of a tied head)."""

    def __init__(self, start: int, weight: nn.Parameter, cfg: ModelConfig):
        super().__init__()
        self.start = start
        self.cfg = cfg
        self.weight = weight

    def forward(self, tokens: Tensor) -> Tensor:
        """The embedded rows of the ids this device holds (scaled as CausalLM.embed scales them), zeros
        for the others."""
        rows = self.weight.shape[0]
        local = tokens - self.start
        held = (local >= 0) & (local < rows)
        x = scale_embedding(F.embedding(local.clamp(0, rows - 1), self.weight), self.cfg)
        return torch.where(held[..., None], x, torch.zeros((), dtype=x.dtype))


class HeadRows(nn.Module):
    """One device's run of vocabulary rows of an untied LM head."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight


def _sum(*terms: Tensor) -> Tensor:
    out = terms[0]
    for t in terms[1:]:
        out = out + t
    return out


def _cat(*pieces: Tensor) -> Tensor:
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)


class TensorParallelLM(CausalLM):
    """A CausalLM whose layers hold parts; its state is every part's buffers (contract.tensor_split)."""

    devices: int = 1

    def state_specs(self, batch: int):
        return [b for b, _device in tensor_state(self.cfg.to_dict(), batch, self.devices)]

    def _sum_on_device_0(self, outputs: list[tuple[int, Tensor]]) -> Tensor:
        """Each device's outputs added on that device in part order, then the devices' sums added on device 0
        in device order."""
        partials: list[Tensor | None] = [None] * self.devices
        for device, y in outputs:
            partials[device] = y if partials[device] is None else partials[device] + y
        return self.on_device[0](_sum, *[p for p in partials if p is not None])

    def head_rows(self, h: Tensor, device: int) -> Tensor:
        """The float32 logits of one device's vocabulary rows."""
        weight = self.vocab[device].weight if self.cfg.tie_word_embeddings else self.vocab_head[device].weight
        logits = F.linear(h, weight)
        if self.cfg.final_logit_softcap is not None:
            cap = self.cfg.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def forward(
        self, tokens: Tensor, start_pos: Tensor, n_valid: Tensor, *state: Tensor, host_pos: int | None = None,
        kv_tiles: int | None = None, all_logits: bool = False,
    ) -> Tensor:
        """As CausalLM.forward: the residual stream on device 0, each part on its device."""
        b, c = tokens.shape
        n, cfg = self.devices, self.cfg
        x = self._sum_on_device_0([(j, self.vocab[j](tokens)) for j in range(n)])
        positions = start_pos[:, None] + torch.arange(c, dtype=start_pos.dtype)
        tile = kv_tile_size(cfg.max_context)
        if kv_tiles is not None:
            kv_length = kv_tiles * tile
        elif host_pos is not None:
            kv_length = (host_pos // tile + 1) * tile
        else:
            kv_length = None
        ctx = ChunkContext(start_pos=start_pos, n_valid=n_valid, positions=positions, embed=x, host_pos=host_pos,
                           kv_length=kv_length)
        peri = cfg.norm_placement == "peri"
        start = 0
        for i, layer in enumerate(self.layers):
            h = layer.input_norm(x)
            outputs = []
            for part, device in zip(layer.mixer.parts, self.mixer_devices[i], strict=True):
                outputs.append((device, part(h, ctx, *state[start:start + part.state_count])))
                start += part.state_count
            out = self._sum_on_device_0(outputs)
            x = x + (layer.post_mixer_norm(out) if peri else out)
            h = layer.mlp_norm(x)
            out = self._sum_on_device_0([(device, part(h)) for part, device in zip(layer.mlp.parts, self.mlp_devices,
                                                                                     strict=True)])
            x = x + (layer.post_mlp_norm(out) if peri else out)
        if not all_logits:
            last = (n_valid - 1).clamp(min=0)
            x = torch.gather(x, 1, last[:, None, None].expand(b, 1, x.shape[-1]))[:, 0]
        h = self.norm(x)
        return self.on_device[0](_cat, *[self.on_device[j](self.head_rows, h, j) for j in range(n)])


def split_model(model: CausalLM, blocks: dict[str, QuantizedTensor], devices: int
                ) -> tuple[TensorParallelLM, dict[str, QuantizedTensor]]:
    """The tensor-parallel form of `model` over `devices`, and the checkpoint blocks of its parameters.

    `model` is left as it was: the new module shares its embedding, norms and head.
    """
    cfg = model.cfg
    if cfg.vocab_size < devices:
        raise ConfigError(f"--scheme tensor deals the {cfg.vocab_size} vocabulary rows over the devices: "
                          f"{devices} devices would leave some with none")
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
    split.mixer_devices = [[p.device for p in mixer_parts(whole, i, devices)] for i in range(cfg.num_layers)]
    split.mlp_devices = mlp_part_devices(whole, devices)
    split.on_device = nn.ModuleList(OnDevice() for _ in range(devices))
    runs = deal_runs(cfg.vocab_size, devices)
    table = model.embed_tokens.weight
    split.vocab = nn.ModuleList(
        VocabRows(run.start, cut.rows(table, "embed_tokens.weight", f"vocab.{j}.weight", run), cfg)
        for j, run in enumerate(runs))
    split._modules.pop("embed_tokens", None)
    if not cfg.tie_word_embeddings:
        split.vocab_head = nn.ModuleList(
            HeadRows(cut.rows(model.lm_head.weight, "lm_head.weight", f"vocab_head.{j}.weight", run))
            for j, run in enumerate(runs))
        split._modules.pop("lm_head", None)
    kept = {name: b for name, b in blocks.items() if not _CUT.match(name) and name not in _TABLES}  # the norms
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

    def rows(self, source: nn.Parameter, whole_name: str, part_name: str, run: range) -> nn.Parameter:
        """A run of rows of a whole table, with its blocks."""
        value, blocks = self._cut(source, self.source.get(whole_name), ROWS, np.arange(run.start, run.stop))
        if blocks is not None:
            self.blocks[part_name] = blocks
        return value

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
