"""Compile time and memory of `foldline compile`, cold and from the compile cache.

    .venv/bin/python scripts/bench_compile.py [--models smollm2-135m,gemma3-270m] [-- COMPILE ARGS]

For each model: a cold compile into an empty compile cache (a fresh
FOLDLINE_CACHE; a shipped model's joined GGUF is linked in from the usual
cache so the figure is the compile, not the unpacking), then the identical
command again, which the cache answers. Prints wall time, the stage times
foldline reports, and the peak resident memory of the largest process of
the compile (python or iree-compile), with the CPU it ran on.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FOLDLINE = [sys.executable, "-m", "foldline.tools.cli"]


def cpu_name() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    name = re.search(r"model name\s*:\s*(.*)", text)
    flags = set(re.search(r"flags\s*:\s*(.*)", text).group(1).split()) if "flags" in text else set()
    isa = "AVX-512 VNNI" if "avx512_vnni" in flags else "AVX2" if "avx2" in flags else platform.machine()
    return f"{name.group(1).strip() if name else platform.machine()} ({isa}), {os.cpu_count()} cores"


def timed(cmd: list[str], env: dict[str, str], log: Path) -> tuple[float, float, str]:
    """(wall seconds, peak RSS in MB of the largest process of the tree, stderr) of one command."""
    t0 = time.perf_counter()
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's rusage: its largest descendant's peak
    wall = time.perf_counter() - t0
    text = log.read_text()
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{' '.join(cmd)} failed:\n{text}")
    return wall, usage.ru_maxrss / 1024, text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("compile_args", nargs="*", help="extra `foldline compile` arguments, after --")
    args = parser.parse_args()
    from foldline.frontend.shipped import SHIPPED, cache_dir, locate_shipped

    print(f"# foldline compile on {cpu_name()}")
    print("| model | cold compile | stages | peak RSS (largest process) | second identical compile |")
    print("| --- | ---: | --- | ---: | ---: |")
    for model in args.models.split(","):
        with tempfile.TemporaryDirectory(prefix="foldline-bench-compile-") as tmp:
            cache = Path(tmp) / "cache"
            cache.mkdir()
            if model in SHIPPED:
                gguf = locate_shipped(model)
                if gguf.parent == cache_dir():
                    (cache / gguf.name).symlink_to(gguf)
            env = {**os.environ, "FOLDLINE_CACHE": str(cache)}
            cmd = [*FOLDLINE, "compile", model, *args.compile_args]
            cold, peak, err = timed([*cmd, "-o", f"{tmp}/a"], env, Path(tmp) / "a.log")
            stages = re.search(r"stage times: (.*) \(total", err)
            warm, _, err2 = timed([*cmd, "-o", f"{tmp}/b"], env, Path(tmp) / "b.log")
            if "reused from the compile cache" not in err2:
                raise SystemExit(f"the second compile of {model} was not served by the cache:\n{err2}")
            print(f"| {model} | {cold:.0f} s | {stages.group(1) if stages else '?'} | {peak:.0f} MB | {warm:.1f} s |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
