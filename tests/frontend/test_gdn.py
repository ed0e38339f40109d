"""Gated delta net: chunked prefill vs the recurrence, degenerate cases, state, export, IREE."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from foldline.frontend import gdn_ops
from foldline.frontend.arch import get_preset
from foldline.frontend.gdn import GatedDeltaNet, gdn_sequential_reference, gdn_state_specs
from foldline.frontend.model import build_model, new_state, state_specs
from foldline.frontend.types import ChunkContext


def _random_inputs(seed: int, b: int = 2, h: int = 3, c: int = 16, dk: int = 8, dv: int = 12,
                   strong_decay: bool = False):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(b, h, c, dk, generator=gen), dim=-1)
    k = F.normalize(torch.randn(b, h, c, dk, generator=gen), dim=-1)
    v = torch.randn(b, h, c, dv, generator=gen)
    rate = 3.0 if strong_decay else 0.3
    log_g = -torch.rand(b, h, c, generator=gen) * rate
    beta = torch.sigmoid(torch.randn(b, h, c, generator=gen) * 2)
    state = torch.randn(b, h, dv, dk, generator=gen)
    return q, k, v, log_g, beta, state


def _scaled_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("chunk", [2, 5, 16, 64])
@pytest.mark.parametrize("strong_decay", [False, True])
def test_chunk_op_matches_token_by_token(chunk, strong_decay):
    """The WY/UT chunk form equals the recurrence on outputs and final state, padding included."""
    q, k, v, log_g, beta, state = _random_inputs(chunk, c=chunk, strong_decay=strong_decay)
    n_valid = torch.tensor([chunk, max(chunk - 3, 1)])  # second row: padded tail
    o, s = gdn_ops.gdn_chunk_impl(q, k, v, log_g, beta, state, n_valid, 8**-0.5)
    o_ref, s_ref = gdn_sequential_reference(q, k, v, log_g, beta, state, n_valid, 8**-0.5)
    assert _scaled_err(s, s_ref) < 1e-5
    for row in range(2):
        n = int(n_valid[row])
        assert _scaled_err(o[row, :, :n], o_ref[row, :, :n]) < 1e-5
    # The state moved: the check above is not comparing two copies of the input.
    assert _scaled_err(s, state) > 1e-2


def test_padded_tokens_leave_state_untouched():
    q, k, v, log_g, beta, state = _random_inputs(7, c=8)
    _, s_none = gdn_ops.gdn_chunk_impl(q, k, v, log_g, beta, state, torch.tensor([0, 0]), 0.5)
    torch.testing.assert_close(s_none, state, rtol=0, atol=0)
    _, s_three = gdn_ops.gdn_chunk_impl(q, k, v, log_g, beta, state, torch.tensor([3, 3]), 0.5)
    _, s_ref = gdn_sequential_reference(q[:, :, :3], k[:, :, :3], v[:, :, :3], log_g[:, :, :3],
                                        beta[:, :, :3], state, torch.tensor([3, 3]), 0.5)
    assert _scaled_err(s_three, s_ref) < 1e-6


@pytest.mark.parametrize("op", ["chunk", "step"])
def test_zero_state_one_token_is_outer_product(op):
    """From a zero state one token writes beta * outer(v, k): v-major, k-minor layout."""
    q, k, v, log_g, beta, _ = _random_inputs(3, c=1, dk=8, dv=8)
    zero = torch.zeros(2, 3, 8, 8)
    impl = gdn_ops.gdn_chunk_impl if op == "chunk" else gdn_ops.gdn_step_impl
    o, s = impl(q, k, v, log_g, beta, zero, torch.tensor([1, 1]), 0.25)
    expected = beta[:, :, 0, None, None] * v[:, :, 0, :, None] * k[:, :, 0, None, :]
    torch.testing.assert_close(s, expected, rtol=1e-6, atol=1e-7)
    transposed = beta[:, :, 0, None, None] * k[:, :, 0, :, None] * v[:, :, 0, None, :]
    assert (s - transposed).abs().max() > 1e-2
    # o = S q * scale = beta * v * (k . q) * scale
    kq = (k[:, :, 0] * q[:, :, 0]).sum(-1)
    torch.testing.assert_close(o[:, :, 0], 0.25 * (beta[:, :, 0] * kq)[..., None] * v[:, :, 0],
                               rtol=1e-5, atol=1e-6)


def _ctx(b: int, c: int, start: int, n_valid: int, d: int) -> ChunkContext:
    start_pos = torch.full((b,), start, dtype=torch.int64)
    positions = start_pos[:, None] + torch.arange(c)
    return ChunkContext(start_pos, torch.full((b,), n_valid, dtype=torch.int64), positions, torch.zeros(b, c, d))


def _mixer() -> GatedDeltaNet:
    cfg = get_preset("qwen35-tiny")
    model = build_model(cfg, seed=3)
    return model.layers[cfg.layers_of("gdn")[0]].mixer


@torch.no_grad()
def test_module_zero_state_one_token():
    """Module plumbing: conv with an empty state sees only its last tap, S = beta outer(v, k)."""
    mixer = _mixer()
    cfg = mixer.cfg
    h = torch.randn(1, 1, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    specs = gdn_state_specs(cfg, 0, 1)
    ssm, conv = (torch.zeros(s.shape) for s in specs)
    mixer(h, _ctx(1, 1, 0, 1, cfg.hidden_size), ssm, conv)

    x = mixer.in_proj_qkv(h)[0, 0]
    torch.testing.assert_close(conv[0, :, -1], x)  # current token in the last slot
    assert torch.all(conv[0, :, :-1] == 0)
    mixed = F.silu(x * mixer.conv1d_weight[:, -1])
    kw = cfg.gdn_key_width
    k = F.normalize(mixed[kw : 2 * kw].reshape(cfg.gdn_num_k_heads, -1), dim=-1)
    v = mixed[2 * kw :].reshape(cfg.gdn_num_v_heads, -1)
    beta = torch.sigmoid(mixer.in_proj_b(h)[0, 0])
    rep = cfg.gdn_num_v_heads // cfg.gdn_num_k_heads
    k_for_v = k.repeat_interleave(rep, dim=0)  # blocked mapping
    expected = beta[:, None, None] * v[:, :, None] * k_for_v[:, None, :]
    torch.testing.assert_close(ssm[0], expected, rtol=1e-4, atol=1e-6)


@torch.no_grad()
def test_module_chunk_equals_decode_steps():
    """Two chunks (the second padded) == the same tokens one decode step at a time."""
    mixer = _mixer()
    cfg = mixer.cfg
    d, c, total = cfg.hidden_size, 16, 27
    h = torch.randn(1, total, d, generator=torch.Generator().manual_seed(1))
    specs = gdn_state_specs(cfg, 0, 1)
    ssm_a, conv_a = (torch.zeros(s.shape) for s in specs)
    outs = []
    for off in range(0, total, c):
        piece = h[:, off : off + c]
        n = piece.shape[1]
        padded = torch.cat([piece, torch.randn(1, c - n, d)], dim=1)  # garbage padding
        outs.append(mixer(padded, _ctx(1, c, off, n, d), ssm_a, conv_a)[:, :n])
    out_chunked = torch.cat(outs, dim=1)

    ssm_b, conv_b = (torch.zeros(s.shape) for s in specs)
    out_steps = torch.cat([mixer(h[:, i : i + 1], _ctx(1, 1, i, 1, d), ssm_b, conv_b) for i in range(total)], dim=1)
    assert _scaled_err(out_chunked, out_steps) < 1e-5
    assert _scaled_err(ssm_a, ssm_b) < 1e-5
    torch.testing.assert_close(conv_a, conv_b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(conv_a[0].T, mixer.in_proj_qkv(h[0, -3:]), rtol=1e-6, atol=1e-6)


@torch.no_grad()
def test_module_batch_rows_pad_independently():
    """Rows with different n_valid: each row's states equal running its valid tokens alone."""
    mixer = _mixer()
    cfg = mixer.cfg
    d, c = cfg.hidden_size, 8
    h = torch.randn(2, c, d, generator=torch.Generator().manual_seed(4))
    specs = gdn_state_specs(cfg, 0, 2)
    ssm, conv = (torch.randn(s.shape, generator=torch.Generator().manual_seed(5)) for s in specs)
    ssm0, conv0 = ssm.clone(), conv.clone()
    ctx = _ctx(2, c, 3, c, d)
    ctx.n_valid = torch.tensor([c, 5])
    mixer(h, ctx, ssm, conv)
    for row, n in ((0, c), (1, 5)):
        one_ssm, one_conv = ssm0[row : row + 1].clone(), conv0[row : row + 1].clone()
        mixer(h[row : row + 1, :n], _ctx(1, n, 3, n, d), one_ssm, one_conv)
        assert _scaled_err(ssm[row : row + 1], one_ssm) < 1e-5
        torch.testing.assert_close(conv[row : row + 1], one_conv, rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_model_chunked_prefill_equals_token_by_token():
    cfg = get_preset("qwen35-tiny")
    model = build_model(cfg, seed=0)
    ids = torch.randint(0, cfg.vocab_size, (1, 37), generator=torch.Generator().manual_seed(5))
    chunk = 16
    st_a = new_state(cfg, 1)
    for off in range(0, ids.shape[1], chunk):
        piece = ids[:, off : off + chunk]
        tokens = torch.zeros(1, chunk, dtype=torch.int64)
        tokens[:, : piece.shape[1]] = piece
        logits_a = model(tokens, torch.tensor([off]), torch.tensor([piece.shape[1]]), *st_a)
    st_b = new_state(cfg, 1)
    for i in range(ids.shape[1]):
        logits_b = model(ids[:, i : i + 1], torch.tensor([i]), torch.tensor([1]), *st_b)
    assert _scaled_err(logits_a, logits_b) < 1e-5
    for spec, a, b in zip(state_specs(cfg, 1), st_a, st_b):
        assert _scaled_err(a, b) < 1e-5, spec.name


def test_gdn_state_specs_constant_in_context():
    cfg = get_preset("qwen35-tiny")
    specs = {s.name: s for s in state_specs(cfg, 2)}
    ssm, conv = specs["layer0.ssm"], specs["layer0.conv"]
    assert (ssm.shape, ssm.dtype, ssm.kind) == ((2, 4, 16, 16), "float32", "gdn_recurrent")
    assert (conv.shape, conv.kind) == ((2, cfg.gdn_conv_channels, 3), "gdn_conv")
    assert specs["layer3.k"].kind == "global_kv"
    gdn_bytes = [sum(s.nbytes for s in state_specs(cfg.replace(max_context=n), 1) if s.kind.startswith("gdn"))
                 for n in (64, 4096)]
    kv_bytes = [sum(s.nbytes for s in state_specs(cfg.replace(max_context=n), 1) if s.kind == "global_kv")
                for n in (64, 4096)]
    assert gdn_bytes[0] == gdn_bytes[1] == 6 * (4 * 16 * 16 * 4 + 128 * 3 * 4)
    assert kv_bytes[1] == 64 * kv_bytes[0]


def test_export_keeps_gdn_ops_and_lowers_them():
    """The frontend emits the anchor ops; lowering to aten removes every foldline op."""
    from foldline.backends.lowering import lower_to_aten
    from foldline.frontend.export import export_entry_point

    cfg = get_preset("qwen35-tiny").replace(layer_types=("gdn", "global"))
    model = build_model(cfg, seed=0)
    for name, op in (("prefill", "gdn_chunk"), ("decode", "gdn_step")):
        program = export_entry_point(model, name, chunk=8).program
        targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
        assert any(op in t for t in targets), targets
        lowered = lower_to_aten(program)
        left = {str(n.target) for n in lowered.graph.nodes if n.op == "call_function" and "foldline" in str(n.target)}
        assert not left


@pytest.mark.slow
def test_qwen35_tiny_compiled_matches_eager(bundle_factory):
    from foldline.frontend.sources import load_model
    from foldline.runtime import Model
    from foldline.testing.parity import SCALED_TOL_FP32, run_parity

    loaded = load_model("qwen35-tiny")
    bundle = Model.load(bundle_factory("qwen35-tiny"))
    prompt = np.random.default_rng(1).integers(0, loaded.config.vocab_size, size=40).tolist()
    assert len(prompt) > bundle.chunk
    report = run_parity(loaded.module, bundle, prompt, 40)
    print(report.summary())
    assert report.steps == 41
    assert report.tokens_agree, report.summary()
    assert report.worst_scaled_error < SCALED_TOL_FP32, report.summary()


@pytest.mark.slow
def test_qwen35_tiny_compiled_chunked_prefill_equals_decode(bundle_factory):
    """Compiled prefill with a padded last chunk == compiled decode token by token, states included."""
    from foldline.runtime import Model

    model = Model.load(bundle_factory("qwen35-tiny"))
    prompt = np.random.default_rng(2).integers(0, model.vocab_size, size=2 * model.chunk + 5).tolist()
    chunked, stepwise = model.session(), model.session()
    logits_chunked = chunked.prefill(prompt)
    for token in prompt:
        logits_step = stepwise.decode(token)
    np.testing.assert_allclose(logits_chunked, logits_step, rtol=0, atol=5e-5)
    for spec, a, b in zip(model.manifest.state, chunked.snapshot().buffers, stepwise.snapshot().buffers):
        np.testing.assert_allclose(a, b, rtol=0, atol=5e-5, err_msg=spec.name)
        if spec.kind == "gdn_recurrent":
            assert np.abs(a).max() > 1e-3  # the state was written
