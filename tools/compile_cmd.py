"""foldline compile MODEL --target cpu -o BUNDLE"""

from __future__ import annotations

from pathlib import Path

from ..dtypes import canonical
from .cli import CliError, positive_int, require_extra


def add_parser(sub) -> None:
    p = sub.add_parser("compile", help="compile a model (preset, .gguf, HF dir, shipped name) into a bundle")
    p.add_argument("model", help="preset name, shipped model name, .gguf file or config.json+safetensors dir")
    p.add_argument("-o", "--output", required=True, type=Path,
                   help="bundle directory to write: a new or empty directory, or an existing bundle with "
                        "--force (required)")
    p.add_argument("--force", action="store_true",
                   help="replace the bundle already in --output; the old one stays until the new one is "
                        "complete (default: refuse)")
    p.add_argument("--target", action="append", choices=["cpu", "vulkan", "cuda", "onnx", "onnx-genai"],
                   help="compile target (repeat for several; default cpu). onnx: ONNX graphs that a stock "
                        "onnxruntime runs (docs/onnx.md), loaded with --device onnxruntime. onnx-genai (alone): "
                        "not a bundle but a model directory for ONNX Runtime GenAI (onnxruntime_genai.Model), "
                        "one graph and genai_config.json")
    p.add_argument("--onnx-opset", type=int, default=None, metavar="20..23",
                   help="with --target onnx or onnx-genai: the highest ONNX opset the graphs may use (default 23, "
                        "where each RMS norm is one RMSNormalization); 20 to 22 keep a norm that follows no "
                        "residual add in plain ops and the graphs at opset 20, for runtimes whose kernels stop "
                        "below opset 23, such as ONNX Runtime's DirectML provider (docs/onnx.md)")
    p.add_argument("--cpu", default=None,
                   help="CPU(s) for llvm-cpu: host, generic, an LLVM CPU name, a comma-separated list "
                        "(e.g. x86-64-v3,znver4) or x86-all (x86-64-v2, x86-64-v3, cascadelake): one module "
                        "per CPU sharing params.irpa; the runtime loads the best one the CPU runs "
                        "(default: x86-all on an x86-64 machine, so the bundle runs at full speed on every "
                        "x86-64 CPU; host elsewhere)")
    p.add_argument("--triple", default=None,
                   help="cross-compile triple, e.g. aarch64-unknown-linux-gnu (default: this machine's)")
    p.add_argument("--vulkan-target", default="host",
                   help="IREE Vulkan target: host (the Vulkan device here; lavapipe -> llvmpipe), "
                        "or a device family such as llvmpipe, ampere, rdna3 (default: host)")
    p.add_argument("--cuda-arch", default="sm_80", help="CUDA SM architecture, e.g. sm_80 (default; runs on Ampere and newer), sm_86, sm_89")
    p.add_argument("--chunk", type=positive_int, default=None,
                   help="static prefill chunk length (default: 64 with quantized weights, else 16)")
    p.add_argument("--batch", type=positive_int, default=1,
                   help="rows per call: sequences the runtime advances together (default 1)")
    p.add_argument("--rows", default=None, metavar="K,K,...",
                   help="with --batch N: row counts below N that get entry points of their own, so that a call "
                        "computes only the rows in use (default: the powers of two below N, 1,2,4 for --batch 8; "
                        "'none' for none)")
    p.add_argument("--max-context", type=positive_int, default=None,
                   help="context length the bundle supports (default: the model's trained context, at most 8192)")
    p.add_argument("--dtype", choices=["auto", "f32", "f16", "bf16"], default="auto",
                   help="compute dtype (default auto: f32 on every target; a bf16 or f16 checkpoint widens "
                        "to f32 exactly); bf16 is refused for --target cpu, which cannot compile it; f16 with "
                        "--target onnx or onnx-genai gives the graphs CUDA's float16 attention kernels take")
    p.add_argument("--kv-dtype", choices=["auto", "f32", "f16", "bf16"], default="auto",
                   help="attention K/V cache element type (default auto: f16 beside quantized weights, "
                        "else the compute dtype); f16 and bf16 halve the caches")
    p.add_argument("--passes", default=None,
                   help="comma-separated pass pipeline (default: the default pipeline, see foldline passes)")
    p.add_argument("--no-pass", action="append", default=[], metavar="NAME",
                   help="drop a pass from the pipeline (repeatable; default: none dropped)")
    p.add_argument("--dump-after", nargs=2, action="append", default=[], metavar=("PASS", "DIR"),
                   help="write the graph after PASS to DIR (repeatable; default: none); such a compile "
                        "is not cached")
    p.add_argument("--keep-mlir", action="store_true",
                   help="also write model.mlir (torch dialect, as imported for the first target) into the "
                        "bundle (default: not written)")
    p.add_argument("--hadamard", choices=["fold", "online"], default="fold",
                   help="Hadamard-folded weights: fold the rotation into float weights (default) or keep it online")
    p.add_argument("--weights", choices=["auto", "f32", "int8", "int4"], default="auto",
                   help="weight precision: auto (default: keep a GGUF's block-quantized weights, floats stay "
                        "floats), f32, or int8 / int4 block formats (groupwise round-to-nearest where the "
                        "checkpoint has none)")
    p.add_argument("--group", type=positive_int, default=32, help="group size for --weights int8/int4 (default 32)")
    p.add_argument("--activations", choices=["auto", "int8", "f32"], default="auto",
                   help="what quantized weights meet in prefill and decode: auto (default: int8 activations per weight "
                        "group with int8 dot products where the CPU target has them: AVX2, AVX-512 VNNI or "
                        "aarch64 dotprod, as llama.cpp; else f32; f32 for the ONNX target's --batch above 1), "
                        "int8 (refused where the target has none), or f32 (exact float products everywhere)")
    p.add_argument("--attention", choices=["auto", "fused", "decomposed"], default="auto",
                   help="prefill attention over the caches: fused (one flash-style attention op per layer, whose "
                        "scratch does not grow with the context), decomposed (scores and softmax as separate "
                        "ops), or auto (default: fused on CUDA, decomposed on CPU, where IREE's attention "
                        "codegen is slower; Vulkan and ONNX always decomposed)")
    p.add_argument("--devices", type=positive_int, default=1, metavar="N",
                   help="run the model on N devices (CPU devices; for cuda and vulkan, one GPU each), split as "
                        "--scheme says (default 1)")
    p.add_argument("--scheme", choices=["pipeline", "tensor"], default="pipeline",
                   help="with --devices N: pipeline (default: each device holds a run of layers with their "
                        "weights and state) or tensor (each device holds part of every layer's heads, KV heads "
                        "and caches, GDN heads and MLP features; their outputs are added on device 0); the "
                        "split `foldline plan MODEL --devices N --scheme ...` prints")
    p.add_argument("--no-cache", action="store_true",
                   help="compile even when the compile cache ($FOLDLINE_CACHE/compiled) holds this bundle, "
                        "and store nothing in it (default: use the cache)")
    p.set_defaults(func=run)


