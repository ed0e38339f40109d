"""Load a GGUF checkpoint: config, reference module with float32 weights, tokenizer.

The file is read by `gguf_file.GGUFFile`; the architecture module named by
`general.architecture` (`frontend/arch/`) says what the metadata and tensor
names mean and how stored values differ from the module's. Every weight is
dequantized to float32, one tensor at a time, straight into a module built on
the meta device, so peak memory stays near the size of the float32 model.

A weight whose blocks repack exactly into foldline's formats (frontend/quant.py)
is repacked once: the blocks are what a compile keeps, and their dequantization
is the module's float value. Loaded for compiling only (`defer_block_weights`),
such a weight is not dequantized at all: the module holds a deferred tensor for
it (frontend/deferred_weights.py).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from gguf.quants import dequantize as gguf_dequantize

from .arch import BY_GGUF_ARCHITECTURE, Architecture, architecture_of
from .config import ConfigError, ModelConfig
from .deferred_weights import defer
from .gguf_file import GGUFError, GGUFFile, MissingTensorError, UnsupportedArchitectureError
from .hadamard import apply_hadamard_metadata, has_hadamard_metadata
from .model import CausalLM, skeleton
from .quant import REPACKABLE, QuantizedTensor, repack_gguf
from .tokenizer import tokenizer_json_from_gguf
from .types import LoadedModel

SUPPORTED_ARCHITECTURES = tuple(BY_GGUF_ARCHITECTURE)


def _architecture(g: GGUFFile) -> Architecture:
    arch = g.architecture
    if arch not in BY_GGUF_ARCHITECTURE:
        raise UnsupportedArchitectureError(
            f"{g.path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return BY_GGUF_ARCHITECTURE[arch]


def config_from_file(g: GGUFFile, max_context: int | None = None) -> ModelConfig:
    arch = _architecture(g)
    _check_sizes_fit(g)
    try:
        cfg = arch.config_from_gguf(g, max_context)
    except GGUFError:
        raise
    except ConfigError as e:
        raise GGUFError(f"{g.path}: metadata describes an invalid model: {e}") from e
    except (TypeError, ValueError, ZeroDivisionError, OverflowError) as e:
        # A value of the wrong type or a zero where a count belongs (a damaged or hand-edited file).
        raise GGUFError(f"{g.path}: metadata describes an invalid model: {type(e).__name__}: {e}") from e
    return cfg


# Hyperparameters that size the module: non-negative integers; when weights are loaded, none may
# exceed the number of elements the file's tensors hold (every one of them spans some weight).
MAX_LAYERS = 65536  # far above any model; a per-layer list of 2**32 entries would exhaust memory
_SIZE_KEYS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
              "attention.head_count_kv", "attention.key_length", "vocab_size", "ssm.state_size",
              "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size", "ssm.conv_kernel")


def _check_sizes_fit(g: GGUFFile, weights: bool = False) -> None:
    """Refuse sizes that cannot be right before a module (or a per-layer list) is built from them.

    weights: the file must also hold the weights (a load, not `foldline plan` on metadata).
    """
    elements = sum(math.prod(t.shape) for t in g.tensors.values())
    for key in _SIZE_KEYS:
        value = g.arch_key(key)
        if value is None:
            continue
        for v in value if isinstance(value, list) else [value]:
            if type(v) is not int or v < 0 or (weights and v > elements and key != "block_count"):
                raise GGUFError(f"{g.path}: {g.architecture}.{key} = {value!r} is not a size this file's "
                                f"{elements} tensor elements can back: corrupted or not a model file")
    layers = g.arch_key("block_count")
    limit = len(g.tensors) if weights else MAX_LAYERS
    if isinstance(layers, int) and layers > limit:
        raise GGUFError(f"{g.path}: {g.architecture}.block_count = {layers} is more than the "
                        + (f"{limit} tensors the file holds" if weights else f"limit of {limit} layers")
                        + ": corrupted or not a model file")


def read_gguf_config(path: str | Path, max_context: int | None = None) -> ModelConfig:
    """The ModelConfig a GGUF file describes; reads metadata only."""
    with GGUFFile(path) as g:
        return config_from_file(g, max_context)


def tensor_name_map(cfg: ModelConfig) -> dict[str, str]:
    """module parameter name -> GGUF tensor name, for every parameter the config's module has."""
    arch = architecture_of(cfg)
    if arch.gguf_tensor_names is None:
        raise GGUFError(f"no GGUF tensor names are known for a {cfg.family} model")
    return arch.gguf_tensor_names(cfg)


def _check_tensor_set(g: GGUFFile, cfg: ModelConfig) -> dict[str, str]:
    """parameter -> tensor name; a tensor the model needs and lacks, or one it has no place for, is an error."""
    arch = architecture_of(cfg)
    names = tensor_name_map(cfg)
    missing = [t for t in names.values() if t not in g.tensors]
    if missing:
        raise MissingTensorError(
            f"{g.path} lacks {len(missing)} tensor(s) a {cfg.family} model needs, first {missing[0]!r}"
        )
    used = set(names.values())
    unexpected = sorted(t for t in g.tensors if t not in used and not arch.gguf_skip_tensor(t, cfg))
    if unexpected:
        raise GGUFError(f"{g.path}: tensor {unexpected[0]!r} has no place in a {cfg.family} model "
                        f"({len(unexpected)} unexpected)")
    return names


