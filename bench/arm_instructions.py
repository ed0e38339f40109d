"""Instructions per token on aarch64, counted under qemu-user: a proxy for Arm speed without Arm hardware.

`python -m foldline.bench.arm_instructions BUNDLE --llama-lib DIR --llama-cpp-python DIR`
runs foldline's aarch64 module (the bundle compiled with `--triple
aarch64-unknown-linux-gnu --cpu cortex-a76[,neoverse-v1]`) and llama.cpp built
for the same aarch64 target on the same GGUF, each in its own emulated Python
(bench/aarch64_python.py), with one thread each. A qemu plugin
(bench/qemu_insn_count.c) counts every guest instruction every thread
executes; the guest marks the phase boundaries with a write to a descriptor the
plugin watches. Both engines get the same prompt ids, warm-up and greedy loop
(prompt, then WARMUP_DECODE_STEPS decodes, then a fresh conversation; then
the counted prefill and decode), and the counts are per prompt token and per
decoded token.

It is a proxy, not a speed: it weighs every instruction alike (an `sdot`
as a scalar add), sees no cache or memory stalls and no second core. It says
how much work each engine asks of the CPU for a token, which on a core that is
not memory-bound is what the time follows.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..frontend.shipped import cache_dir
from . import timer
from .aarch64_python import Arm64Python

PLUGIN_SOURCE = Path(__file__).with_name("qemu_insn_count.c")
MARK_FD = 987654  # the descriptor bench/qemu_insn_count.c watches (MARK_FD there)
PHASES = {"prefill": "per_prompt_token", "decode": "per_decoded_token"}  # each phase's field of Counted

_GUEST_LOOP = f'''
import json, os, sys
import numpy as np
args = json.loads(sys.argv[1])
ids, new_tokens = args["ids"], args["new_tokens"]
WARMUP_DECODE_STEPS = {timer.WARMUP_DECODE_STEPS}

def mark(k):
    """Phase boundary k: a write the counting plugin sees (it fails here with EBADF)."""
    try:
        os.write({MARK_FD}, b"m" * k)
    except OSError:
        pass

def measure(prefill, decode, fresh):
    """The warm-up every bench engine runs, then the counted prefill (marks 1-2) and decode (marks 2-3)."""
    logits = prefill(ids)
    for _ in range(min(WARMUP_DECODE_STEPS, new_tokens)):
        logits = decode(int(np.argmax(logits)))
    fresh()
    mark(1)
    logits = prefill(ids)
    mark(2)
    tokens = []
    for _ in range(new_tokens):
        tokens.append(int(np.argmax(logits)))
        logits = decode(tokens[-1])
    mark(3)
    print("TOKENS " + json.dumps(tokens))
    with open("/proc/self/maps") as f:  # qemu-user gives the guest's own address map
        print("MAPS " + json.dumps(f.read()))
'''

_FOLDLINE = '''
from foldline.runtime import Model
model = Model.load(args["bundle"], threads=1, cpu=args["cpu"], verify=False)
session = model.session()
measure(session.prefill, session.decode, session.reset)
'''

# llama.cpp through llama-cpp-python's ctypes bindings (its llama_cpp.py, which matches the library's structs),
# loaded without the package's __init__ (which wants jinja2 and more that the emulated Python lacks).
# As llama-server runs it: flash attention on, windowed layers holding only their window.
_LLAMA_CPP = '''
import ctypes, types
package = types.ModuleType("llama_cpp")
package.__path__ = [args["llama_cpp_python"]]
sys.modules["llama_cpp"] = package
import llama_cpp.llama_cpp as L

L.llama_backend_init()
model = L.llama_model_load_from_file(args["gguf"].encode(), L.llama_model_default_params())
if not model:
    raise SystemExit(f"llama.cpp could not load {args['gguf']}")
params = L.llama_context_default_params()
needed = len(ids) + new_tokens + 8
params.n_ctx = max(args["n_ctx"] or needed, needed)
params.n_batch = needed
params.n_ubatch = min(needed, 512)
params.n_threads = params.n_threads_batch = 1
params.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
params.swa_full = False
ctx = L.llama_init_from_model(model, params)
n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))

def evaluate(tokens):
    array = (L.llama_token * len(tokens))(*tokens)
    if L.llama_decode(ctx, L.llama_batch_get_one(array, len(tokens))) != 0:
        raise SystemExit("llama_decode failed")
    return np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()

measure(evaluate, lambda token: evaluate([token]), lambda: L.llama_memory_clear(L.llama_get_memory(ctx), True))
'''


@dataclass
class Counted:
    """One engine's counts: instructions per prompt token and per decoded token, and its greedy tokens."""

    engine: str
    per_prompt_token: float
    per_decoded_token: float
    tokens: list[int]
    decode_where: dict[str, int] | None = None  # with pages: the decode's instructions per guest file


