"""`foldline plan --devices`: parameters from the config, the per-device split, the fit, the errors."""

from __future__ import annotations

import itertools
import math
import random
import re
from pathlib import Path

import pytest

from foldline.contract.state import STATE_KINDS
from foldline.frontend.arch import PRESETS, get_preset
from foldline.frontend.model import build_model, skeleton
from foldline.passes.shard_plan import (
    STATE_SPLITS,
    _balanced_runs,
    all_reduce_sends,
    deal,
    parameter_count,
    parse_size,
    read_by,
    shard_plan,
    smallest_fit,
    weight_parts,
)
from foldline.passes.state_layout import plan_state
from foldline.tools.cli import main

GIB = 1024**3
MI = 1048576
TINY = [name for name, factory in PRESETS.items() if not factory().planning_only]
DOCS = Path(__file__).resolve().parents[2] / "docs"


def module_parameters(model) -> dict[str, int]:
    return {name: p.numel() for name, p in model.named_parameters()}


def config_parameters(cfg) -> dict[str, int]:
    """weight_parts per module parameter (a tensor split two ways is listed as name[part])."""
    out: dict[str, int] = {}
    for p in weight_parts(cfg):
        name = p.name.split("[")[0]
        out[name] = out.get(name, 0) + p.params
    return out


@pytest.mark.parametrize("name", TINY)
def test_parameter_count_equals_the_modules(name):
    cfg = get_preset(name)
    model = build_model(cfg)
    assert parameter_count(cfg) == sum(p.numel() for p in model.parameters())
    assert config_parameters(cfg) == module_parameters(model)  # tensor by tensor, not only the sum


def test_parameter_count_covers_gdn_and_ripple_extras():
    assert {n for n in TINY if "gdn" in get_preset(n).layer_types}, "no tiny preset with GDN layers"
    ripple = config_parameters(get_preset("ripple-tiny"))
    assert "layers.0.mixer.value_lambda" in ripple and "layers.0.mixer.gate_proj.weight" in ripple
    qwen = config_parameters(get_preset("qwen35-tiny"))
    assert "layers.0.mixer.conv1d_weight" in qwen and "layers.0.mixer.A_log" in qwen


def test_parameter_count_of_the_planning_only_config():
    """ripple-65b is never built with weights: its module on the meta device has the same parameters."""
    cfg = get_preset("ripple-65b")
    assert config_parameters(cfg) == module_parameters(skeleton(cfg))
    assert parameter_count(cfg) == 64_782_689_360


def test_every_state_kind_has_a_split_rule():
    assert set(STATE_SPLITS) == set(STATE_KINDS)


def ripple_replicated_bytes(cfg) -> int:
    """Per device: four peri norms per layer, q/k norms, the value-residual scalar, the final norm (bf16)."""
    per_layer = 4 * cfg.hidden_size + 2 * cfg.head_dim + 1
    return 2 * (cfg.num_layers * per_layer + cfg.hidden_size)


def test_ripple_65b_eight_devices_adds_up():
    cfg = get_preset("ripple-65b")
    plan = shard_plan(cfg, 8, 1, MI)
    one = plan.one_device
    assert one.weights == 2 * parameter_count(cfg)
    assert one.state == plan_state(cfg, 1, MI).total_bytes == int(64.25 * GIB)
    # 80 query heads, 8 KV heads: 10 and 1 per device, nothing copied but the norms and scalars.
    assert all(d.state * 8 == one.state for d in plan.devices)
    assert sum(d.weights for d in plan.devices) == one.weights + 7 * ripple_replicated_bytes(cfg)
    assert plan.weight_copies == 7 * ripple_replicated_bytes(cfg) and plan.state_copies == 0
    assert all(d.attention_scratch * 8 == one.attention_scratch for d in plan.devices)
    assert len({d.total for d in plan.devices}) == 1


