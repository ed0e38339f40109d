"""Property tests over random configurations, in torch eager: each rewrite == its reference.

ring-buffer-swa (ops and whole graphs), the chunked gated delta net against
the token-by-token recurrence, fold-embedding-scale and fuse-hadamard on
random widths. Tolerances are the golden harness's (`GOLDEN_TOL`, scaled
errors, docs/passes.md); fold-embedding-scale is exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from foldline.frontend import attention_ops, gdn_ops
from foldline.frontend.arch import get_preset
from foldline.frontend.gdn import gdn_sequential_reference, gdn_state_specs
from foldline.frontend.model import build_model
from foldline.frontend.types import TORCH_DTYPES, ChunkContext
from foldline.passes.manager import CompileUnit, run_pipeline
from foldline.testing.golden import (
    GOLDEN_TOL,
    Step,
    compare_units,
    copy_unit,
    golden_check,
    make_steps,
    ring_from_full,
)

from reliability.reliability_common import FULL, record, scaled

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = GOLDEN_TOL["float32"]


# ---- ring-buffer-swa ---------------------------------------------------------------------------


@st.composite
def ring_op_cases(draw):
    """Shapes, window, chunk, start positions per row and a sequence of n_valid per row."""
    window = draw(st.integers(1, 12))
    chunk = draw(st.integers(1, 3 * window + 2))
    b = draw(st.integers(1, 3))
    starts = draw(st.lists(st.integers(0, 3 * window), min_size=b, max_size=b))
    calls = draw(st.lists(st.lists(st.integers(0, chunk), min_size=b, max_size=b), min_size=1, max_size=8))
    return window, chunk, b, starts, calls, draw(st.integers(0, 2**16))


@settings(max_examples=scaled(40, 3000))
@given(case=ring_op_cases())
def test_ring_ops_equal_full_cache_ops(case):
    """ring_attention + ring_write == cache_attention + kv_cache_write, for any window, chunk and rows.

    Rows start at different positions, chunks are padded or empty, chunks may
    be longer than the window (a chunk that wraps the ring more than once).
    """
    window, chunk, b, starts, calls, seed = case
    record("property ring ops: cases")
    gen = torch.Generator().manual_seed(seed)
    h, d = 2, 4
    length = max(starts) + chunk * len(calls) + 1
    pos = torch.tensor(starts)
    # The reference cache starts with what the rows already hold: random K/V at positions < start.
    full_k = torch.zeros(b, h, length, d)
    full_v = torch.zeros(b, h, length, d)
    for row, start in enumerate(starts):
        full_k[row, :, :start] = torch.randn(h, start, d, generator=gen)
        full_v[row, :, :start] = torch.randn(h, start, d, generator=gen)
    ring_k, ring_v = ring_from_full(full_k, pos, window), ring_from_full(full_v, pos, window)
    for n in calls:
        n_valid = torch.tensor(n)
        k_new = torch.randn(b, h, chunk, d, generator=gen)
        v_new = torch.randn(b, h, chunk, d, generator=gen)
        q = torch.randn(b, 2 * h, chunk, d, generator=gen)
        full_k = attention_ops.kv_cache_write_impl(full_k, k_new, pos, n_valid)
        full_v = attention_ops.kv_cache_write_impl(full_v, v_new, pos, n_valid)
        want = attention_ops.cache_attention_impl(q, full_k, full_v, pos, window, 0.5, "blocked", length)
        got = attention_ops.ring_attention_impl(q, ring_k, ring_v, k_new, v_new, pos, n_valid, window, 0.5, "blocked")
        ring_k = attention_ops.ring_write_impl(ring_k, k_new, pos, n_valid)
        ring_v = attention_ops.ring_write_impl(ring_v, v_new, pos, n_valid)
        valid = torch.arange(chunk)[None, :] < n_valid[:, None]  # padded queries have no defined output
        torch.testing.assert_close(got.transpose(1, 2)[valid], want.transpose(1, 2)[valid], rtol=0, atol=1e-5)
        pos = pos + n_valid
        assert torch.equal(ring_k, ring_from_full(full_k, pos, window))
        assert torch.equal(ring_v, ring_from_full(full_v, pos, window))


@settings(max_examples=scaled(30, 1000))
@given(
    window=st.integers(1, 12),
    starts=st.lists(st.integers(0, 40), min_size=1, max_size=3),
    steps=st.integers(1, 30),
    seed=st.integers(0, 2**16),
)
def test_one_token_ring_ops_equal_full_cache_ops(window, starts, steps, seed):
    """ring_write_token + ring_decode_attention (the decode form: attention over the written ring)
    == kv_cache_write + cache_attention, step by step across wrap-around, one to three rows."""
    record("property one-token ring ops: cases")
    gen = torch.Generator().manual_seed(seed)
    b, h, d = len(starts), 2, 4
    length = max(starts) + steps + 1
    pos = torch.tensor(starts)
    full_k = torch.randn(b, h, length, d, generator=gen)  # slots below a row's start are its history
    full_v = torch.randn(b, h, length, d, generator=gen)
    ring_k, ring_v = ring_from_full(full_k, pos, window), ring_from_full(full_v, pos, window)
    ones = torch.ones(b, dtype=torch.int64)
    for _ in range(steps):
        k_new, v_new = torch.randn(b, h, 1, d, generator=gen), torch.randn(b, h, 1, d, generator=gen)
        q = torch.randn(b, 2 * h, 1, d, generator=gen)
        full_k = attention_ops.kv_cache_write_impl(full_k, k_new, pos, ones)
        full_v = attention_ops.kv_cache_write_impl(full_v, v_new, pos, ones)
        want = attention_ops.cache_attention_impl(q, full_k, full_v, pos, window, 0.5, "blocked", length)
        ring_k = attention_ops.ring_write_token_impl(ring_k, k_new, pos, ones)
        ring_v = attention_ops.ring_write_token_impl(ring_v, v_new, pos, ones)
        got = attention_ops.ring_decode_attention_impl(q, ring_k, ring_v, pos, window, 0.5, "blocked")
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        pos = pos + 1
        assert torch.equal(ring_k, ring_from_full(full_k, pos, window))
        assert torch.equal(ring_v, ring_from_full(full_v, pos, window))


def ring_config(window: int, max_context: int = 64):
    """Ripple's block with a small window and three layers: cheap to export, wraps often."""
    return get_preset("ripple-tiny").replace(
        name=f"ring-prop-w{window}", layer_types=("local", "global", "local"), sliding_window=window,
        max_context=max_context,
    )


