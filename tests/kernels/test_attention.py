"""The hand-written decode attention kernel (kernels/attention.py) against the ops' eager form.

Each case exports one cache_attention or ring_decode_attention call as a decode
entry point, imports it with the op kept, expands it into the kernel, compiles
it for this CPU with IREE and runs it at several positions (runtime inputs, so
one compile serves them all) against the aten implementation the other targets
compile (frontend/attention_ops.py).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from foldline.backends.iree import importer
from foldline.frontend import attention_ops
from foldline.kernels.attention import (
    DecodeAttentionShape,
    decode_attention_executable,
    supports,
)


class _Attend(torch.nn.Module):
    def __init__(self, ring: bool, window: int, scale: float, kv_mapping: str, length: int):
        super().__init__()
        self.ring, self.window, self.scale, self.kv_mapping, self.length = ring, window, scale, kv_mapping, length

    def forward(self, q, k, v, start_pos):
        op = torch.ops.foldline.ring_decode_attention if self.ring else torch.ops.foldline.cache_attention
        return op(q, k, v, start_pos, self.window, self.scale, self.kv_mapping, self.length)


def _eager(case, q, k, v, pos):
    impl = attention_ops.ring_decode_attention_impl if case["ring"] else attention_ops.cache_attention_impl
    return impl(q, k, v, pos, case["window"], case["scale"], case["kv_mapping"], case["length"])


def _compile(module, example):
    import iree.compiler as ireec
    import iree.runtime as rt

    from foldline.backends.targets import make_target
    from foldline.kernels.attention import expand_decode_attention_ops

    with torch.no_grad():
        program = torch.export.export(module, example, strict=False)
    mlir, _ = importer.import_programs([("decode", program)], decode_attention_kernel=True)
    mlir, sites = expand_decode_attention_ops(mlir)
    assert sites == {"attention decode": 1} and "foldline_attn_" in mlir
    vmfb = ireec.compile_str(mlir, input_type="torch", extra_args=make_target("cpu").flags)
    return rt.load_vm_flatbuffer(vmfb, driver="local-task")


CASES = {
    # SmolLM2's shape: 9 query heads on 3 kv heads, f16 cache read up to a length bucket below its size
    "global-f16-blocked": dict(ring=False, batch=1, hq=9, hkv=3, d=64, slots=96, length=64, window=0,
                               kv_mapping="blocked", dtype=torch.float16, positions=[[0], [17], [63]]),
    # a sliding-window layer left as a full cache: the window bounds the keys from below
    "window-f32-interleaved": dict(ring=False, batch=1, hq=4, hkv=2, d=32, slots=64, length=64, window=8,
                                   kv_mapping="interleaved", dtype=torch.float32, positions=[[3], [20], [63]]),
    "global-bf16": dict(ring=False, batch=1, hq=2, hkv=1, d=16, slots=32, length=32, window=0,
                        kv_mapping="blocked", dtype=torch.bfloat16, positions=[[5], [31]]),
    # Gemma 3's local layers: a ring of W slots, partly filled, then wrapped
    "ring-f16-d256": dict(ring=True, batch=1, hq=4, hkv=1, d=256, slots=16, length=0, window=16,
                          kv_mapping="blocked", dtype=torch.float16, positions=[[0], [9], [40]]),
    # a ring read only up to a length bucket (positions below it)
    "ring-length-bucket": dict(ring=True, batch=1, hq=4, hkv=2, d=32, slots=32, length=8, window=32,
                               kv_mapping="interleaved", dtype=torch.float16, positions=[[2], [7]]),
    # f16 compute (--dtype f16): q and the output in f16, the kernel's arithmetic in f32
    "f16-compute": dict(ring=False, batch=1, hq=4, hkv=2, d=32, slots=32, length=32, window=0,
                        kv_mapping="blocked", dtype=torch.float16, qdtype=torch.float16, positions=[[9], [31]]),
    # a batched bundle: each row at its own position
    "batch-rows": dict(ring=False, batch=2, hq=4, hkv=2, d=32, slots=48, length=48, window=0,
                       kv_mapping="blocked", dtype=torch.float16, positions=[[3, 40], [47, 0]]),
    # keys split over 6 workgroups per key/value head: one key (five splits empty), one key per split,
    # shares that end inside the cache and the last slot
    "splits": dict(ring=False, batch=1, hq=9, hkv=3, d=64, slots=1024, length=1024, window=0,
                   kv_mapping="blocked", dtype=torch.float16, positions=[[0], [5], [700], [1023]]),
    # split over 8, the window's lower bound moving through the splits, rows of a batch apart
    "splits-window-rows": dict(ring=False, batch=2, hq=4, hkv=2, d=32, slots=512, length=512, window=100,
                               kv_mapping="interleaved", dtype=torch.float16, positions=[[50, 300], [511, 99]]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_the_decomposed_attention(name):
    case = dict(CASES[name], scale=0.125)
    torch.manual_seed(0)
    b, hq, hkv, d, slots = case["batch"], case["hq"], case["hkv"], case["d"], case["slots"]
    q = torch.randn(b, hq, 1, d).to(case.get("qdtype", torch.float32))
    k = torch.randn(b, hkv, slots, d).to(case["dtype"])
    v = torch.randn(b, hkv, slots, d).to(case["dtype"])
    module = _Attend(case["ring"], case["window"], case["scale"], case["kv_mapping"], case["length"])
    compiled = _compile(module, (q, k, v, torch.tensor(case["positions"][0])))
    if case["dtype"] == torch.bfloat16:  # numpy has no bfloat16: the bits, as the runtime's ml_dtypes arrays
        def as_numpy(t):
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    else:
        def as_numpy(t):
            return t.numpy()
    for positions in case["positions"]:
        pos = torch.tensor(positions)
        want = _eager(case, q, k, v, pos).float().numpy()
        got = compiled.decode(q.numpy(), as_numpy(k), as_numpy(v), pos.numpy()).to_host().astype(np.float32)
        scaled = np.abs(got - want).max() / np.abs(want).max()
        tol = 1e-5 if q.dtype == torch.float32 else 1e-3  # an f16 output rounds to 2^-11
        assert scaled < tol, f"{name} at {positions}: scaled error {scaled:.2e}"


def test_keys_split_over_enough_workgroups_whatever_the_batch():
    smollm2 = DecodeAttentionShape(1, 9, 3, 64, 8192, 8192, 0, "blocked", "f16", 0.125)
    assert smollm2.splits == 6  # 3 key/value heads x 6 >= 16 workgroups a row
    assert DecodeAttentionShape(**{**smollm2.__dict__, "batch": 4}).splits == 6
    gemma_ring = DecodeAttentionShape(1, 4, 1, 256, 512, 512, 0, "blocked", "f16", 0.0625)
    assert gemma_ring.splits == 16
    short = DecodeAttentionShape(1, 4, 2, 32, 48, 48, 0, "blocked", "f16", 0.125)
    assert short.splits == 1  # a split reads 32 keys at least


def test_a_rows_output_is_the_same_to_the_bit_in_any_batch():
    """What a batched bundle's rows rely on to decode as alone: the splits and the order of every
    sum depend on the row's own position only."""
    torch.manual_seed(1)
    hq, hkv, d, slots = 6, 2, 32, 640
    q = torch.randn(3, hq, 1, d)
    k, v = (torch.randn(3, hkv, slots, d).half() for _ in range(2))
    positions = np.array([37, 639, 400])
    module = _Attend(False, 0, 0.125, "blocked", slots)
    together = _compile(module, (q, k, v, torch.tensor(positions))).decode(
        q.numpy(), k.numpy(), v.numpy(), positions).to_host()
    alone = _compile(module, (q[:1], k[:1], v[:1], torch.tensor(positions[:1])))
    for row in range(3):
        got = alone.decode(q[row:row + 1].numpy(), k[row:row + 1].numpy(), v[row:row + 1].numpy(),
                           positions[row:row + 1]).to_host()
        assert np.array_equal(got[0].view(np.uint32), together[row].view(np.uint32)), f"row {row}"