def _float_value(g: GGUFFile, cfg: ModelConfig, tname: str) -> np.ndarray:
    """A tensor as float32 in the module's convention (gguf's dequantization, then the architecture's)."""
    value = g.dequantize(tname)
    try:
        return architecture_of(cfg).gguf_tensor_value(tname, value, cfg)
    except GGUFError:
        raise
    except ValueError as e:  # a conversion (llama's row permutation) that the stored shape does not fit
        raise GGUFError(f"{g.path}: tensor {tname!r} of shape {list(value.shape)} does not fit a "
                        f"{cfg.family} model of this config: {e}") from e


def _reorders_rows(g: GGUFFile, cfg: ModelConfig, tname: str, rows: int) -> bool:
    """Whether the architecture's conversion of `tname` only reorders its rows (llama's Q/K), so that
    it applies alike to blocks and to floats; a conversion that changes values does not."""
    probe = np.arange(rows, dtype=np.int64)[:, None]
    try:
        moved = np.asarray(architecture_of(cfg).gguf_tensor_value(tname, probe, cfg))
    except ValueError:
        return False
    return moved.shape == probe.shape and np.array_equal(np.sort(moved[:, 0]), probe[:, 0])


def _repacked(g: GGUFFile, cfg: ModelConfig, tname: str) -> QuantizedTensor | None:
    """A 2-D tensor's blocks in foldline's format with the architecture's row order, or None when its block
    type has no exact foldline form (or the conversion is more than a row order)."""
    info = g.info(tname)
    if info.qtype not in [int(q) for q in REPACKABLE] or len(info.shape) != 2 or 0 in info.shape:
        return None
    if not _reorders_rows(g, cfg, tname, info.shape[0]) or not _exact_on_sampled_rows(g, tname):
        return None
    arch = architecture_of(cfg)
    blocks = repack_gguf(g.raw(tname), info.qtype)
    for key in ("codes", "scales", "mins"):
        array = getattr(blocks, key)
        if array is not None:
            setattr(blocks, key, np.ascontiguousarray(arch.gguf_tensor_value(tname, array, cfg)))
    return blocks


SAMPLED_ROWS = 32


def _exact_on_sampled_rows(g: GGUFFile, tname: str, rows: int = SAMPLED_ROWS) -> bool:
    """Whether repacking `tname` dequantizes to gguf's own float32 values on `rows` rows spread over it.

    Every row goes through the same repacking code, and tests/frontend/test_quant.py checks each block
    type bit for bit; this guards a file against a block type read the wrong way, cheaply.
    """
    info = g.info(tname)
    raw = g.raw(tname)
    picked = np.unique(np.linspace(0, info.shape[0] - 1, min(rows, info.shape[0])).astype(np.int64))
    sample = np.ascontiguousarray(raw[picked])
    blocks = repack_gguf(sample, info.qtype)
    want = np.asarray(gguf_dequantize(sample, info.qtype), dtype=np.float32)
    return np.array_equal(blocks.dequantize(), want.reshape(len(picked), -1))


def build_module(g: GGUFFile, cfg: ModelConfig, defer_blocks: bool = False
                 ) -> tuple[CausalLM, dict[str, QuantizedTensor]]:
    """The reference CausalLM with the file's weights, materialised one tensor at a time, and the
    weights' blocks where they repack exactly into foldline's formats (quant.REPACKABLE).

    A weight with blocks takes their dequantization as its float value (what gguf's dequantizer
    gives, and faster), or, with `defer_blocks`, a deferred tensor (frontend/deferred_weights.py).
    """
    _check_sizes_fit(g, weights=True)
    try:
        model = skeleton(cfg)
    except RuntimeError as e:  # sizes whose products overflow (a damaged file); nothing is allocated
        raise GGUFError(f"{g.path}: the metadata's sizes do not form a model: {e}") from e
    expected = dict(model.named_parameters())
    state: dict[str, torch.Tensor] = {}
    blocks_of: dict[str, QuantizedTensor] = {}
    for param, tname in _check_tensor_set(g, cfg).items():
        shape = tuple(expected[param].shape)
        blocks = _repacked(g, cfg, tname)
        if blocks is not None and tuple(blocks.shape) == shape:
            blocks_of[param] = blocks
            state[param] = defer(shape, blocks) if defer_blocks else torch.from_numpy(blocks.dequantize())
            continue
        w = _float_value(g, cfg, tname)
        if w.shape != shape:
            raise GGUFError(
                f"{g.path}: tensor for {param!r} has shape {w.shape}, the config implies {shape}"
            )
        state[param] = torch.from_numpy(w)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval(), blocks_of


def load_gguf(path: str | Path, max_context: int | None = None, defer_block_weights: bool = False) -> LoadedModel:
    """LoadedModel for a GGUF file: config, float32 module, tokenizer.json and chat template.

    defer_block_weights: for a compile that keeps the file's blocks, the module does not hold the
    float values of block-quantized weights (frontend/deferred_weights.py); never with Hadamard-rotated
    weights, whose folding reads them.
    """
    path = Path(path)
    with GGUFFile(path) as g:
        cfg = config_from_file(g, max_context)
        module, blocks = build_module(g, cfg, defer_blocks=defer_block_weights and not has_hadamard_metadata(g.metadata))
        if has_hadamard_metadata(g.metadata):
            # Weights stored Hadamard-rotated: wrap them so the module computes the unrotated model.
            gguf_to_param = {tensor: param for param, tensor in tensor_name_map(cfg).items()}
            apply_hadamard_metadata(module, g.metadata, name_map=gguf_to_param)
        tokenizer_json = tokenizer_json_from_gguf(g.metadata) if g.get("tokenizer.ggml.tokens") else None
        # A GGUF without a template is a base model (Gemma 3 270M): no chat format is made up for it.
        template = g.get("tokenizer.chat_template")
    return LoadedModel(cfg, module, tokenizer_json, template, source=f"gguf:{path.name}", source_blocks=blocks)