def build_plugin(cache: Path) -> Path:
    """The counting plugin compiled for this host (cached by its source's digest); needs a C compiler."""
    source = PLUGIN_SOURCE.read_bytes()
    out = cache / f"qemu_insn_count-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if out.exists():
        return out
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise InputError("counting instructions needs a C compiler for the qemu plugin (cc or gcc; or set CC)")
    cache.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(f".{os.getpid()}.tmp")
    done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-fvisibility=hidden", "-o", str(partial),
                           str(PLUGIN_SOURCE)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"compiling {PLUGIN_SOURCE.name} failed:\n{done.stderr}")
    partial.replace(out)
    return out


def read_marks(path: Path) -> tuple[dict[int, int], dict[int, dict[int, int]]]:
    """The plugin's output: instructions executed at each mark {mark: count}, and with pages=on the
    instructions per 4 KiB code page at each mark {mark: {page address: count}}."""
    marks: dict[int, int] = {}
    pages: dict[int, dict[int, int]] = {}
    for line in path.read_text().splitlines():
        fields = line.split()
        if fields[0] == "page":
            pages.setdefault(int(fields[1]), {})[int(fields[2])] = int(fields[3])
        elif fields[0] != "exit":
            marks[int(fields[0])] = int(fields[1])
    return marks, pages


def where(pages: dict[int, dict[int, int]], maps: str, first: int = 2, last: int = 3) -> dict[str, int]:
    """The instructions between marks `first` and `last` per file of the guest's address map (a library,
    the interpreter; `[anonymous]` for code mapped by hand, as IREE's loader maps a module's kernels)."""
    ranges = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        ranges.append((lo, hi, Path(fields[5]).name if len(fields) > 5 else "[anonymous]"))
    totals: dict[str, int] = {}
    before = pages.get(first, {})
    for page, count in pages.get(last, {}).items():
        name = next((n for lo, hi, n in ranges if lo <= page < hi), "[unmapped]")
        totals[name] = totals.get(name, 0) + count - before.get(page, 0)
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def per_token(marks: dict[int, int], prompt_len: int, new_tokens: int) -> tuple[float, float]:
    """Instructions per prompt token (marks 1-2) and per decoded token (marks 2-3)."""
    if not {1, 2, 3} <= marks.keys():
        raise RuntimeError(f"the counted run did not reach every phase mark (got {sorted(marks)})")
    return (marks[2] - marks[1]) / prompt_len, (marks[3] - marks[2]) / new_tokens


def _printed(stdout: str, tag: str) -> Any:
    return json.loads(next(ln for ln in stdout.splitlines() if ln.startswith(tag + " "))[len(tag) + 1:])