class _WriteAndAttend(torch.nn.Module):
    """A decode step's cache writes and attention as the model writes them: each row's token into slot
    pos mod slots, then the attention reading the written caches, which are returned too. One row
    takes its slot from the host (pos_shape's second dimension), as the one-row decode entry point."""

    def __init__(self, ring: bool, window: int, scale: float, kv_mapping: str):
        super().__init__()
        self.ring, self.window, self.scale, self.kv_mapping = ring, window, scale, kv_mapping

    def forward(self, q, k, v, k_new, v_new, start_pos, n_valid, pos_shape=None):
        ops = torch.ops.foldline
        write = ops.ring_write_token if self.ring else ops.kv_cache_write
        host = () if pos_shape is None else (pos_shape.shape[1],)
        k2 = write(k, k_new, start_pos, n_valid, *host)
        v2 = write(v, v_new, start_pos, n_valid, *host)
        if self.ring:
            out = ops.ring_decode_attention(q, k2, v2, start_pos, self.window, self.scale, self.kv_mapping, 0)
        else:
            out = ops.cache_attention(q, k2, v2, start_pos, self.window, self.scale, self.kv_mapping, k.shape[2])
        return out, k2, v2


WRITE_CASES = {
    # SmolLM2's heads, split over 6 workgroups: the token lands in the last share; its K/V come in f32,
    # and the kernel rounds them to the f16 cache as the write's .to() does
    "global-f16": dict(ring=False, hq=9, hkv=3, d=64, slots=512, window=0, kv_mapping="blocked",
                       dtype=torch.float16, new_dtype=torch.float32, positions=[[0], [5], [300], [511]]),
    # a windowed layer over a full cache: the window's first key moves through the shares
    "window-f32": dict(ring=False, hq=4, hkv=2, d=32, slots=256, window=40, kv_mapping="interleaved",
                       dtype=torch.float32, positions=[[3], [100], [255]]),
    # Gemma 3's local layers: a ring, written before and after it wraps (slot pos % 64)
    "ring-f16-d256": dict(ring=True, hq=4, hkv=1, d=256, slots=64, window=64, kv_mapping="blocked",
                          dtype=torch.float16, positions=[[0], [63], [64], [200]]),
    "ring-bf16": dict(ring=True, hq=2, hkv=1, d=16, slots=32, window=32, kv_mapping="blocked",
                      dtype=torch.bfloat16, positions=[[31], [33]]),
    # a batched bundle's rows, each at its own position; a row with no token keeps its caches
    "rows": dict(ring=False, hq=4, hkv=2, d=32, slots=96, window=0, kv_mapping="blocked",
                 dtype=torch.float16, positions=[[3, 95, 40], [50, 0, 7]], valid=[[1, 1, 0], [0, 1, 1]]),
    "ring-rows": dict(ring=True, hq=4, hkv=2, d=32, slots=32, window=32, kv_mapping="interleaved",
                      dtype=torch.float16, new_dtype=torch.float32, positions=[[3, 70], [31, 33]],
                      valid=[[1, 0], [1, 1]]),
    # a CPU without F16C (x86-64-v2): the rounding to f16 is a library call, the read the integer form
    "no-f16c": dict(ring=False, hq=4, hkv=2, d=32, slots=64, window=0, kv_mapping="blocked", cpu="x86-64-v2",
                    dtype=torch.float16, new_dtype=torch.float32, positions=[[0], [63]]),
    "ring-bf16-from-f32": dict(ring=True, hq=2, hkv=1, d=16, slots=32, window=32, kv_mapping="blocked",
                               dtype=torch.bfloat16, new_dtype=torch.float32, positions=[[5], [40]]),
}


