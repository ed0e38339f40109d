"""The prism.hadamard.* checkpoint metadata: its keys, parsing with validation, and writing.

docs/hadamard.md describes the keys. Parsing rejects anything inconsistent or
unknown with a HadamardMetadataError naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .transform import DEFAULT_BLOCK_SIZE, HadamardMetadataError, block_for_width, random_signs

PREFIX = "prism.hadamard."
KEY_WEIGHT_NAMES = PREFIX + "weight_names"
KEY_INVERSE_NAMES = PREFIX + "inverse_weight_names"
KEY_BLOCK_SIZE = PREFIX + "block_size"
KEY_SIGN_MODE = PREFIX + "sign_mode"
KEY_SIGN_WIDTHS = PREFIX + "sign_widths"
KEY_SIGN_VALUES = PREFIX + "sign_values"
KEY_PERM_NAMES = PREFIX + "perm_weight_names"
KEY_PERM_HEAD_DIM = PREFIX + "perm_head_dim"
KEY_PERM_REP = PREFIX + "perm_rep"
KNOWN_KEYS = frozenset({
    KEY_WEIGHT_NAMES, KEY_INVERSE_NAMES, KEY_BLOCK_SIZE, KEY_SIGN_MODE, KEY_SIGN_WIDTHS,
    KEY_SIGN_VALUES, KEY_PERM_NAMES, KEY_PERM_HEAD_DIM, KEY_PERM_REP,
})
SIGN_MODES = ("explicit",)


# ---------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Permutation:
    """The tiled->grouped head permutation one weight's activation needs first."""

    head_dim: int
    rep: int


@dataclass
class HadamardMetadata:
    """The parsed, self-consistent prism.hadamard.* keys."""

    weight_names: list[str]
    inverse_names: list[str] = field(default_factory=list)
    block_size: int = DEFAULT_BLOCK_SIZE
    signs: dict[int, Tensor] = field(default_factory=dict)  # activation width -> +-1 vector
    permutations: dict[str, Permutation] = field(default_factory=dict)
    sign_mode: str = "explicit"

    def signs_for(self, width: int, name: str) -> Tensor:
        if width not in self.signs:
            raise HadamardMetadataError(
                f"{name!r} reads an activation of width {width}, but {KEY_SIGN_WIDTHS} lists only "
                f"{sorted(self.signs)}"
            )
        return self.signs[width]

    def to_gguf_fields(self) -> dict[str, Any]:
        """Key -> value for a GGUF writer (lists of str / int / float)."""
        widths = list(self.signs)
        out: dict[str, Any] = {
            KEY_WEIGHT_NAMES: list(self.weight_names),
            KEY_BLOCK_SIZE: self.block_size,
            KEY_SIGN_MODE: self.sign_mode,
            KEY_SIGN_WIDTHS: widths,
            KEY_SIGN_VALUES: [int(v) for v in torch.cat([self.signs[w] for w in widths]).tolist()],
        }
        if self.inverse_names:
            out[KEY_INVERSE_NAMES] = list(self.inverse_names)
        if self.permutations:
            names = list(self.permutations)
            out[KEY_PERM_NAMES] = names
            out[KEY_PERM_HEAD_DIM] = [self.permutations[n].head_dim for n in names]
            out[KEY_PERM_REP] = [self.permutations[n].rep for n in names]
        return out


def has_hadamard_metadata(metadata: Mapping[str, Any]) -> bool:
    return any(str(k).startswith(PREFIX) for k in metadata)


def _str_list(metadata: Mapping[str, Any], key: str, required: bool) -> list[str]:
    if key not in metadata:
        if required:
            raise HadamardMetadataError(f"Hadamard metadata lacks {key!r}")
        return []
    value = metadata[key]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise HadamardMetadataError(f"{key!r} must be an array of strings, got {type(value).__name__}")
    if len(set(value)) != len(value):
        dup = next(v for v in value if list(value).count(v) > 1)
        raise HadamardMetadataError(f"{key!r} lists {dup!r} more than once")
    return list(value)


def _int_list(metadata: Mapping[str, Any], key: str) -> list[int]:
    value = metadata.get(key)
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and float(v).is_integer() for v in value
    ):
        raise HadamardMetadataError(f"{key!r} must be an array of integers, got {value!r:.80}")
    return [int(v) for v in value]


