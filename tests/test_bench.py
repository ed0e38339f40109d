"""foldline bench: figures for the compiled bundle and torch eager, side by side."""

from __future__ import annotations

import json

import pytest

from foldline.tools.bench_cmd import format_table, prompt_ids
from foldline.tools.cli import main


def test_prompt_ids_are_deterministic_and_in_range():
    a = prompt_ids(49152, 128, seed=0)
    assert a == prompt_ids(49152, 128, seed=0) and a != prompt_ids(49152, 128, seed=1)
    assert len(a) == 128 and min(a) >= 1000 and max(a) < 49152


def test_table_has_ratios():
    compiled = {"prefill_tok_s": 200.0, "decode_tok_s": 50.0, "prefill_cpu_ms_tok": 5.0, "decode_cpu_ms_tok": 20.0,
                "peak_rss_mib": 300.0, "load_s": 1.0}
    eager = {k: v / 2 for k, v in compiled.items()}
    table = format_table(compiled, eager, 128, 128, "cpu")
    lines = table.splitlines()
    assert "torch eager" in lines[0] and "foldline / eager" in lines[0]
    assert lines[1].split()[-1] == "2.00x"  # prefill ratio
    assert "decode tok/s (128 tokens)" in table
    assert "torch eager" not in format_table(compiled, None, 128, 128, "cpu")


@pytest.mark.slow
def test_bench_cli_on_a_compiled_bundle(bundle_factory, tmp_path, capsys):
    bundle = bundle_factory("llama-tiny")
    out = tmp_path / "bench.json"
    rc = main(["bench", str(bundle), "--prompt-len", "20", "--new-tokens", "8", "--eager", "llama-tiny",
               "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "prefill tok/s (20 tokens)" in printed and "foldline / eager" in printed
    data = json.loads(out.read_text())
    for engine in ("compiled", "eager"):
        figures = data[engine]
        assert figures["prefill_tok_s"] > 0 and figures["decode_tok_s"] > 0
        assert figures["peak_rss_mib"] > 10
    assert data["compiled"]["chunk"] == 16


@pytest.mark.slow
def test_bench_rejects_a_run_longer_than_the_context(bundle_factory, capsys):
    bundle = bundle_factory("llama-tiny")
    assert main(["bench", str(bundle), "--prompt-len", "100", "--new-tokens", "100"]) == 2
    assert "exceeds the bundle's max_context 128" in capsys.readouterr().err
