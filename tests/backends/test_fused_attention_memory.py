"""What the fused prefill attention allocates, read from IREE's stream program: the transient memory of a
prefill call is the same at 8 Ki and 128 Ki positions (nothing of the context's length but the caches) and
within 10% of `foldline plan`'s scratch for the same config; the decomposed form's grows with the tiles read.
And run: a compiled bundle's peak resident set with 60,000 tokens held is the one with 4,000 held.
"""

from __future__ import annotations

import re

import pytest

from foldline.backends.build import compile_torch_module, expand_kernels
from foldline.backends.iree.fused_attention import (
    FUSED_ATTENTION_PASS,
    TAIL_TILES,
    fused_decompositions,
)
from foldline.backends.iree.importer import import_programs
from foldline.backends.lowering import Lowering
from foldline.backends.targets import make_target
from foldline.frontend.arch import get_preset
from foldline.passes.manager import TargetPasses, run_pipeline
from foldline.passes.shard_plan import (
    FUSED_TAIL_TILES,
    attention_scratch_bytes,
    decode_attention_scratch_bytes,
    mlp_scratch_bytes,
)
from foldline.testing.golden import copy_unit

CHUNK = 64  # the chunk `foldline plan` sizes scratch for
CONTEXTS = (8192, 131072)
# A transient allocation of a function's stream program and its size: a constant, or an SSA value
# computed from the call's shapes (the tiles read).
_TRANSIENT = re.compile(r"stream\.resource\.alloca .*=> !stream\.resource<transient>\{%(\w+)\}")


def _stream_program(exported_unit, context: int, fused: bool, target: str) -> str:
    """prefill and decode of llama-tiny at `context` positions, compiled for `target` to IREE's stream phase."""
    cfg = get_preset("llama-tiny").replace(max_context=context)
    unit = copy_unit(exported_unit(cfg, batch=1, chunk=CHUNK))
    run_pipeline(unit, None, progress=lambda _m: None)
    t = make_target("cpu", cpu="x86-64-v3") if target == "cpu" else make_target(target)
    mlir, _params = import_programs(
        unit.programs.items(), decode_attention_kernel=target == "cpu",
        lowering=Lowering(fused_decompositions() if fused else None),
        target_passes=TargetPasses(unit, [FUSED_ATTENTION_PASS], {}) if fused else None)
    text, _int8, _sites = expand_kernels(mlir, t, "f32")
    stream, _report = compile_torch_module(text, t.flags, stop_at="stream")
    return stream.decode() if isinstance(stream, bytes) else stream


def prefill_transients(stream: str, function: str = "prefill") -> list[str]:
    """The sizes of the transient allocations of `function`'s stream program: a byte count, or the name
    of the value that computes it."""
    lines = stream.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"  util.func public @{function}$async("))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("  util.func"))
    return [m.group(1) for line in lines[start:end] if (m := _TRANSIENT.search(line))]


def _bytes(sizes: list[str]) -> int:
    assert sizes and all(re.fullmatch(r"c\d+", s) for s in sizes), f"transient sizes not constant: {sizes}"
    return sum(int(s[1:]) for s in sizes)


def test_the_plan_and_the_lowering_split_at_the_same_tiles():
    assert FUSED_TAIL_TILES == TAIL_TILES


def test_the_transient_size_is_read_from_a_stream_program():
    program = """  util.func public @prefill$async(%arg0: !hal.buffer_view) {
    %r, %t = stream.resource.alloca uninitialized await(%1) => !stream.resource<transient>{%c385856} => !stream.timepoint
    %s, %u = stream.resource.alloca uninitialized await(%1) => !stream.resource<external>{%c2048} => !stream.timepoint
  }
  util.func public @decode$async(%arg0: !hal.buffer_view) {
    %r, %t = stream.resource.alloca uninitialized await(%1) => !stream.resource<transient>{%c132480} => !stream.timepoint
  }"""
    assert prefill_transients(program) == ["c385856"]
    assert _bytes(prefill_transients(program)) == 385856
    with pytest.raises(AssertionError, match="not constant"):
        _bytes(["42"])


