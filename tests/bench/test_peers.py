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

    names = ["foldline (cpu)", "llama.cpp", "ORT GenAI int8"]
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


def test_every_table_names_the_cpu_and_the_kernel_form_it_runs():
    """The load line each table's header carries names the CPU and its best int8 kernel form (the ISA the
    bundle's module is chosen for), so a table read later says where it was measured."""
    from foldline.bench import host
    from foldline.contract.isa.registry import kernel_forms
    from foldline.runtime.device import host_arch, host_cpu_features

    described = host.check_host(busy_ok=True).describe()
    flags, arch = host_cpu_features() or set(), host_arch()
    best = next((f.name for f in kernel_forms(arch) if f.runs_on(flags, arch)), "float kernels")
    assert described.endswith(f"({best})") and " cores of " in described
    assert [f for f in kernel_forms(arch) if f.name in described] == [f for f in kernel_forms(arch) if f.name == best]


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
    names = ["foldline (cpu)", "llama.cpp", "ORT GenAI genai"]
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
        assert set(row["engines"]) == {"foldline (cpu)", "llama.cpp", "ORT GenAI genai"}
        assert all(len(f["rounds"]) == 2 for f in row["engines"].values())
    assert "decode foldline (cpu) / ORT GenAI genai" in printed
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


def _one_hot(vocab: int, hot: list[int]) -> np.ndarray:
    return np.eye(vocab, dtype=np.float32)[hot]


def test_accuracy_scores_known_logits_and_refuses_other_steps():
    from foldline.bench.accuracy import score
    from foldline.bench.child import BenchError

    reference = [_one_hot(4, [1, 2, 3])]
    assert score(reference, [reference[0].copy()]) == {"cosine_worst": 1.0, "cosine_mean": 1.0, "top1_agree": 3,
                                                       "steps": 3}
    ours = reference[0].copy()
    ours[1] = [0.0, 0.0, 0.6, 0.8]  # cosine 0.6 to the reference's step, and its top-1 is another token
    scored = score(reference, [ours])
    assert scored["cosine_worst"] == pytest.approx(0.6) and scored["top1_agree"] == 2
    assert scored["cosine_mean"] == pytest.approx((1 + 0.6 + 1) / 3)
    with pytest.raises(BenchError, match="shape"):
        score(reference, [ours[:2]])


def test_genai_accuracy_reads_every_steps_logits_teacher_forced(stubs, genai_dir):
    """GenAI is fed each prompt, then the reference's greedy tokens but the last, one at a time, in a generator per
    prompt; get_output('logits') of each call scored at its last token against the reference."""
    from foldline.bench.accuracy import genai_logits, measure

    (genai_dir / "genai_config.json").write_text(json.dumps({"model": {"vocab_size": 32}}))
    # The stand-in answers token t with one-hot logits at t + 1: after the prompt 6, then 10, 11; and 8.
    reference = {"prompts": [{"ids": [3, 4, 5], "greedy": [9, 10, 31]}, {"ids": [7], "greedy": [8]}],
                 "logits": [_one_hot(32, [6, 10, 12]), _one_hot(32, [8])]}
    scores = measure({"ORT GenAI genai": genai_logits(str(genai_dir), sys.executable, 64)}, reference)
    assert scores == {"ORT GenAI genai": {"cosine_worst": 0.0, "cosine_mean": 0.75, "top1_agree": 3, "steps": 4}}
    assert [e["tokens"] for e in stubs.events("append")] == [[3, 4, 5], [9], [10], [7]]
    assert len(stubs.events("generator")) == 2, "one fresh generator per prompt"