@pytest.mark.parametrize("name", list(WRITE_CASES))
def test_the_kernel_writes_the_steps_token_and_reads_it(name):
    """A decode attention whose caches were written at the step's position takes the writing kernel: one
    dispatch pair stands for the two cache writes and the attention. Each row's output is the eager
    form's, and the caches it returns are the eager writes', every slot to the bit; a row with no
    valid token (n_valid 0) keeps its caches as they were."""
    import iree.compiler as ireec
    import iree.runtime as rt

    from foldline.backends.targets import make_target
    from foldline.frontend.export import position_shape
    from foldline.kernels.attention import expand_decode_attention_ops
    from foldline.kernels.mlir import FloatIsa

    case = WRITE_CASES[name]
    torch.manual_seed(2)
    hq, hkv, d, slots, dtype = case["hq"], case["hkv"], case["d"], case["slots"], case["dtype"]
    b = len(case["positions"][0])
    module = _WriteAndAttend(case["ring"], case["window"], 0.125, case["kv_mapping"])
    q = torch.randn(b, hq, 1, d)
    k, v = (torch.randn(b, hkv, slots, d).to(dtype) for _ in range(2))
    k_new, v_new = (torch.randn(b, hkv, 1, d).to(case.get("new_dtype", dtype)) for _ in range(2))
    ones = torch.ones(b, dtype=torch.int64)
    if b == 1:  # the host's position, a dynamic dimension traced at 2
        example = (q, k, v, k_new, v_new, torch.tensor([2]), ones, position_shape(2))
        dynamic = (None,) * 7 + ({1: torch.export.Dim("position", min=0, max=4 * slots)},)
    else:
        example, dynamic = (q, k, v, k_new, v_new, torch.tensor([2] * b), ones), None
    with torch.no_grad():
        program = torch.export.export(module, example, strict=False, dynamic_shapes=dynamic)
    mlir, _ = importer.import_programs([("decode", program)], decode_attention_kernel=True)
    assert "foldline.kv_cache_write" in mlir or "foldline.ring_write_token" in mlir  # kept for the kernel
    target = make_target("cpu", cpu=case.get("cpu", "host"))
    mlir, sites = expand_decode_attention_ops(mlir, FloatIsa.of(target.cpu_flags, "x86_64"))
    assert sites == {"attention decode + cache write": 1}
    assert "kv_cache_write" not in mlir and "ring_write_token" not in mlir and "slice_scatter" not in mlir
    compiled = rt.load_vm_flatbuffer(ireec.compile_str(mlir, input_type="torch", extra_args=target.flags),
                                     driver="local-task")

    def as_numpy(x):
        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if x.dtype == torch.bfloat16 else x.numpy()

    for i, positions in enumerate(case["positions"]):
        pos, valid = torch.tensor(positions), torch.tensor(case.get("valid", [[1] * b] * 9)[i])
        host = (position_shape(positions[0]),) if b == 1 else ()
        want = module(q, k, v, k_new, v_new, pos, valid, *host)
        got = compiled.decode(*(as_numpy(x) for x in (q, k, v, k_new, v_new)), pos.numpy(), valid.numpy(),
                              *(h.numpy() for h in host))
        out = got[0].to_host().astype(np.float32)
        for row in range(b):
            if valid[row]:
                scale = np.abs(want[0][row].numpy()).max()
                assert np.abs(out[row] - want[0][row].numpy()).max() / scale < 1e-5, f"{name} at {positions}"
        for cache, before, expected in zip(got[1:], (k, v), want[1:]):
            for row in range(b):
                wanted = as_numpy(expected[row] if valid[row] else before[row])
                assert np.array_equal(cache.to_host()[row].view(np.uint8), wanted.view(np.uint8)), \
                    f"{name} at {positions}, row {row}"


