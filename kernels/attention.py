"""Decode attention as two hand-written CPU dispatches per layer.

A decode step attends one query token per head over the cache it has just
written. Decomposed into aten ops, IREE runs that as three dispatches per
layer (scores, softmax, weighted sum of values), and its matmul-like
reductions over 3-4 query heads read the f16 cache far below the memory's
bandwidth, each dispatch adding the task system's own cost
(docs/architecture.md, "Decode attention on CPU targets").

The decode programs keep `foldline::cache_attention` and
`foldline::ring_decode_attention` as ops (backends/iree/importer.py), which reach
MLIR as `torch.operator`; for CPU targets `expand_decode_attention_ops`
replaces each with a call to two dispatches written in templates/
(`stream.executable`, vector dialect, called with `flow.dispatch`, as kernels/int8_decode.py).

decode_attention.mlir: the keys a row reads, [first, hi), are split into
`splits` equal shares; one workgroup per (row, key/value head, share) reads
its share of that head's cache slots once for every query head that shares
it, 16 features per vector, and asks for the slots 16 keys ahead
(memref.prefetch):

    keys [first, hi): hi = min(pos + 1, L), first = max(pos + 1 - W, 0) with a window W, else 0
    s[l] = scale * sum_d q[d] * k[l, d]      (scratch, with the share's max m)
    p[l] = exp(s[l] - m), z = sum_l p[l]     (16 keys per vector)
    O[d] = sum_l p[l] * v[l, d]              (left unnormalized, with m and z)

decode_attention_combine.mlir, a workgroup per row: M = max m over the
shares, w = exp(m - M) (0 for a share with no key), o = sum w O / sum w z.
This is the decomposed form's masked softmax: a masked key's exp(-1e30 - m)
is exactly 0 there, and here it is never visited. A ring holds exactly the
window after the step's write, and slot l is filled once l <= pos, so the
ring form is the same kernel with no window bound. The scores go through a
transient scratch result (rows x L floats), not a stack buffer: at L = 8192
it would exceed IREE's stack allocation limit.

Why split: with a workgroup per query head, each key/value head was read
once per query head of its group, and a core read one stream at a time; at
4,096 tokens held SmolLM2's attention read its cache at about half the speed
its weights are read. A workgroup per key/value head alone leaves a core idle:
a row has few of them (SmolLM2 3, Gemma 3 one). The share count depends on the head count and the cache
length only, never on the batch, and every sum runs in a fixed order, so a
row's output is the same to the bit alone or beside other rows (the batched
bundles' rows rely on it).

GPU targets import the decomposed form instead (backends/build.py imports
the programs a second time for them).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from iree.compiler import ir

from ..frontend.types import MLIR_ELEMENTS
from .mlir import (
    CACHE_LINE,
    HARDWARE_FLOAT,
    FloatIsa,
    element_bytes,
    f32_bits,
    tensor_type,
)
from .sites import (
    KernelCall,
    SiteError,
    builtin_tensor,
    constant,
    is_constant,
    rewrite_sites,
    shape_and_type,
)
from .template import instantiate

OP_NAMES = ("torch.foldline.cache_attention", "torch.foldline.ring_decode_attention")
CACHE_TYPES = ("f16", "bf16", "f32")
LANES = 16  # features per vector (512 bits of f32)
SPLIT_WORKGROUPS = 16  # workgroups a row's keys are split over (whole key/value heads)
MIN_SPLIT_KEYS = 32  # keys a split may read at least, at the full length
PREFETCH_KEYS = 16  # keys ahead of the one read that a pass asks the memory for
VALUE_ACCUMULATORS = 16  # vectors the value pass accumulates at once: half the registers of AVX-512


class AttentionKernelError(SiteError):
    """A kept attention op this generator cannot express."""


@dataclass(frozen=True)
class DecodeAttentionShape:
    """Everything that shapes one kernel.

    slots: the cache's (or ring's) slot count S; length: the keys read, the first L <= S slots;
    window: W > 0 reads only positions above pos - W (a full cache of a sliding-window layer),
    0 reads every slot up to pos (a global layer, or a ring, which holds the window only).
    """

    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    slots: int
    length: int
    window: int
    kv_mapping: str  # "blocked" (head h reads kv h // rep) or "interleaved" (kv h % n_kv)
    cache_type: str  # "f16", "bf16" or "f32"
    scale: float
    q_type: str = "f32"  # the compute dtype of q and the output; the kernel works in f32

    @property
    def rows(self) -> int:
        return self.batch * self.q_heads

    @property
    def splits(self) -> int:
        """Workgroups per (row, key/value head), each reading its share of the keys held: enough for
        SPLIT_WORKGROUPS per row, whatever the batch, so that a row's sums are the same in any batch."""
        return max(1, min(-(-SPLIT_WORKGROUPS // self.kv_heads), self.length // MIN_SPLIT_KEYS))

    @property
    def name(self) -> str:
        return (f"foldline_attn_b{self.batch}_h{self.q_heads}x{self.kv_heads}_d{self.head_dim}_s{self.slots}"
                f"_l{self.length}_w{self.window}_{self.kv_mapping[0]}_{self.cache_type}_sc{f32_bits(self.scale)}"
                + ("" if self.q_type == "f32" else f"_q{self.q_type}"))


def supports(s: DecodeAttentionShape) -> bool:
    """Whole vectors of features, whole head groups, a known cache type and mapping."""
    return (s.head_dim % LANES == 0 and s.q_heads % s.kv_heads == 0 and s.cache_type in CACHE_TYPES
            and s.q_type in CACHE_TYPES
            and s.kv_mapping in ("blocked", "interleaved") and 0 < s.length <= s.slots and s.window >= 0)








def _types(s: DecodeAttentionShape) -> dict[str, tuple[tuple[int, ...], str]]:
    return {
        "q": ((s.batch, s.q_heads, 1, s.head_dim), s.q_type),
        "kv": ((s.batch, s.kv_heads, s.slots, s.head_dim), s.cache_type),
        "pos": ((s.batch,), "i64"),
        "scratch": ((s.rows, s.length), "f32"),
    }


def _parameters(s: DecodeAttentionShape) -> dict[str, object]:
    """The shape as the decode_attention templates take it."""
    return dict(name=s.name, batch=s.batch, q_heads=s.q_heads, kv_heads=s.kv_heads, head_dim=s.head_dim,
                slots=s.slots, length=s.length, window=s.window, kv_mapping=s.kv_mapping,
                cache_type=s.cache_type, q_type=s.q_type, splits=s.splits)


def decode_attention_executable(s: DecodeAttentionShape, isa: FloatIsa = HARDWARE_FLOAT) -> str:
    """The `stream.executable` for one shape (templates/decode_attention.mlir): a workgroup per
    (row, key/value head, share of the keys), three passes over its share."""
    if not supports(s):
        raise AttentionKernelError(f"no decode attention kernel for {s}")
    rep, chunks = s.q_heads // s.kv_heads, s.head_dim // LANES
    line = CACHE_LINE // element_bytes(s.cache_type)
    return instantiate("decode_attention", **_parameters(s), rep=rep, scale_bits=f32_bits(s.scale).upper(),
                       lanes=LANES, chunks=chunks, blocks=_value_blocks(rep, chunks, line),
                       line_offsets=list(range(0, s.head_dim, line)), prefetch_keys=PREFETCH_KEYS,
                       fma=isa.fma, f16=isa.f16)


def _value_blocks(rep: int, chunks: int, line: int) -> list[tuple[int, int, list[tuple[int, int]], list[int]]]:
    """The feature blocks the value pass takes one at a time, so that its accumulators (`rep` query
    heads x the block's chunks) stay in registers: (first chunk, end chunk, (head, chunk) pairs,
    the offsets of the cache lines it reads in a row, `line` elements each)."""
    width = max(1, min(chunks, VALUE_ACCUMULATORS // rep))
    blocks = []
    for first in range(0, chunks, width):
        end = min(first + width, chunks)
        lines = sorted({c * LANES // line * line for c in range(first, end)})
        blocks.append((first, end, [(j, c) for j in range(rep) for c in range(first, end)], lines))
    return blocks


def decode_attention_combine_executable(s: DecodeAttentionShape, isa: FloatIsa = HARDWARE_FLOAT) -> str:
    """The `stream.executable` combining a shape's splits (templates/decode_attention_combine.mlir):
    a workgroup per row."""
    return instantiate("decode_attention_combine", **_parameters(s), lanes=LANES, chunks=s.head_dim // LANES,
                       fma=isa.fma)


def decode_attention_function(s: DecodeAttentionShape) -> str:
    """The util.func @name(q, k, v, pos) -> out that a site calls (templates/decode_attention_call.mlir):
    the two dispatches, the scratch dropped."""
    return instantiate("decode_attention_call", **_parameters(s))


# ---------------------------------------------------------------------------
# The rewrite
# ---------------------------------------------------------------------------






def shape_of(op: ir.Operation) -> DecodeAttentionShape:
    """The kernel shape of a kept cache_attention / ring_decode_attention op (one query token per row)."""
    q, k, v, _pos, window, scale, kv_mapping, length = op.operands
    if shape_and_type(v) != shape_and_type(k):
        raise AttentionKernelError(f"decode attention takes equal key and value caches; got {k.type}, {v.type}")
    name = ir.StringAttr(op.attributes["name"]).value.removesuffix(".default")
    shape = kernel_shape(*shape_and_type(q), *shape_and_type(k), ring=name.endswith("ring_decode_attention"),
                         window=int(constant(window)), scale=float(constant(scale)),
                         kv_mapping=str(constant(kv_mapping)), length=_length(length))
    if not supports(shape):
        raise AttentionKernelError(f"no decode attention kernel for {shape}")
    return shape


def _length(value: ir.Value) -> int:
    """The op's constant length, or 0 (every slot) for a symbolic one: the kernel stops at pos anyway."""
    return constant(value) if is_constant(value, "int") else 0


def kernel_shape(q_dims: tuple[int, ...], q_type: str, k_dims: tuple[int, ...], cache_type: str, *, ring: bool,
                 window: int, scale: float, kv_mapping: str, length: int) -> DecodeAttentionShape:
    """The kernel shape of one decode attention call, from its operands' geometry and constants."""
    (batch, q_heads, chunk, head_dim), (_, kv_heads, slots, _) = q_dims, k_dims
    if chunk != 1:
        raise AttentionKernelError(f"decode attention takes one query token per row; got q {q_dims}")
    if ring:  # the ring holds the window: every slot up to pos
        length, window = (length if 0 < length < slots else slots), 0
    else:
        length = min(length, slots) if length > 0 else slots
    return DecodeAttentionShape(batch, q_heads, kv_heads, head_dim, slots, length, window, kv_mapping,
                                cache_type, scale, q_type)


def covers(node: torch.fx.Node) -> bool:
    """Whether a kernel here covers an FX cache_attention / ring_decode_attention node (else: decomposed form)."""
    q, k, v, _pos, window, scale, kv_mapping, length = (*node.args, *(0,) * 8)[:8]  # `length` defaults to 0
    qv, kv, vv = q.meta["val"], k.meta["val"], v.meta["val"]
    if (tuple(kv.shape), kv.dtype) != (tuple(vv.shape), vv.dtype) or qv.dim() != 4 or kv.dim() != 4:
        return False
    if qv.dtype not in MLIR_ELEMENTS or kv.dtype not in MLIR_ELEMENTS:
        return False
    try:  # supports() then refuses element types the kernel has no form for
        shape = kernel_shape(tuple(qv.shape), MLIR_ELEMENTS[qv.dtype], tuple(kv.shape), MLIR_ELEMENTS[kv.dtype],
                             ring="ring_decode_attention" in str(node.target), window=int(window),
                             scale=float(scale), kv_mapping=str(kv_mapping),
                             length=length if isinstance(length, int) else 0)
    except AttentionKernelError:
        return False
    return supports(shape)


def expand_decode_attention_ops(mlir: str, float_isa: FloatIsa = HARDWARE_FLOAT) -> tuple[str, Counter[str]]:
    """Replace every kept decode attention op with a call to its hand-written dispatch (CPU targets),
    spelt for `float_isa`: the FMA and f16 conversion the target's CPU has (mlir.FloatIsa.of).

    Returns the new module text and how many sites took the kernel.
    """

    def plan(op: ir.Operation) -> KernelCall:
        s = shape_of(op)
        t = _types(s)

        def operands() -> list[ir.Value]:
            kv = tensor_type(*t["kv"])
            return [builtin_tensor(op.operands[0], tensor_type(*t["q"])), builtin_tensor(op.operands[1], kv),
                    builtin_tensor(op.operands[2], kv), builtin_tensor(op.operands[3], tensor_type(*t["pos"]))]

        return KernelCall(at=op, callee=s.name, operands=operands, result_type=tensor_type(*t["q"]), replaces=[op],
                          code=lambda: [decode_attention_executable(s, float_isa),
                                        decode_attention_combine_executable(s, float_isa),
                                        decode_attention_function(s)],
                          kind="attention decode")

    return rewrite_sites(mlir, OP_NAMES, plan)
