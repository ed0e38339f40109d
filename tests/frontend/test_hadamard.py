"""Hadamard-folded checkpoints: the transform, each convention against its candidates, metadata, GGUF."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from foldline.frontend import hadamard as H
from foldline.frontend.arch import get_preset
from foldline.frontend.layers import RMSNorm
from foldline.frontend.model import build_model, new_state

from helpers.rotated_gguf import rotate_gguf, rotated_model, write_llama_gguf

CHUNK = 16


def _dense_sylvester(n: int) -> Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


@torch.no_grad()
def _logits(model: nn.Module, tokens: Tensor) -> Tensor:
    state = new_state(model.cfg, 1)
    return model(tokens, torch.tensor([0]), torch.tensor([tokens.shape[1]]), *state).double()


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _cos(a: Tensor, b: Tensor) -> float:
    return float(F.cosine_similarity(a.reshape(1, -1), b.reshape(1, -1)))


# ---------------------------------------------------------------------------
# The transform
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("block", [2, 8, 64, 1024])
def test_butterfly_equals_dense_sylvester_per_block(block):
    x = torch.randn(3, 3 * block, dtype=torch.float64)
    dense = _dense_sylvester(block)
    expected = torch.cat([x[:, i * block:(i + 1) * block] @ dense.T for i in range(3)], dim=1)
    torch.testing.assert_close(H.wht(x, block), expected, rtol=0, atol=1e-12)
    # Normalized and an involution: H H = I.
    torch.testing.assert_close(H.wht(H.wht(x, block), block), x, rtol=0, atol=1e-12)
    if block == 1024:
        assert float(dense[0, 0]) == 1 / 32


def test_block_rule():
    assert [H.block_for_width(w, 1024) for w in (5120, 6144, 17408)] == [1024, 1024, 1024]
    assert [H.block_for_width(w, 1024) for w in (576, 1536, 64, 160)] == [64, 512, 64, 32]
    assert H.block_for_width(96, 32) == 32
    with pytest.raises(H.HadamardMetadataError, match="odd"):
        H.block_for_width(49, 1024)
    with pytest.raises(H.HadamardMetadataError, match="power of two"):
        H.block_for_width(64, 48)


def test_tiled_to_grouped_turns_interleaved_heads_into_blocked():
    """Not circular: the permutation must map llama.cpp's tiled GDN layout onto the grouped one.

    In the tiled layout value head h reads key head h % nk (interleaved); in the
    grouped layout it reads h // rep (blocked). Label every channel with its key head.
    """
    hd, nk, rep = 4, 16, 3
    n_v = nk * rep
    tiled = torch.arange(n_v).remainder(nk).repeat_interleave(hd).to(torch.float64)
    grouped = torch.arange(n_v).div(rep, rounding_mode="floor").repeat_interleave(hd).to(torch.float64)
    assert torch.equal(H.tiled_to_grouped(tiled, hd, rep), grouped)
    assert not torch.equal(tiled, grouped)
    # And the attention layout (h = kv * rep + r) is already grouped: permuting it breaks it.
    attn = torch.arange(n_v).div(rep, rounding_mode="floor").repeat_interleave(hd).to(torch.float64)
    assert not torch.equal(H.tiled_to_grouped(attn, hd, rep), attn)


@pytest.mark.parametrize("perm", [(0, 1), (16, 3)])
def test_fold_inverts_the_stored_form(perm):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(7, 96, dtype=torch.float64, generator=gen)
    signs = H.random_signs(96, gen)
    stored = H.rotate_weight(w, signs, 32, *perm)
    torch.testing.assert_close(H.fold_weight(stored, signs, 32, *perm), w, rtol=0, atol=1e-12)
    x = torch.randn(5, 96, dtype=torch.float64, generator=gen)
    torch.testing.assert_close(H.rotate_activation(x, signs, 32, *perm) @ stored.T, x @ w.T, rtol=0, atol=1e-12)
    assert (stored - w).abs().max() > 0.1


def test_custom_ops_match_their_reference_kernels():
    x = torch.randn(2, 5, 96)
    signs = H.random_signs(96, torch.Generator().manual_seed(1))
    out = torch.ops.foldline.hadamard_rotate(x, signs, 32, 16, 3)
    torch.testing.assert_close(out, H.rotate_activation(x, signs, 32, 16, 3))
    torch.testing.assert_close(torch.ops.foldline.hadamard_unrotate(out, signs, 32), H.unrotate_rows(out, signs, 32))


# ---------------------------------------------------------------------------
# Conventions: run the candidates side by side, only the documented one reproduces the model
# ---------------------------------------------------------------------------

Candidate = Callable[[Tensor, Tensor, int, int, int], Tensor]

LINEAR_CANDIDATES: dict[str, Candidate] = {
    "signs then WHT (documented)": lambda x, s, b, hd, rep: H.rotate_activation(x, s, b, hd, rep),
    "WHT then signs": lambda x, s, b, hd, rep: (
        H.wht(H.tiled_to_grouped(x, hd, rep) if rep > 1 else x, b) * s),
    "WHT without signs": lambda x, s, b, hd, rep: H.wht(H.tiled_to_grouped(x, hd, rep) if rep > 1 else x, b),
    "no rotation": lambda x, s, b, hd, rep: x,
}


class _CandidateLinear(nn.Module):
    def __init__(self, base: H.HadamardLinear, fn: Candidate, hd: int, rep: int):
        super().__init__()
        self.weight, self.bias = base.weight, base.bias
        self.signs, self.block, self.fn, self.hd, self.rep = base.hadamard_signs, base.block, fn, hd, rep

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(self.fn(x, self.signs, self.block, self.hd, self.rep), self.weight, self.bias)


def _swap_linears(model: nn.Module, select: Callable[[str], bool], fn: Candidate,
                  perm: tuple[int, int] | None = None) -> nn.Module:
    """A copy whose selected rotated linears use candidate `fn` (perm: override (hd, rep))."""
    out = copy.deepcopy(model)
    for name, module in list(out.named_modules()):
        if isinstance(module, H.HadamardLinear) and select(name):
            hd, rep = perm if perm is not None else (module.perm_head_dim, module.perm_rep)
            parent, _, leaf = name.rpartition(".")
            setattr(out.get_submodule(parent), leaf, _CandidateLinear(module, fn, hd, rep))
    return out


@pytest.fixture(scope="module")
def llama_pair():
    ref = build_model(get_preset("llama-tiny"), seed=0)
    rot, meta = rotated_model(ref, block_size=32, seed=5)
    tokens = torch.randint(0, ref.cfg.vocab_size, (1, CHUNK), generator=torch.Generator().manual_seed(2))
    return ref, rot, meta, tokens


@pytest.fixture(scope="module")
def qwen_pair():
    """qwen35-tiny in llama.cpp's tiled GDN layout (interleaved) with distinct widths per activation."""
    cfg = get_preset("qwen35-tiny").replace(gdn_num_v_heads=6, gdn_kv_mapping="interleaved")
    ref = build_model(cfg, seed=3)
    rot, meta = rotated_model(ref, block_size=32, seed=7)
    tokens = torch.randint(0, cfg.vocab_size, (1, CHUNK), generator=torch.Generator().manual_seed(4))
    return ref, rot, meta, tokens


