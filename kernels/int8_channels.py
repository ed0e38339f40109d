"""Decode kernels whose vector lanes are output channels: a group's products summed exactly, scaled once.

The k-lane kernel (int8_decode.py) puts 64 codes of one output row in a
vector, so each 32-bit lane holds four products, and each lane is converted,
multiplied by its group's scale and added per 64 codes and activation row.
With a few activation rows (a batched bundle's decode) those float steps keep
the vector units busy: per 64 products a row costs one dot product and three
float operations.

Here the 16 lanes of a vector are 16 output channels. Each 64-code step reads
the codes of 16 channels (unpacked as the k-lane kernel unpacks them),
transposes them in registers (the j-th four codes of channel c to lane c of
vector j), and each four codes of the step are one dot-product instruction
against the activation row's four bytes at that place, broadcast to every
lane. An int32 lane then sums a whole group (g products) exactly, and is
converted and scaled once per group:

    y[r, n] = sum over g, in order: isum[r, n, g] * (s[n, g] * dx[r, g])  (+ m[n, g] * cg[r, g])

each term a fused multiply-add into the lane's one accumulator. The transpose
is paid once per step for all rows, so a row costs a dot product per 64
products and three float operations per group. A call of one row skips the
transpose: each channel's codes meet the row four products a lane, as in the
k-lane kernel, and the 16 channels' lanes are added into groups
(`_tree_group_sums`). Every lane computes its
channel's output from its own integer sums with the same float operations,
whatever the number of rows, so each row of a few-row call is the one-row
call's result to the bit. Integer sums are exact in any order, so a group's
dot products run as two chains added at the end.

The kernel takes the k-lane kernel's bindings, activation quantization
(norm, gate), code unpacking and q8 offset, so the two differ only in the
order of the float operations (kernels/int8_decode.py's module docstring
holds what both share).
"""

from __future__ import annotations

from ..contract.block_formats import codes_dims
from .builder import Builder, Value, stream_executable
from .int8_decode import (
    CODES_PER_STEP,
    LARGE_N,
    PREFETCH_BYTES,
    ROWS_PER_WORKGROUP_LARGE,
    Int8DotShape,
    Operands,
    StepOffsets,
    bytes_of_128,
    code_dot,
    dot,
    fifth_bit_constants,
    int8_dot_executable,
    offset_codes,
    quantize_activation,
    row_views,
    step_codes,
)
from .int8_decode import supports as supports_k_lanes
from .mlir import CACHE_LINE, element_bytes

CHANNELS = 16  # output channels per vector: one int32 lane each
QUAD = 4  # codes per lane of one dot-product instruction


def supports(s: Int8DotShape) -> bool:
    """Shapes the k-lane kernel takes whose N is whole vectors of channels, on forms that scale lanes as
    they are (not NEON's group sums first)."""
    return supports_k_lanes(s) and s.n % CHANNELS == 0 and not s.isa.group_sums_first


