"""foldline plan MODEL --context N: the state bytes the runtime will allocate, from the config alone.

The layout is the one the default pipeline produces (sliding-window layers as
rings of W slots, `passes.state_layout`), beside the naive figure where every
attention layer keeps every position. Nothing is exported or compiled.
"""

from __future__ import annotations

from collections import defaultdict

from ..dtypes import ALIASES as DTYPES
from ..passes.shard_plan import (
    SCHEMES,
    SEARCH_DEVICES,
    decode_attention_scratch_bytes,
    fmt_bytes,
    fused_splits_at_a_tile,
)
from .cli import positive_int, require_extra

# --target -> the device `attention_form` decides for (backends/targets.py's devices)
PLAN_TARGETS = {"cpu": "cpu", "cuda": "cuda", "vulkan": "vulkan", "onnx": "onnxruntime"}


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="state memory the runtime allocates for MODEL at a context length")
    p.add_argument("model", help="preset name, shipped model name, .gguf file or HF directory")
    p.add_argument("--context", type=positive_int, default=None, help="context length in positions (default: the config's)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="compute dtype (default: as compile's auto, float32; a planning-only config's own)")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", *sorted(DTYPES)],
                   help="K/V cache dtype (default auto, as compile: f16 for block-quantized GGUF weights, "
                        "else the compute dtype)")
    p.add_argument("--batch", type=positive_int, default=1, help="sequences held at once (default 1)")
    p.add_argument("--summary", action="store_true",
                   help="only the per-kind and total lines (default: every state buffer too)")
    p.add_argument("--devices", type=positive_int, default=None, metavar="N",
                   help="plan MODEL split over N devices: each device's weights, state and scratch, and the "
                        "bytes they exchange per decode step (docs/scaling.md; default: one device, no split)")
    p.add_argument("--scheme", default="tensor", choices=SCHEMES,
                   help="with --devices: tensor parallel (default; heads, MLP features and vocabulary split) "
                        "or pipeline (contiguous runs of layers)")
    p.add_argument("--device-memory", default=None, metavar="SIZE",
                   help="with --devices: the memory of one device (24GiB, 80GB, or bytes): whether the plan "
                        f"fits, and the fewest devices of {', '.join(map(str, SEARCH_DEVICES))} that do "
                        "(default: no fit check)")
    p.add_argument("--weight-bits", type=float, default=None, metavar="B",
                   help="with --devices: bits per weight of the projections and embedding tables "
                        "(4.5 for Q4_0 blocks; default: the compute dtype's)")
    p.add_argument("--target", default="cpu", choices=list(PLAN_TARGETS),
                   help="with --devices: the compile target whose prefill attention form sizes the scratch "
                        "(default cpu, as compile)")
    p.add_argument("--attention", default="auto", choices=["auto", "fused", "decomposed"],
                   help="with --devices: size attention's scratch for the form `compile --attention` gives "
                        "--target (default auto: the target's own, decomposed on CPU, fused on CUDA), the fused "
                        "one (one row: scratch independent of the context) or the decomposed one (scores for "
                        "the whole length)")
    p.set_defaults(func=run)


