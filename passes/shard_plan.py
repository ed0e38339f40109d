"""A model split over N devices: each device's weights, state and scratch, and the bytes they exchange.

Arithmetic on a `ModelConfig` alone, like `passes.state_layout`: nothing is
built, exported or compiled. `foldline compile --devices N --scheme ...` builds
the same splits (contract/tensor_split.py deals the heads for both), except
that a compiled tensor-parallel bundle keeps the embedding and the head whole
on device 0.

Tensor parallel ("tensor", the default), per layer:

- attention: q (with a fused or separate output gate, and q's bias) and o are
  split by query heads, k and v (and their biases) by KV heads. Query heads
  are dealt to devices in contiguous runs ordered by the KV head they read (an
  interleaved mapping only permutes q's rows), so a device holds exactly the
  KV heads its query heads read. When a KV head's query heads land on several
  devices, that head's k/v weights and its cache are copied to each of them:
  the replication is counted, never hidden.
- MLP: gate and up split by columns (intermediate features), down by rows.
- GDN: every projection, the conv taps and the decay vectors split by value
  heads; the key heads are held by the devices whose value heads read them,
  copied as KV heads are. The recurrent state splits by value heads, the conv
  state by channel (key-head channels with the key heads).
- the token embedding and the LM head split by vocabulary rows
  (vocab-parallel); a tied head is the same split matrix.
- replicated on every device: the norms (RMSNorm, q/k norms, GDN's gated
  norm) and Ripple's value-residual scalar.

Per decode step the devices move what the compiled bundle moves
(frontend/tensor_parallel.py keeps the residual stream on device 0): each
other device sends its looked-up embedding row to device 0; per layer, twice
(mixer and MLP), device 0 sends the normed row to each device holding a part
and each sends its partial row back (`all_reduce_sends`); device 0 sends the
final normed row to every device and each sends its float32 logits rows,
vocab/N x 4 B, back; with a value residual, the embedded row goes to each
device holding attention heads.

Pipeline ("pipeline"): each device holds a contiguous run of layers, with the
embedding on the first and the final norm and head on the last (a tied head
copies the embedding there), the runs chosen so the largest device holds as
few bytes of weights and state as possible. Per decode step one hidden vector
per row crosses each boundary (two with a value residual, which reads the
embedded token in every layer).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction

from ..contract.entry_points import kv_tile_size
from ..contract.state import SEQ_DIM, StateBuffer
from ..contract.tensor_split import deal_counts
from ..dtypes import itemsize
from ..frontend.config import ConfigError, ModelConfig
from .state_layout import plan_state

SCHEMES = ("tensor", "pipeline")
# The prefill chunk `foldline plan` sizes scratch for.
CHUNK = 64
# The tiles the fused form attends with the causal mask (backends/iree/fused_attention.TAIL_TILES;
# tests/backends/test_fused_attention_memory.py checks they agree).
FUSED_TAIL_TILES = 2
# The device counts the smallest-fit search tries: the usual tensor-parallel group sizes.
SEARCH_DEVICES = (1, 2, 4, 8, 16, 32, 64)
LOGIT_BYTES = 4  # the runtime returns float32 logits


# ---- how units are dealt to devices ---------------------------------------------------------------


@dataclass(frozen=True)
class Split:
    """`total` units (heads, features, vocabulary rows) and how many each device holds.

    The counts add up to more than `total` when units are copied (KV heads
    read by query heads on several devices); a replicated vector is one unit
    held by every device.
    """

    total: int
    per_device: tuple[int, ...]

    @property
    def held(self) -> int:
        return sum(self.per_device)

    @property
    def copies(self) -> int:
        """Units held beyond the one of each a single device holds."""
        return self.held - self.total

    def describe(self, noun: str) -> str:
        lo, hi = min(self.per_device), max(self.per_device)
        each = f"{lo:,}" if lo == hi else f"{lo:,}-{hi:,}"
        text = f"{self.total:,} {noun}: {each} per device"
        if self.copies:
            text += f" ({copies_of(self.copies)})"
        return text


def copies_of(count: int) -> str:
    return f"{count:,} cop{'y' if count == 1 else 'ies'}"


def deal(total: int, devices: int) -> Split:
    """`total` units over `devices` in contiguous runs as even as they go (the first ones get the extra)."""
    return Split(total, deal_counts(total, devices))


def everywhere(devices: int) -> Split:
    """One unit on every device: a replicated tensor."""
    return Split(1, (1,) * devices)


def read_by(queries: Split, n_query: int, n_shared: int) -> Split:
    """The shared heads (KV heads, GDN key heads) each device needs for the query heads `queries` gave it.

    Query heads are ordered by the shared head they read, `n_query // n_shared`
    of them per shared head, so a device's run reads a contiguous run of shared heads.
    """
    if n_shared == 0:
        return Split(0, (0,) * len(queries.per_device))
    group = n_query // n_shared
    counts, start = [], 0
    for n in queries.per_device:
        counts.append(0 if n == 0 else (start + n - 1) // group - start // group + 1)
        start += n
    return Split(n_shared, tuple(counts))


# ---- weights -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightPart:
    """One parameter tensor (or the part of one that splits one way) and its split."""

    name: str  # the module's parameter name, with a suffix where a tensor splits two ways
    layer: int | None  # None: the embedding, the final norm, the head
    per_unit: int  # parameters per unit of `split`
    axis: str  # the Splits field it splits along, or "replicated" (a norm, a scalar: on every device)
    split: Split
    matrix: bool  # a projection or embedding table: planned at --weight-bits; else the compute dtype

    @property
    def params(self) -> int:
        """Parameters on one device holding the whole model."""
        return self.per_unit * self.split.total

    def on(self, device: int) -> int:
        return self.per_unit * self.split.per_device[device]


@dataclass(frozen=True)
class Splits:
    """Every way a tensor-parallel plan deals units to devices."""

    query_heads: Split
    kv_heads: Split
    mlp: Split
    vocab: Split
    gdn_v_heads: Split
    gdn_k_heads: Split
    replicated: Split


def tensor_splits(cfg: ModelConfig, devices: int) -> Splits:
    q = deal(cfg.num_heads, devices)
    v = deal(cfg.gdn_num_v_heads, devices)
    return Splits(
        query_heads=q,
        kv_heads=read_by(q, cfg.num_heads, cfg.num_kv_heads),
        mlp=deal(cfg.intermediate_size, devices),
        vocab=deal(cfg.vocab_size, devices),
        gdn_v_heads=v,
        gdn_k_heads=read_by(v, cfg.gdn_num_v_heads, cfg.gdn_num_k_heads),
        replicated=everywhere(devices),
    )


def weight_parts(cfg: ModelConfig, devices: int = 1) -> list[WeightPart]:
    """Every parameter of the reference modules (frontend/model.py, frontend/gdn.py), split over `devices`."""
    s = tensor_splits(cfg, devices)
    d, hd = cfg.hidden_size, cfg.head_dim
    parts: list[WeightPart] = []

    def add(name: str, layer: int | None, per_unit: int, axis: str, matrix: bool) -> None:
        parts.append(WeightPart(name, layer, per_unit, axis, getattr(s, axis), matrix))

    add("embed_tokens.weight", None, d, "vocab", True)
    for i, kind in enumerate(cfg.layer_types):
        p = f"layers.{i}."
        m = p + "mixer."
        add(p + "input_norm.weight", i, d, "replicated", False)
        if kind == "gdn":
            dk, dv, k_taps = cfg.gdn_head_k_dim, cfg.gdn_head_v_dim, cfg.gdn_conv_kernel
            add(m + "in_proj_qkv.weight[q,k]", i, 2 * dk * d, "gdn_k_heads", True)
            add(m + "in_proj_qkv.weight[v]", i, dv * d, "gdn_v_heads", True)
            add(m + "in_proj_z.weight", i, dv * d, "gdn_v_heads", True)
            add(m + "in_proj_b.weight", i, d, "gdn_v_heads", True)
            add(m + "in_proj_a.weight", i, d, "gdn_v_heads", True)
            add(m + "conv1d_weight[q,k]", i, 2 * dk * k_taps, "gdn_k_heads", False)
            add(m + "conv1d_weight[v]", i, dv * k_taps, "gdn_v_heads", False)
            add(m + "dt_bias", i, 1, "gdn_v_heads", False)
            add(m + "A_log", i, 1, "gdn_v_heads", False)
            add(m + "norm.weight", i, dv, "replicated", False)
            add(m + "out_proj.weight", i, dv * d, "gdn_v_heads", True)
        else:
            q_per_head = hd * (2 if cfg.attn_output_gate == "fused_q" else 1)
            add(m + "q_proj.weight", i, d * q_per_head, "query_heads", True)
            add(m + "k_proj.weight", i, d * hd, "kv_heads", True)
            add(m + "v_proj.weight", i, d * hd, "kv_heads", True)
            if cfg.attn_bias:
                add(m + "q_proj.bias", i, q_per_head, "query_heads", False)
                add(m + "k_proj.bias", i, hd, "kv_heads", False)
                add(m + "v_proj.bias", i, hd, "kv_heads", False)
            add(m + "o_proj.weight", i, hd * d, "query_heads", True)
            if cfg.attn_output_gate == "separate":
                add(m + "gate_proj.weight", i, d * hd, "query_heads", True)
            if cfg.qk_norm:
                add(m + "q_norm.weight", i, hd, "replicated", False)
                add(m + "k_norm.weight", i, hd, "replicated", False)
            if cfg.value_residual:
                add(m + "value_lambda", i, 1, "replicated", False)
        add(p + "mlp_norm.weight", i, d, "replicated", False)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            add(p + f"mlp.{proj}.weight", i, d, "mlp", True)
        if cfg.norm_placement == "peri":
            add(p + "post_mixer_norm.weight", i, d, "replicated", False)
            add(p + "post_mlp_norm.weight", i, d, "replicated", False)
    add("norm.weight", None, d, "replicated", False)
    if not cfg.tie_word_embeddings:
        add("lm_head.weight", None, d, "vocab", True)
    return parts


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of the model the config describes (equal to the torch module's; tests check it)."""
    return sum(p.params for p in weight_parts(cfg))