def test_a_partial_read_keeps_its_writes_apart():
    """The writing kernel reads its whole cache: a read shorter than the cache might not hold the slot
    written, so such a site keeps its writes as ops of their own."""
    one = DecodeAttentionShape(1, 4, 2, 32, 64, 64, 0, "blocked", "f16", 0.125, write=True)
    assert supports(one) and supports(DecodeAttentionShape(**{**one.__dict__, "batch": 4}))
    assert not supports(DecodeAttentionShape(**{**one.__dict__, "length": 32}))


def test_shapes_the_kernel_does_not_take_are_refused():
    base = DecodeAttentionShape(1, 4, 2, 32, 64, 64, 0, "blocked", "f16", 0.125)
    assert supports(base)
    for bad in (dict(head_dim=24), dict(q_heads=5), dict(cache_type="f8"), dict(kv_mapping="other"),
                dict(length=65), dict(length=0)):
        shape = DecodeAttentionShape(**{**base.__dict__, **bad})
        assert not supports(shape)
        with pytest.raises(ValueError, match="no decode attention kernel"):
            decode_attention_executable(shape)


def test_only_decode_entry_points_keep_the_attention_ops():
    assert importer.is_decode_entry("decode")
    assert not importer.is_decode_entry("prefill") and not importer.is_decode_entry("decode_256")
