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

A step writes its tokens' keys and values into the caches just before it
attends (`foldline::kv_cache_write`, or `ring_write_token` into a ring). Left
to IREE, each write is a dispatch or more of its own (a one-row slice update
at the host position, a batch's scatter of eight), the rounding of the new
values to the cache's dtype another. Where both writes a covered attention
reads are one-token writes at its own position (`kernel_writes`), the
importer keeps them as ops too, and the kernel makes them: the step's K and
V and each row's valid count are operands, the workgroup whose share holds
slot pos % slots stores a valid row's token before it reads, and the call
returns the caches as results tied to its operands, written in place
(backends/iree/inplace_state.py). A one-row step then reads its host
position nowhere, has no input-dependent shape, and IREE records its command
buffer once and replays it.

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
from dataclasses import dataclass, replace

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
    defining_op,
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
    write: bool = False  # the kernel also writes the step's key and value into the caches
    new_type: str = ""  # their element type, converted to cache_type (default: cache_type)

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
                + ("" if self.q_type == "f32" else f"_q{self.q_type}")
                + (f"_write{self.new_type if self.new_type != self.cache_type else ''}" if self.write else ""))

    @property
    def new_element(self) -> str:
        return self.new_type or self.cache_type


def supports(s: DecodeAttentionShape) -> bool:
    """Whole vectors of features, whole head groups, a known cache type and mapping; a writing kernel reads
    its whole cache (the slot it writes is then in a workgroup's share)."""
    return (s.head_dim % LANES == 0 and s.q_heads % s.kv_heads == 0 and s.cache_type in CACHE_TYPES
            and s.q_type in CACHE_TYPES
            and s.kv_mapping in ("blocked", "interleaved") and 0 < s.length <= s.slots and s.window >= 0
            and (not s.write or (s.length == s.slots and s.new_element in CACHE_TYPES)))


def _types(s: DecodeAttentionShape) -> dict[str, tuple[tuple[int, ...], str]]:
    return {
        "q": ((s.batch, s.q_heads, 1, s.head_dim), s.q_type),
        "kv": ((s.batch, s.kv_heads, s.slots, s.head_dim), s.cache_type),
        "pos": ((s.batch,), "i64"),
        "new": ((s.batch, s.kv_heads, 1, s.head_dim), s.new_element),
        "scratch": ((s.rows, s.length), "f32"),
    }


def _parameters(s: DecodeAttentionShape) -> dict[str, object]:
    """The shape as the decode_attention templates take it."""
    return dict(name=s.name, batch=s.batch, q_heads=s.q_heads, kv_heads=s.kv_heads, head_dim=s.head_dim,
                slots=s.slots, length=s.length, window=s.window, kv_mapping=s.kv_mapping,
                cache_type=s.cache_type, q_type=s.q_type, splits=s.splits, write=s.write, new_type=s.new_element,
                narrows=element_bytes(s.new_element) > element_bytes(s.cache_type))


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
    the two dispatches, the scratch dropped; a writing kernel's takes (q, k, v, k_new, v_new, pos, n_valid)
    and returns (out, k', v')."""
    return instantiate("decode_attention_call", **_parameters(s))


# ---------------------------------------------------------------------------
# The rewrite
# ---------------------------------------------------------------------------


def shape_of(op: ir.Operation) -> DecodeAttentionShape:
    """The kernel shape of a kept cache_attention / ring_decode_attention op (one query token per row)."""
    q, k, v, _pos, window, scale, kv_mapping, length = op.operands
    if shape_and_type(v) != shape_and_type(k):
        raise AttentionKernelError(f"decode attention takes equal key and value caches; got {k.type}, {v.type}")
    name = ir.StringAttr(op.attributes["name"]).value
    shape = kernel_shape(*shape_and_type(q), *shape_and_type(k), ring=_is_ring(name),
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


def covers(node: torch.fx.Node, write: bool = False) -> bool:
    """Whether a kernel here covers an FX cache_attention / ring_decode_attention node (else: decomposed form);
    with `write`, the kernel that also makes the step's cache writes."""
    q, k, v, _pos, window, scale, kv_mapping, length = (*node.args, *(0,) * 8)[:8]  # `length` defaults to 0
    qv, kv, vv = q.meta["val"], k.meta["val"], v.meta["val"]
    if (tuple(kv.shape), kv.dtype) != (tuple(vv.shape), vv.dtype) or qv.dim() != 4 or kv.dim() != 4:
        return False
    if qv.dtype not in MLIR_ELEMENTS or kv.dtype not in MLIR_ELEMENTS:
        return False
    try:  # supports() then refuses element types the kernel has no form for
        shape = kernel_shape(tuple(qv.shape), MLIR_ELEMENTS[qv.dtype], tuple(kv.shape), MLIR_ELEMENTS[kv.dtype],
                             ring=_is_ring(str(node.target)), window=int(window),
                             scale=float(scale), kv_mapping=str(kv_mapping),
                             length=length if isinstance(length, int) else 0)
    except AttentionKernelError:
        return False
    return supports(replace(shape, write=write))


