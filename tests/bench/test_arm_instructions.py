"""The aarch64 instruction counter (bench/arm_instructions.py): its qemu plugin counts what runs between
the marks, and the llama.cpp peer's guest script, run against a stand-in of its ctypes bindings
(tests/fixtures/arm_llama_stub), counts exactly its prefill and its decode.

foldline's own side runs on a compiled bundle in tests/kernels/test_aarch64.py.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from foldline.bench.aarch64_python import Arm64Python
from foldline.bench.arm_instructions import (
    build_plugin,
    count_llama_cpp,
    format_table,
    main,
    read_marks,
    where,
)
from foldline.bench.timer import WARMUP_DECODE_STEPS

STUB = Path(__file__).parent.parent / "fixtures" / "arm_llama_stub"

# A guest program: mark 1, a loop of N iterations, mark 2, a loop of 2N, mark 3.
LOOPS = """
import os, sys
def mark(k):
    try:
        os.write(987654, b"m" * k)
    except OSError:
        pass
n = int(sys.argv[1])
mark(1)
s = 0
for i in range(n):
    s += i
mark(2)
for i in range(2 * n):
    s += i
mark(3)
with open("/proc/self/maps") as f:
    print("MAPS " + __import__("json").dumps(f.read()))
"""


@pytest.fixture(scope="module")
def arm64() -> Iterator[Arm64Python]:
    found = Arm64Python.find()
    if isinstance(found, str):
        pytest.skip(found)
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler for the qemu plugin")
    yield found
    found.close()


@pytest.fixture(scope="module")
def plugin(arm64, tmp_path_factory) -> Path:
    return build_plugin(tmp_path_factory.mktemp("plugin"))


@pytest.mark.parametrize("pages", [False, True])
def test_plugin_counts_what_runs_between_the_marks(arm64, plugin, tmp_path, pages):
    out = tmp_path / "marks.txt"
    options = f"{plugin},out={out}" + (",pages=on" if pages else "")
    done = arm64.run(LOOPS, "20000", qemu_options=["-plugin", options])
    marks, by_page = read_marks(out)
    assert marks[1] < marks[2] < marks[3]
    first, second = marks[2] - marks[1], marks[3] - marks[2]
    assert 1.9 < second / first < 2.1, f"twice the loop counted {second / first:.3f}x the instructions"
    assert "exit" in out.read_text().splitlines()[-1]
    if pages:
        maps = json.loads(next(ln for ln in done.stdout.splitlines() if ln.startswith("MAPS "))[5:])
        files = where(by_page, maps)
        assert sum(files.values()) == second  # every instruction of the phase lands on one page
        interpreter, share = next(iter(files.items()))
        assert interpreter.startswith(("python3", "libpython")) and share > 0.9 * second, files
    else:
        assert by_page == {}


def test_llama_cpp_peer_counts_its_prefill_and_decode_only(arm64, plugin, tmp_path, monkeypatch):
    """The stand-in burns the same work per token in prefill and decode: equal counts per token say the
    marks bracket the counted calls and nothing of the warm-up; its log says how llama.cpp was set up."""
    log = tmp_path / "stub.jsonl"
    monkeypatch.setenv("BENCH_STUB_LOG", str(log))
    ids, new_tokens = list(range(100, 116)), 6
    counted = count_llama_cpp(arm64, plugin, tmp_path / "m.gguf", None, STUB, ids, new_tokens, n_ctx=512)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    context = next(e for e in events if e["event"] == "context")
    assert (context["n_threads"], context["n_threads_batch"]) == (1, 1)
    assert context["flash_attn_type"] == 1 and context["swa_full"] is False
    assert context["n_ctx"] == 512
    calls = [e["n"] if e["event"] == "decode" else e["event"] for e in events if e["event"] in ("decode", "clear")]
    assert calls == [len(ids), *[1] * WARMUP_DECODE_STEPS, "clear", len(ids), *[1] * new_tokens]
    assert counted.tokens == [ids[-1] + 1 + i for i in range(new_tokens)]  # greedy on the stand-in's logits
    ratio = counted.per_decoded_token / counted.per_prompt_token
    assert 0.9 < ratio < 1.15, f"per decoded token {ratio:.3f}x per prompt token"
    table = format_table([[counted]], "cortex-a76", "stub")
    assert "| llama.cpp |" in table


def test_a_bundle_without_the_aarch64_module_is_refused_by_name(bundle_factory):
    """An x86 bundle (or another aarch64 CPU's) is refused before any emulation, naming what it has."""
    bundle = bundle_factory("llama-tiny")
    with pytest.raises(SystemExit) as refused:
        main([str(bundle)])
    message = str(refused.value)
    assert "no aarch64 module for --cpu cortex-a76" in message and "its aarch64 modules: none" in message