def _pipeline(args) -> list[str]:
    """The pass pipeline asked for; the default one without importing the passes (and torch)."""
    if args.passes is None and not args.no_pass:
        from ..passes.pipeline import DEFAULT_PIPELINE

        return list(DEFAULT_PIPELINE)
    from ..passes.manager import resolve_pipeline

    names = [n for n in args.passes.split(",") if n] if args.passes is not None else None
    return resolve_pipeline(names, args.no_pass)


def run(args) -> int:
    require_extra("compiler")
    # Only what an unchanged compile needs is imported before the cache is asked: the compiler
    # stages (torch, torch.export) take seconds to import.
    from ..backends.compile_cache import CompileCache
    from ..backends.options import (
        BuildOptions,
        build_cache_key,
        check_devices,
        check_onnx_opset,
        from_cache,
        row_counts,
    )
    from ..backends.output_dir import check_output_dir, staged_output
    from ..backends.targets import ONNX_DEVICE, default_cpu, make_targets
    from ..frontend.fingerprint import checkpoint_fingerprint
    from .compile_progress import CompileProgress

    check_output_dir(args.output, args.force)  # before anything is computed: a wrong -o fails at once

    targets = [
        target
        for t in (args.target or ["cpu"])
        for target in make_targets(t, cpu=args.cpu or default_cpu(args.triple), triple=args.triple,
                                   vulkan=args.vulkan_target, cuda_arch=args.cuda_arch)
    ]
    rows = _row_counts(args.rows, args.batch)
    options = BuildOptions(
        targets=targets,
        passes=_pipeline(args),
        chunk=args.chunk,
        batch=args.batch,
        rows=rows,
        max_context=args.max_context,
        dump_after={name: Path(d) for name, d in args.dump_after},
        keep_mlir=args.keep_mlir,
        hadamard=args.hadamard,
        weights=args.weights,
        group=args.group,
        kv_dtype="auto" if args.kv_dtype == "auto" else canonical(args.kv_dtype),
        dtype="auto" if args.dtype == "auto" else canonical(args.dtype),
        activations=args.activations,
        attention=args.attention,
        devices=args.devices,
        scheme=args.scheme,
        onnx_opset=BuildOptions.onnx_opset if args.onnx_opset is None else args.onnx_opset,
    )
    if args.onnx_opset is not None and not any(t.device == ONNX_DEVICE for t in targets):
        raise CliError("--onnx-opset is for --target onnx or onnx-genai")
    row_counts(options)  # refuse row counts outside 1..--batch before anything is loaded
    check_devices(options)
    check_onnx_opset(options)
    cache = None if args.no_cache else CompileCache()
    with staged_output(args.output) as staging, CompileProgress(shown_as={staging: args.output}) as progress:
        key = build_cache_key(checkpoint_fingerprint(args.model, options.max_context), options)
        if from_cache(cache, key, staging, progress):
            return 0
        check_model(args.model)  # after the cache: an unknown name is never in it, and presets import torch
        from ..backends.build import compile_spec

        compile_spec(args.model, staging, options, progress=progress, cache=cache)
    return 0