def parse_hadamard_metadata(metadata: Mapping[str, Any]) -> HadamardMetadata:
    """Validate the prism.hadamard.* keys of a checkpoint; raise HadamardMetadataError on any disagreement."""
    unknown = sorted(k for k in metadata if str(k).startswith(PREFIX) and k not in KNOWN_KEYS)
    if unknown:
        raise HadamardMetadataError(
            f"unknown Hadamard metadata key {unknown[0]!r}; foldline understands {sorted(KNOWN_KEYS)}"
        )
    weights = _str_list(metadata, KEY_WEIGHT_NAMES, required=True)
    inverse = _str_list(metadata, KEY_INVERSE_NAMES, required=False)
    mode = metadata.get(KEY_SIGN_MODE, "explicit")
    if mode not in SIGN_MODES:
        raise HadamardMetadataError(f"{KEY_SIGN_MODE} is {mode!r}; foldline supports {SIGN_MODES}")
    block = metadata.get(KEY_BLOCK_SIZE, DEFAULT_BLOCK_SIZE)
    if isinstance(block, bool) or not isinstance(block, int):
        raise HadamardMetadataError(f"{KEY_BLOCK_SIZE} must be an integer, got {block!r}")
    block_for_width(block, block)  # power of two check
    for key in (KEY_SIGN_WIDTHS, KEY_SIGN_VALUES):
        if key not in metadata:
            raise HadamardMetadataError(f"Hadamard metadata lacks {key!r} (needed with sign_mode 'explicit')")
    widths = _int_list(metadata, KEY_SIGN_WIDTHS)
    if len(set(widths)) != len(widths) or any(w <= 0 for w in widths):
        raise HadamardMetadataError(f"{KEY_SIGN_WIDTHS} {widths} must be distinct positive widths")
    raw = metadata[KEY_SIGN_VALUES]
    if not isinstance(raw, (list, tuple)):
        raise HadamardMetadataError(f"{KEY_SIGN_VALUES} must be an array")
    values = torch.tensor([float(v) for v in raw], dtype=torch.float32)
    if values.numel() != sum(widths):
        raise HadamardMetadataError(
            f"{KEY_SIGN_VALUES} has {values.numel()} entries; {KEY_SIGN_WIDTHS} {widths} sum to {sum(widths)}"
        )
    if values.numel() and not bool(((values == 1) | (values == -1)).all()):
        bad = values[(values != 1) & (values != -1)][0].item()
        raise HadamardMetadataError(f"{KEY_SIGN_VALUES} must hold only +1 and -1 (found {bad})")
    signs = dict(zip(widths, torch.split(values, widths))) if widths else {}
    perms: dict[str, Permutation] = {}
    perm_names = _str_list(metadata, KEY_PERM_NAMES, required=False)
    if perm_names:
        head_dims, reps = _int_list(metadata, KEY_PERM_HEAD_DIM), _int_list(metadata, KEY_PERM_REP)
        if not len(head_dims) == len(reps) == len(perm_names):
            raise HadamardMetadataError(
                f"{KEY_PERM_NAMES}, {KEY_PERM_HEAD_DIM} and {KEY_PERM_REP} must have one entry per weight "
                f"({len(perm_names)}, {len(head_dims)}, {len(reps)})"
            )
        for name, hd, rep in zip(perm_names, head_dims, reps):
            if name not in weights:
                raise HadamardMetadataError(f"{name!r} has a head permutation but is not in {KEY_WEIGHT_NAMES}")
            if hd <= 0 or rep <= 0:
                raise HadamardMetadataError(f"{name!r}: permutation head_dim {hd} and rep {rep} must be positive")
            perms[name] = Permutation(hd, rep)
    elif any(k in metadata for k in (KEY_PERM_HEAD_DIM, KEY_PERM_REP)):
        raise HadamardMetadataError(f"{KEY_PERM_HEAD_DIM} / {KEY_PERM_REP} given without {KEY_PERM_NAMES}")
    return HadamardMetadata(weights, inverse, int(block), signs, perms, mode)


def make_metadata(
    widths: list[int], weight_names: list[str], inverse_names: list[str] | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE, seed: int = 0, permutations: Mapping[str, Permutation] | None = None,
) -> HadamardMetadata:
    """Metadata with seeded random signs, one vector per distinct width (in the order given)."""
    gen = torch.Generator().manual_seed(seed)
    signs = {w: random_signs(w, gen) for w in dict.fromkeys(widths)}
    return HadamardMetadata(list(weight_names), list(inverse_names or []), block_size, signs,
                            dict(permutations or {}))