def run(args) -> int:
    # Reading a config goes through the model definitions (frontend/arch), which import torch.
    require_extra("compiler", ("torch", "gguf"))
    from ..backends.iree.fused_attention import attention_form
    from ..contract.entry_points import kv_tile_size
    from ..frontend.config import ConfigError
    from ..frontend.sources import holds_block_quantized_weights, resolve_config
    from ..passes.shard_plan import parse_size, shard_plan
    from ..passes.state_layout import plan_state

    cfg = resolve_config(args.model)
    if args.dtype is not None:
        cfg = cfg.replace(dtype=DTYPES[args.dtype])
    elif not cfg.planning_only:
        cfg = cfg.replace(dtype="float32")  # what `compile --dtype auto` builds (backends/policy.py)
    if args.kv_dtype != "auto":
        cfg = cfg.replace(kv_dtype=DTYPES[args.kv_dtype])
    elif not cfg.planning_only:
        cfg = cfg.replace(kv_dtype=cfg.auto_cache_dtype(holds_block_quantized_weights(args.model)))
    if args.devices is None:
        given = [flag for flag, value in (("--device-memory", args.device_memory), ("--weight-bits", args.weight_bits),
                                          ("--scheme", None if args.scheme == "tensor" else args.scheme),
                                          ("--attention", None if args.attention == "auto" else args.attention),
                                          ("--target", None if args.target == "cpu" else args.target))
                 if value is not None]
        if given:
            raise ConfigError(f"{', '.join(given)}: only with --devices N (a split over devices)")
    memory = parse_size(args.device_memory) if args.device_memory is not None else None
    context = args.context if args.context is not None else cfg.max_context
    try:
        plan = plan_state(cfg, args.batch, context)
    except ModuleNotFoundError as e:
        raise ConfigError(f"{cfg.name}: cannot lay out its state ({e})") from e
    shards = None
    args.attention = attention_form(PLAN_TARGETS[args.target], args.attention)
    if args.devices is not None:  # before any output: a plan that cannot be made is one error line
        shards = shard_plan(cfg, args.devices, args.batch, context, args.scheme, args.weight_bits,
                            fused_attention=args.attention == "fused")

    kinds = defaultdict(int)
    for t in cfg.layer_types:
        kinds[t] += 1
    layers = ", ".join(
        f"{n} {k}" + (f" (window {cfg.sliding_window})" if k == "local" else "") for k, n in kinds.items()
    )
    print(f"{cfg.name}: {cfg.num_layers} layers ({layers}); batch {args.batch}, "
          f"context {context:,} positions, {cfg.dtype}, K/V {cfg.cache_dtype}")
    if shards is not None:
        return print_shard_plan(cfg, shards, args, context, memory)
    if not args.summary:
        print("state buffers after the default pipeline:")
        name_w = max(len(s.name) for s in plan.specs)
        for s in plan.specs:
            shape = "[" + ", ".join(str(d) for d in s.shape) + "]"
            print(f"  {s.name:<{name_w}}  {s.kind:<13}  {shape:<24}  {s.dtype:<8}  {fmt_bytes(s.nbytes):>11}")
    by_kind: dict[str, list[int]] = defaultdict(list)
    naive_kind: dict[str, int] = defaultdict(int)
    for s in plan.specs:
        by_kind[s.kind].append(s.nbytes)
    for s in plan.naive_specs:
        naive_kind[s.kind] += s.nbytes
    print("by kind:")
    for kind, sizes in by_kind.items():
        print(f"  {kind:<13}  {len(sizes):>4} buffers  {fmt_bytes(sum(sizes)):>11}"
              f"   (naive {fmt_bytes(naive_kind[kind])})")
    total, naive = plan.total_bytes, plan.naive_bytes
    saved = f", {naive / total:.2f}x smaller" if total and naive != total else ""
    print(f"total: {fmt_bytes(total)} ({total:,} bytes) compact vs {fmt_bytes(naive)} ({naive:,} bytes) "
          f"naive (every attention layer keeping every position){saved}")
    if "global" in cfg.layer_types:
        print(f"attention reads the positions held, in tiles of {kv_tile_size(context)} slots")
        scratch = attention_scratch_bytes(cfg, args.batch, context, chunk=64)
        fused = attention_scratch_bytes(cfg, args.batch, context, chunk=64, fused=True)
        fused_formula = ("4 B x heads x chunk x 2 tiles x 2 + 4 B x kv_heads x 2 tiles x head_dim x 2"
                         if fused_splits_at_a_tile(args.batch, 64, context) else
                         "batched rows: 4 B x heads x chunk x length, the mask")
        print(f"attention scratch at the full context, chunk 64: {fmt_bytes(scratch)} per call decomposed "
              f"(4 B x heads x length x (chunk + 2 x head_dim); CPU, Vulkan and ONNX by default), "
              f"{fmt_bytes(fused)} fused ({fused_formula}; CUDA by default, compile --attention fused)")
        print(f"decode attention scratch at the full context: {fmt_bytes(decode_attention_scratch_bytes(cfg, args.batch, context))} "
              f"per step on CPU targets (the decode kernel's scores, 4 B x heads x length)")
    return 0