def test_linear_weights_take_signs_then_wht(llama_pair):
    ref, rot, _, tokens = llama_pair
    truth = _logits(ref, tokens)
    results = {name: _logits(_swap_linears(rot, lambda n: "layers." in n, fn), tokens)
               for name, fn in LINEAR_CANDIDATES.items()}
    for name, logits in results.items():
        print(f"{name:28s} rel {_rel(logits, truth):.3e} cos {_cos(logits, truth):.6f}")
    assert _rel(results["signs then WHT (documented)"], truth) < 1e-5
    for name in list(LINEAR_CANDIDATES)[1:]:
        assert _rel(results[name], truth) > 0.1, name
        assert _cos(results[name], truth) < 0.95, name


def test_lm_head_takes_signs_then_wht():
    """An untied head (qwen35's output.weight): rotated input via the final norm."""
    cfg = get_preset("qwen35-tiny")
    ref = build_model(cfg, seed=1)
    rot, _ = rotated_model(ref, block_size=32, seed=2)
    tokens = torch.arange(CHUNK)[None] * 7
    truth = _logits(ref, tokens)
    assert isinstance(rot.norm, H.HeadRotationNorm)
    assert _rel(_logits(rot, tokens), truth) < 1e-5
    plain = copy.deepcopy(rot)
    plain.norm.forward = lambda x: RMSNorm.forward(plain.norm, x)  # the head without its rotation
    assert _rel(_logits(plain, tokens), truth) > 0.1


