"""foldline bench's peer paths, run for real against stand-ins of llama-cpp-python and onnxruntime-genai.

The stand-ins (tests/fixtures/bench_stubs) go on the child processes' PYTHONPATH and log, with perf_counter
readings, every setting they were given and every call: when GenAI's generator was built against when the
timer started, what each engine's warm-up was, what llama.cpp was configured with.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from foldline.bench.peers import bench_llama_cpp, bench_ort_genai
from foldline.bench.timer import WARMUP_DECODE_STEPS
from foldline.tools.cli import main

STUBS = Path(__file__).parent.parent / "fixtures" / "bench_stubs"


class StubLog:
    def __init__(self, path: Path):
        self.path = path

    def events(self, name: str | None = None) -> list[dict]:
        if not self.path.exists():
            return []
        events = [json.loads(line) for line in self.path.read_text().splitlines()]
        return [e for e in events if name is None or e["event"] == name]

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


@pytest.fixture
def stubs(tmp_path, monkeypatch) -> StubLog:
    """The stand-in peers on the children's PYTHONPATH, logging to a file of this test."""
    monkeypatch.setenv("PYTHONPATH", str(STUBS))
    monkeypatch.setenv("BENCH_STUB_LOG", str(tmp_path / "stub_log.jsonl"))
    return StubLog(tmp_path / "stub_log.jsonl")


@pytest.fixture
def genai_dir(tmp_path) -> Path:
    folder = tmp_path / "genai"
    folder.mkdir()
    (folder / "genai_config.json").write_text("{}")
    return folder


def _gguf(tmp_path: Path) -> Path:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    return gguf


IDS = list(range(1000, 1020))


def test_genai_generator_is_built_before_the_timed_prefill_with_the_old_one_freed(stubs, genai_dir):
    figures = bench_ort_genai(genai_dir, IDS, 6, 1, python=sys.executable, n_ctx=512)
    built = stubs.events("generator")
    assert len(built) == 2, "one generator for the warm-up, one for the timed run"
    assert all(g["max_length"] == 512 for g in built)
    assert built[1]["at"] < figures["timer_start"], "the timed run's generator was built inside the timer"
    assert built[1]["live"] == 1, "the warm-up's generator was still alive when the next was built"
    freed = stubs.events("generator_freed")
    assert freed and built[0]["at"] < freed[0]["at"] < built[1]["at"]
    timed = [e for e in stubs.events("append") if e["at"] > figures["timer_start"]]
    assert [e["n"] for e in timed] == [len(IDS)] + [1] * 6  # the prompt at once, then one token a step
    [overlay] = stubs.events("overlay")
    assert overlay["settings"]["model"]["decoder"]["session_options"]["intra_op_num_threads"] == 1


def test_llama_cpp_runs_as_llama_server_with_the_bundles_context(stubs, tmp_path):
    figures = bench_llama_cpp(_gguf(tmp_path), IDS, 6, 2, python=sys.executable, n_ctx=8192)
    [init] = stubs.events("init")
    assert init["flash_attn"] is True and init["swa_full"] is False
    assert init["n_ctx"] == 8192 and init["n_threads"] == init["n_threads_batch"] == 2
    assert figures["settings"]["n_ctx"] == 8192 and figures["version"] == "0.0.0+stub"
    timed = [e for e in stubs.events("eval") if e["at"] > figures["timer_start"]]
    assert timed[0] == {**timed[0], "n": len(IDS), "start": 0}, "the timed prefill starts from an empty cache"
    assert len(timed) == 1 + 6


def test_every_peer_gets_the_same_warmup_the_whole_prompt_and_its_decode_steps(stubs, tmp_path, genai_dir):
    llama = bench_llama_cpp(_gguf(tmp_path), IDS, 6, 1, python=sys.executable)
    before_timer = [e["n"] for e in stubs.events("eval") if e["at"] < llama["timer_start"]]
    stubs.clear()
    genai = bench_ort_genai(genai_dir, IDS, 6, 1, python=sys.executable)
    genai_before = [e["n"] for e in stubs.events("append") if e["at"] < genai["timer_start"]]
    expected = [len(IDS)] + [1] * WARMUP_DECODE_STEPS
    assert before_timer == genai_before == expected
    assert llama["warmup"] == genai["warmup"] == {"prefill_tokens": len(IDS), "decode_steps": WARMUP_DECODE_STEPS}