# (window, chunk, batch) triples the graph property draws from: each is exported once per session,
# so the quick slice keeps to one (a chunk longer than 2W); the full run covers chunks below,
# equal to and above the window.
RING_GRAPHS = (
    [(3, 8, 2)] if not FULL else
    [(w, c, b) for w in (2, 3, 5, 7) for c in (1, 4, 9) for b in (1, 3)]
)


@st.composite
def ring_graph_cases(draw):
    window, chunk, batch = draw(st.sampled_from(RING_GRAPHS))
    prompts = draw(st.lists(st.integers(1, 40), min_size=batch, max_size=batch))
    decodes = draw(st.integers(0, 64 - max(prompts)))
    return window, chunk, prompts, decodes, draw(st.integers(0, 2**16))


@settings(max_examples=scaled(6, 150))
@given(case=ring_graph_cases())
def test_ring_pass_golden_random(case, exported_unit):
    """The rewritten graph == the full-cache graph: rows at different positions, padding, wrap-around."""
    window, chunk, prompts, decodes, seed = case
    record("property ring-buffer-swa graph: cases")
    cfg = ring_config(window)
    unit = exported_unit(cfg, batch=len(prompts), chunk=chunk)
    steps = make_steps(prompts, chunk, decodes, cfg.vocab_size, seed=seed)
    _, report, pass_report = golden_check(unit, ["ring-buffer-swa"], steps)
    record("property ring-buffer-swa graph: steps", report.steps)
    assert pass_report[0]["changed"]
    assert report.steps == len(steps)
    assert report.ok(TOL), f"window {window} chunk {chunk} prompts {prompts} decodes {decodes}: {report.summary()}"


# ---- gated delta net ---------------------------------------------------------------------------


