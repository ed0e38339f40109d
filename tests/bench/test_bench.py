"""foldline bench: figures for the compiled bundle and its peers, side by side."""

from __future__ import annotations

import json
import os

import pytest

from foldline.bench.engines import prompt_ids
from foldline.bench.tables import best_of_threads, combine_rounds, format_table, round_ratios
from foldline.tools.cli import main


def test_prompt_ids_are_deterministic_and_in_range():
    a = prompt_ids(49152, 128, seed=0)
    assert a == prompt_ids(49152, 128, seed=0) and a != prompt_ids(49152, 128, seed=1)
    assert len(a) == 128 and min(a) >= 1000 and max(a) < 49152


def test_an_also_bundle_runs_the_same_cpu_module_as_the_benched_one():
    """`--cpu x86-64-v3 --also OTHER`: OTHER runs its AVX2 module too, not the one the host would pick;
    a bundle without that module is refused by name, and a bundle on another device is not pinned."""
    from types import SimpleNamespace

    from foldline.bench.child import BenchError
    from foldline.bench.modes import also_cpu, also_label

    def bundle(*cpus):
        modules = {f"cpu-{c}": SimpleNamespace(cpu=c) for c in cpus}
        return SimpleNamespace(root="old", modules=modules,
                               module_keys=lambda device: list(modules) if device == "cpu" else [])

    assert also_cpu("old", bundle("znver4", "x86-64-v3"), "cpu", "x86-64-v3") == "x86-64-v3"
    assert also_cpu("old", bundle("znver4"), "cpu", None) is None
    assert also_cpu("old", bundle(), "onnxruntime", "x86-64-v3") is None
    with pytest.raises(BenchError, match="--also old: bundle old has no CPU module for --cpu x86-64-v3 \\(it has: znver4\\)"):
        also_cpu("old", bundle("znver4"), "cpu", "x86-64-v3")
    assert also_label("/tmp/old", "cpu", "x86-64-v3") == "foldline (cpu, x86-64-v3) old"


def _figures(decode: float, rss: float = 300.0) -> dict:
    return {"prefill_tok_s": 2 * decode, "decode_tok_s": decode, "prefill_cpu_ms_tok": 5.0,
            "decode_cpu_ms_tok": 1000 / decode, "peak_rss_mib": rss, "load_s": 1.0}


def test_table_has_one_ratio_column_per_peer_with_its_spread_over_rounds():
    compiled = combine_rounds([_figures(50.0), _figures(40.0), _figures(60.0)])
    llama = combine_rounds([_figures(25.0), _figures(25.0), _figures(20.0)])
    hf = combine_rounds([_figures(200.0)] * 3)
    table = format_table({"foldline": compiled, "llama.cpp": llama, "HF eager": hf}, 128, 128)
    lines = table.splitlines()
    assert lines[0].split()[-4:] == ["foldline", "/", "HF", "eager"]
    assert "foldline / llama.cpp" in lines[0]
    # decode: medians 50 / 25; by round 50/25, 40/25, 60/20
    assert lines[2].split()[-4:] == ["2.00x", "(1.60-3.00)", "0.25x", "(0.20-0.30)"]
    assert "decode tok/s (128 tokens)" in table
    assert "/" not in format_table({"foldline": compiled}, 128, 128).splitlines()[0]
    single = format_table({"foldline": combine_rounds([_figures(50.0)]), "llama.cpp": combine_rounds(
        [_figures(25.0)])}, 128, 128)
    assert single.splitlines()[2].split()[-1] == "2.00x", "one round: no spread to show"


def test_rounds_combine_into_medians_and_the_largest_peak_rss():
    ours = combine_rounds([_figures(100.0, 300), _figures(60.0, 320), _figures(110.0, 310)])
    assert ours["decode_tok_s"] == 100.0 and ours["prefill_tok_s"] == 200.0  # medians, not means
    assert ours["peak_rss_mib"] == 320
    assert [r["decode_tok_s"] for r in ours["rounds"]] == [100.0, 60.0, 110.0]
    peer = combine_rounds([_figures(50.0), _figures(60.0), _figures(55.0)])
    ratios = round_ratios({"foldline": ours, "llama.cpp": peer})
    assert ratios == {"llama.cpp": [2.0, 1.0, 2.0]}  # round by round, in the order they ran