@dataclass(frozen=True)
class WeightWidth:
    """Bits per parameter: matrices (projections, embedding tables) at `matrix_bits`, the rest in the compute dtype."""

    matrix_bits: Fraction
    vector_bits: Fraction

    @classmethod
    def of(cls, cfg: ModelConfig, weight_bits: float | None = None) -> WeightWidth:
        vector = Fraction(8 * itemsize(cfg.dtype))
        if weight_bits is None:
            return cls(vector, vector)
        if not 0 < weight_bits <= 64 or not math.isfinite(weight_bits):
            raise ConfigError(f"--weight-bits {weight_bits}: expected a number of bits per weight in (0, 64]")
        return cls(Fraction(repr(float(weight_bits))), vector)

    def bits(self, part: WeightPart) -> Fraction:
        return self.matrix_bits if part.matrix else self.vector_bits

    def describe(self, cfg: ModelConfig) -> str:
        if self.matrix_bits == self.vector_bits:
            return f"{cfg.dtype}"
        return f"{float(self.matrix_bits):g} bits per matrix weight, {cfg.dtype} norms and vectors"


def _to_bytes(bits: Fraction) -> int:
    return math.ceil(bits / 8)


# ---- state -----------------------------------------------------------------------------------------


def _per_unit(spec: StateBuffer, dim: int, split: Split) -> tuple[int, ...]:
    unit = spec.nbytes // spec.shape[dim]
    return tuple(unit * n for n in split.per_device)