@st.composite
def gdn_cases(draw):
    b, h = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    c = draw(st.integers(1, 48))
    dk, dv = draw(st.sampled_from([2, 4, 8, 16])), draw(st.integers(1, 16))
    n_valid = draw(st.lists(st.integers(0, c), min_size=b, max_size=b))
    rate = draw(st.sampled_from([0.0, 0.05, 0.3, 3.0, 8.0]))
    return b, h, c, dk, dv, n_valid, rate, draw(st.integers(0, 2**16))


def series_amplification(k: torch.Tensor, log_g: torch.Tensor, beta: torch.Tensor, n_valid: torch.Tensor) -> torch.Tensor:
    """Per row, ||(I - |A|)^-1||_inf in float64, A the chunk's strictly lower beta_t (gamma_t/gamma_s) k_t.k_s.

    The chunk op inverts (I + A) as the series sum_n (-A)^n by repeated squaring
    (gdn_ops._unit_lower_inverse): each term is rounded to fp32 relative to its own
    size, and the sizes of all terms add up to (I - |A|)^-1. Rounding in the
    result is therefore bounded by fp32 rounding times this norm; it is 1 to a
    few when keys are nearly orthogonal (head widths of 8 and up) and reaches
    1e4 to 1e5 when 2-wide keys make A's entries all near +-1.
    """
    c = k.shape[2]
    valid = torch.arange(c)[None, :] < n_valid[:, None]
    lg = torch.where(valid[:, None], log_g.double(), 0.0)
    bt = torch.where(valid[:, None], beta.double(), 0.0)
    cum = torch.cumsum(lg, -1)
    t = torch.arange(c)
    decay = torch.exp((cum[..., :, None] - cum[..., None, :]).clamp(max=0.0))
    kd = k.double()
    a = torch.where(t[:, None] > t[None, :], bt[..., :, None] * decay * (kd @ kd.transpose(-1, -2)), 0.0)
    eye = torch.eye(c, dtype=torch.float64)
    series = torch.linalg.solve_triangular(eye - a.abs(), eye.expand_as(a).contiguous(), upper=False)
    return series.abs().sum(-1).amax(dim=(-2, -1))  # [B]


@settings(max_examples=scaled(40, 3000))
@given(case=gdn_cases())
@example(case=(1, 1, 31, 2, 1, [29], 0.0, 0))  # found by the full run: 2-wide keys, amplification > 1
@example(case=(1, 1, 34, 2, 1, [1], 0.0, 0))  # found by the full run: an output near zero made of large terms
def test_gdn_chunk_equals_recurrence(case):
    """The WY chunk form == the token-by-token delta rule, any chunk length, padding per row, any decay.

    Tolerance: twice GOLDEN_TOL's fp32 bound (the recurrence rounds C times
    too, and at C = 48 its error alone comes near one bound) times the row's series
    amplification (series_amplification), above what random cases give (docs/reliability.md).
    Rows with padding only keep their state exactly.
    """
    b, h, c, dk, dv, n_valid_list, rate, seed = case
    record("property gdn chunk vs recurrence: cases")
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(b, h, c, dk, generator=gen), dim=-1)
    k = F.normalize(torch.randn(b, h, c, dk, generator=gen), dim=-1)
    v = torch.randn(b, h, c, dv, generator=gen)
    log_g = -torch.rand(b, h, c, generator=gen) * rate
    beta = torch.sigmoid(torch.randn(b, h, c, generator=gen) * 2)
    state = torch.randn(b, h, dv, dk, generator=gen)
    n_valid = torch.tensor(n_valid_list)
    scale = dk**-0.5
    o, s = gdn_ops.gdn_chunk_impl(q, k, v, log_g, beta, state, n_valid, scale)
    o_ref, s_ref = gdn_sequential_reference(q, k, v, log_g, beta, state, n_valid, scale)
    # Each output is a dot product S_t q_t; a row's errors are scaled by the largest size of those
    # terms, |S_t| |q_t| over its valid tokens (as the golden harness scales logits by their terms):
    # an output near zero made of large terms legitimately keeps their rounding.
    terms, s_t = [], state
    for i in range(c):
        _, s_t = gdn_ops.gdn_step_impl(q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1],
                                   log_g[:, :, i : i + 1], beta[:, :, i : i + 1], s_t, (n_valid > i).long(), scale)
        terms.append(torch.matmul(s_t.abs(), q[:, :, i].abs()[..., None])[..., 0] * scale)
    o_terms = torch.stack(terms, dim=2)  # [B, H, C, Dv]
    amplification = series_amplification(k, log_g, beta, n_valid)
    for row, n in enumerate(n_valid_list):
        if n == 0:  # padded tokens leave the state exactly as it was
            assert torch.equal(s[row], state[row])
        tol = 2 * TOL * float(amplification[row])
        if float(amplification[row]) > 10:
            record("property gdn chunk vs recurrence: rows with amplification > 10")
        s_scale = max(float(s_ref[row].abs().max()), 1e-30)
        assert float((s[row] - s_ref[row]).abs().max()) / s_scale < tol
        if n:
            o_scale = max(float(o_terms[row, :, :n].max()), 1e-30)
            assert float((o[row, :, :n] - o_ref[row, :, :n]).abs().max()) / o_scale < tol


