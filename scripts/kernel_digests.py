"""Digests of the int8 kernels compiled for every form: proof that a change to how they are built changed no byte.

Each case is one int8 decode or prefill kernel (the executables and a `main` that
dispatches them) for one ISA form, compiled with iree-compile for a CPU of that
form (aarch64 forms cross-compiled). Run it before and after a change to the
kernels' Python and compare the two files:

    nice -n 10 .venv/bin/python scripts/kernel_digests.py before.json
    ... change the code ...
    nice -n 10 .venv/bin/python scripts/kernel_digests.py after.json --compare before.json

Each kernel has two digests: its MLIR as IREE prints it (the same ops in the same
order; `--mlir-only` stops there, seconds), and the machine code of its executables
(the proof: the same code whatever the order of ops that fold to it).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import tempfile
from pathlib import Path

from foldline.kernels import int8_decode as dec
from foldline.kernels import int8_gemm as gemm
from foldline.kernels.arm import NEON_DOTPROD, NEON_I8MM
from foldline.kernels.int8_channels import int8_decode_executable
from foldline.kernels.mlir import as_tensor
from foldline.kernels.x86 import AVX2, AVX512_VNNI, AVX_VNNI

AARCH64 = "aarch64-unknown-linux-gnu"
# form -> (the CPU its kernels are compiled for, the triple, None: x86-64)
CPUS = {AVX512_VNNI: ("cascadelake", None), AVX_VNNI: ("alderlake", None), AVX2: ("x86-64-v3", None),
        NEON_DOTPROD: ("cortex-a76", AARCH64), NEON_I8MM: ("neoverse-v1", AARCH64)}

DECODE = [
    dec.Int8DotShape("q4", 32, "f16", True, 256, 32),
    dec.Int8DotShape("q4", 32, "f32", True, 256, 32),
    dec.Int8DotShape("q4", 64, "f16", True, 256, 32),
    dec.Int8DotShape("q5", 32, "f16", True, 256, 32),
    dec.Int8DotShape("q5", 16, "f32", True, 128, 32),
    dec.Int8DotShape("q8", 32, "f16", False, 256, 32),
    dec.Int8DotShape("q8", 16, "f32", True, 128, 16),
    dec.Int8DotShape("q8", 32, "f32", True, 64, 8192),  # rows per workgroup above LARGE_N
    dec.Int8DotShape("q4", 32, "f16", True, 128, 32, norm=dec.RowNorm(1e-5, None)),
    dec.Int8DotShape("q8", 32, "f16", False, 128, 32, norm=dec.RowNorm(1e-6, 1.0), residual=True),
    dec.Int8DotShape("q4", 32, "f16", True, 128, 32, residual=True, gate="silu"),
    dec.Int8DotShape("q5", 32, "f32", True, 128, 32, gate="gelu_tanh"),
]
# A batched bundle's decode on x86: output channels in the lanes, one row (the tree of lane sums) and
# several (the transpose), f16 scales gathered in pairs and loaded by channel
CHANNEL_LANES = [
    dec.Int8DotShape("q4", 32, "f16", True, 576, 192, norm=dec.RowNorm(1e-5, None), channel_lanes=True),
    dec.Int8DotShape("q4", 32, "f16", True, 576, 192, norm=dec.RowNorm(1e-5, None), rows=8, channel_lanes=True),
    dec.Int8DotShape("q8", 32, "f16", False, 256, 64, rows=4, channel_lanes=True),
    dec.Int8DotShape("q4", 64, "f16", True, 256, 32, residual=True, gate="silu", channel_lanes=True),
    dec.Int8DotShape("q8", 16, "f32", False, 128, 32, rows=2, channel_lanes=True),
]
PREFILL = [
    gemm.Int8GemmShape("q4", 32, "f16", True, 32, 256, 32),
    gemm.Int8GemmShape("q4", 64, "f16", True, 16, 512, 32),
    gemm.Int8GemmShape("q5", 16, "f32", True, 16, 256, 32),
    gemm.Int8GemmShape("q5", 32, "f16", True, 32, 256, 32),
    gemm.Int8GemmShape("q8", 32, "f16", False, 32, 256, 32),
    gemm.Int8GemmShape("q8", 32, "f32", True, 32, 256, 64),
]


def decode_module(s: dec.Int8DotShape) -> str:
    codes_t, scales_t = as_tensor(dec._codes_memref(s)), as_tensor(dec._scales_memref(s))
    x_t, y_t = f"tensor<{s.rows * s.x_len}xf32>", f"tensor<{s.rows * s.n}xf32>"
    params = [f"%x: {x_t}"] + ([f"%w: tensor<{s.k}xf32>"] if s.norm else [])
    params += [f"%c: {codes_t}", f"%s: {scales_t}"] + ([f"%m: {scales_t}"] if s.has_min else [])
    params += [f"%r: {y_t}"] if s.residual else []
    call = dec.int8_dot_dispatch(s, "%x", "%c", "%s", "%m" if s.has_min else None, "%y",
                                 norm_weight="%w" if s.norm else None, residual="%r" if s.residual else None)
    return (f"{int8_decode_executable(s)}\nutil.func public @main({', '.join(params)}) -> {y_t} {{\n"
            f"  {call}\n  util.return %y : {y_t}\n}}\n")


def prefill_module(s: gemm.Int8GemmShape) -> str:
    codes_t, scales_t = as_tensor(gemm._codes_memref(s)), as_tensor(gemm._scales_memref(s))
    params = [f"%x: tensor<{s.m}x{s.k}xf32>", f"%c: {codes_t}", f"%s: {scales_t}"]
    params += [f"%mn: {scales_t}"] if s.has_min else []
    body = "\n  ".join(gemm.int8_gemm_dispatches(s, "%x", "%c", "%s", "%mn" if s.has_min else None, "%y"))
    return (f"{gemm.quantize_executable(s)}\n{gemm.gemm_executable(s)}\n"
            f"util.func public @main({', '.join(params)}) -> tensor<{s.m}x{s.n}xf32> {{\n  {body}\n"
            f"  util.return %y : tensor<{s.m}x{s.n}xf32>\n}}\n")


def cases():
    """(case name, form, module text) of every kernel in the matrix."""
    for isa in (AVX512_VNNI, AVX_VNNI, AVX2, NEON_DOTPROD):
        for s in DECODE:
            s = dataclasses.replace(s, isa=isa)
            yield f"{isa.name}/{s.name}", isa, decode_module(s)
    for isa in (AVX512_VNNI, AVX_VNNI, AVX2):
        for s in CHANNEL_LANES:
            s = dataclasses.replace(s, isa=isa)
            yield f"{isa.name}/{s.name}", isa, decode_module(s)
    for isa in (AVX512_VNNI, AVX_VNNI, AVX2, NEON_DOTPROD, NEON_I8MM):
        for s in PREFILL:
            s = dataclasses.replace(s, isa=isa)
            yield f"{isa.name}/{s.name}", isa, prefill_module(s)


def printed(text: str) -> str:
    """The module as IREE's printer writes it: SSA names and spacing no longer depend on the generator."""
    from iree.compiler import ir

    with ir.Context() as ctx:
        ctx.allow_unregistered_dialects = True
        return str(ir.Module.parse(text))


