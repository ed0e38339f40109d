"""Shared frontend types: dtypes, the chunk context, a loaded model.

A leaf module: it imports nothing from the rest of foldline, so every other
frontend module (the reference modules, the GDN mixer, the loaders, the passes)
can use these types without an import cycle.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..dtypes import DTYPES, FLOAT_DTYPES
from .config import ModelConfig
from .deferred_weights import blocks_of, mark_deferred

# The torch side of foldline.dtypes: canonical name -> torch dtype.
TORCH_DTYPES = {name: getattr(torch, name) for name in FLOAT_DTYPES}
# torch dtype -> its MLIR element spelling (f32, f16, bf16, i64, ...), for every dtype foldline knows.
MLIR_ELEMENTS = {getattr(torch, d.name): d.mlir for d in DTYPES.values()}


@dataclass
class ChunkContext:
    """What every layer needs to know about the chunk being processed."""

    start_pos: Tensor  # [B] int64
    n_valid: Tensor  # [B] int64
    positions: Tensor  # [B, C] int64
    embed: Tensor  # [B, C, d] scaled embedding (Ripple's value-residual seed)
    host_pos: int | None = None  # start_pos[0] on the host, given by decode entry points (one real token)
    kv_length: int | None = None  # slots attention over a full cache reads (a whole number of tiles); None: all


@dataclass
class LoadedModel:
    """A model ready to export: its config, the reference module with weights, its tokenizer."""

    config: ModelConfig
    module: nn.Module  # a frontend.model.CausalLM
    tokenizer_json: str | None = None  # a tokenizers JSON document
    chat_template: str | None = None
    source: str = ""
    # The checkpoint's block-quantized weights, exactly repacked (quant.QuantizedTensor by parameter
    # name); the module holds their float32 dequantization, the eager reference.
    source_blocks: dict[str, Any] = field(default_factory=dict)
    # What identifies the checkpoint (frontend/fingerprint.py); None for a module built by hand,
    # which the compile cache then never serves.
    fingerprint: dict[str, Any] | None = None

    @contextmanager
    def reconfigured(self, **changes: Any) -> Iterator[ModelConfig]:
        """Compile-time config changes (kv_dtype, dtype) on the config and the module, undone on exit.

        Every submodule holding the config (the model, its layers and mixers) sees the
        new one inside the block, so the module and `config` never disagree, and a
        model loaded once can be compiled several ways. A new `dtype` casts the
        module's floating weights too; the original tensors come back on
        exit, so a narrowing cast (float32 -> float16) loses nothing for later uses.
        """
        old, new = self.config, self.config.replace(**changes)
        saved = self._cast(TORCH_DTYPES[new.dtype]) if new.dtype != old.dtype else None
        self._point(old, new)
        try:
            yield new
        finally:
            self._point(new, old)
            if saved is not None:
                self._uncast(saved)

    def _cast(self, dtype: torch.dtype) -> list[tuple[nn.Parameter, Tensor, Any]]:
        """Cast every floating parameter to `dtype`; returns the originals. Buffers keep their
        dtype (the Hadamard signs are float32 on purpose; the rest are built in the model's)."""
        saved = []
        for p in self.module.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                blocks = blocks_of(p)
                saved.append((p, p.data, blocks))
                # a deferred weight's values are not made yet: its cast stays unmade too
                p.data = torch.empty(p.shape, dtype=dtype) if blocks is not None else p.data.to(dtype)
        return saved

    @staticmethod
    def _uncast(saved: list[tuple[nn.Parameter, Tensor, Any]]) -> None:
        for p, original, blocks in saved:
            p.data = original
            if blocks is not None:  # the original data was never written, whatever the cast's became
                mark_deferred(p, blocks)

    def _point(self, old: ModelConfig, new: ModelConfig) -> None:
        for sub in self.module.modules():
            if getattr(sub, "cfg", None) is old:
                sub.cfg = new
        self.config = new