def attention_scratch_bytes(cfg, batch: int, length: int, chunk: int, fused: bool = False) -> int:
    """The float32 intermediates of one chunk's attention over `length` slots (passes.shard_plan's formula)."""
    from ..passes.shard_plan import attention_scratch_bytes as scratch

    return scratch(cfg, batch, length, chunk, fused=fused)


def print_shard_plan(cfg, plan, args, context: int, memory: int | None) -> int:
    """The per-device table of a ShardPlan, the traffic per decode step and the fit in --device-memory."""
    from ..passes.shard_plan import CHUNK, WeightWidth, parameter_count, smallest_fit

    n, scheme, bits = args.devices, args.scheme, args.weight_bits
    title = "tensor parallel" if scheme == "tensor" else "pipeline by layers"
    print(f"{title} over {n} device{'s' if n != 1 else ''}; {parameter_count(cfg):,} parameters, "
          f"weights as {WeightWidth.of(cfg, bits).describe(cfg)}")
    for note in plan.notes:
        print(f"  {note}")
    pipeline = scheme == "pipeline"
    head = f"  {'device':>6}  " + (f"{'layers':>9}  " if pipeline else "")
    print(head + f"{'weights':>11}  {'state':>11}  {'scratch':>11}  {'total':>11}")

    def row(label: str, weights: int, state: int, scratch: int, total: int, layers: str = "") -> None:
        cells = f"  {label:>6}  " + (f"{layers:>9}  " if pipeline else "")
        print(cells + "  ".join(f"{fmt_bytes(v):>11}" for v in (weights, state, scratch, total)))

    for d in plan.devices:
        row(str(d.index), d.weights, d.state, d.scratch, d.total, f"{d.layers[0]}-{d.layers[1]}" if d.layers else "")
    devs = plan.devices
    row("sum", *(sum(getattr(d, k) for d in devs) for k in ("weights", "state", "scratch", "total")))
    one = plan.one_device
    row("1 dev", one.weights, one.state, one.scratch, one.total)
    print(f"held beyond one device: {fmt_bytes(plan.weight_copies)} of weights ({plan.weight_copies:,} bytes), "
          f"{fmt_bytes(plan.state_copies)} of state ({plan.state_copies:,} bytes)")
    if args.attention == "decomposed":
        attention = "attention's float32 scores and K/V per query head at the longest cache (decomposed)"
    elif fused_splits_at_a_tile(args.batch, CHUNK, context):
        attention = "the fused attention's masked two tiles: scores, weights, K and V (whatever the length)"
    else:
        attention = "the fused attention's additive mask per query head (batched rows: it grows with the length)"
    print(f"scratch: one prefill chunk of 64: {attention}, plus the MLP's gate and up outputs (both counted)")
    print(f"traffic per decode step: {fmt_bytes(plan.traffic.per_device)} sent by the busiest device, "
          f"{fmt_bytes(plan.traffic.total)} in all")
    for line in plan.traffic.lines:
        print(f"  {line}")
    if memory is None:
        print(f"largest device: {fmt_bytes(plan.largest)} (--device-memory SIZE checks a fit)")
        return 0
    fewest = smallest_fit(cfg, memory, args.batch, context, scheme, bits,
                          fused_attention=args.attention == "fused")
    fewest_text = str(fewest) if fewest is not None else f"none up to {SEARCH_DEVICES[-1]}"
    print(f"fits in {fmt_bytes(memory)} ({memory:,} bytes): {'yes' if plan.fits(memory) else 'no'} (largest device "
          f"{fmt_bytes(plan.largest)}); smallest N that fits: {fewest_text} "
          f"(N in {', '.join(map(str, SEARCH_DEVICES))})")
    return 0