def workgroups(s: Int8DotShape) -> int:
    """Workgroups of a call: the largest divisor of its blocks of 16 channels up to the k-lane kernel's
    count (fewer for more rows, as each workgroup quantizes every row again; 1024 channels each for large
    N), an even one where one is at least half of that (two threads then share them evenly)."""
    blocks = s.n // CHANNELS
    wanted = min(blocks, s.workgroups_below_large_n if s.n < LARGE_N else max(1, s.n // ROWS_PER_WORKGROUP_LARGE))
    divisors = [d for d in range(wanted, 0, -1) if blocks % d == 0]
    even = [d for d in divisors if d % 2 == 0 and 2 * d >= wanted]
    return (even or divisors)[0]


def _transpose(b: Builder, words: list[Value]) -> list[Value]:
    """The 16 x 16 int32 matrix of 16 vector<16xi32> rows, transposed: four rounds of two-source shuffles,
    each swapping the off-diagonal blocks of a size (8, 4, 2, 1) between row pairs."""
    rows = list(words)
    size = CHANNELS
    for block in (8, 4, 2, 1):
        for c in range(size):
            if c & block:
                continue
            a, d = rows[c], rows[c + block]
            rows[c] = b.shuffle(a, d, [size + j - block if j & block else j for j in range(size)])
            rows[c + block] = b.shuffle(a, d, [size + j if j & block else j + block for j in range(size)])
    return rows


class _GroupTables:
    """Reads a per-group table ([N, G] scales or mins) for 16 channels at once, lane i channel order[i]:
    one gather of 32-bit words per word of a step's groups where the step's groups fill whole words, else
    one load per channel."""

    def __init__(self, b: Builder, s: Int8DotShape, binding: Value, table: Value, order: list[int]):
        self.s, self.table, self.order = s, table, order
        self.bytes = element_bytes(s.scale_type)
        per = CODES_PER_STEP // s.group
        self.words_per_step = per * self.bytes // 4
        self.row_words = s.groups * self.bytes // 4
        self.by_words = (per * self.bytes) % 4 == 0 and (s.groups * self.bytes) % 4 == 0
        if self.by_words:
            self.words = b.subspan(binding, b.index(0), b.memref((s.n * self.row_words,), "i32"))
            self.lane_offsets = b.const(tuple(c * self.row_words for c in order), b.vector(CHANNELS, "i32"))
            self.mask = b.const(tuple([1] * CHANNELS), b.vector(CHANNELS, "i1"))
            self.zeros = b.const(0, b.vector(CHANNELS, "i32"))

    def step(self, b: Builder, n0: Value, step: Value) -> list[Value]:
        """The step's groups' values for channels n0..n0+15: one vector<16xf32> per group."""
        s, per, vf = self.s, CODES_PER_STEP // self.s.group, b.vector(CHANNELS, "f32")
        if not self.by_words:
            groups = []
            for h in range(per):
                g = b.addi(b.muli(step, b.index(per)), b.index(h))
                values = [b.load_scalar(self.table, [b.addi(n0, b.index(c)), g]) for c in self.order]
                v = b.from_elements(b.vector(CHANNELS, s.scale_type), values)
                groups.append(b.extf(v, vf) if s.scale_type == "f16" else v)
            return groups
        first = b.addi(b.muli(n0, b.index(self.row_words)), b.muli(step, b.index(self.words_per_step)))
        values_per_word = 4 // self.bytes
        groups = []
        for w in range(self.words_per_step):
            word = b.gather(b.vector(CHANNELS, "i32"), self.words, [b.addi(first, b.index(w))],
                            self.lane_offsets, self.mask, self.zeros)
            if values_per_word == 1:
                groups.append(b.vbitcast(word, vf))
                continue
            halves = b.vbitcast(word, b.vector(2 * CHANNELS, "f16"))  # little-endian: group 2w low, 2w + 1 high
            for part in range(2):
                picked = b.shuffle(halves, halves, [2 * c + part for c in range(CHANNELS)])
                groups.append(b.extf(picked, vf))
        return groups


def _broadcast_quad(b: Builder, xq: Value, k: Value) -> Value:
    """The activation row's four bytes at k, in every lane (vector<64xi8>)."""
    four = b.vbitcast(b.load(b.vector(4, "i8"), xq, [k]), b.vector(1, "i32"))
    return b.vbitcast(b.broadcast(b.extract(four, 0), b.vector(CHANNELS, "i32")), b.vector(64, "i8"))


def _group_offsets(b: Builder, s: Int8DotShape, o: Operands) -> Value:
    """Per group, -128 times the sum of its activation codes (i32): the start of a q8 group's sum of
    (q + 128) x, from the k-lane kernel's per-lane table (`offset_codes`)."""
    table = b.alloca(b.memref((s.groups,), "i32"))
    lanes = s.group // QUAD

    def group(g: Value) -> None:
        first = b.muli(g, b.index(lanes))
        total = b.load_scalar(o.neg_offset, [first])
        for j in range(1, lanes):
            total = b.addi(total, b.load_scalar(o.neg_offset, [b.addi(first, b.index(j))]))
        b.store_scalar(total, table, [g])

    b.loop(o.c0, b.index(s.groups), o.c1, group)
    return table


def _dot_chains(b: Builder, s: Int8DotShape, start: Value, codes: list[Value], quads: list[Value]) -> Value:
    """start + the group's dot products of its code vectors against the broadcast activation quads, as two
    integer chains added at the end (exact in any order)."""
    chains: list[Value | None] = [start, None]
    for j, (q, x) in enumerate(zip(codes, quads)):
        chains[j % 2] = dot(b, s, chains[j % 2], q, x)
    return chains[0] if chains[1] is None else b.addi(chains[0], chains[1])


def _merge_lanes(b: Builder, pieces: list[tuple[Value, list[int]]]) -> Value:
    """One vector<16xi32> whose lanes are, in order, the given lanes of each piece (two at a time)."""
    while len(pieces) > 1:
        merged = []
        for (a, at), (c, ct) in zip(pieces[::2], pieces[1::2]):
            lanes = at + [CHANNELS + j for j in ct]
            merged.append((b.shuffle(a, c, lanes + [0] * (CHANNELS - len(lanes))), list(range(len(lanes)))))
        pieces = merged
    return pieces[0][0]


# Lane masks of the tree's rounds over two vector<16xi32>: within each 128-bit block, the low and the high
# pair of lanes of both (vpunpckldq / vpunpckhdq); then the even and the odd 128-bit blocks of both
# (vshufi32x4). Each adds lanes of one vector, so of one channel, from the same group.
_LOW_PAIRS = [i for k in range(4) for i in (4 * k, 16 + 4 * k, 4 * k + 1, 17 + 4 * k)]
_HIGH_PAIRS = [i for k in range(4) for i in (4 * k + 2, 18 + 4 * k, 4 * k + 3, 19 + 4 * k)]
_EVEN_BLOCKS = [i for k in (0, 2, 4, 6) for i in range(4 * k, 4 * k + 4)]
_ODD_BLOCKS = [i for k in (1, 3, 5, 7) for i in range(4 * k, 4 * k + 4)]


def tree_order(s: Int8DotShape) -> tuple[list[int], list[list[tuple[int, int]]]]:
    """The one-row tree's plan, worked out on labels: the channel each lane of a group's sum holds (the
    same for every group of the step), and per reduced vector its lanes' (channel, group)."""
    lanes_per_group = s.group // QUAD
    vectors = [[(c, frozenset([lane])) for lane in range(CHANNELS)] for c in range(CHANNELS)]
    for low, high in _rounds(lanes_per_group):
        vectors = [[(x[i][0], x[i][1] | y[i][1]) for i in range(CHANNELS)]
                   for x, y in ((_pick(a, c, low), _pick(a, c, high)) for a, c in zip(vectors[::2], vectors[1::2]))]
    labelled = [[(c, min(lanes) // lanes_per_group) for c, lanes in v] for v in vectors]
    assert all(lanes == frozenset(range(g * lanes_per_group, (g + 1) * lanes_per_group))
               for v, lab in zip(vectors, labelled) for (_, lanes), (_, g) in zip(v, lab)), "a lane is not a group"
    per = CODES_PER_STEP // s.group
    orders = [[c for v in labelled for c, g in v if g == h] for h in range(per)]
    assert all(order == orders[0] for order in orders), orders
    return orders[0], labelled


def _rounds(lanes_per_group: int) -> list[tuple[list[int], list[int]]]:
    """The tree's rounds until a lane holds a group: pairs within blocks, then whole blocks."""
    rounds = [(_LOW_PAIRS, _HIGH_PAIRS), (_LOW_PAIRS, _HIGH_PAIRS)][: {1: 0, 2: 1}.get(lanes_per_group, 2)]
    return rounds + [(_EVEN_BLOCKS, _ODD_BLOCKS)] * {8: 1, 16: 2}.get(lanes_per_group, 0)


def _pick(a: list, c: list, mask: list[int]) -> list:
    both = a + c
    return [both[i] for i in mask]


def _tree_group_sums(b: Builder, s: Int8DotShape, products: list[Value]) -> list[Value]:
    """Per group of the step, each channel's sum (vector<16xi32>, lanes in `tree_order`'s channel order)
    from the channels' lane sums (products[c], lane l: codes 4l..4l+3), added pairwise in rounds of
    non-destructive shuffles (`_rounds`), until a lane holds a group."""
    vectors = list(products)
    for low, high in _rounds(s.group // QUAD):
        vectors = [b.addi(b.shuffle(a, c, low), b.shuffle(a, c, high)) for a, c in zip(vectors[::2], vectors[1::2])]
    _, labelled = tree_order(s)
    per = CODES_PER_STEP // s.group
    return [_merge_lanes(b, [(v, [i for i, (_, g) in enumerate(lab) if g == h]) for v, lab in zip(vectors, labelled)])
            for h in range(per)]


def _blocks_ahead(s: Int8DotShape) -> int:
    """How many blocks of 16 channels ahead of the one computed its codes are asked for: PREFETCH_BYTES
    of codes at least."""
    code_bytes = codes_dims(s.fmt, s.n, s.k)[1]
    return max(1, -(-PREFETCH_BYTES // (CHANNELS * code_bytes)))


def _prefetch_step(b: Builder, s: Int8DotShape, codes: Value, ahead: Value, step: Value) -> None:
    """Ask for a step's share of the codes of the block `ahead`, in address order.

    A block is CHANNELS whole rows of codes, one span of memory, but each step reads a line of every
    row. Asked for in that order, one row's decode read its codes far slower than the k-lane kernel's
    row-by-row walk; asked for as one run of addresses, a share each step, it comes close. Each line's
    row and column are worked out from its address (the last line at most): the same lines asked for
    through a flat view of the codes made the step slower (docs/quantization.md has the figures).
    """
    code_bytes = codes_dims(s.fmt, s.n, s.k)[1]
    per_step = CHANNELS * code_bytes // (s.k // CODES_PER_STEP)
    start = b.addi(b.muli(ahead, b.index(code_bytes)), b.muli(step, b.index(per_step)))
    last, row_bytes = b.index(s.n * code_bytes - 1), b.index(code_bytes)
    for line in range(0, per_step, CACHE_LINE):
        at = b.minsi(b.addi(start, b.index(line)), last)
        b.prefetch(codes, [b.divui(at, row_bytes), b.remui(at, row_bytes)])


def _prefetch_tables(b: Builder, s: Int8DotShape, ahead: Value, tables: list[Value]) -> None:
    """Ask for every line of the scale (and min) rows of the block `ahead`."""
    per_line = CACHE_LINE // element_bytes(s.scale_type)
    for c in range(CHANNELS):
        row = b.addi(ahead, b.index(c))
        for table in tables:
            for group in range(0, s.groups, per_line):
                b.prefetch(table, [row, b.index(group)])


def _one_row_sums(b: Builder, s: Int8DotShape, o: Operands, channel_codes: list[Value], at: StepOffsets) -> list[list[Value]]:
    """One row: each channel's codes against the row as the k-lane kernel takes them (four products a
    lane), the lanes then added into groups (`_tree_group_sums`): fewer shuffles than a transpose."""
    xs = b.load(b.vector(64, "i8"), o.xq, [at.k])
    return [_tree_group_sums(b, s, [code_dot(b, s, o, q, xs, at) for q in channel_codes])]


def _rows_sums(b: Builder, s: Int8DotShape, rows: list[Operands], starts: list[Value | None],
               channel_codes: list[Value], at: StepOffsets, groups: list[Value]) -> list[list[Value]]:
    """Several rows: the channels' codes transposed once (`_transpose`), then per row and group one dot
    product per four codes against the row's four bytes there, broadcast (`_dot_chains`)."""
    v16 = b.vector(CHANNELS, "i32")
    words = [b.vbitcast(q, v16) for q in channel_codes]
    lanes = [b.vbitcast(t, b.vector(64, "i8")) for t in _transpose(b, words)]
    quads_per_group = s.group // QUAD
    sums = []
    for r, orow in enumerate(rows):
        per_group = []
        for h, g in enumerate(groups):
            k0 = b.addi(at.k, b.index(h * s.group))
            quads = [_broadcast_quad(b, orow.xq, b.addi(k0, b.index(QUAD * j))) for j in range(quads_per_group)]
            start = b.const(0, v16) if starts[r] is None else b.broadcast(b.load_scalar(starts[r], [g]), v16)
            per_group.append(_dot_chains(b, s, start, lanes[h * quads_per_group:(h + 1) * quads_per_group], quads))
        sums.append(per_group)
    return sums


def int8_channels_executable(s: Int8DotShape) -> str:
    """The `stream.executable` of `s` (the k-lane kernel's bindings and name, `_cl` added) computing y with
    output channels in the lanes."""
    if not supports(s):
        raise ValueError(f"no channel-lane int8 kernel for {s}")
    count = workgroups(s)
    channels_per_workgroup = s.n // count
    bindings = 4 + (s.norm is not None) + s.has_min + s.residual
    per = CODES_PER_STEP // s.group

    def body(b: Builder, args: list[Value]) -> None:
        arg = iter(args)
        c0, c1 = b.index(0), b.index(1)
        xs = row_views(b, s, next(arg), s.x_len, c0)
        w = b.subspan(next(arg), c0, b.memref((s.k,), "f32")) if s.norm is not None else None
        codes = b.subspan(next(arg), c0, b.memref(codes_dims(s.fmt, s.n, s.k), "i8"))
        scales_binding = next(arg)
        scales = b.subspan(scales_binding, c0, b.memref((s.n, s.groups), s.scale_type))
        mins_binding = next(arg) if s.has_min else None
        mins = b.subspan(mins_binding, c0, b.memref((s.n, s.groups), s.scale_type)) if s.has_min else None
        residuals = row_views(b, s, next(arg), s.n, c0) if s.residual else [None] * s.rows
        ys = row_views(b, s, next(arg), s.n, c0)
        rows = [Operands(c0, c1, x, w, codes, scales, mins, res, y) for x, res, y in zip(xs, residuals, ys)]
        for o in rows:
            quantize_activation(b, s, o, per_lane=False)
        starts = [_group_offsets(b, s, o) if offset_codes(s) and s.rows > 1 else None for o in rows]
        s.isa.constants(b)
        o = rows[0]
        o.m15, o.s4 = b.const(15, b.vector(32, "i8")), b.const(4, b.vector(32, "i8"))
        if s.fmt == "q5":
            fifth_bit_constants(b, CODES_PER_STEP, s.isa.bit_vectors)
        o.offset_bytes = bytes_of_128(b) if offset_codes(s) else None
        # the channel each lane holds: the one-row tree's order, the transpose's own for several rows
        order = tree_order(s)[0] if s.rows == 1 else list(range(CHANNELS))
        scale_tables = _GroupTables(b, s, scales_binding, scales, order)
        min_tables = _GroupTables(b, s, mins_binding, mins, order) if s.has_min else None
        vf = b.vector(CHANNELS, "f32")
        zero_f = b.const(0.0, vf)
        first = b.muli(b.workgroup_id(), b.index(channels_per_workgroup))

        def block(n0: Value) -> None:
            ahead = b.minsi(b.addi(n0, b.index(_blocks_ahead(s) * CHANNELS)), b.index(s.n - CHANNELS))
            _prefetch_tables(b, s, ahead, [scales, mins] if s.has_min else [scales])

            def step(i: Value, *accs: Value) -> list[Value]:
                at = StepOffsets.of_step(b, s, i)
                _prefetch_step(b, s, codes, ahead, i)
                channel_codes = [step_codes(b, s, o, b.addi(n0, b.index(c)), at) for c in range(CHANNELS)]
                groups = [b.addi(b.muli(i, b.index(per)), b.index(h)) for h in range(per)]
                sums = (_one_row_sums(b, s, o, channel_codes, at) if s.rows == 1
                        else _rows_sums(b, s, rows, starts, channel_codes, at, groups))
                group_scales = scale_tables.step(b, n0, i)
                group_mins = min_tables.step(b, n0, i) if min_tables is not None else None
                out = list(accs)
                for h, g in enumerate(groups):
                    for r, orow in enumerate(rows):
                        dx = b.broadcast(b.load_scalar(orow.dxe, [g]), vf)
                        out[r] = b.fma(b.sitofp(sums[r][h], vf), b.mulf(group_scales[h], dx), out[r])
                        if group_mins is not None:
                            cg = b.broadcast(b.load_scalar(orow.cg, [g]), vf)
                            out[r] = b.fma(group_mins[h], cg, out[r])
                return out

            accs = b.loop(c0, b.index(s.k // CODES_PER_STEP), c1, step, [zero_f] * s.rows)
            for acc, orow in zip(accs, rows):
                if order != list(range(CHANNELS)):  # back to channel order, once a block
                    acc = b.shuffle(acc, acc, [order.index(c) for c in range(CHANNELS)])
                if s.residual:  # r + y, the graph's add
                    acc = b.addf(b.load(vf, orow.res, [n0]), acc)
                b.store(acc, orow.y, [n0])

        b.loop(first, b.addi(first, b.index(channels_per_workgroup)), b.index(CHANNELS), block)

    return stream_executable(s.name, count, bindings, body)


def int8_decode_executable(s: Int8DotShape) -> str:
    """The decode kernel of `s`: channel lanes where s.channel_lanes, else the k-lane kernel."""
    return int8_channels_executable(s) if s.channel_lanes else int8_dot_executable(s)
