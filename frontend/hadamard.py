"""Hadamard-folded checkpoints: the rotation math, its custom ops, and attaching it to a model.

A Hadamard-folded checkpoint stores some weights in a rotated basis so that
quantization error spreads evenly over the input dimension. Each listed weight
W_s expects its activation rotated just before the matmul:

    x -> [tiled->grouped head permutation P, when listed] -> x * signs -> WHT(x) -> W_s @ x

so the weight in the model's own basis is W = W_s H D P. Tables listed as
inverse (the token embedding) store rotated rows z = H D e; a lookup restores
the row in the reverse order, e = signs * WHT(z). The transform is a
normalized Sylvester Walsh-Hadamard transform applied independently to
contiguous blocks (see `block_for_width`). docs/hadamard.md has the metadata.

The rotation is emitted as `foldline::hadamard_rotate` / `foldline::hadamard_unrotate`
so the `fuse-hadamard` pass can find it; both decompose into an O(n log n)
butterfly (adds, subtracts, reshapes), never a dense n x n matmul.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .model import RMSNorm
from .ops import register_decomposition

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
DEFAULT_BLOCK_SIZE = 1024  # the measured qwen35 / Bonsai files
SIGN_MODES = ("explicit",)


class HadamardMetadataError(ValueError):
    """prism.hadamard.* metadata that is inconsistent or that foldline does not understand."""


# ---------------------------------------------------------------------------
# Math
# ---------------------------------------------------------------------------


def block_for_width(width: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """The transform block for an activation of `width`: the largest power of two dividing it, capped.

    For widths that are multiples of block_size (all of qwen35's: 5120, 6144, 17408)
    this is block_size itself. Other widths (576 = 9 x 64) use the largest
    power-of-two block that tiles them exactly, so no padding changes the shapes.
    """
    if block_size < 2 or block_size & (block_size - 1):
        raise HadamardMetadataError(f"Hadamard block size {block_size} is not a power of two >= 2")
    if width <= 0:
        raise HadamardMetadataError(f"activation width {width} must be positive")
    low_bit = width & -width
    block = min(low_bit, block_size)
    if block < 2:
        raise HadamardMetadataError(f"activation width {width} is odd: no Walsh-Hadamard block tiles it")
    return block


def _compute_dtype(x: Tensor) -> torch.dtype:
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


def wht(x: Tensor, block: int) -> Tensor:
    """Normalized Sylvester WHT on contiguous blocks of the last dim, as a log2(block)-stage butterfly.

    H_{2n} = [[H_n, H_n], [H_n, -H_n]] is H_2 applied on every index bit, so each
    stage pairs elements `half` apart: (a, b) -> (a + b, a - b). One scale of
    1/sqrt(block) at the end (exactly 1/32 for 1024). H is symmetric and orthogonal.
    """
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"width {n} is not a multiple of the Hadamard block {block}")
    lead = tuple(x.shape[:-1])
    groups = n // block
    y = x
    half = 1
    while half < block:
        y = y.reshape(*lead, groups, block // (2 * half), 2, half)
        a, b = y.select(-2, 0), y.select(-2, 1)
        y = torch.stack((a + b, a - b), dim=-2)
        half *= 2
    return y.reshape(*lead, n) * (1.0 / math.sqrt(block))


def tiled_to_grouped(x: Tensor, head_dim: int, rep: int) -> Tensor:
    """Reorder heads from tiled [rep, nk, hd] to grouped [nk, rep, hd] (numpy order, last dim).

    ggml writes these shapes innermost first: tiled [hd, nk, rep] -> grouped [hd, rep, nk].
    Tiled is llama.cpp's GDN value-head order (head h = r * nk + k reads key head
    h % nk); grouped is the order the rotation was computed in (h = k * rep + r).
    """
    n = x.shape[-1]
    nk = n // (head_dim * rep)
    if nk * head_dim * rep != n:
        raise ValueError(f"width {n} is not head_dim {head_dim} x rep {rep} x key heads")
    lead = tuple(x.shape[:-1])
    return x.reshape(*lead, rep, nk, head_dim).transpose(-3, -2).reshape(*lead, n)


def permutation_index(width: int, head_dim: int, rep: int) -> Tensor:
    """perm with tiled_to_grouped(x)[..., i] == x[..., perm[i]] (identity when rep <= 1)."""
    idx = torch.arange(width)
    if rep <= 1 or head_dim <= 0:
        return idx
    return tiled_to_grouped(idx[None], head_dim, rep)[0]


def rotate_activation(x: Tensor, signs: Tensor, block: int, perm_head_dim: int = 0, perm_rep: int = 1) -> Tensor:
    """What a listed weight expects: WHT(signs * P x), computed in fp32 (or fp64), returned in x's dtype."""
    y = x.to(_compute_dtype(x))
    if perm_rep > 1:
        y = tiled_to_grouped(y, perm_head_dim, perm_rep)
    y = y * signs.to(y.dtype)
    return wht(y, block).to(x.dtype)


def unrotate_rows(z: Tensor, signs: Tensor, block: int) -> Tensor:
    """An embedding row back in the model's basis: signs * WHT(z) (reverse order of the forward)."""
    y = z.to(_compute_dtype(z))
    return (wht(y, block) * signs.to(y.dtype)).to(z.dtype)