def test_ssm_out_needs_the_permutation_and_attn_output_does_not(qwen_pair):
    ref, rot, meta, tokens = qwen_pair
    cfg = ref.cfg
    truth = _logits(ref, tokens)
    gdn_perm = (cfg.gdn_head_v_dim, cfg.gdn_num_v_heads // cfg.gdn_num_k_heads)
    attn_perm = (cfg.head_dim, cfg.num_heads // cfg.num_kv_heads)
    documented = LINEAR_CANDIDATES["signs then WHT (documented)"]
    assert any(n.endswith("mixer.out_proj.weight") for n in meta.permutations)
    assert _rel(_logits(rot, tokens), truth) < 1e-5

    def is_ssm_out(n: str) -> bool:
        return n.endswith("mixer.out_proj")

    def is_attn_output(n: str) -> bool:
        return n.endswith("mixer.o_proj")

    ssm = {
        "permute + signs + WHT (documented)": _logits(_swap_linears(rot, is_ssm_out, documented, gdn_perm), tokens),
        "signs + WHT, no permute": _logits(_swap_linears(rot, is_ssm_out, documented, (0, 1)), tokens),
        "permute, no WHT": _logits(_swap_linears(rot, is_ssm_out, lambda x, s, b, hd, rep:
                                                 H.tiled_to_grouped(x, hd, rep), gdn_perm), tokens),
    }
    attn = {
        "signs + WHT, no permute (documented)": _logits(_swap_linears(rot, is_attn_output, documented, (0, 1)),
                                                        tokens),
        "permute + signs + WHT": _logits(_swap_linears(rot, is_attn_output, documented, attn_perm), tokens),
    }
    for name, logits in {**ssm, **attn}.items():
        print(f"{name:40s} rel {_rel(logits, truth):.3e} cos {_cos(logits, truth):.6f}")
    assert _rel(ssm["permute + signs + WHT (documented)"], truth) < 1e-5
    assert _rel(ssm["signs + WHT, no permute"], truth) > 1e-2
    assert _rel(ssm["permute, no WHT"], truth) > 1e-2
    assert _rel(attn["signs + WHT, no permute (documented)"], truth) < 1e-5
    assert _rel(attn["permute + signs + WHT"], truth) > 1e-2


def test_ssm_alpha_beta_take_the_activation_unrotated(qwen_pair):
    ref, rot, meta, tokens = qwen_pair
    truth = _logits(ref, tokens)
    assert not any(n.endswith(("in_proj_a.weight", "in_proj_b.weight")) for n in meta.weight_names)
    rotated_gates = copy.deepcopy(rot)
    for name, module in list(rotated_gates.named_modules()):
        if name.endswith(("in_proj_a", "in_proj_b")):
            parent, _, leaf = name.rpartition(".")
            width = module.in_features
            setattr(rotated_gates.get_submodule(parent), leaf,
                    H.HadamardLinear(module, meta.signs[width], H.block_for_width(width, meta.block_size)))
    assert _rel(_logits(rot, tokens), truth) < 1e-5
    assert _rel(_logits(rotated_gates, tokens), truth) > 1e-3


@pytest.mark.parametrize("order", ["reverse", "forward"])
def test_embedding_lookup_is_undone_in_reverse_order(llama_pair, order):
    ref, rot, _, tokens = llama_pair
    truth = _logits(ref, tokens)
    model = copy.deepcopy(rot)
    emb = model.embed_tokens
    assert isinstance(emb, H.HadamardEmbedding)
    if order == "forward":  # h = WHT(signs * z), the forward convention applied to a row
        emb.forward = lambda ids: H.wht(F.embedding(ids, emb.weight) * emb.hadamard_signs, emb.block)
    logits = _logits(model, tokens)
    print(f"embedding {order}: rel {_rel(logits, truth):.3e} cos {_cos(logits, truth):.6f}")
    if order == "reverse":
        assert _rel(logits, truth) < 1e-5
        direct = F.embedding(tokens, emb.weight)
        torch.testing.assert_close(H.unrotate_rows(direct, emb.hadamard_signs, emb.block),
                                   ref.embed_tokens(tokens), rtol=0, atol=1e-6)
    else:
        assert _rel(logits, truth) > 0.1


# ---------------------------------------------------------------------------
# Metadata validation
# ---------------------------------------------------------------------------


def _good_metadata(meta: H.HadamardMetadata) -> dict:
    return meta.to_gguf_fields()


@pytest.mark.parametrize(
    "change, message",
    [
        ({H.KEY_SIGN_MODE: "random"}, "sign_mode"),
        ({H.KEY_BLOCK_SIZE: 48}, "power of two"),
        ({H.PREFIX + "rotation": "qr"}, "unknown Hadamard metadata key"),
        ({H.KEY_SIGN_VALUES: [1, -1, 1]}, "entries"),
        ({H.KEY_SIGN_WIDTHS: [64, 64]}, "distinct"),
        ("zero_sign", "only \\+1 and -1"),
        ("drop_width_160", "width 160"),
        ({H.KEY_WEIGHT_NAMES: ["layers.0.mlp.nonexistent.weight"]}, "not a weight"),
        ({H.KEY_INVERSE_NAMES: ["layers.0.mlp.down_proj.weight"]}, "not an embedding"),
        ({H.KEY_PERM_NAMES: ["layers.0.mlp.down_proj.weight"], H.KEY_PERM_HEAD_DIM: [16], H.KEY_PERM_REP: [2, 3]},
         "one entry per"),
        ({H.KEY_PERM_NAMES: ["layers.0.mlp.nothing.weight"], H.KEY_PERM_HEAD_DIM: [16], H.KEY_PERM_REP: [2]},
         "not in"),
        ({H.KEY_PERM_NAMES: ["layers.0.mlp.down_proj.weight"], H.KEY_PERM_HEAD_DIM: [7], H.KEY_PERM_REP: [3]},
         "not a multiple"),
        ("drop_weight_names", "lacks"),
        ("tied_head_without_table", "not in .*inverse_weight_names"),
    ],
)
def test_inconsistent_metadata_is_rejected(llama_pair, change, message):
    ref, _, meta, _ = llama_pair
    md = _good_metadata(meta)
    if change == "zero_sign":
        md[H.KEY_SIGN_VALUES] = [0] + md[H.KEY_SIGN_VALUES][1:]
    elif change == "drop_width_160":
        widths = md[H.KEY_SIGN_WIDTHS]
        i = widths.index(160)
        start = sum(widths[:i])
        md[H.KEY_SIGN_VALUES] = md[H.KEY_SIGN_VALUES][:start] + md[H.KEY_SIGN_VALUES][start + 160:]
        md[H.KEY_SIGN_WIDTHS] = [w for w in widths if w != 160]
    elif change == "drop_weight_names":
        del md[H.KEY_WEIGHT_NAMES]
    elif change == "tied_head_without_table":
        md[H.KEY_WEIGHT_NAMES] = ["embed_tokens.weight"]
        del md[H.KEY_INVERSE_NAMES]
    else:
        md.update(change)
    with pytest.raises(H.HadamardMetadataError, match=message):
        H.apply_hadamard_metadata(copy.deepcopy(ref), md, name_map={})


def test_apply_is_idempotent(llama_pair):
    ref, rot, meta, tokens = llama_pair
    again = copy.deepcopy(rot)
    report = H.apply_hadamard_metadata(again, meta, name_map={})
    assert report.linears == [] and report.embeddings == [] and not report.head
    assert _rel(_logits(again, tokens), _logits(ref, tokens)) < 1e-5


# ---------------------------------------------------------------------------
# GGUF fixtures through the loader
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("hadamard_gguf")
    ref = build_model(get_preset("llama-tiny"), seed=0)
    plain = write_llama_gguf(ref, d / "llama-tiny.gguf")
    return ref, plain, d


@pytest.mark.parametrize("block", [32, 1024])
def test_rotated_gguf_loads_to_the_unrotated_model(llama_gguf, block):
    from foldline.frontend.gguf_file import GGUFFile
    from foldline.frontend.gguf_loader import load_gguf

    ref, plain, d = llama_gguf
    out = d / f"rotated-{block}.gguf"
    meta = rotate_gguf(plain, out, block_size=block, seed=3)
    with GGUFFile(out) as g:
        assert g.metadata[H.KEY_SIGN_MODE] == "explicit"
        assert g.metadata[H.KEY_BLOCK_SIZE] == block
        assert g.metadata[H.KEY_SIGN_WIDTHS] == [64, 160]
        assert len(g.metadata[H.KEY_SIGN_VALUES]) == 224
        assert g.metadata[H.KEY_INVERSE_NAMES] == ["token_embd.weight"]
        assert "blk.0.ffn_down.weight" in g.metadata[H.KEY_WEIGHT_NAMES]
        with GGUFFile(plain) as p:
            assert (g.dequantize("blk.0.ffn_down.weight") != p.dequantize("blk.0.ffn_down.weight")).any()
            assert (g.dequantize("blk.0.attn_norm.weight") == p.dequantize("blk.0.attn_norm.weight")).all()
    loaded = load_gguf(out).module
    assert len(meta.weight_names) == 7 * 3
    assert isinstance(loaded.embed_tokens, H.HadamardEmbedding)
    assert isinstance(loaded.norm, H.HeadRotationNorm)  # tied head reads the rotated table
    assert isinstance(loaded.layers[2].mlp.down_proj, H.HadamardLinear)
    assert loaded.layers[2].mlp.down_proj.block == min(block, 32)  # 160 = 5 x 32
    tokens = torch.randint(0, 512, (1, CHUNK), generator=torch.Generator().manual_seed(9))
    assert _rel(_logits(loaded, tokens), _logits(ref, tokens)) < 1e-5
    assert _rel(_logits(load_gguf(plain).module, tokens), _logits(ref, tokens)) < 1e-6


def test_loader_rejects_disagreeing_keys(llama_gguf):
    from foldline.frontend.gguf_loader import load_gguf

    _, plain, d = llama_gguf
    out = d / "bad.gguf"
    rotate_gguf(plain, out, block_size=32, seed=3, extra_metadata={H.KEY_SIGN_MODE: "hashed"})
    with pytest.raises(H.HadamardMetadataError, match="sign_mode"):
        load_gguf(out)


def test_tiled_gdn_output_without_permutation_is_rejected(qwen_pair):
    ref, _, meta, _ = qwen_pair
    md = meta.to_gguf_fields()
    for key in (H.KEY_PERM_NAMES, H.KEY_PERM_HEAD_DIM, H.KEY_PERM_REP):
        del md[key]
    with pytest.raises(H.HadamardMetadataError, match="tiled order"):
        H.apply_hadamard_metadata(copy.deepcopy(ref), md, name_map={})