@pytest.mark.slow
@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_fused_prefill_allocates_the_same_at_any_context(target, exported_unit):
    """The fused form's prefill allocates one constant transient block, the same at 8 Ki and 128 Ki
    positions, within 10% of `foldline plan`'s scratch (attention's and the MLP's, chunk 64); compiled
    for CUDA (sm_80) too, which needs no GPU to reach the stream phase. A CPU decode step's is the decode
    kernel's scores, as the plan states it, at each context."""
    cfg = get_preset("llama-tiny")
    programs = {n: _stream_program(exported_unit, n, True, target) for n in CONTEXTS}
    short, long = (_bytes(prefill_transients(programs[n])) for n in CONTEXTS)
    assert short == long
    plan = attention_scratch_bytes(cfg, 1, CONTEXTS[1], CHUNK, fused=True) + mlp_scratch_bytes(cfg, 1, CHUNK)
    assert abs(long - plan) <= 0.1 * long, (long, plan)
    if target == "cpu":
        for n, program in programs.items():
            decode = _bytes(prefill_transients(program, "decode"))
            assert abs(decode - decode_attention_scratch_bytes(cfg, 1, n)) <= 0.1 * decode, (n, decode)


@pytest.mark.slow
def test_the_decomposed_prefill_allocates_by_the_tiles_read(exported_unit):
    """The decomposed form's scores follow the tiles a call reads: its transient size is computed at the
    call, not a constant (what the fused test would catch)."""
    sizes = prefill_transients(_stream_program(exported_unit, CONTEXTS[0], False, "cpu"))
    assert sizes and not all(re.fullmatch(r"c\d+", s) for s in sizes), sizes


# Runs in a child process (VmHWM is per process): the bundle's prefill at one position with zeroed caches,
# then the peak resident set before and after.
_PEAK_AT = """
import sys
import numpy as np
from foldline.contract.entry_points import kv_tiles_input
from foldline.runtime import Model

model = Model.load(sys.argv[1])
position, chunk = int(sys.argv[2]), model.chunk
state = [model.ctx.zeros(s.shape, s.host_dtype) for s in model.manifest.state]
inputs = [np.ones((1, chunk), np.int64), np.array([position]), np.array([chunk]),
          kv_tiles_input(position + chunk, model.max_context)]
peak = lambda: next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
before = peak()
for _ in range(3):
    model.ctx.call("prefill", inputs, state)
print(before, peak())
"""
HELD = (4_000, 60_000)


def _peak_rss(bundle, position: int) -> tuple[int, int]:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _PEAK_AT, str(bundle), str(position)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = map(int, out.stdout.split())
    return before, after


@pytest.mark.slow
def test_a_prefill_60000_tokens_in_peaks_where_one_4000_in_does(bundle_factory):
    """Run, not compiled only: llama-tiny at 64 Ki positions, a prefill chunk with 4,000 and with 60,000 tokens
    held. The caches are allocated whole for the context at load (the state the plan states does not change
    with the tokens held), so the fused form's peak resident set is the same within 1 MiB; the decomposed
    form's scores over the tiles read (4 B x heads x chunk x positions) show in its peak."""
    fused, decomposed = (bundle_factory("llama-tiny", max_context=65536, attention=a) for a in ("fused", "decomposed"))
    (b4, p4), (b60, p60) = (_peak_rss(fused, n) for n in HELD)
    assert abs(b60 - b4) < 1 << 20, "the same load, caches included"
    assert p60 - p4 <= 1 << 20, f"fused: {(p60 - p4) / 2**20:.1f} MiB more at 60,000 held"
    cfg = get_preset("llama-tiny")
    scores = 4 * cfg.num_heads * 16 * (HELD[1] - HELD[0])  # bundle_factory's chunk: 16
    (_, d4), (_, d60) = (_peak_rss(decomposed, n) for n in HELD)
    assert d60 - d4 >= scores // 2, f"decomposed: {(d60 - d4) / 2**20:.1f} MiB more, scores {scores / 2**20:.1f} MiB"
