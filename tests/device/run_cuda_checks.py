#!/usr/bin/env python3
"""CUDA checks for a machine with an NVIDIA GPU (a few minutes): compile, run, compare with eager.

    .venv/bin/python tests/device/run_cuda_checks.py [--cuda-arch sm_80] [--presets llama-tiny,...]

For each tiny preset this runs `foldline verify PRESET --target cuda` (compile
for CUDA, then greedy-decode compiled and torch eager side by side), then
compiles one cpu+cuda bundle and checks that `--device cuda` and
`--device cpu` generate the same tokens. Exit status 0 only if everything
passed; a JSON summary goes to $OUT/cuda_checks.json when $OUT is set.
Not part of the pytest suite: machines without a GPU cannot run it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

PRESETS = ("llama-tiny", "ripple-tiny", "gemma3-tiny")


def run_cli(args: list[str]) -> tuple[int, str]:
    """foldline ARGS in this process; returns the exit status and what it printed."""
    from foldline.tools.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            rc = main(args)
        except SystemExit as e:  # argparse errors
            rc = int(e.code or 0)
        except Exception as e:  # report and go on with the next check
            print(f"{type(e).__name__}: {e}")
            rc = 1
    return rc, buf.getvalue()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuda-arch", default="sm_80", help="SM arch to compile for (default sm_80: "
                        "runs on Ampere and, through the driver's PTX JIT, on Hopper)")
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()

    from foldline.runtime.device import available_devices

    devices = available_devices("cuda")
    if not devices:
        print("no CUDA device: the IREE cuda driver finds none (needs an NVIDIA GPU and libcuda)")
        return 2
    print(f"CUDA devices: {devices}")

    results: list[dict] = []
    for preset in [p for p in args.presets.split(",") if p]:
        t0 = time.time()
        rc, out = run_cli(["verify", preset, "--target", "cuda", "--cuda-arch", args.cuda_arch,
                           "--steps", str(args.steps)])
        line = next((ln for ln in out.splitlines() if ln.startswith("verify ")), out.strip()[-400:])
        results.append({"check": f"verify {preset}", "ok": rc == 0, "seconds": round(time.time() - t0, 1),
                        "detail": line})
        print(f"[{'PASS' if rc == 0 else 'FAIL'}] verify {preset} --target cuda ({time.time() - t0:.0f} s): {line}")

    with tempfile.TemporaryDirectory() as tmp:
        bundle = Path(tmp) / "multi"
        t0 = time.time()
        rc, out = run_cli(["compile", "llama-tiny", "--target", "cpu", "--target", "cuda",
                           "--cuda-arch", args.cuda_arch, "-o", str(bundle)])
        tokens = {}
        if rc == 0:
            for device in ("cpu", "cuda"):
                rc_gen, out_gen = run_cli(["generate", str(bundle), "--prompt-ids", "1,2,3,4,5",
                                           "--max-new-tokens", "16", "--device", device])
                tokens[device] = out_gen.strip().splitlines()[0] if rc_gen == 0 else f"error: {out_gen.strip()}"
        ok = rc == 0 and tokens.get("cpu") == tokens.get("cuda") and "error" not in tokens.get("cuda", "error")
        results.append({"check": "multi-target cpu+cuda generate", "ok": ok,
                        "seconds": round(time.time() - t0, 1), "detail": tokens or out.strip()[-400:]})
        print(f"[{'PASS' if ok else 'FAIL'}] cpu+cuda bundle, same greedy tokens on both devices: {tokens}")

    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "cuda_checks.json").write_text(
            json.dumps({"devices": devices, "cuda_arch": args.cuda_arch, "results": results}, indent=2))
    failed = [r["check"] for r in results if not r["ok"]]
    print("ALL PASSED" if not failed else f"FAILED: {', '.join(failed)}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