def _ctx(b: int, c: int, start: int, n_valid: int, d: int) -> ChunkContext:
    start_pos = torch.full((b,), start, dtype=torch.int64)
    positions = start_pos[:, None] + torch.arange(c)
    return ChunkContext(start_pos, torch.full((b,), n_valid, dtype=torch.int64), positions, torch.zeros(b, c, d))


@pytest.fixture(scope="module")
def gdn_mixer():
    cfg = get_preset("qwen35-tiny")
    model = build_model(cfg, seed=3)
    return model.layers[cfg.layers_of("gdn")[0]].mixer


@settings(max_examples=scaled(8, 200))
@given(chunk=st.integers(1, 24), total=st.integers(1, 60), seed=st.integers(0, 2**16))
@torch.no_grad()
def test_gdn_module_chunks_equal_decode_steps(gdn_mixer, chunk, total, seed):
    """The mixer fed in padded chunks (garbage padding) == the same tokens one decode step at a time."""
    record("property gdn module chunks vs steps: cases")
    cfg = gdn_mixer.cfg
    d = cfg.hidden_size
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(1, total, d, generator=gen)
    specs = gdn_state_specs(cfg, 0, 1)
    ssm_a, conv_a = (torch.zeros(s.shape) for s in specs)
    outs = []
    for off in range(0, total, chunk):
        piece = h[:, off : off + chunk]
        n = piece.shape[1]
        padded = torch.cat([piece, 100 * torch.randn(1, chunk - n, d, generator=gen)], dim=1)
        outs.append(gdn_mixer(padded, _ctx(1, chunk, off, n, d), ssm_a, conv_a)[:, :n])
    out_chunked = torch.cat(outs, dim=1)
    ssm_b, conv_b = (torch.zeros(s.shape) for s in specs)
    out_steps = torch.cat([gdn_mixer(h[:, i : i + 1], _ctx(1, 1, i, 1, d), ssm_b, conv_b) for i in range(total)], dim=1)
    assert float((out_chunked - out_steps).abs().max() / out_steps.abs().max()) < TOL
    assert float((ssm_a - ssm_b).abs().max() / ssm_b.abs().max()) < TOL
    torch.testing.assert_close(conv_a, conv_b, rtol=1e-5, atol=1e-6)


# ---- fold-embedding-scale ------------------------------------------------------------------------


class _ScaledLookup(nn.Module):
    """embedding * constant(s) -> head: the pattern the pass folds, at a drawn width and dtype."""

    def __init__(self, vocab: int, width: int, factors: tuple[float, ...], dtype: torch.dtype, left: bool):
        super().__init__()
        self.factors, self.left = factors, left
        self.embed = nn.Embedding(vocab, width).to(dtype)
        self.head = nn.Linear(width, vocab, bias=False).to(dtype)

    def forward(self, ids):
        x = self.embed(ids)
        for f in self.factors:
            x = torch.mul(torch.tensor(f, dtype=x.dtype), x) if self.left else x * f
        return self.head(x)