def test_a_reference_file_round_trips_and_a_bad_one_is_refused(tmp_path):
    from foldline.bench.accuracy import load_reference, save_reference
    from foldline.bench.child import BenchError

    reference = {"prompts": [{"ids": [1, 2], "greedy": [3, 4]}], "logits": [_one_hot(8, [3, 4])]}
    save_reference(tmp_path / "ref.npz", reference)
    loaded = load_reference(tmp_path / "ref.npz")
    assert loaded["prompts"] == reference["prompts"] and np.array_equal(loaded["logits"][0], reference["logits"][0])
    save_reference(tmp_path / "short.npz", {"prompts": reference["prompts"], "logits": [_one_hot(8, [3])]})
    with pytest.raises(BenchError, match="one logits row per greedy token"):
        load_reference(tmp_path / "short.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(BenchError, match="not a reference file"):
        load_reference(tmp_path / "junk.npz")


def test_genai_folders_are_named_by_their_folder_and_a_clash_is_refused(tmp_path):
    from foldline.bench.child import BenchError
    from foldline.bench.modes import genai_labels

    labels = genai_labels([str(tmp_path / "foldline"), str(tmp_path / "int8"), str(tmp_path / "int4-kquant")])
    assert list(labels) == ["ORT GenAI foldline", "ORT GenAI int8", "ORT GenAI int4-kquant"]
    with pytest.raises(BenchError, match="distinct names"):
        genai_labels([str(tmp_path / "a" / "int8"), str(tmp_path / "b" / "int8")])


def test_accuracy_of_a_model_without_shipped_prompts_needs_a_reference_file(tmp_path):
    from foldline.bench.accuracy import hf_reference, shipped_name
    from foldline.bench.child import BenchError

    assert shipped_name("/somewhere/SmolLM2-135M-Instruct.Q4_1.gguf") == "smollm2-135m"
    with pytest.raises(BenchError, match="not a shipped model .* give a reference file: --accuracy REF.npz"):
        hf_reference(str(_gguf(tmp_path)))


def test_accuracy_outside_the_prompt_bench_is_refused_in_one_line(capsys):
    assert main(["bench", "no-bundle", "--accuracy", "--held", "128"]) == 2
    assert "--accuracy goes with the prompt bench" in capsys.readouterr().err


def test_the_table_holds_each_engines_accuracy_in_its_column():
    from foldline.bench.tables import format_table

    def figures(**extra):
        base = {"prefill_tok_s": 100.0, "decode_tok_s": 50.0, "prefill_cpu_ms_tok": 1.0, "decode_cpu_ms_tok": 2.0,
                "peak_rss_mib": 300.0, "load_s": 0.5, "threads": 2, "rounds": [{"decode_tok_s": 50.0}]}
        return {**base, **extra}

    engines = {"foldline (cpu)": figures(cosine_worst=0.9923, cosine_mean=0.998, top1_agree=47, steps=48),
               "llama.cpp": figures(),
               "HF eager": figures(accuracy_reference=True),
               "ORT GenAI int8": figures(cosine_worst=0.9846, cosine_mean=0.995, top1_agree=46, steps=48)}
    rows = {line.split("  ")[0]: line.split() for line in format_table(engines, 100, 128).splitlines()}
    worst = rows["cosine to HF eager, worst of 48 steps"]
    assert worst[-4:] == ["0.9923", "-", "ref", "0.9846"]
    assert rows["top-1 = HF eager"][-4:] == ["47/48", "-", "ref", "46/48"]
    assert "cosine to HF eager, mean" in rows
    assert not any(k.startswith("cosine") for k in
                   (line.split("  ")[0] for line in format_table({"foldline (cpu)": figures()}, 100, 128).splitlines()))


@pytest.mark.slow
def test_bench_times_and_scores_several_genai_folders_side_by_side(bundle_factory, stubs, tmp_path, capsys):
    """foldline's bundle and two GenAI folders in one run, with --accuracy: each folder its own column in the order
    given, every engine scored against the reference (here the bundle's own logits: it scores 1.0), the first folder
    compared with the other, and how each folder was made printed under the table."""
    from foldline.bench.accuracy import bundle_logits, save_reference
    from foldline.contract.manifest import Manifest

    bundle = bundle_factory("llama-tiny")
    vocab = Manifest.load(bundle).vocab_size
    folders = []
    for name in ("foldline-export", "builder-int8"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "genai_config.json").write_text(json.dumps({"model": {"vocab_size": vocab}}))
        folders.append(folder)
    (folders[1] / "peer_build.json").write_text(json.dumps(
        {"built_by": "onnxruntime_genai.models.builder 0.18.0", "variant": "int8", "precision": "int8",
         "extra_options": ["accuracy_level=4"]}))
    prompts = [([5, 6, 7, 8], [9, 10]), ([11], [12])]
    bundle_logits(str(bundle), "cpu", None)(prompts, str(tmp_path / "own.npz"))
    with np.load(tmp_path / "own.npz") as z:
        own = [z["logits0"], z["logits1"]]
    reference = {"prompts": [{"ids": [5, 6, 7, 8], "greedy": [9, 10, 3]}, {"ids": [11], "greedy": [12, 3]}],
                 "logits": own}
    save_reference(tmp_path / "ref.npz", reference)
    out = tmp_path / "bench.json"
    rc = main(["bench", str(bundle), "--ort-genai", str(folders[0]), "--ort-genai", str(folders[1]),
               "--genai-python", sys.executable, "--accuracy", str(tmp_path / "ref.npz"), "--new-tokens", "4",
               "--prompt-len", "8", "--rounds", "2", "--threads", "1", "--busy-ok", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    engines = json.loads(out.read_text())["engines"]
    assert list(engines) == ["foldline (cpu)", "ORT GenAI foldline-export", "ORT GenAI builder-int8"]
    assert engines["foldline (cpu)"]["cosine_worst"] == pytest.approx(1.0, abs=1e-6)
    assert engines["foldline (cpu)"]["top1_agree"] == engines["foldline (cpu)"]["steps"] == 5
    # the stand-in's one-hot logits at token + 1, scored against the bundle's own
    stand_in = [_one_hot(vocab, [8 + 1, 9 + 1, 10 + 1]), _one_hot(vocab, [11 + 1, 12 + 1])]
    expected = score_of(own, stand_in)
    for name in ("ORT GenAI foldline-export", "ORT GenAI builder-int8"):
        assert engines[name]["cosine_worst"] == pytest.approx(expected["cosine_worst"], abs=1e-6)
        assert engines[name]["top1_agree"] == expected["top1_agree"]
        assert len(engines[name]["rounds"]) == 2
    assert "cosine to HF eager, worst of 5 steps" in printed and "top-1 = HF eager" in printed
    assert "ORT GenAI foldline-export / ORT GenAI builder-int8: decode " in printed
    assert "made by: onnxruntime_genai.models.builder 0.18.0, variant int8: -p int8 accuracy_level=4" in printed
    assert "made by: not recorded" in printed


def score_of(reference: list[np.ndarray], logits: list[np.ndarray]) -> dict:
    from foldline.bench.accuracy import score

    return score(reference, logits)
