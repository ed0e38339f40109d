"""What the online Hadamard rotation costs per decode step: fold vs online bundles of one model.

    python scripts/bench_hadamard.py MODEL [--steps 64] [--work DIR]
    python scripts/bench_hadamard.py --fold-bundle A --online-bundle B

MODEL is anything `foldline compile` accepts, usually a Hadamard-folded GGUF
(tests/helpers/rotated_gguf.py writes one). Both bundles are compiled with the
same options except the fuse-hadamard mode, then each decodes the same greedy
continuation; the difference of the median step times is the online cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def compile_both(model: str, work: Path, chunk: int, max_context: int | None) -> dict[str, Path]:
    from foldline.backends.build import BuildOptions, compile_model
    from foldline.backends.targets import make_target
    from foldline.frontend.sources import load_model

    out = {}
    for mode in ("fold", "online"):
        bundle = work / f"bundle-{mode}"
        options = BuildOptions(targets=[make_target("cpu")], chunk=chunk, max_context=max_context, hadamard=mode)
        compile_model(load_model(model, max_context=max_context), bundle, options, progress=lambda _m: None)
        out[mode] = bundle
    return out


def time_decode(bundle: Path, steps: int, prompt: list[int], repeats: int) -> tuple[list[float], list[int]]:
    """Per-step wall times (s) over `repeats` runs of `steps` greedy decode steps, and the tokens."""
    import numpy as np

    from foldline.runtime import Model

    model = Model.load(bundle)
    times: list[float] = []
    tokens: list[int] = []
    for _ in range(repeats):
        session = model.session()
        token = int(np.argmax(session.prefill(prompt)))
        tokens = [token]
        for _ in range(steps):
            t0 = time.perf_counter()
            token = int(np.argmax(session.decode(token)))
            times.append(time.perf_counter() - t0)
            tokens.append(token)
    return times, tokens


def rotation_counts(bundle: Path) -> str:
    manifest = json.loads((bundle / "manifest.json").read_text())
    report = next((p for p in manifest.get("passes", []) if p["name"] == "fuse-hadamard"), None)
    return "; ".join(report["notes"][:5]) if report else "fuse-hadamard did not run"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", help="model to compile in both modes")
    p.add_argument("--fold-bundle", type=Path)
    p.add_argument("--online-bundle", type=Path)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--max-context", type=int, default=128)
    p.add_argument("--work", type=Path, default=None, help="where to write the bundles (default: a temp dir)")
    args = p.parse_args(argv)
    if args.fold_bundle and args.online_bundle:
        bundles = {"fold": args.fold_bundle, "online": args.online_bundle}
    elif args.model:
        work = args.work or Path(tempfile.mkdtemp(prefix="bench-hadamard-"))
        print(f"compiling {args.model} twice into {work} ...", flush=True)
        bundles = compile_both(args.model, work, args.chunk, args.max_context)
    else:
        p.error("give MODEL, or both --fold-bundle and --online-bundle")
    prompt = list(range(1, 17))
    results = {}
    for mode, bundle in bundles.items():
        times, tokens = time_decode(bundle, args.steps, prompt, args.repeats)
        results[mode] = (statistics.median(times), tokens)
        print(f"{mode:6s}: median decode step {results[mode][0] * 1e3:8.3f} ms  ({rotation_counts(bundle)})")
    fold_s, online_s = results["fold"][0], results["online"][0]
    print(f"online rotation cost per decode step: {(online_s - fold_s) * 1e3:+.3f} ms "
          f"({(online_s / fold_s - 1) * 100:+.1f}%); greedy tokens identical: {results['fold'][1] == results['online'][1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