def check_model(spec: str) -> None:
    """Refuse a MODEL that is no file, directory, preset or shipped name, listing what there is."""
    from ..frontend.arch import PRESETS
    from ..frontend.shipped import SHIPPED

    if spec in SHIPPED or Path(spec).exists():
        return
    configs = {name: factory() for name, factory in sorted(PRESETS.items())}
    if spec in configs and not configs[spec].planning_only:
        return
    presets = ", ".join(name + (" (plan only)" if cfg.planning_only else "") for name, cfg in configs.items())
    shipped = ", ".join(sorted(SHIPPED))
    if spec in configs:
        raise CliError(f"{spec} is a planning-only config (no weights): foldline plan {spec} sizes it; "
                       f"presets: {presets}; shipped models: {shipped}")
    raise CliError(f"unknown model {spec!r}: not a file or directory; presets: {presets}; shipped models: "
                   f"{shipped}; or a .gguf file or a directory with config.json and safetensors")


def _row_counts(text: str | None, batch: int) -> tuple[int, ...] | None:
    """--rows: the row counts below --batch with entry points of their own (None: the default)."""
    if text is None:
        return None
    if batch == 1:
        raise CliError("--rows needs --batch N with N > 1")
    if text.strip().lower() == "none":
        return ()
    try:
        rows = tuple(sorted({int(t) for t in text.split(",") if t.strip()}))
    except ValueError as e:
        raise CliError(f"--rows takes comma-separated row counts, got {text!r}") from e
    if not rows:
        raise CliError(f"--rows takes comma-separated row counts, got {text!r}")
    return rows  # their range is checked with the other options (backends/options.row_counts)

