"""Hadamard-folded checkpoints, split by concern.

- `transform`: the block Walsh-Hadamard math, weight folding, and the
  `foldline::hadamard_rotate` / `hadamard_unrotate` custom ops;
- `metadata`: the prism.hadamard.* keys, parsed and validated;
- `surgery`: wrapping a built model's listed weights so it computes the unrotated model.

The names below are the package's public surface (`from foldline.frontend import hadamard as H`).
"""

from .metadata import (
    KEY_BLOCK_SIZE,
    KEY_INVERSE_NAMES,
    KEY_PERM_HEAD_DIM,
    KEY_PERM_NAMES,
    KEY_PERM_REP,
    KEY_SIGN_MODE,
    KEY_SIGN_VALUES,
    KEY_SIGN_WIDTHS,
    KEY_WEIGHT_NAMES,
    KNOWN_KEYS,
    PREFIX,
    SIGN_MODES,
    HadamardMetadata,
    Permutation,
    has_hadamard_metadata,
    make_metadata,
    parse_hadamard_metadata,
)
from .surgery import (
    HadamardEmbedding,
    HadamardLinear,
    HadamardReport,
    HeadRotationNorm,
    apply_hadamard_metadata,
    rotated_copy_of_weights,
)
from .transform import (
    DEFAULT_BLOCK_SIZE,
    HADAMARD_OPS,
    HadamardMetadataError,
    block_for_width,
    fold_weight,
    permutation_index,
    random_signs,
    rotate_activation,
    rotate_weight,
    tiled_to_grouped,
    unrotate_rows,
    wht,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE", "HADAMARD_OPS", "KEY_BLOCK_SIZE", "KEY_INVERSE_NAMES", "KEY_PERM_HEAD_DIM",
    "KEY_PERM_NAMES", "KEY_PERM_REP", "KEY_SIGN_MODE", "KEY_SIGN_VALUES", "KEY_SIGN_WIDTHS",
    "KEY_WEIGHT_NAMES", "KNOWN_KEYS", "PREFIX", "SIGN_MODES", "HadamardEmbedding", "HadamardLinear",
    "HadamardMetadata", "HadamardMetadataError", "HadamardReport", "HeadRotationNorm", "Permutation",
    "apply_hadamard_metadata", "block_for_width", "fold_weight", "has_hadamard_metadata", "make_metadata",
    "parse_hadamard_metadata", "permutation_index", "random_signs", "rotate_activation", "rotate_weight",
    "rotated_copy_of_weights", "tiled_to_grouped", "unrotate_rows", "wht",
]