# The write each decode attention op reads its caches from, when the kernel makes it (frontend/attention_ops):
# a one-token write of every row at its start_pos (n_valid 0 or 1), into a full cache or a ring.
WRITE_OP_OF = {"foldline.cache_attention": "foldline.kv_cache_write",
               "foldline.ring_decode_attention": "foldline.ring_write_token"}


def _is_ring(op_name: str) -> bool:
    return "ring_decode_attention" in op_name


def _bare(op_name: str) -> str:
    """An op's name without its dialect prefix or overload: torch.foldline.x.default -> foldline.x."""
    return op_name.removeprefix("torch.").removesuffix(".default")


def kernel_writes(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """The (k, v) cache writes of an FX decode attention node that the writing kernel makes itself, else None.

    Both caches come from one-token writes of the attention's own position, read nowhere else but
    into the state (the `copy` back into the state input) or as results; the kernel covers the shape
    with `write`.
    The importer keeps such writes as ops (backends/iree/importer.kernel_keep_rule), and
    `expand_decode_attention_ops` replaces them with the kernel's tied results.
    """
    want = WRITE_OP_OF.get(_bare(str(node.target)))
    writes = node.args[1:3]
    if want is None or len(writes) != 2 or writes[0] is writes[1]:
        return None
    for w in writes:
        if not (isinstance(w, torch.fx.Node) and w.op == "call_function" and _bare(str(w.target)) == want):
            return None
        if w.args[2] is not node.args[3] or w.args[1].meta["val"].shape[2] != 1:
            return None  # written at another position, or a chunk
        if any(u is not node and u.op != "output" and not (u.target == torch.ops.aten.copy.default and u.args[1] is w)
               for u in w.users):
            return None  # read elsewhere than by this attention and the state's copy (or the program's result)
    new_types = {MLIR_ELEMENTS.get(w.args[1].meta["val"].dtype) for w in writes}
    if len(new_types) != 1 or new_types.pop() not in CACHE_TYPES:
        return None  # the kernel converts f32, f16 or bf16 keys and values, both of one type
    return (writes[0], writes[1]) if covers(node, write=True) else None


@dataclass(frozen=True)
class SlotWrites:
    """The step's two kept cache writes a decode attention reads, and where the call standing for all three
    ops goes (after both writes and every operand, before any other reader of the written caches)."""

    writes: tuple[ir.Operation, ir.Operation]  # k, v: torch.operator foldline.kv_cache_write / ring_write_token
    at: ir.InsertionPoint
    new_type: str  # the element type of the key and value written (the kernel converts it to the cache's)

    @property
    def n_valid(self) -> ir.Value:
        return self.writes[0].operands[3]


def slot_writes(op: ir.Operation, s: DecodeAttentionShape) -> SlotWrites | None:
    """The kept writes (`kernel_writes`) a decode attention op reads its caches from; None where it reads
    caches written otherwise. A kept write the kernel cannot make is an error: no other lowering is left."""
    want = WRITE_OP_OF[_bare(ir.StringAttr(op.attributes["name"]).value)]
    writes = tuple(defining_op(value) for value in op.operands[1:3])
    kept = [w is not None and w.name == "torch.operator" and _bare(ir.StringAttr(w.attributes["name"]).value) == want
            for w in writes]
    if not any(kept):
        return None
    if not all(kept) or writes[0].operation == writes[1].operation:
        raise AttentionKernelError(f"{op.name}: a kept cache write feeds only one of the caches it reads")
    for w in writes:
        if w.operands[2] != op.operands[3] or w.operands[3] != writes[0].operands[3]:
            raise AttentionKernelError("a kept cache write's position or valid count is not the attention's")
    new = {shape_and_type(w.operands[1]) for w in writes}
    if len(new) != 1 or next(iter(new))[0] != (s.batch, s.kv_heads, 1, s.head_dim):
        raise AttentionKernelError(f"kept cache writes of {sorted(new)} into {s}")
    new_type = next(iter(new))[1]
    if not supports(replace(s, write=True, new_type=new_type)):
        raise AttentionKernelError(f"kept cache writes into a decode attention the writing kernel does not take: {s}")
    return SlotWrites(writes, _call_site(op, writes), new_type)


def _call_site(op: ir.Operation, writes: tuple[ir.Operation, ...]) -> ir.InsertionPoint:
    """Where a call standing for `op` and `writes` goes: just after the last of the writes and the values
    the call takes, before any other reader of the writes' results (the state's copies).

    Ops are ordered with `is_before_in_block`, never by listing the block: a decode function holds tens of
    thousands of ops, and a Python handle for each of them, per site, made this rewrite most of a compile
    (docs/benchmarks.md, "Compile time")."""
    block = op.operation.block
    used = [op.operands[0], op.operands[3], *(v for w in writes for v in w.operands[:4])]  # the call's operands
    made = [m.operation for m in (writes[0], writes[1], *(defining_op(v) for v in used)) if m is not None]
    if any(m.block != block for m in made):
        raise AttentionKernelError("a decode attention's operand is made in another block")
    last = made[0]
    for m in made[1:]:
        if last.is_before_in_block(m):
            last = m
    readers = [use.owner.operation for w in writes for use in w.results[0].uses]
    if any(r.block != block or not last.is_before_in_block(r) for r in readers if r != op.operation):
        raise AttentionKernelError("a written cache is read before the attention's call could stand for the write")
    return ir.InsertionPoint.after(last)


def expand_decode_attention_ops(mlir: str, float_isa: FloatIsa = HARDWARE_FLOAT) -> tuple[str, Counter[str]]:
    """Replace every kept decode attention op with a call to its hand-written dispatch (CPU targets),
    spelt for `float_isa`: the FMA and f16 conversion the target's CPU has (mlir.FloatIsa.of).

    Returns the new module text and how many sites took the kernel.
    """

    def plan(op: ir.Operation) -> KernelCall:
        s = shape_of(op)
        writes = slot_writes(op, s)
        if writes is not None:
            s = replace(s, write=True, new_type=writes.new_type)
        t = _types(s)
        kv, pos = tensor_type(*t["kv"]), tensor_type(*t["pos"])

        def operands() -> list[ir.Value]:
            q = builtin_tensor(op.operands[0], tensor_type(*t["q"]))
            if writes is None:
                return [q, builtin_tensor(op.operands[1], kv), builtin_tensor(op.operands[2], kv),
                        builtin_tensor(op.operands[3], pos)]
            (k_old, k_new), (v_old, v_new) = (w.operands[:2] for w in writes.writes)
            new = tensor_type(*t["new"])
            return [q, builtin_tensor(k_old, kv), builtin_tensor(v_old, kv), builtin_tensor(k_new, new),
                    builtin_tensor(v_new, new), builtin_tensor(op.operands[3], pos),
                    builtin_tensor(writes.n_valid, pos)]

        return KernelCall(at=ir.InsertionPoint(op) if writes is None else writes.at, callee=s.name, operands=operands,
                          result_type=tensor_type(*t["q"]), replaces=[op],
                          more_results=[] if writes is None else [(kv, w) for w in writes.writes],
                          code=lambda: [decode_attention_executable(s, float_isa),
                                        decode_attention_combine_executable(s, float_isa),
                                        decode_attention_function(s)],
                          kind="attention decode" + (" + cache write" if writes is not None else ""))

    return rewrite_sites(mlir, OP_NAMES, plan)