def test_peak_rss_is_the_childs_own_high_water_mark_not_its_parents(stubs, tmp_path, genai_dir):
    """ru_maxrss would carry this process's peak into the child across exec; VmHWM is the child's own. One GenAI
    cache counts toward it: an 8192-position cache (32 MiB in the stand-in) adds one cache over a small one, not two."""
    ballast = np.ones(600 * 2**20, dtype=np.uint8)  # this process's peak: 600 MiB more than any child's
    small = bench_ort_genai(genai_dir, IDS, 6, 1, python=sys.executable, n_ctx=64)
    large = bench_ort_genai(genai_dir, IDS, 6, 1, python=sys.executable, n_ctx=8192)
    llama = bench_llama_cpp(_gguf(tmp_path), IDS, 6, 1, python=sys.executable)
    del ballast
    for figures in (small, large, llama):
        assert figures["rss_source"] == "VmHWM"
        assert 5 < figures["peak_rss_mib"] < 300, figures["peak_rss_mib"]
    cache_mib = 8192 * 4096 / 2**20  # the stand-in's CACHE_BYTES_PER_POSITION
    assert 0.75 * cache_mib < large["peak_rss_mib"] - small["peak_rss_mib"] < 1.5 * cache_mib


def test_rounds_shuffle_the_engines_seeded_and_never_repeat_the_previous_order():
    from foldline.bench.rounds import round_orders

    names = ["foldline (cpu)", "llama.cpp", "ORT GenAI"]
    orders = round_orders(names, 8, seed=0)
    assert orders == round_orders(names, 8, seed=0)
    assert all(sorted(o) == sorted(names) for o in orders)
    assert all(a != b for a, b in zip(orders, orders[1:]))
    assert {o[0] for o in orders} != {names[0]}, "foldline ran first in every round"
    assert round_orders(names, 8, seed=1) != orders