@settings(max_examples=scaled(5, 100))
@given(vocab=st.integers(2, 300), width=st.integers(1, 200),
       factors=st.lists(st.floats(-40, 40, allow_nan=False, width=32).filter(lambda f: f != 0), min_size=1, max_size=3),
       dtype=st.sampled_from(["float32", "bfloat16", "float16"]), left=st.booleans(), seed=st.integers(0, 2**16))
@example(vocab=2, width=67, factors=[27.0, 30.0, 31.0], dtype="float16", left=False, seed=0)  # f16 overflow
def test_fold_embedding_scale_random_widths(vocab, width, factors, dtype, left, seed):
    """Folding the multipliers into the table changes no logit bit, at any width, dtype and chain length."""
    record("property fold-embedding-scale: cases")
    torch.manual_seed(seed)
    module = _ScaledLookup(vocab, width, tuple(factors), TORCH_DTYPES[dtype], left).eval()
    ids = torch.randint(0, vocab, (2, 5))
    with torch.no_grad():
        program = torch.export.export(module, (ids,), strict=False).run_decompositions({})
    unit = CompileUnit(get_preset("llama-tiny"), {"prefill": program}, [])
    report = run_pipeline(unit, ["fold-embedding-scale"], progress=lambda _m: None)
    assert report[0]["changed"]
    after = unit.programs["prefill"]
    muls = [n for n in after.graph.nodes if n.target == torch.ops.aten.mul.Tensor]
    assert not muls, "a multiply of the lookup survived the fold"
    probe = torch.randint(0, vocab, (2, 5), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():  # bit-exact; an f16 chain that overflows gives inf / NaN in the same places
        torch.testing.assert_close(after.module()(probe), program.module()(probe), rtol=0, atol=0, equal_nan=True)


# ---- fuse-hadamard -----------------------------------------------------------------------------


@st.composite
def hadamard_cases(draw):
    heads = draw(st.sampled_from([2, 4]))
    head_dim = draw(st.sampled_from([8, 12, 16, 24]))
    kv_heads = draw(st.sampled_from([h for h in (1, 2, heads) if heads % h == 0]))
    hidden = draw(st.sampled_from([16, 24, 32, 48, 64, 96]))
    inter = 2 * draw(st.integers(4, 60))
    block = draw(st.sampled_from([2, 4, 8, 16, 32, 64]))
    mode = draw(st.sampled_from(["fold", "online"]))
    return heads, head_dim, kv_heads, hidden, inter, block, mode, draw(st.integers(0, 2**16))


@settings(max_examples=scaled(3, 60))
@given(case=hadamard_cases())
def test_fuse_hadamard_random_widths(case):
    """fuse-hadamard (fold or online) == the rotated model it rewrites, for widths tiled by any block."""
    from foldline.frontend.export import export_entry_point

    from helpers.rotated_gguf import rotated_model

    heads, head_dim, kv_heads, hidden, inter, block, mode, seed = case
    record("property fuse-hadamard: cases")
    cfg = get_preset("llama-tiny").replace(
        name="hadamard-prop", hidden_size=hidden, intermediate_size=inter, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, layer_types=("global", "global"), vocab_size=96, max_context=32,
    )
    rot, _ = rotated_model(build_model(cfg, seed=seed % 97), block_size=block, seed=seed)
    entry = export_entry_point(rot, "decode", chunk=4)
    unit = CompileUnit(cfg, {"decode": entry.program}, entry.state_specs, options={"hadamard": mode})
    after = copy_unit(unit)
    report = run_pipeline(after, ["fuse-hadamard"], progress=lambda _m: None)
    assert report[0]["changed"]
    rotations = [n for n in after.programs["decode"].graph.nodes
                 if n.op == "call_function" and "hadamard" in str(n.target)]
    assert (rotations == []) == (mode == "fold")
    gen = torch.Generator().manual_seed(seed)
    steps = [Step("decode", torch.randint(0, cfg.vocab_size, (1, 1), generator=gen), torch.tensor([p]))
             for p in range(6)]
    result = compare_units(unit, after, steps)
    assert result.ok(TOL), f"{case}: {result.summary()}"
