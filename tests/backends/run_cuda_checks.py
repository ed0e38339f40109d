#!/usr/bin/env python3
"""CUDA checks for a machine with an NVIDIA GPU: bundles compiled elsewhere, run on the GPU, held to eager.

    # here, with the compiler (no GPU needed): compile the bundles and record eager references
    .venv/bin/python tests/backends/run_cuda_checks.py prepare DIR [--cuda-arch sm_80] [--presets llama-tiny,...]
    # on the GPU machine, with the runtime alone (numpy, iree-base-runtime; no torch, no compiler)
    python3 tests/backends/run_cuda_checks.py run DIR

`prepare` compiles each tiny preset for CUDA in its default form (prefill
attention fused into one flash-style op per layer, backends/iree/fused_attention.py)
and the first preset also with `--attention decomposed`, each beside a CPU
module of the same weights, at a 512-token context. It records the torch eager
reference for a prompt over several 64-slot KV tiles followed by greedy decode
steps: every step's logits, the scale of its terms (testing/parity.py) and the
eager tokens, as plain arrays (`np.savez`, read back without pickle).

`run` feeds each bundle's CUDA module the eager tokens (teacher-forced, so one
divergent token cannot hide the later steps) and requires every step within
the fp32 scaled tolerance with the same greedy token, then the same bundle's
CPU module against its CUDA module. Exit status 0 only if everything passed; a
JSON summary goes to $OUT/cuda_checks.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

PRESETS = ("llama-tiny", "ripple-tiny", "gemma3-tiny", "qwen35-tiny")
SCALED_TOL = 1e-4  # testing.parity.SCALED_TOL_FP32, restated: `run` imports nothing that needs torch
CONTEXT = 512
FUSED_SITE = "attention prefill fused"


def prepare(out: Path, presets: list[str], cuda_arch: str, prompt_len: int, steps: int) -> int:
    """Compile the bundles and record the eager references (needs torch and the compiler)."""
    import torch

    from foldline.backends.build import BuildOptions, compile_model
    from foldline.backends.policy import resolve_dtypes
    from foldline.backends.targets import make_target
    from foldline.frontend.sources import load_model
    from foldline.testing.parity import EagerRunner

    out.mkdir(parents=True, exist_ok=True)
    runs = [(p, "auto") for p in presets] + [(p, "decomposed") for p in presets[:1]]
    for preset, form in runs:
        loaded = load_model(preset, max_context=CONTEXT)
        options = BuildOptions(targets=[make_target("cuda", cuda_arch=cuda_arch), make_target("cpu", cpu="generic")],
                               attention=form)
        bundle = out / f"{preset}-{form}"
        compile_model(loaded, bundle, options, progress=lambda _msg: None)
        rng = np.random.default_rng(0)
        prompt = rng.integers(0, loaded.config.vocab_size, size=prompt_len).tolist()
        dtype, kv_dtype = resolve_dtypes(loaded, options)
        with loaded.reconfigured(dtype=dtype, kv_dtype=kv_dtype if kv_dtype != dtype else None), torch.no_grad():
            eager = EagerRunner(loaded.module, json.loads((bundle / "manifest.json").read_text())["prefill_chunk"])
            logits, scales, tokens = [eager.prefill(prompt)], [eager.term_scale()], []
            for _ in range(steps):
                tokens.append(int(np.argmax(logits[-1])))
                logits.append(eager.decode(tokens[-1]))
                scales.append(eager.term_scale())
        np.savez(bundle / "reference.npz", prompt=np.array(prompt, np.int64), tokens=np.array(tokens, np.int64),
                 logits=np.stack(logits).astype(np.float32), scales=np.stack(scales).astype(np.float32))
        print(f"prepared {bundle.name}")
    return 0


def _teacher_forced(model, prompt: np.ndarray, tokens: np.ndarray) -> list[np.ndarray]:
    """The module's logits after the prompt and after each given token."""
    session = model.session()
    logits = [np.asarray(session.prefill(prompt.tolist()))]
    for token in tokens.tolist():
        logits.append(np.asarray(session.decode(int(token))))
    return logits