def fold_weight(w_stored: Tensor, signs: Tensor, block: int, perm_head_dim: int = 0, perm_rep: int = 1) -> Tensor:
    """W = W_s H D P: the weight that reads the unrotated activation; fp64 math, one rounding."""
    m = wht(w_stored.to(torch.float64), block) * signs.to(torch.float64)  # rows: (W_s H D)
    if perm_rep > 1:
        perm = permutation_index(m.shape[-1], perm_head_dim, perm_rep)
        out = torch.empty_like(m)
        out[..., perm] = m  # (M P)[:, perm[i]] = M[:, i]
        m = out
    return m.to(w_stored.dtype).contiguous()


def rotate_weight(w: Tensor, signs: Tensor, block: int, perm_head_dim: int = 0, perm_rep: int = 1) -> Tensor:
    """W_s = W P^T D H, the inverse of `fold_weight` (what a converter stores); fp64 math.

    With perm = 0 this is also the stored form of an inverse-listed table: z = H D e per row.
    """
    m = w.to(torch.float64)
    if perm_rep > 1:
        m = m[..., permutation_index(m.shape[-1], perm_head_dim, perm_rep)]
    return wht(m * signs.to(torch.float64), block).to(w.dtype).contiguous()


def random_signs(width: int, generator: torch.Generator) -> Tensor:
    """A random +-1 vector (float32) of `width` entries."""
    return torch.randint(0, 2, (width,), generator=generator).to(torch.float32) * 2 - 1


# ---------------------------------------------------------------------------
# Custom ops
# ---------------------------------------------------------------------------


def hadamard_rotate_impl(x: Tensor, signs: Tensor, block: int, perm_head_dim: int, perm_rep: int) -> Tensor:
    return rotate_activation(x, signs, block, perm_head_dim, perm_rep)


def hadamard_unrotate_impl(z: Tensor, signs: Tensor, block: int) -> Tensor:
    return unrotate_rows(z, signs, block)


@torch.library.custom_op("foldline::hadamard_rotate", mutates_args=())
def hadamard_rotate(x: Tensor, signs: Tensor, block: int, perm_head_dim: int, perm_rep: int) -> Tensor:
    return hadamard_rotate_impl(x, signs, block, perm_head_dim, perm_rep)


@hadamard_rotate.register_fake
def _(x, signs, block, perm_head_dim, perm_rep):
    return x.new_empty(x.shape)


@torch.library.custom_op("foldline::hadamard_unrotate", mutates_args=())
def hadamard_unrotate(z: Tensor, signs: Tensor, block: int) -> Tensor:
    return hadamard_unrotate_impl(z, signs, block)


@hadamard_unrotate.register_fake
def _(z, signs, block):
    return z.new_empty(z.shape)


register_decomposition(torch.ops.foldline.hadamard_rotate.default, hadamard_rotate_impl)
register_decomposition(torch.ops.foldline.hadamard_unrotate.default, hadamard_unrotate_impl)

HADAMARD_OPS = (torch.ops.foldline.hadamard_rotate.default, torch.ops.foldline.hadamard_unrotate.default)


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
        rotated = torch.ops.foldline.hadamard_rotate(x, self.hadamard_signs, self.block, self.perm_head_dim,
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
        return torch.ops.foldline.hadamard_unrotate(rows, self.hadamard_signs, self.block)


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
        return torch.ops.foldline.hadamard_rotate(super().forward(x), self.hadamard_signs, self.block, 0, 1)


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


def default_name_map(model: nn.Module) -> dict[str, str]:
    """GGUF tensor name -> module parameter name, from the GGUF loader's table (empty if unavailable)."""
    cfg = getattr(model, "cfg", None)
    if cfg is None:
        return {}
    try:
        from .gguf_loader import tensor_name_map
    except ImportError:
        return {}
    try:
        return {gguf: param for param, gguf in tensor_name_map(cfg).items()}
    except ValueError:  # a family whose tensors the loader does not map yet: module names only
        return {}


def _set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def _check_gdn_permutation(model: nn.Module, path: str, name: str, perm: Permutation | None) -> None:
    """A tiled GDN output projection (interleaved value heads, rep > 1) must declare its permutation.

    The rotation was computed in grouped head order; without the permutation the
    measured cosine is -0.11, silently, on every GDN layer.
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
    table needs the forward rotation on its input. Names are GGUF tensor names
    (through `name_map`, default: the GGUF loader's table) or module parameter
    names. Raises HadamardMetadataError when the keys disagree with the model.
    """
    meta = metadata if isinstance(metadata, HadamardMetadata) else parse_hadamard_metadata(metadata)
    names = dict(name_map) if name_map is not None else default_name_map(model)
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
    names = dict(name_map) if name_map is not None else default_name_map(model)
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


def make_metadata(
    widths: list[int], weight_names: list[str], inverse_names: list[str] | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE, seed: int = 0, permutations: Mapping[str, Permutation] | None = None,
) -> HadamardMetadata:
    """Metadata with seeded random signs, one vector per distinct width (in the order given)."""
    gen = torch.Generator().manual_seed(seed)
    signs = {w: random_signs(w, gen) for w in dict.fromkeys(widths)}
    return HadamardMetadata(list(weight_names), list(inverse_names or []), block_size, signs,
                            dict(permutations or {}))