def test_each_engine_is_reported_at_its_fastest_thread_count():
    best = best_of_threads({1: [_figures(30.0), _figures(32.0)], 2: [_figures(45.0), _figures(20.0)],
                            4: [_figures(40.0), _figures(41.0)]})
    assert best["threads"] == 4 and best["threads_tried"] == [1, 2, 4]  # by median: 31, 32.5, 40.5
    assert best["decode_tok_s"] == 40.5
    no_decode = _figures(10.0) | {"decode_tok_s": float("nan")}
    prefill_only = best_of_threads({1: [no_decode], 2: [no_decode | {"prefill_tok_s": 99.0}]})
    assert prefill_only["threads"] == 2, "nothing decoded: the fastest prefill"


def test_ort_genai_needs_its_builders_folder_and_is_reported_when_not_installed(tmp_path, monkeypatch):
    from foldline.bench.child import PeerUnavailable
    from foldline.bench.peers import bench_ort_genai

    model = tmp_path / "model"
    model.mkdir()
    with pytest.raises(FileNotFoundError, match="build_ort_genai_peer.py"):
        bench_ort_genai(model, [1, 2, 3], 2, 1)  # no genai_config.json: not a GenAI model folder
    (model / "genai_config.json").write_text("{}")
    # The child interpreter without onnxruntime-genai: a module of that name first on its path that is not there.
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "onnxruntime_genai.py").write_text("raise ModuleNotFoundError(\"No module named 'onnxruntime_genai'\")\n")
    monkeypatch.setenv("PYTHONPATH", str(shadow))
    with pytest.raises(PeerUnavailable, match="onnxruntime_genai"):
        bench_ort_genai(model, [1, 2, 3], 2, 1)


