"""Load a GGUF checkpoint: config, reference module with float32 weights, tokenizer.

The file is read by `gguf_file.GGUFFile`; the architecture module named by
`general.architecture` (`frontend/arch/`) says what the metadata and tensor
names mean and how stored values differ from the module's. Every weight is
dequantized to float32, one tensor at a time, straight into a module built on
the meta device, so peak memory stays near the size of the float32 model.

Loaded for compiling only (`defer_block_weights`), a weight whose blocks repack
exactly into foldline's formats is not dequantized at all: the module holds a
deferred tensor for it (frontend/deferred_weights.py) and the compile keeps the
blocks. Exactness is then checked on a sample of rows rather than the whole
tensor (every row goes through the same repacking code); the eager load checks
every element.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
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


def _iter_weights(g: GGUFFile, cfg: ModelConfig, skip: set[str] = frozenset()) -> Iterator[tuple[str, np.ndarray]]:
    """(parameter name, float32 array) for every parameter but `skip`; missing or left-over tensors are errors."""
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
    for param, tname in names.items():
        if param in skip:
            continue
        value = g.dequantize(tname)
        try:
            converted = arch.gguf_tensor_value(tname, value, cfg)
        except GGUFError:
            raise
        except ValueError as e:  # a conversion (llama's row permutation) that the stored shape does not fit
            raise GGUFError(f"{g.path}: tensor {tname!r} of shape {list(value.shape)} does not fit a "
                            f"{cfg.family} model of this config: {e}") from e
        yield param, converted


def _repacked(g: GGUFFile, cfg: ModelConfig, tname: str) -> QuantizedTensor | None:
    """A 2-D tensor's blocks in foldline's format with the architecture's value conversion applied, or None
    when its block type has no exact foldline form."""
    info = g.info(tname)
    if info.qtype not in [int(q) for q in REPACKABLE] or len(info.shape) != 2:
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

    Compared before any value conversion (a row reordering, applied alike to the blocks and the floats).
    """
    info = g.info(tname)
    raw = g.raw(tname)
    picked = np.unique(np.linspace(0, info.shape[0] - 1, min(rows, info.shape[0])).astype(np.int64))
    blocks = repack_gguf(np.ascontiguousarray(raw[picked]), info.qtype)
    want = np.asarray(gguf_dequantize(np.ascontiguousarray(raw[picked]), info.qtype), dtype=np.float32)
    return np.array_equal(blocks.dequantize(), want.reshape(len(picked), -1))


def source_blocks(g: GGUFFile, cfg: ModelConfig, module: CausalLM) -> dict[str, QuantizedTensor]:
    """The file's block-quantized 2-D weights, repacked exactly into foldline's formats, by parameter name.

    A tensor whose blocks do not dequantize to exactly the module's (float32) weight is left out:
    it stays float.
    """
    params = dict(module.named_parameters())
    out: dict[str, QuantizedTensor] = {}
    for param, tname in tensor_name_map(cfg).items():
        blocks = _repacked(g, cfg, tname)
        if blocks is not None and np.array_equal(blocks.dequantize(), params[param].detach().numpy()):
            out[param] = blocks
    return out


def deferred_blocks(g: GGUFFile, cfg: ModelConfig) -> dict[str, QuantizedTensor]:
    """As source_blocks, for a module that will not hold their floats: exactness checked on sampled rows."""
    out: dict[str, QuantizedTensor] = {}
    for param, tname in tensor_name_map(cfg).items():
        if tname not in g.tensors:
            continue  # build_module names what is missing
        blocks = _repacked(g, cfg, tname)
        if blocks is not None and _exact_on_sampled_rows(g, tname):
            out[param] = blocks
    return out


def build_module(g: GGUFFile, cfg: ModelConfig, deferred: dict[str, QuantizedTensor] | None = None) -> CausalLM:
    """The reference CausalLM with the file's weights, materialised one tensor at a time; the weights in
    `deferred` become deferred tensors (frontend/deferred_weights.py) backed by those blocks."""
    deferred = deferred or {}
    _check_sizes_fit(g, weights=True)
    try:
        model = skeleton(cfg)
    except RuntimeError as e:  # sizes whose products overflow (a damaged file); nothing is allocated
        raise GGUFError(f"{g.path}: the metadata's sizes do not form a model: {e}") from e
    expected = dict(model.named_parameters())
    state: dict[str, torch.Tensor] = {}
    for param, blocks in deferred.items():
        shape = tuple(expected[param].shape)
        if tuple(blocks.shape) != shape:
            raise GGUFError(f"{g.path}: tensor for {param!r} has shape {tuple(blocks.shape)}, the config implies {shape}")
        state[param] = defer(shape, blocks)
    for param, w in _iter_weights(g, cfg, skip=set(deferred)):
        shape = tuple(expected[param].shape)
        if w.shape != shape:
            raise GGUFError(
                f"{g.path}: tensor for {param!r} has shape {w.shape}, the config implies {shape}"
            )
        state[param] = torch.from_numpy(w)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def load_gguf(path: str | Path, max_context: int | None = None, defer_block_weights: bool = False) -> LoadedModel:
    """LoadedModel for a GGUF file: config, float32 module, tokenizer.json and chat template.

    defer_block_weights: for a compile that keeps the file's blocks, the module does not hold the
    float values of block-quantized weights (frontend/deferred_weights.py); never with Hadamard-rotated
    weights, whose folding reads them.
    """
    path = Path(path)
    with GGUFFile(path) as g:
        cfg = config_from_file(g, max_context)
        defer_weights = defer_block_weights and not has_hadamard_metadata(g.metadata)
        _check_sizes_fit(g, weights=True)
        deferred = deferred_blocks(g, cfg) if defer_weights else {}
        module = build_module(g, cfg, deferred)
        blocks = deferred if defer_weights else source_blocks(g, cfg, module)
        if has_hadamard_metadata(g.metadata):
            # Weights stored Hadamard-rotated: wrap them so the module computes the unrotated model.
            gguf_to_param = {tensor: param for param, tensor in tensor_name_map(cfg).items()}
            apply_hadamard_metadata(module, g.metadata, name_map=gguf_to_param)
        tokenizer_json = tokenizer_json_from_gguf(g.metadata) if g.get("tokenizer.ggml.tokens") else None
        template = g.get("tokenizer.chat_template")
        if template is None:
            template = architecture_of(cfg).default_chat_template
    return LoadedModel(cfg, module, tokenizer_json, template, source=f"gguf:{path.name}", source_blocks=blocks)
