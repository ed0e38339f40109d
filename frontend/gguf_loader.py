"""Load a GGUF checkpoint: config, reference module with float32 weights, tokenizer.

The file is read by `gguf_file.GGUFFile`; the architecture module named by
`general.architecture` (`frontend/arch/`) says what the metadata and tensor
names mean and how stored values differ from the module's. Every weight is
dequantized to float32, one tensor at a time, straight into a module built on
the meta device, so peak memory stays near the size of the float32 model.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from .arch import BY_GGUF_ARCHITECTURE, Architecture, architecture_of
from .config import ConfigError, ModelConfig
from .gguf_file import GGUFError, GGUFFile, MissingTensorError, UnsupportedArchitectureError
from .hadamard import apply_hadamard_metadata, has_hadamard_metadata
from .model import CausalLM
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
    try:
        return _architecture(g).config_from_gguf(g, max_context)
    except ConfigError as e:
        raise GGUFError(f"{g.path}: metadata describes an invalid model: {e}") from e


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


def _iter_weights(g: GGUFFile, cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """(parameter name, float32 array) for every parameter; missing or left-over tensors are errors."""
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
        yield param, arch.gguf_tensor_value(tname, g.dequantize(tname), cfg)


def source_blocks(g: GGUFFile, cfg: ModelConfig, module: CausalLM) -> dict[str, QuantizedTensor]:
    """The file's block-quantized 2-D weights, repacked exactly into foldline's formats, by parameter name.

    The architecture's value conversion (llama's Q/K row order) is applied to
    each row-indexed array of the blocks; a tensor whose blocks then do not
    dequantize to exactly the module's weight is left out (it stays float).
    """
    arch = architecture_of(cfg)
    params = dict(module.named_parameters())
    out: dict[str, QuantizedTensor] = {}
    for param, tname in tensor_name_map(cfg).items():
        info = g.info(tname)
        if info.qtype not in [int(q) for q in REPACKABLE] or len(info.shape) != 2:
            continue
        blocks = repack_gguf(g.raw(tname), info.qtype)
        fields = {"codes": blocks.codes, "scales": blocks.scales, "mins": blocks.mins}
        for key, array in fields.items():
            if array is not None:
                setattr(blocks, key, np.ascontiguousarray(arch.gguf_tensor_value(tname, array, cfg)))
        if np.array_equal(blocks.dequantize(), params[param].detach().numpy()):
            out[param] = blocks
    return out


def build_module(g: GGUFFile, cfg: ModelConfig) -> CausalLM:
    """The reference CausalLM with the file's weights, materialised one tensor at a time."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    expected = dict(model.named_parameters())
    state: dict[str, torch.Tensor] = {}
    for param, w in _iter_weights(g, cfg):
        shape = tuple(expected[param].shape)
        if w.shape != shape:
            raise GGUFError(
                f"{g.path}: tensor for {param!r} has shape {w.shape}, the config implies {shape}"
            )
        state[param] = torch.from_numpy(w)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def load_gguf(path: str | Path, max_context: int | None = None) -> LoadedModel:
    """LoadedModel for a GGUF file: config, float32 module, tokenizer.json and chat template."""
    path = Path(path)
    with GGUFFile(path) as g:
        cfg = config_from_file(g, max_context)
        module = build_module(g, cfg)
        blocks = source_blocks(g, cfg, module)
        if has_hadamard_metadata(g.metadata):
            # Weights stored Hadamard-rotated: wrap them so the module computes the unrotated model.
            gguf_to_param = {tensor: param for param, tensor in tensor_name_map(cfg).items()}
            apply_hadamard_metadata(module, g.metadata, name_map=gguf_to_param)
        tokenizer_json = tokenizer_json_from_gguf(g.metadata) if g.get("tokenizer.ggml.tokens") else None
        template = g.get("tokenizer.chat_template")
        if template is None:
            template = architecture_of(cfg).default_chat_template
    return LoadedModel(cfg, module, tokenizer_json, template, source=f"gguf:{path.name}", source_blocks=blocks)