def test_a_busy_host_is_refused_unless_asked_and_then_flagged(monkeypatch):
    from foldline.bench import host
    from foldline.bench.child import BenchError

    monkeypatch.setattr(host.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(host.os, "getloadavg", lambda: (2.5, 1.0, 1.0))
    with pytest.raises(BenchError, match=r"host is busy \(1-minute load 2.5 on 4 cores"):
        host.check_host(busy_ok=False)
    flagged = host.check_host(busy_ok=True)
    assert flagged.busy and "HOST BUSY" in flagged.flag()
    monkeypatch.setattr(host.os, "getloadavg", lambda: (1.5, 1.0, 1.0))
    quiet = host.check_host(busy_ok=False)
    assert not quiet.busy and quiet.flag() == ""


def test_plot_without_its_extra_names_the_extra(monkeypatch, capsys):
    from foldline.tools import cli

    monkeypatch.setattr(cli, "_importable", lambda module: module != "matplotlib")
    assert main(["bench", "b", "--plot", "x.png"]) == 2
    assert "--plot needs the plot extra (matplotlib not installed): pip install 'foldline[plot]'" in \
        capsys.readouterr().err


def _bench_cli(bundle: Path, tmp_path: Path, genai_dir: Path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "bench.json"
    rc = main(["bench", str(bundle), "--llama-cpp", str(_gguf(tmp_path)), "--llama-python", sys.executable,
               "--ort-genai", str(genai_dir), "--genai-python", sys.executable, "--new-tokens", "6",
               "--busy-ok", "--json", str(out), *extra])
    return rc, json.loads(out.read_text()) if rc == 0 else {}


@pytest.mark.slow
def test_bench_runs_every_engine_alike_in_shuffled_rounds(bundle_factory, stubs, tmp_path, genai_dir, capsys):
    """Two prompt lengths, two thread counts, three engines, two rounds: the order differs between rounds, every
    engine (foldline too) gets the same warm-up, reports its own VmHWM and its best thread count."""
    pytest.importorskip("matplotlib")
    bundle = bundle_factory("llama-tiny")
    plot = tmp_path / "bench.png"
    rc, data = _bench_cli(bundle, tmp_path, genai_dir, "--prompt-len", "8,20", "--threads", "1,2",
                          "--rounds", "2", "--plot", str(plot))
    assert rc == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "round 2/2, prompt 20, 2 threads: " in captured.err and "round 1/" not in printed  # progress: stderr
    names = ["foldline (cpu)", "llama.cpp", "ORT GenAI"]
    assert len(data["orders"]) == 2 and data["orders"][0] != data["orders"][1]
    assert all(sorted(o) == sorted(names) for o in data["orders"])
    assert "order by round: 1: " + " -> ".join(data["orders"][0]) + "; 2: " in printed
    assert [p["prompt_len"] for p in data["prompt_lengths"]] == [8, 20]
    assert "prefill tok/s (8 tokens)" in printed and "prefill tok/s (20 tokens)" in printed
    for entry in data["prompt_lengths"]:
        engines = entry["engines"]
        assert list(engines) == names
        for figures in engines.values():
            assert figures["warmup"] == {"prefill_tokens": entry["prompt_len"], "decode_steps": WARMUP_DECODE_STEPS}
            assert figures["rss_source"] == "VmHWM"
            assert figures["threads_tried"] == [1, 2] and figures["threads"] in (1, 2)
            assert len(figures["rounds"]) == 2
    # the decode ratio's spread over the two rounds is printed beside its median
    assert "foldline (cpu) / llama.cpp" in printed and ")" in printed.split("decode tok/s")[1].splitlines()[0]
    [init, *_] = stubs.events("init")
    assert init["n_ctx"] == 128 and init["flash_attn"] is True  # the bundle's context
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert ("HOST BUSY" in printed) == data["host_busy"]


@pytest.mark.slow
def test_held_bench_runs_in_rounds_with_every_engine(bundle_factory, stubs, tmp_path, genai_dir, capsys):
    pytest.importorskip("matplotlib")
    bundle = bundle_factory("llama-tiny")
    plot = tmp_path / "held.png"
    rc, data = _bench_cli(bundle, tmp_path, genai_dir, "--held", "16,100", "--rounds", "2", "--threads", "1",
                          "--plot", str(plot))
    assert rc == 0
    printed = capsys.readouterr().out
    assert [h["held"] for h in data["held"]] == [16, 100]
    for row in data["held"]:
        assert set(row["engines"]) == {"foldline (cpu)", "llama.cpp", "ORT GenAI"}
        assert all(len(f["rounds"]) == 2 for f in row["engines"].values())
    assert "decode foldline (cpu) / ORT GenAI" in printed
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_llama_cpp_chat_gets_the_chat_warmup_then_reuses_its_prefix(stubs, tmp_path):
    from foldline.bench.chat import bench_chat_llama_cpp, chat_script, chat_warmup

    script = chat_script(64, 3, 5, 3, seed=0)
    warmup = chat_warmup(64, 5, seed=0)
    figures = bench_chat_llama_cpp(str(_gguf(tmp_path)), script, warmup, 1, 256, True, python=sys.executable)
    evals = stubs.events("eval")
    first_reset = next(i for i, e in enumerate(stubs.events()) if e["event"] == "reset")
    before = [e["n"] for e in stubs.events()[:first_reset] if e["event"] == "eval"]
    assert before == [5] + [1] * WARMUP_DECODE_STEPS
    assert figures["warmup"] == {"prefill_tokens": 5, "decode_steps": WARMUP_DECODE_STEPS}
    assert [t["prefilled"] for t in figures["turns"]] == [5, 6, 6]  # the new user tokens and the last answer
    assert len(evals) == len(before) + sum(1 + len(t["reply"]) - 1 for t in script)
    [init] = stubs.events("init")
    assert init["flash_attn"] is True and init["n_ctx"] == 256