@pytest.mark.slow
def test_bench_cli_on_a_compiled_bundle(bundle_factory, tmp_path, capsys):
    bundle = bundle_factory("llama-tiny")
    out = tmp_path / "bench.json"
    rc = main(["bench", str(bundle), "--prompt-len", "20", "--new-tokens", "8", "--eager", "llama-tiny",
               "--rounds", "2", "--busy-ok", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "prefill tok/s (20 tokens)" in printed and "foldline (cpu) / reference eager" in printed
    assert "order by round: 1: " in printed
    data = json.loads(out.read_text())
    assert data["rounds"] == 2 and len(data["engines"]["reference eager"]["rounds"]) == 2
    for engine in ("foldline (cpu)", "reference eager"):
        figures = data["engines"][engine]
        assert figures["prefill_tok_s"] > 0 and figures["decode_tok_s"] > 0
        assert figures["peak_rss_mib"] > 10
        assert figures["warmup"] == {"prefill_tokens": 20, "decode_steps": 4}
    assert data["engines"]["foldline (cpu)"]["chunk"] == 16
    wall = data["memory_wall"]  # bench/memory_wall.py, measured in the same run
    assert wall["held"] == 20 + 8 // 2 and wall["dispatches_per_step"] > 0 and wall["weights_read_bytes"] > 0
    assert wall["decode_gb_s"] > 0 and len(wall["host_read_gb_s"]) == 5
    assert abs(wall["fraction"] - wall["decode_gb_s"] / max(wall["host_read_gb_s"])) < 1e-9
    assert f"{wall['dispatches_per_step']} dispatches per decode step" in printed
    assert "% of it" in printed


def test_a_peer_that_is_not_installed_is_reported_not_fatal(tmp_path):
    from foldline.bench.child import PeerUnavailable
    from foldline.bench.peers import bench_llama_cpp

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(PeerUnavailable, match="llama_cpp"):
        bench_llama_cpp(gguf, [1, 2, 3], 2, 1)  # this interpreter has no llama-cpp-python


@pytest.mark.slow
def test_bench_rejects_a_run_longer_than_the_context(bundle_factory, capsys):
    bundle = bundle_factory("llama-tiny")
    assert main(["bench", str(bundle), "--prompt-len", "100", "--new-tokens", "100"]) == 2
    assert "exceeds the bundle's max_context 128" in capsys.readouterr().err


@pytest.mark.slow
def test_chat_bench_prefills_only_the_new_tokens_with_the_cache(bundle_factory, tmp_path, capsys):
    """--chat: with the prompt cache a turn prefills its user tokens and the last answer (whose state the decode
    steps wrote, which a full cache does not serve); without it, the whole conversation."""
    bundle = bundle_factory("llama-tiny")
    out = tmp_path / "chat.json"
    assert main(["bench", str(bundle), "--chat", "4", "--prompt-len", "10", "--new-tokens", "5", "--rounds", "2",
                 "--busy-ok", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "a 4-turn chat, 10 new user tokens and 5 answer tokens per turn" in printed
    assert "median of 2 round(s)" in printed
    engines = json.loads(out.read_text())["chat"]
    assert all(len(e["rounds"]) == 2 for e in engines.values())
    cached, plain = engines["foldline"]["turns"], engines["foldline, no cache"]["turns"]
    assert [t["prompt"] for t in cached] == [t["prompt"] for t in plain] == [10, 25, 40, 55]
    assert [t["prefilled"] for t in cached] == [10, 15, 15, 15]
    assert [t["prefilled"] for t in plain] == [10, 25, 40, 55]
    assert all(0 < t["first_token_ms"] <= t["turn_ms"] for t in cached + plain)
    assert main(["bench", str(bundle), "--chat", "9", "--prompt-len", "10", "--new-tokens", "5"]) == 2
    assert "the chat takes 135 tokens; this bundle's context is 128" in capsys.readouterr().err


@pytest.mark.slow
def test_streams_bench_shares_module_calls_between_streams(bundle_factory, tmp_path, capsys):
    """--streams: streams submitted at once share every module call (a prompt within one chunk, then decode)."""
    bundle = bundle_factory("gemma3-tiny", batch=2)
    out = tmp_path / "streams.json"
    assert main(["bench", str(bundle), "--streams", "1,2", "--prompt-len", "8", "--new-tokens", "6", "--busy-ok",
                 "--json", str(out)]) == 0
    assert "6 greedy tokens per stream after a 8-token prompt" in capsys.readouterr().out
    results = json.loads(out.read_text())["streams"]
    assert [r["streams"] for r in results] == [1, 2] and all(r["rows"] == 2 for r in results)
    assert [r["module_calls"] for r in results] == [6, 6], "one call per token, for one stream or two"
    assert [r["tokens"] for r in results] == [6, 12], "every stream's callbacks received all its tokens"
    assert all(r["device_busy"] is None for r in results), "one device: no per-device figures"


@pytest.mark.slow
def test_streams_bench_reports_how_busy_each_device_kept_its_cores(bundle_factory, tmp_path, capsys):
    """A batched pipeline bundle over 2 CPU devices: each device's workers' CPU time over the wall time."""
    bundle = bundle_factory("qwen35-tiny", batch=2, devices=2)  # the one tests/backends/test_multi_device.py runs
    out = tmp_path / "streams.json"
    assert main(["bench", str(bundle), "--streams", "1,2", "--prompt-len", "8", "--new-tokens", "16", "--busy-ok",
                 "--json", str(out)]) == 0
    assert "busy cores per device" in capsys.readouterr().out
    for r in json.loads(out.read_text())["streams"]:
        busy = r["device_busy"]
        assert len(busy) == 2 and all(0 < b <= os.cpu_count() for b in busy), busy


def test_a_failing_child_names_the_engine():
    from foldline.bench.child import run_foldline

    with pytest.raises(RuntimeError, match=r"foldline \(bench_compiled\) benchmark failed"):
        run_foldline("engines", "bench_compiled", {"bundle": "/nonexistent", "device": "cpu", "prompt_len": 1,
                                                   "new_tokens": 1, "seed": 0})