def test_ripple_65b_eight_devices_cli(capsys):
    assert main(["plan", "ripple-65b", "--devices", "8", "--context", "1048576"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\s+(\d+)\s+(\S+ \S+)\s+(\S+ \S+)\s+(\S+ \S+)\s+(\S+ \S+)$", out, flags=re.M)
    assert [r[0] for r in rows] == [str(i) for i in range(8)]
    assert {r[2] for r in rows} == {"8.03 GiB"}  # 64.25 GiB / 8
    held = re.search(r"held beyond one device: .* of weights \(([\d,]+) bytes\), .* of state \(([\d,]+) bytes\)", out)
    assert held, out
    assert int(held.group(1).replace(",", "")) == 7 * ripple_replicated_bytes(get_preset("ripple-65b"))
    assert held.group(2) == "0"
    assert "160 reductions" in out  # 2 x 80 layers
    assert "state buffers after the default pipeline" not in out


def test_kv_heads_replicated_beyond_their_count():
    """16 devices, 8 KV heads: each KV head's weights and cache are held twice, and the plan says so."""
    cfg = get_preset("ripple-65b")
    eight, sixteen = shard_plan(cfg, 8, 1, MI), shard_plan(cfg, 16, 1, MI)
    assert all(d.state == eight.devices[0].state for d in sixteen.devices)
    assert sixteen.state_copies == sixteen.one_device.state
    kv_weights_per_head = cfg.num_layers * 2 * cfg.hidden_size * cfg.head_dim * 2
    assert sixteen.weight_copies == 15 * ripple_replicated_bytes(cfg) + 8 * kv_weights_per_head
    assert any("8 KV heads cannot split 16 ways: 8 copies held" in n for n in sixteen.notes)


def test_gdn_state_splits_by_heads():
    cfg = get_preset("qwen35-tiny")
    one = plan_state(cfg, 1, 128).total_bytes
    two = shard_plan(cfg, 2, 1, 128)  # 4 query / 2 KV heads, 4 value / 2 key heads: no copies
    assert [d.state for d in two.devices] == [one // 2, one // 2] and two.state_copies == 0
    eight = shard_plan(cfg, 8, 1, 128)  # 2 KV heads and 2 key heads each held by two devices
    kv_head = 2 * 128 * cfg.head_dim * 4 * len(cfg.layers_of("global"))  # k and v, every slot, f32
    conv_key_head = 2 * cfg.gdn_head_k_dim * (cfg.gdn_conv_kernel - 1) * 4 * len(cfg.layers_of("gdn"))
    assert eight.state_copies == 2 * kv_head + 2 * conv_key_head
    assert sum(d.state for d in eight.devices) == one + eight.state_copies


def test_read_by_counts_the_shared_heads_each_device_needs():
    assert read_by(deal(80, 8), 80, 8).per_device == (1,) * 8
    assert read_by(deal(80, 16), 80, 8).per_device == (1,) * 16
    assert read_by(deal(80, 3), 80, 8).per_device == (3, 4, 3)  # query heads 0-26, 27-53, 54-79
    assert read_by(deal(4, 8), 4, 2).per_device == (1, 1, 1, 1, 0, 0, 0, 0)


def test_weight_bits_plan_quantized_matrices():
    cfg = get_preset("ripple-65b")
    plan = shard_plan(cfg, 1, 1, MI, weight_bits=4.5)
    parts = weight_parts(cfg)
    matrices = sum(p.params for p in parts if p.matrix)
    vectors = sum(p.params for p in parts if not p.matrix)
    assert vectors == ripple_replicated_bytes(cfg) // 2
    assert plan.one_device.weights == math.ceil(matrices * 9 / 16 + vectors * 2)


def test_smallest_fit_flips_at_the_largest_device(capsys):
    cfg = get_preset("ripple-65b")
    four, eight = shard_plan(cfg, 4, 1, MI).largest, shard_plan(cfg, 8, 1, MI).largest
    assert four > eight
    assert smallest_fit(cfg, eight, 1, MI) == 8
    assert smallest_fit(cfg, eight - 1, 1, MI) == 16
    assert smallest_fit(cfg, four, 1, MI) == 4

    def answer(memory: int) -> str:
        assert main(["plan", "ripple-65b", "--devices", "8", "--context", "1048576",
                     "--device-memory", str(memory), "--attention", "decomposed"]) == 0
        line = re.search(r"^fits in .*$", capsys.readouterr().out, flags=re.M)
        assert line
        return line.group(0)

    assert re.search(r": yes .*smallest N that fits: 8 ", answer(eight))
    assert re.search(r": no .*smallest N that fits: 16 ", answer(eight - 1))
    assert "smallest N that fits: none up to 64" in answer(1024)


def test_fused_attention_scratch_does_not_grow_with_the_context(capsys):
    """The fused form's scratch is the masked two tiles' softmax per query head and chunk row: the same at
    4096 positions and at 1 Mi, split with the heads; `plan --devices` sizes it so for CUDA, whose form it
    is by default, and sizes the decomposed form for the CPU, whose default that is."""
    cfg = get_preset("ripple-65b")
    short, long = (shard_plan(cfg, 8, 1, n, fused_attention=True) for n in (4096, MI))
    # 10 query heads and 1 KV head a device, chunk 64, two tiles of 64 keys
    per_device = 4 * (2 * 10 * 64 * 128 + 2 * 1 * 128 * cfg.head_dim)
    assert all(d.attention_scratch == per_device for d in short.devices + long.devices)
    assert long.one_device.attention_scratch == 8 * per_device
    decomposed = shard_plan(cfg, 8, 1, MI)
    assert decomposed.devices[0].attention_scratch > 10_000 * per_device
    batched = shard_plan(cfg, 8, 2, MI, fused_attention=True)  # rows apart: the mask over every key
    assert batched.devices[0].attention_scratch == 4 * 2 * 10 * 64 * MI
    assert main(["plan", "ripple-65b", "--devices", "8", "--context", "1048576", "--target", "cuda"]) == 0
    table = capsys.readouterr().out
    assert re.search(r"^\s+0\s+15\.09 GiB\s+8\.03 GiB\s+[\d.]+ MiB", table, flags=re.M), table
    assert main(["plan", "ripple-65b", "--devices", "8", "--context", "1048576"]) == 0
    table = capsys.readouterr().out
    assert re.search(r"^\s+0\s+15\.09 GiB\s+8\.03 GiB\s+[\d.]+ GiB", table, flags=re.M), table


def test_pipeline_holds_every_layer_once():
    cfg = get_preset("ripple-65b")
    plan = shard_plan(cfg, 6, 1, MI, scheme="pipeline")
    runs = [d.layers for d in plan.devices]
    assert runs[0][0] == 0 and runs[-1][1] == cfg.num_layers - 1
    assert all(b[0] == a[1] + 1 for a, b in itertools.pairwise(runs))
    assert sum(d.weights for d in plan.devices) == plan.one_device.weights
    assert sum(d.state for d in plan.devices) == plan.one_device.state
    assert plan.traffic.total == 5 * 2 * cfg.hidden_size * 2  # the hidden and the embedded row per boundary


def test_pipeline_copies_a_tied_head():
    cfg = get_preset("llama-tiny")
    assert cfg.tie_word_embeddings
    plan = shard_plan(cfg, 3, 1, 128, scheme="pipeline")
    assert plan.weight_copies == cfg.vocab_size * cfg.hidden_size * 4
    assert shard_plan(cfg, 1, 1, 128, scheme="pipeline").weight_copies == 0


def test_balanced_runs_are_optimal():
    rng = random.Random(0)
    for _ in range(200):
        costs = [rng.randint(1, 50) for _ in range(rng.randint(1, 9))]
        n = rng.randint(1, len(costs))
        runs = _balanced_runs(costs, n)
        assert len(runs) == n and runs[0][0] == 0 and runs[-1][1] == len(costs) - 1
        assert all(a <= b for a, b in runs) and all(b[0] == a[1] + 1 for a, b in itertools.pairwise(runs))
        best = min(
            max(sum(costs[a:b]) for a, b in itertools.pairwise((0, *cuts, len(costs))))
            for cuts in itertools.combinations(range(1, len(costs)), n - 1)
        )
        assert max(sum(costs[a:b + 1]) for a, b in runs) == best


def test_traffic_per_decode_step():
    cfg = get_preset("ripple-65b")
    hidden = cfg.hidden_size * 2
    plan = shard_plan(cfg, 8, 1, MI)
    logits = cfg.vocab_size // 8 * 4  # each device's rows of the logits, to device 0
    # device 0: the normed row to the 7 others per mixer and MLP (160) and for the head, and Ripple's embedded
    # row; each other device: its looked-up embedding row, its 160 partial rows, its logits rows
    assert plan.traffic.sent == (162 * 7 * hidden,) + (161 * hidden + logits,) * 7
    assert plan.traffic.per_device == 162 * 7 * hidden
    assert shard_plan(cfg, 1, 1, MI).traffic.per_device == 0


def test_a_reduction_moves_rows_only_to_and_from_devices_holding_parts():
    """Device 0 sends the normed row to each other device holding a part, each of those its partial row
    back; a device without a part of the layer (more devices than heads) neither."""
    assert all_reduce_sends(10, 3, (True, True, True)) == (20, 10, 10)
    assert all_reduce_sends(10, 3, (True, False, True)) == (10, 0, 10)
    assert all_reduce_sends(10, 1, (True,)) == (0,)


def test_parse_size():
    assert parse_size("24GiB") == 24 * GIB
    assert parse_size("80GB") == 80 * 10**9
    assert parse_size("1.5 TiB") == 3 * 2**39
    assert parse_size("123") == 123
    for bad in ("0", "eighty", "80XB", "-5GB", "GB", ""):
        with pytest.raises(ValueError, match="--device-memory"):
            parse_size(bad)


@pytest.mark.parametrize("argv,needle", [
    (["--devices", "0"], "argument --devices: must be a positive integer"),
    (["--devices", "-2"], "argument --devices: must be a positive integer"),
    (["--devices", "8", "--device-memory", "80XB"], "--device-memory '80XB'"),
    (["--device-memory", "80GB"], "only with --devices"),
    (["--attention", "decomposed"], "only with --devices"),
    (["--devices", "4", "--weight-bits", "0"], "--weight-bits"),
    (["--devices", "81", "--scheme", "pipeline"], "needs at least 81 layers"),
])
def test_plan_devices_errors(capsys, argv, needle):
    assert main(["plan", "ripple-65b", *argv]) == 2
    captured = capsys.readouterr()
    assert needle in captured.err and captured.out == ""


def test_docs_show_the_commands_output(capsys):
    """docs/scaling.md's worked example is what the command prints today."""
    argv = ["plan", "ripple-65b", "--devices", "8", "--context", "1048576", "--device-memory", "80GB",
            "--target", "cuda"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    text = (DOCS / "scaling.md").read_text()
    assert "foldline " + " ".join(argv) in text
    assert out.strip() in text