def compiled(text: str, isa) -> str:
    """A digest of the machine code of every executable of the module, compiled without debug symbols.

    The vmfb itself records the source locations of the printed module, so it changes with
    any line moved; the executables' code does not.
    """
    import iree.compiler as ireec

    from foldline.backends.targets import cpu_target

    cpu, triple = CPUS[isa]
    with tempfile.TemporaryDirectory() as tmp:
        ireec.compile_str(text, extra_args=[*cpu_target(cpu, triple).flags, "--iree-llvmcpu-debug-symbols=false",
                                            f"--iree-hal-dump-executable-binaries-to={tmp}"])
        digest = hashlib.sha256()
        for path in sorted(Path(tmp).iterdir()):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
        return digest.hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--compare", type=Path, help="a file written before, to compare against")
    parser.add_argument("--mlir-only", action="store_true", help="digest the printed MLIR only, no compile")
    parser.add_argument("--dump", type=Path, help="a folder to write each kernel's printed MLIR to (to diff)")
    args = parser.parse_args()
    digests = {}
    for name, isa, text in cases():
        text = printed(text)
        if args.dump:
            (args.dump / f"{name.replace('/', '-')}.mlir").write_text(text)
        entry = {"mlir": hashlib.sha256(text.encode()).hexdigest()}
        if not args.mlir_only:
            entry["code"] = compiled(text, isa)
        digests[name] = entry
        print(name, *entry.values(), flush=True)
    args.out.write_text(json.dumps(digests, indent=1) + "\n")
    if args.compare is None:
        return 0
    before = json.loads(args.compare.read_text())
    differ = [f"{name} {kind}" for name, entry in digests.items() for kind, digest in entry.items()
              if before.get(name, {}).get(kind, digest) != digest]
    missing = sorted(set(before) ^ set(digests))
    for line in differ + [f"{name}: in one file only" for name in missing]:
        print("DIFFERS", line)
    print(f"{len(digests)} kernels, {len(differ)} digests differ, {len(missing)} missing")
    return 1 if differ or missing else 0


if __name__ == "__main__":
    sys.exit(main())