def count(arm64: Arm64Python, plugin: Path, engine: str, script: str, args: dict[str, Any], prompt_len: int,
          new_tokens: int, paths: Sequence[Path] = (), env: dict[str, str] | None = None,
          pages: bool = False) -> Counted:
    """Run one engine's guest script under the counting plugin (pages: also where the decode's went)."""
    with tempfile.TemporaryDirectory(prefix="foldline-insn-") as tmp:
        out = Path(tmp) / "marks.txt"
        options = f"{plugin},out={out}" + (",pages=on" if pages else "")
        done = arm64.run(_GUEST_LOOP + script, json.dumps(args), timeout=3600,
                         qemu_options=["-plugin", options], paths=list(paths), env=env)
        marks, by_page = read_marks(out)
    prefill, decode = per_token(marks, prompt_len, new_tokens)
    decode_where = where(by_page, _printed(done.stdout, "MAPS")) if pages else None
    return Counted(engine, prefill, decode, _printed(done.stdout, "TOKENS"), decode_where)


def count_foldline(arm64: Arm64Python, plugin: Path, bundle: Path, cpu: str, ids: list[int], new_tokens: int,
                   pages: bool = False) -> Counted:
    """foldline's runtime on the bundle's aarch64 module for `cpu`, one worker thread."""
    args = {"ids": ids, "new_tokens": new_tokens, "bundle": str(Path(bundle).resolve()), "cpu": cpu}
    return count(arm64, plugin, "foldline", _FOLDLINE, args, len(ids), new_tokens, pages=pages)


def count_llama_cpp(arm64: Arm64Python, plugin: Path, gguf: Path, llama_lib: Path | None, llama_cpp_python: Path,
                    ids: list[int], new_tokens: int, n_ctx: int, pages: bool = False) -> Counted:
    """llama.cpp's aarch64 libraries in `llama_lib` through the ctypes bindings in `llama_cpp_python`, one
    thread, with a context of n_ctx (the bundle's, so both hold caches of the same capacity)."""
    import typing_extensions  # pure Python, which llama_cpp.py imports; the emulated Python has only it

    args = {"ids": ids, "new_tokens": new_tokens, "gguf": str(Path(gguf).resolve()),
            "llama_cpp_python": str(Path(llama_cpp_python).resolve()), "n_ctx": n_ctx}
    env = {"LLAMA_CPP_LIB_PATH": str(Path(llama_lib).resolve())} if llama_lib else {}
    with tempfile.TemporaryDirectory(prefix="foldline-insn-py-") as extra:
        (Path(extra) / "typing_extensions.py").symlink_to(Path(typing_extensions.__file__))
        return count(arm64, plugin, "llama.cpp", _LLAMA_CPP, args, len(ids), new_tokens, paths=[Path(extra)],
                     env=env, pages=pages)


def format_table(rows: list[list[Counted]], cpu: str, llama_build: str) -> str:
    """Median counts per engine over the rounds, the spread, and foldline's ratio to llama.cpp."""
    by_engine: dict[str, list[Counted]] = {}
    for round_ in rows:
        for c in round_:
            by_engine.setdefault(c.engine, []).append(c)
    lines = [f"aarch64 instructions per token under qemu-user (a proxy, not a speed): foldline module {cpu}, "
             f"llama.cpp built {llama_build}; one thread each",
             "| engine | per prompt token (M) | per decoded token (M) |", "| --- | ---: | ---: |"]
    medians = {}
    for engine, runs in by_engine.items():
        cells = []
        for phase in PHASES:
            values = [getattr(c, PHASES[phase]) / 1e6 for c in runs]
            medians[(engine, phase)] = statistics.median(values)
            cells.append(f"{medians[(engine, phase)]:.2f} ({min(values):.2f}-{max(values):.2f})")
        lines.append(f"| {engine} | {cells[0]} | {cells[1]} |")
    if ("llama.cpp", "decode") in medians and ("foldline", "decode") in medians:
        ratio = [medians[("foldline", p)] / medians[("llama.cpp", p)] for p in PHASES]
        lines.append(f"| foldline / llama.cpp | {ratio[0]:.2f}x | {ratio[1]:.2f}x |")
    return "\n".join(lines)