def _conv_state(cfg: ModelConfig, spec: StateBuffer, s: Splits) -> tuple[int, ...]:
    per_channel = spec.nbytes // spec.shape[1]
    k = 2 * cfg.gdn_head_k_dim * per_channel
    v = cfg.gdn_head_v_dim * per_channel
    return tuple(k * nk + v * nv for nk, nv in zip(s.gdn_k_heads.per_device, s.gdn_v_heads.per_device, strict=True))


# state kind -> bytes of one buffer on each device (contract/state.py's shapes)
STATE_SPLITS: dict[str, Callable[[ModelConfig, StateBuffer, Splits], tuple[int, ...]]] = {
    "global_kv": lambda cfg, spec, s: _per_unit(spec, 1, s.kv_heads),
    "local_kv": lambda cfg, spec, s: _per_unit(spec, 1, s.kv_heads),
    "gdn_recurrent": lambda cfg, spec, s: _per_unit(spec, 1, s.gdn_v_heads),
    "gdn_conv": _conv_state,
}


def _split_state(cfg: ModelConfig, spec: StateBuffer, s: Splits) -> tuple[int, ...]:
    if spec.kind not in STATE_SPLITS:
        raise ConfigError(f"{cfg.name}: no rule to split state of kind {spec.kind!r} over devices")
    return STATE_SPLITS[spec.kind](cfg, spec, s)


