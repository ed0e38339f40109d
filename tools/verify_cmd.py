"""foldline verify MODEL: compile, then run compiled and eager side by side."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from .cli import positive_int, require_extra


def add_parser(sub) -> None:
    p = sub.add_parser("verify", help="compile MODEL and check the compiled module against torch eager")
    p.add_argument("model", help="preset name, shipped model name, .gguf file or HF directory")
    p.add_argument("--target", default="cpu", choices=["cpu", "vulkan", "cuda", "onnx"],
                   help="compile target to check (default cpu)")
    p.add_argument("--cpu", default="host", help="CPU for llvm-cpu: host, generic or an LLVM CPU name (default host)")
    p.add_argument("--vulkan-target", default="host", help="IREE Vulkan target (default: the device here)")
    p.add_argument("--cuda-arch", default="sm_80", help="CUDA SM architecture (default sm_80)")
    p.add_argument("--steps", type=positive_int, default=48, help="greedy decode steps after the prompt (default 48)")
    p.add_argument("--prompt-len", type=positive_int, default=40,
                   help="random prompt length in token ids (default 40)")
    p.add_argument("--chunk", type=positive_int, default=None, help="prefill chunk (default: as foldline compile)")
    p.add_argument("--max-context", type=positive_int, default=None,
                   help="context length of the compiled bundle (default: as foldline compile)")
    p.add_argument("--passes", default=None, help="comma-separated pass pipeline (default: the default pipeline)")
    p.add_argument("--tol", type=float, default=None, help="scaled-error tolerance (default 1e-4 for fp32)")
    p.add_argument("--bundle", type=Path, default=None, help="keep the bundle here (default: a temporary directory)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt ids (default 0)")
    p.add_argument("--attention", choices=["auto", "fused", "decomposed"], default="auto",
                   help="prefill attention form, as foldline compile --attention (default auto)")
    p.set_defaults(func=run)


def run(args) -> int:
    require_extra("compiler")
    from ..backends.build import BuildOptions, compile_model
    from ..backends.iree.fused_attention import attention_form
    from ..backends.policy import resolve_dtypes
    from ..backends.targets import make_target
    from ..frontend.sources import load_model
    from ..passes.manager import resolve_pipeline
    from ..runtime import BundleError, Model
    from ..runtime.device import available_devices
    from ..testing.parity import SCALED_TOL_FP32, run_parity

    target = make_target(args.target, cpu=args.cpu, vulkan=args.vulkan_target, cuda_arch=args.cuda_arch)
    if target.device in ("vulkan", "cuda") and not available_devices(target.device):
        raise BundleError(f"device {target.device!r} is not available here; nothing to verify on")
    loaded = load_model(args.model, max_context=args.max_context)
    names = [n for n in args.passes.split(",") if n] if args.passes is not None else None
    options = BuildOptions(targets=[target], passes=resolve_pipeline(names), chunk=args.chunk,
                           attention=args.attention)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.bundle or Path(tmp) / "bundle"
        compile_model(loaded, out, options)
        bundle = Model.load(out, device=target.device)
        rng = np.random.default_rng(args.seed)
        prompt = rng.integers(0, loaded.config.vocab_size, size=args.prompt_len).tolist()
        steps = min(args.steps, loaded.config.max_context - args.prompt_len - 1)
        dtype, kv_dtype = resolve_dtypes(loaded, options)  # the eager reference computes as the bundle does
        with loaded.reconfigured(dtype=dtype, kv_dtype=kv_dtype if kv_dtype != dtype else None):
            report = run_parity(loaded.module, bundle, prompt, steps)
    tol = args.tol if args.tol is not None else SCALED_TOL_FP32
    form = attention_form(target.device, args.attention)
    print(f"verify {args.model} on {args.target} ({form} prefill attention): {report.summary()} "
          f"(tolerance {tol:.0e})")
    if not report.ok(tol):
        print("MISMATCH")
        return 1
    print("OK")
    return 0