def format_where(counted: list[Counted], new_tokens: int, shown: int = 8) -> str:
    """Per engine, the guest files its decode instructions went to (millions per decoded token)."""
    lines = ["where the decode instructions go (M per decoded token)"]
    for c in counted:
        items = list((c.decode_where or {}).items())
        cells = [f"{name} {n / new_tokens / 1e6:.2f}" for name, n in items[:shown]]
        rest = sum(n for _, n in items[shown:])
        if rest:
            cells.append(f"other {rest / new_tokens / 1e6:.2f}")
        lines.append(f"  {c.engine}: " + ", ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m foldline.bench.arm_instructions", description=__doc__.split("\n\n")[0])
    p.add_argument("bundle", help="a bundle with an aarch64 CPU module (foldline compile --triple aarch64-...)")
    p.add_argument("--cpu", default="cortex-a76", help="which of the bundle's aarch64 modules (its --cpu name; "
                   "default cortex-a76, NEON dotprod)")
    p.add_argument("--gguf", default=None, help="the GGUF llama.cpp runs (default: the one the bundle came from)")
    p.add_argument("--llama-lib", type=Path, default=None,
                   help="folder of llama.cpp's aarch64 shared libraries (libllama.so; docs/benchmarks.md builds "
                        "them); without it only foldline is counted")
    p.add_argument("--llama-build", default="", help="how that llama.cpp was built, for the table's title "
                   "(e.g. armv8.2-a+dotprod)")
    p.add_argument("--llama-cpp-python", type=Path, default=None,
                   help="the llama_cpp folder of the llama-cpp-python source matching that llama.cpp (its "
                        "ctypes bindings)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens decoded after the prompt (default 16)")
    p.add_argument("--rounds", type=int, default=1, help="counted runs per engine (default 1; counts move "
                   "only with thread timing)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt ids (default 0)")
    p.add_argument("--where", action="store_true",
                   help="also print where each engine's decode instructions go, per guest file (slower)")
    args = p.parse_args(argv)

    from ..contract.manifest import Manifest
    from .engines import prompt_ids
    from .modes import source_model

    if (args.llama_lib is None) != (args.llama_cpp_python is None):
        raise SystemExit("--llama-lib and --llama-cpp-python go together")
    manifest = Manifest.load(args.bundle)
    arm_cpus = [m.cpu for m in manifest.modules.values() if m.arch == "aarch64"]
    if args.cpu not in arm_cpus:
        raise SystemExit(f"{args.bundle} has no aarch64 module for --cpu {args.cpu} (its aarch64 modules: "
                         f"{', '.join(map(str, arm_cpus)) or 'none'}; compile one with --triple "
                         f"aarch64-unknown-linux-gnu --cpu {args.cpu})")
    arm64 = Arm64Python.find()
    if isinstance(arm64, str):
        raise SystemExit(arm64)
    ids = prompt_ids(manifest.vocab_size, args.prompt_len, args.seed)
    plugin = build_plugin(cache_dir() / "qemu-plugins")
    rows = []
    try:
        for r in range(args.rounds):
            round_ = [count_foldline(arm64, plugin, Path(args.bundle), args.cpu, ids, args.new_tokens, args.where)]
            if args.llama_lib is not None:
                gguf = Path(args.gguf or source_model(manifest, "auto"))
                round_.append(count_llama_cpp(arm64, plugin, gguf, args.llama_lib, args.llama_cpp_python, ids,
                                              args.new_tokens, manifest.max_context, args.where))
            rows.append(round_)
            print(f"round {r + 1}: " + ", ".join(
                f"{c.engine} {c.per_prompt_token / 1e6:.2f}M/prompt token, {c.per_decoded_token / 1e6:.2f}M/decoded"
                for c in round_), file=sys.stderr)
    finally:
        arm64.close()
    print(format_table(rows, args.cpu, args.llama_build or "(not given)"))
    if args.where:
        print(format_where(rows[0], args.new_tokens))
    if len(rows[0]) == 2:
        same = sum(a == b for a, b in zip(rows[0][0].tokens, rows[0][1].tokens))
        print(f"greedy tokens equal at {same} of {args.new_tokens} decode steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
