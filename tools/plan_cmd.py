"""foldline plan MODEL --context N: the state bytes the runtime will allocate, from the config alone.

The layout is the one the default pipeline produces (sliding-window layers as
rings of W slots, `passes.state_layout`), beside the naive figure where every
attention layer keeps every position. Nothing is exported or compiled.
"""

from __future__ import annotations

from collections import defaultdict

from ..dtypes import ALIASES as DTYPES


def fmt_bytes(n: int) -> str:
    """Binary units with at most two decimals and no trailing zeros: 64.25 GiB, 320 GiB."""
    units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
    value, unit = float(n), 0
    while value >= 1024 and unit < len(units) - 1:
        value /= 1024
        unit += 1
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return f"{text} {units[unit]}"


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="state memory the runtime allocates for MODEL at a context length")
    p.add_argument("model", help="preset name, shipped model name, .gguf file or HF directory")
    p.add_argument("--context", type=int, default=None, help="context length in positions (default: the config's)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="compute dtype (default: as compile's auto, float32; a planning-only config's own)")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", *sorted(DTYPES)],
                   help="K/V cache dtype (default auto, as compile: f16 for block-quantized GGUF weights, "
                        "else the compute dtype)")
    p.add_argument("--batch", type=int, default=1, help="sequences held at once (default 1)")
    p.add_argument("--summary", action="store_true", help="only the per-kind and total lines")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..contract.entry_points import kv_tile_size
    from ..frontend.config import ConfigError
    from ..frontend.sources import holds_block_quantized_weights, resolve_config
    from ..passes.state_layout import plan_state

    cfg = resolve_config(args.model)
    if args.dtype is not None:
        cfg = cfg.replace(dtype=DTYPES[args.dtype])
    elif not cfg.planning_only:
        cfg = cfg.replace(dtype="float32")  # what `compile --dtype auto` builds (backends/build.py)
    if args.kv_dtype != "auto":
        cfg = cfg.replace(kv_dtype=DTYPES[args.kv_dtype])
    elif not cfg.planning_only:
        cfg = cfg.replace(kv_dtype=cfg.auto_cache_dtype(holds_block_quantized_weights(args.model)))
    if args.context is not None and args.context <= 0:
        raise ConfigError("--context must be positive")
    if args.batch <= 0:
        raise ConfigError("--batch must be positive")
    context = args.context if args.context is not None else cfg.max_context
    try:
        plan = plan_state(cfg, args.batch, context)
    except ModuleNotFoundError as e:
        raise ConfigError(f"{cfg.name}: cannot lay out its state ({e})") from e

    kinds = defaultdict(int)
    for t in cfg.layer_types:
        kinds[t] += 1
    layers = ", ".join(
        f"{n} {k}" + (f" (window {cfg.sliding_window})" if k == "local" else "") for k, n in kinds.items()
    )
    print(f"{cfg.name}: {cfg.num_layers} layers ({layers}); batch {args.batch}, "
          f"context {context:,} positions, {cfg.dtype}, K/V {cfg.cache_dtype}")
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
        print(f"attention scratch at the full context: {fmt_bytes(scratch)} per call "
              f"(4 B x heads x length x (chunk + 2 x head_dim), chunk 64)")
    return 0


def attention_scratch_bytes(cfg, batch: int, length: int, chunk: int) -> int:
    """The float32 intermediates of one chunk's attention over `length` slots, the largest scratch
    that grows with the context: scores [heads, chunk, length] and K, V read per query head
    [heads, length, head_dim] (ops._attend)."""
    return 4 * batch * cfg.num_heads * length * (chunk + 2 * cfg.head_dim)