def run(bundles: Path) -> int:
    """Each prepared bundle's CUDA module against its eager reference and its CPU module (runtime only)."""
    from foldline.runtime import Model
    from foldline.runtime.device import available_devices

    devices = available_devices("cuda")
    if not devices:
        print("no CUDA device: the IREE cuda driver finds none (needs an NVIDIA GPU and libcuda)")
        return 2
    print(f"CUDA devices: {devices}")
    results: list[dict] = []
    for bundle in sorted(p for p in bundles.iterdir() if (p / "reference.npz").is_file()):
        t0 = time.time()
        ref = np.load(bundle / "reference.npz", allow_pickle=False)
        manifest = json.loads((bundle / "manifest.json").read_text())
        fused_sites = manifest["modules"]["cuda"].get("kernels", {}).get(FUSED_SITE, 0)
        try:
            with Model.load(bundle, device="cuda") as model:
                cuda = _teacher_forced(model, ref["prompt"], ref["tokens"])
            with Model.load(bundle, device="cpu") as model:
                cpu = _teacher_forced(model, ref["prompt"], ref["tokens"])
        except Exception as e:  # report and go on with the next bundle
            results.append({"check": bundle.name, "ok": False, "detail": f"{type(e).__name__}: {e}"})
            print(f"[FAIL] {bundle.name}: {type(e).__name__}: {e}")
            continue
        scaled = max(float((np.abs(c - e) / np.maximum(s, 1e-30)).max())
                     for c, e, s in zip(cuda, ref["logits"], ref["scales"]))
        agree = sum(int(np.argmax(c) == np.argmax(e)) for c, e in zip(cuda, ref["logits"]))
        cpu_vs_cuda = max(float(np.abs(c - g).max()) for c, g in zip(cpu, cuda))
        form_ok = (fused_sites > 0) == bundle.name.endswith("-auto")  # CUDA's default form is the fused one
        ok = scaled <= SCALED_TOL and agree == len(cuda) and form_ok
        detail = (f"{len(cuda)} steps over a {len(ref['prompt'])}-token prompt: worst scaled error {scaled:.2e} "
                  f"(tolerance {SCALED_TOL:.0e}), greedy tokens agree {agree}/{len(cuda)}, "
                  f"{fused_sites} fused attention sites, CPU module vs CUDA max abs {cpu_vs_cuda:.2e}")
        results.append({"check": bundle.name, "ok": ok, "seconds": round(time.time() - t0, 1),
                        "worst_scaled_error": scaled, "tokens_agree": agree, "steps": len(cuda),
                        "fused_attention_sites": fused_sites, "cpu_vs_cuda_max_abs": cpu_vs_cuda, "detail": detail})
        print(f"[{'PASS' if ok else 'FAIL'}] {bundle.name}: {detail}")
    if not results:
        print(f"no prepared bundle under {bundles} (run `prepare` first)")
        return 2
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "cuda_checks.json").write_text(
            json.dumps({"devices": devices, "results": results}, indent=2))
    failed = [r["check"] for r in results if not r["ok"]]
    print("ALL PASSED" if not failed else f"FAILED: {', '.join(failed)}")
    return 0 if not failed else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="compile the bundles and record eager references (here)")
    p.add_argument("dir", type=Path)
    p.add_argument("--cuda-arch", default="sm_80", help="SM arch to compile for (default sm_80: "
                   "runs on Ampere and, through the driver's PTX JIT, on Hopper)")
    p.add_argument("--presets", default=",".join(PRESETS))
    p.add_argument("--prompt-len", type=int, default=300, help="prompt token ids (300: five 64-slot KV tiles)")
    p.add_argument("--steps", type=int, default=32, help="greedy decode steps after the prompt")
    r = sub.add_parser("run", help="run the prepared bundles on the GPU")
    r.add_argument("dir", type=Path)
    args = parser.parse_args()
    if args.command == "prepare":
        return prepare(args.dir, [p for p in args.presets.split(",") if p], args.cuda_arch, args.prompt_len,
                       args.steps)
    return run(args.dir)


if __name__ == "__main__":
    sys.exit(main())
