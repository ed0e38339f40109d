"""Model surgery: make a built model whose listed weights are stored rotated compute the unrotated model.

Listed linear weights are wrapped in `HadamardLinear` (rotation op, then the
linear); inverse-listed tables in `HadamardEmbedding`; a head reading a
rotated weight gets the rotation on its input (`HeadRotationNorm`). Parameter
names never change, so checkpoints load into the wrapped model as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..layers import RMSNorm
from .metadata import (
    KEY_INVERSE_NAMES,
    KEY_PERM_NAMES,
    KEY_WEIGHT_NAMES,
    HadamardMetadata,
    Permutation,
    parse_hadamard_metadata,
)
from .transform import (
    HADAMARD_ROTATE,
    HADAMARD_UNROTATE,
    HadamardMetadataError,
    block_for_width,
    rotate_weight,
)

# ---------------------------------------------------------------------------
# Attaching the rotation to a built model
# ---------------------------------------------------------------------------


class HadamardLinear(nn.Linear):
    """An nn.Linear whose stored weight reads a rotated activation; parameter names are unchanged."""

    def __init__(self, base: nn.Linear, signs: Tensor, block: int, perm: Permutation | None = None):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.register_parameter("weight", base.weight)
        self.register_parameter("bias", base.bias)
        self.block = block
        self.perm_head_dim = perm.head_dim if perm else 0
        self.perm_rep = perm.rep if perm else 1
        # Not persistent: load_state_dict / the checkpoint never see it; export lifts it as a constant.
        self.register_buffer("hadamard_signs", signs.detach().clone().to(torch.float32), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        rotated = HADAMARD_ROTATE(x, self.hadamard_signs, self.block, self.perm_head_dim,
                                                     self.perm_rep)
        return F.linear(rotated, self.weight, self.bias)

    def extra_repr(self) -> str:
        perm = f", perm=(hd={self.perm_head_dim}, rep={self.perm_rep})" if self.perm_rep > 1 else ""
        return f"{super().extra_repr()}, hadamard block={self.block}{perm}"


class HadamardEmbedding(nn.Embedding):
    """An nn.Embedding whose table stores rotated rows; a lookup returns signs * WHT(row)."""

    def __init__(self, base: nn.Embedding, signs: Tensor, block: int):
        nn.Module.__init__(self)
        for attr in ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type",
                     "scale_grad_by_freq", "sparse"):
            setattr(self, attr, getattr(base, attr))
        self.register_parameter("weight", base.weight)
        self.block = block
        self.register_buffer("hadamard_signs", signs.detach().clone().to(torch.float32), persistent=False)

    def forward(self, ids: Tensor) -> Tensor:
        rows = super().forward(ids)
        return HADAMARD_UNROTATE(rows, self.hadamard_signs, self.block)


class HeadRotationNorm(RMSNorm):
    """The final norm, followed by the rotation the LM head's stored weight (or tied table) expects.

    Only the head reads the final norm's output, so rotating it there is exactly
    `head(rotate(h))`; subclassing keeps the parameter name `norm.weight`.
    """

    def __init__(self, norm: RMSNorm, signs: Tensor, block: int):
        nn.Module.__init__(self)
        self.eps, self.offset = norm.eps, norm.offset
        self.register_parameter("weight", norm.weight)
        self.block = block
        self.register_buffer("hadamard_signs", signs.detach().clone().to(torch.float32), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return HADAMARD_ROTATE(super().forward(x), self.hadamard_signs, self.block, 0, 1)


@dataclass
class HadamardReport:
    """What `apply_hadamard_metadata` attached, by module path."""

    linears: list[str] = field(default_factory=list)
    embeddings: list[str] = field(default_factory=list)
    permuted: list[str] = field(default_factory=list)
    head: bool = False  # the LM head (tied or not) reads a rotated weight

    def summary(self) -> str:
        return (f"{len(self.linears)} rotated linear(s) ({len(self.permuted)} with head permutation), "
                f"{len(self.embeddings)} rotated table(s){', LM head input rotated' if self.head else ''}")


def _set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def _check_gdn_permutation(model: nn.Module, path: str, name: str, perm: Permutation | None) -> None:
    """A tiled GDN output projection (interleaved value heads, rep > 1) must declare its permutation.

    The rotation was computed in grouped head order; without the permutation every GDN
    layer's output is silently wrong (cosine -0.11 to the reference: docs/hadamard.md).
    """
    cfg = getattr(model, "cfg", None)
    if cfg is None or not path.endswith("mixer.out_proj") or "gdn" not in cfg.layer_types:
        return
    rep = cfg.gdn_num_v_heads // max(cfg.gdn_num_k_heads, 1)
    if cfg.gdn_kv_mapping == "interleaved" and rep > 1 and (perm is None or perm.rep <= 1):
        raise HadamardMetadataError(
            f"{name!r} reads GDN value heads in tiled order (rep {rep}) but has no head permutation; "
            f"list it in {KEY_PERM_NAMES} with head_dim {cfg.gdn_head_v_dim} and rep {rep}"
        )


def apply_hadamard_metadata(
    model: nn.Module, metadata: Mapping[str, Any] | HadamardMetadata, name_map: Mapping[str, str] | None = None
) -> HadamardReport:
    """Make a built CausalLM whose listed weights are stored rotated compute the unrotated model.

    Listed linear weights get `HadamardLinear` (rotation op, then the linear);
    inverse-listed tables get `HadamardEmbedding`. A tied head reading a rotated
    table needs the forward rotation on its input. Names are module parameter
    names, or checkpoint tensor names translated by `name_map` (the GGUF loader
    passes its table). Raises HadamardMetadataError when the keys disagree with the model.
    """
    meta = metadata if isinstance(metadata, HadamardMetadata) else parse_hadamard_metadata(metadata)
    names = dict(name_map or {})
    params = dict(model.named_parameters())
    report = HadamardReport()

    def resolve(name: str) -> tuple[str, nn.Module]:
        param = names.get(name, name)
        if param not in params:
            raise HadamardMetadataError(f"Hadamard metadata lists {name!r}, which is not a weight of this model")
        path, _, leaf = param.rpartition(".")
        if leaf != "weight":
            raise HadamardMetadataError(f"Hadamard metadata lists {name!r}, which is not a weight ({param})")
        return path, model.get_submodule(path)

    tied = bool(getattr(getattr(model, "cfg", None), "tie_word_embeddings", False))
    rotated_tables: set[str] = set()
    head_signs: Tensor | None = None
    for name in meta.inverse_names:
        path, module = resolve(name)
        if isinstance(module, HadamardEmbedding):
            continue  # already applied
        if not isinstance(module, nn.Embedding):
            raise HadamardMetadataError(
                f"{name!r} is in {KEY_INVERSE_NAMES} but is a {type(module).__name__}, not an embedding table"
            )
        width = module.embedding_dim
        _set_module(model, path, HadamardEmbedding(module, meta.signs_for(width, name), block_for_width(width, meta.block_size)))
        report.embeddings.append(path)
        rotated_tables.add(path)
    for name in meta.weight_names:
        path, module = resolve(name)
        if isinstance(module, nn.Embedding):
            if not tied:
                raise HadamardMetadataError(
                    f"{name!r} is in {KEY_WEIGHT_NAMES} but is an embedding table and the head is not tied to it"
                )
            if path not in rotated_tables and not isinstance(module, HadamardEmbedding):
                raise HadamardMetadataError(
                    f"{name!r} (a tied table) is listed for the head but not in {KEY_INVERSE_NAMES}: "
                    "its lookup would read rotated rows"
                )
            continue
        if path == "lm_head" and isinstance(module, nn.Linear):
            # CausalLM.head reads lm_head.weight directly, so the rotation goes on the head's input.
            if name in meta.permutations:
                raise HadamardMetadataError(f"{name!r}: a head permutation on the LM head is not supported")
            head_signs = meta.signs_for(module.in_features, name)
            continue
        if isinstance(module, HadamardLinear):
            continue
        if not isinstance(module, nn.Linear):
            raise HadamardMetadataError(f"{name!r} belongs to a {type(module).__name__}, not a linear layer")
        width = module.in_features
        perm = meta.permutations.get(name)
        _check_gdn_permutation(model, path, name, perm)
        if perm is not None and perm.rep > 1 and width % (perm.head_dim * perm.rep):
            raise HadamardMetadataError(
                f"{name!r}: input width {width} is not a multiple of head_dim {perm.head_dim} x rep {perm.rep}"
            )
        signs = meta.signs_for(width, name)
        _set_module(model, path, HadamardLinear(module, signs, block_for_width(width, meta.block_size), perm))
        report.linears.append(path)
        if perm is not None and perm.rep > 1:
            report.permuted.append(path)
    if tied and rotated_tables:
        width = model.embed_tokens.embedding_dim
        head_signs = meta.signs_for(width, "the tied head")
    if head_signs is not None and not isinstance(getattr(model, "norm", None), HeadRotationNorm):
        if not isinstance(getattr(model, "norm", None), RMSNorm):
            raise HadamardMetadataError("the LM head reads a rotated weight, but the model has no final RMSNorm")
        model.norm = HeadRotationNorm(model.norm, head_signs, block_for_width(head_signs.numel(), meta.block_size))
        report.head = True
    return report


def rotated_copy_of_weights(
    model: nn.Module, meta: HadamardMetadata, name_map: Mapping[str, str] | None = None
) -> dict[str, Tensor]:
    """Module parameter name -> stored (rotated) tensor for every listed weight of an unrotated model."""
    names = dict(name_map or {})
    params = dict(model.named_parameters())
    out: dict[str, Tensor] = {}
    for name in list(meta.inverse_names) + list(meta.weight_names):
        param = names.get(name, name)
        if param in out:
            continue
        w = params[param].detach()
        width = w.shape[-1]
        perm = meta.permutations.get(name)
        out[param] = rotate_weight(w, meta.signs_for(width, name), block_for_width(width, meta.block_size),
                                   perm.head_dim if perm else 0, perm.rep if perm else 1)
    return out