# ---- scratch --------------------------------------------------------------------------------------


def fused_splits_at_a_tile(batch: int, chunk: int, slots: int) -> bool:
    """Whether the fused form attends a chunk as a prefix and two tiles (backends/iree/fused_attention.py,
    `_splits_at_a_tile`): one row, a chunk of at most one tile, a cache of several tiles."""
    tile = kv_tile_size(slots)
    return batch == 1 and chunk <= tile and slots // tile >= FUSED_TAIL_TILES


def attention_scratch_bytes(cfg: ModelConfig, batch: int, length: int, chunk: int, heads: int | None = None,
                            fused: bool = False) -> int:
    """The float32 intermediates of one chunk's attention over `length` slots. `heads`: the query heads
    one device computes.

    Decomposed (ops._attend), the largest scratch that grows with the context: scores
    [heads, chunk, length] and K, V read per query head [heads, length, head_dim].
    Fused (backends/iree/fused_attention.py, `--attention fused`), one row: the keys before the
    chunk's last two tiles take IREE's online attention, whose scratch is a tile of keys per
    workgroup; the two tiles take a softmax of their own, whose scores and weights [heads, chunk,
    2 tiles] and K and V widened to f32 [kv_heads, 2 tiles, head_dim] are the scratch, whatever the
    length. Batched rows keep one attention over every key read with an additive mask
    [heads, chunk, length].
    """
    heads = cfg.num_heads if heads is None else heads
    if not fused:
        return 4 * batch * heads * length * (chunk + 2 * cfg.head_dim)
    if fused_splits_at_a_tile(batch, chunk, length):
        keys = FUSED_TAIL_TILES * kv_tile_size(length)
        kv_heads = max(1, heads * cfg.num_kv_heads // cfg.num_heads)
        return 4 * (2 * heads * chunk * keys + 2 * kv_heads * keys * cfg.head_dim)
    return 4 * batch * heads * chunk * length


def decode_attention_scratch_bytes(cfg: ModelConfig, batch: int, length: int) -> int:
    """A decode step's attention scratch on CPU targets: the decode kernel's scores, one float32 row of
    `length` per query head (kernels/attention.py)."""
    return 4 * batch * cfg.num_heads * length


def mlp_scratch_bytes(cfg: ModelConfig, batch: int, chunk: int, features: int | None = None) -> int:
    """The MLP's largest intermediates: gate and up of one chunk, [batch, chunk, features] each."""
    features = cfg.intermediate_size if features is None else features
    return 2 * batch * chunk * features * itemsize(cfg.dtype)


def _attention_length(specs: list[StateBuffer]) -> int:
    """The most slots one attention layer reads: its cache's length (a ring's window, a full cache's context)."""
    return max((s.shape[SEQ_DIM] for s in specs if s.kind in ("global_kv", "local_kv")), default=0)


# ---- plans ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DevicePlan:
    """What one device holds and needs."""

    index: int
    weights: int
    state: int
    attention_scratch: int
    mlp_scratch: int
    layers: tuple[int, int] | None = None  # pipeline: first and last layer held

    @property
    def scratch(self) -> int:
        """Both scratch figures counted, an upper bound: they are not needed at the same moment."""
        return self.attention_scratch + self.mlp_scratch

    @property
    def total(self) -> int:
        return self.weights + self.state + self.scratch


@dataclass(frozen=True)
class Traffic:
    """Bytes crossing between devices per decode step, and how they add up."""

    per_device: int  # the most any one device sends
    total: int  # summed over devices
    lines: tuple[str, ...]  # the terms, in words
    sent: tuple[int, ...] = ()  # per device, where the scheme tells them apart (tensor)


@dataclass(frozen=True)
class ShardPlan:
    """A model over N devices under one scheme, beside the same model on one device."""

    scheme: str
    devices: tuple[DevicePlan, ...]
    one_device: DevicePlan
    weight_copies: int  # bytes of weights held beyond the one-device figure
    state_copies: int
    notes: tuple[str, ...]  # the splits and the copies, in words
    traffic: Traffic

    @property
    def largest(self) -> int:
        return max(d.total for d in self.devices)

    def fits(self, memory: int) -> bool:
        return self.largest <= memory


def shard_plan(cfg: ModelConfig, devices: int, batch: int = 1, context: int | None = None,
               scheme: str = "tensor", weight_bits: float | None = None, fused_attention: bool = False) -> ShardPlan:
    """The plan of `cfg` over `devices` devices; ConfigError on a count or scheme that cannot be planned.
    fused_attention: size attention's scratch for the fused form (attention_scratch_bytes)."""
    if devices <= 0:
        raise ConfigError(f"--devices must be positive (got {devices})")
    if scheme not in SCHEMES:
        raise ConfigError(f"unknown scheme {scheme!r}; expected one of {', '.join(SCHEMES)}")
    if batch <= 0:
        raise ConfigError("--batch must be positive")
    width = WeightWidth.of(cfg, weight_bits)
    specs = plan_state(cfg, batch, context).specs
    one = _tensor(cfg, 1, batch, specs, width, fused=fused_attention)
    if scheme == "tensor":
        return _tensor(cfg, devices, batch, specs, width, one.devices[0], fused=fused_attention)
    return _pipeline(cfg, devices, batch, specs, width, one.devices[0], fused=fused_attention)


def _tensor(cfg: ModelConfig, n: int, batch: int, specs: list[StateBuffer], width: WeightWidth,
            one: DevicePlan | None = None, fused: bool = False) -> ShardPlan:
    s = tensor_splits(cfg, n)
    parts = weight_parts(cfg, n)
    weights = [_to_bytes(sum(p.on(i) * width.bits(p) for p in parts)) for i in range(n)]
    state = [0] * n
    for spec in specs:
        for i, b in enumerate(_split_state(cfg, spec, s)):
            state[i] += b
    length = _attention_length(specs)
    has_attention = any(t != "gdn" for t in cfg.layer_types)
    devs = tuple(
        DevicePlan(i, weights[i], state[i],
                   attention_scratch_bytes(cfg, batch, length, CHUNK, s.query_heads.per_device[i], fused)
                   if has_attention else 0,
                   mlp_scratch_bytes(cfg, batch, CHUNK, s.mlp.per_device[i]))
        for i in range(n)
    )
    one = one or devs[0]

    notes = []
    if n > 1:
        layout = []
        if has_attention:
            layout += [s.query_heads.describe("query heads"), s.kv_heads.describe("KV heads")]
        if "gdn" in cfg.layer_types:
            layout += [s.gdn_v_heads.describe("GDN value heads"), s.gdn_k_heads.describe("GDN key heads")]
        layout += [s.mlp.describe("MLP features"), s.vocab.describe("vocabulary rows")]
        notes.append("split: " + "; ".join(layout))
        rep_bytes = _to_bytes(sum(p.params * width.bits(p) for p in parts if p.axis == "replicated"))
        notes.append(f"replicated on every device: norms and scalars, {fmt_bytes(rep_bytes)} each")
        kv_weights = sum(p.per_unit * width.bits(p) for p in parts if p.axis == "kv_heads") * s.kv_heads.copies
        kv_state = sum(sum(_split_state(cfg, spec, s)) - spec.nbytes
                       for spec in specs if spec.kind in ("global_kv", "local_kv"))
        if s.kv_heads.copies:
            notes.append(f"{cfg.num_kv_heads} KV heads cannot split {n} ways: {copies_of(s.kv_heads.copies)} held, "
                         f"{fmt_bytes(_to_bytes(kv_weights))} of k/v weights and {fmt_bytes(kv_state)} of cache")
        if s.gdn_k_heads.copies:
            k_weights = sum(p.per_unit * width.bits(p) for p in parts if p.axis == "gdn_k_heads") * s.gdn_k_heads.copies
            k_state = sum(2 * cfg.gdn_head_k_dim * spec.nbytes // spec.shape[1]
                          for spec in specs if spec.kind == "gdn_conv") * s.gdn_k_heads.copies
            notes.append(f"{cfg.gdn_num_k_heads} GDN key heads cannot split {n} ways: {copies_of(s.gdn_k_heads.copies)} "
                         f"held, {fmt_bytes(_to_bytes(k_weights))} of projections and conv taps and "
                         f"{fmt_bytes(k_state)} of conv state")
    weight_copies = sum(weights) - one.weights
    state_copies = sum(state) - one.state

    traffic = _tensor_traffic(cfg, n, batch, s)
    return ShardPlan("tensor", devs, one, weight_copies, state_copies, tuple(notes), traffic)


def all_reduce_sends(hidden: int, devices: int, parts: tuple[bool, ...]) -> tuple[int, ...]:
    """Elements of a row of `hidden` each device sends in one of the compile's reductions
    (frontend/tensor_parallel.py): device 0 sends the normed row to each other device holding a part
    (`parts[j]`), and each of those sends its partial sum back to device 0."""
    return tuple(hidden * sum(parts[1:]) if j == 0 else hidden * held for j, held in enumerate(parts))


def _tensor_traffic(cfg: ModelConfig, n: int, batch: int, s: Splits) -> Traffic:
    """Bytes each device sends per decode step, as the compiled bundle moves them: the embedded rows added on
    device 0, each layer's mixer and MLP reduced there, the final normed row out and the logits rows back."""
    row = batch * itemsize(cfg.dtype)
    every = (True,) * n
    heads = {"gdn": s.gdn_v_heads.per_device}
    blocks = [p for t in cfg.layer_types
              for p in (tuple(h > 0 for h in heads.get(t, s.query_heads.per_device)),
                        tuple(f > 0 for f in s.mlp.per_device))]
    sent = [0] * n
    for parts in [*blocks, every]:  # the layers' reductions, then the head's normed row and its rows back
        for j, elements in enumerate(all_reduce_sends(cfg.hidden_size, n, parts)):
            sent[j] += elements * row
    embedded = [0] + [cfg.hidden_size * row] * (n - 1)  # each device's looked-up rows, added on device 0
    if cfg.value_residual and any(t != "gdn" for t in cfg.layer_types):  # the embedded row to attention parts
        embedded[0] += cfg.hidden_size * row * sum(h > 0 for h in s.query_heads.per_device[1:])
    logits = [0] + [batch * rows * LOGIT_BYTES for rows in s.vocab.per_device[1:]]
    head_rows = [cfg.hidden_size * row * (j > 0) for j in range(n)]  # counted with the reductions above
    sent = [a + b + c - d for a, b, c, d in zip(sent, embedded, logits, head_rows, strict=True)]
    hidden = cfg.hidden_size * row
    return Traffic(max(sent), sum(sent), (
        f"{len(blocks)} reductions of {fmt_bytes(hidden)} (each layer's mixer and MLP) on device 0: the normed row "
        f"out to each other device, its partial row back",
        "the embedding: each other device's looked-up row to device 0"
        + (", the embedded row out to each for the value residual" if cfg.value_residual else ""),
        f"the head: the final normed row out, each other device's logits rows back "
        f"({max(s.vocab.per_device[1:], default=0):,} vocabulary rows x 4 B)",
        f"{fmt_bytes(sent[0])} sent by device 0, {fmt_bytes(max(sent[1:], default=0))} by the busiest other",
    ), tuple(sent))


def _balanced_runs(costs: list[int], n: int) -> list[tuple[int, int]]:
    """`costs` cut into `n` non-empty contiguous runs with the smallest possible largest sum; [first, last] each."""

    def runs_needed(limit: int) -> int:
        count, acc = 1, 0
        for c in costs:
            if acc + c > limit:
                count, acc = count + 1, 0
            acc += c
        return count

    lo, hi = max(costs), sum(costs)
    while lo < hi:
        mid = (lo + hi) // 2
        if runs_needed(mid) <= n:
            hi = mid
        else:
            lo = mid + 1
    runs, start = [], 0
    for j in range(n):
        left_after = n - 1 - j  # devices still to fill, one layer each at least
        end, acc = start, costs[start]
        if j == n - 1:
            end = len(costs) - 1
        else:
            while end + 1 < len(costs) - left_after and acc + costs[end + 1] <= lo:
                end += 1
                acc += costs[end]
        runs.append((start, end))
        start = end + 1
    return runs


def _pipeline(cfg: ModelConfig, n: int, batch: int, specs: list[StateBuffer], width: WeightWidth,
              one: DevicePlan, fused: bool = False) -> ShardPlan:
    layers = cfg.num_layers
    if n > layers:
        raise ConfigError(f"a pipeline over {n} devices needs at least {n} layers; {cfg.name} has {layers}")
    parts = weight_parts(cfg, 1)
    layer_bits = [Fraction(0)] * layers
    layer_state = [0] * layers
    for p in parts:
        if p.layer is not None:
            layer_bits[p.layer] += p.params * width.bits(p)
    for spec in specs:
        for i in spec.layers:
            layer_state[i] += spec.nbytes // len(spec.layers)
    first = sum(p.params * width.bits(p) for p in parts if p.name == "embed_tokens.weight")
    last = sum(p.params * width.bits(p) for p in parts if p.layer is None and p.name != "embed_tokens.weight")
    tied_copy = first if cfg.tie_word_embeddings and n > 1 else Fraction(0)
    layer_bits[0] += first
    layer_bits[-1] += last + tied_copy
    costs = [_to_bytes(b) + st for b, st in zip(layer_bits, layer_state, strict=True)]
    runs = _balanced_runs(costs, n)
    length_of = {i: 0 for i in range(layers)}
    for spec in specs:
        if spec.kind in ("global_kv", "local_kv"):
            for i in spec.layers:
                length_of[i] = max(length_of[i], spec.shape[SEQ_DIM])
    devs = []
    for j, (a, b) in enumerate(runs):
        attn = any(cfg.layer_types[i] != "gdn" for i in range(a, b + 1))
        length = max(length_of[i] for i in range(a, b + 1))
        devs.append(DevicePlan(j, _to_bytes(sum(layer_bits[a:b + 1])), sum(layer_state[a:b + 1]),
                               attention_scratch_bytes(cfg, batch, length, CHUNK, fused=fused) if attn else 0,
                               mlp_scratch_bytes(cfg, batch, CHUNK), layers=(a, b)))
    notes = [f"layers dealt in contiguous runs balanced by bytes of weights and state: "
             f"{', '.join(str(b - a + 1) for a, b in runs)}"]
    if tied_copy:
        notes.append(f"the head is tied to the embedding: the last device holds a copy "
                     f"({fmt_bytes(_to_bytes(tied_copy))})")
    hidden = batch * cfg.hidden_size * itemsize(cfg.dtype)
    vectors = 2 if cfg.value_residual else 1
    boundary = vectors * hidden
    why = " (the hidden row and, for the value residual, the embedded row)" if vectors == 2 else " (the hidden row)"
    traffic = Traffic(boundary if n > 1 else 0, (n - 1) * boundary, (
        f"{fmt_bytes(boundary)} across each of the {n - 1} boundaries{why}: {fmt_bytes((n - 1) * boundary)} in all",
    ))
    weights = sum(d.weights for d in devs)
    state = sum(d.state for d in devs)
    return ShardPlan("pipeline", tuple(devs), one, weights - one.weights, state - one.state, tuple(notes), traffic)


def smallest_fit(cfg: ModelConfig, memory: int, batch: int = 1, context: int | None = None,
                 scheme: str = "tensor", weight_bits: float | None = None,
                 candidates: tuple[int, ...] = SEARCH_DEVICES, fused_attention: bool = False) -> int | None:
    """The fewest devices of `candidates` whose largest device fits in `memory` bytes; None when none does."""
    for n in candidates:
        if scheme == "pipeline" and n > cfg.num_layers:
            break
        if shard_plan(cfg, n, batch, context, scheme, weight_bits, fused_attention).fits(memory):
            return n
    return None


# ---- sizes ------------------------------------------------------------------------------------------

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_size(text: str, what: str = "--device-memory") -> int:
    """Bytes from "24GiB", "80GB", "1.5 TiB" or a plain byte count (decimal units are powers of 10)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if unit not in _SIZE_UNITS:
        raise ConfigError(f"{what} {text!r}: expected a byte count or a size such as 24GiB or 80GB "
                          "(units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    try:
        value = int(Decimal(m.group(1)) * _SIZE_UNITS[unit])
    except InvalidOperation as e:  # pragma: no cover - the pattern admits only decimal numbers
        raise ConfigError(f"{what} {text!r}: not a number") from e
    if value <= 0:
        raise ConfigError(f"{what} {text!r}: must be at least one byte")
    return value


def fmt_bytes(n: int) -> str:
    """Binary units with at most two decimals and no trailing zeros: 64.25 GiB, 320 GiB."""
    units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
    value, unit = float(n), 0
    while value >= 1024 and unit < len(units) - 1:
        value /= 1024
        unit += 1
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return f"{text} {units[unit]}"
