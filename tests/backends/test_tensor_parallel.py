"""Tensor-parallel bundles (`foldline compile --devices N --scheme tensor`): the split, its placement, parity.

How heads are dealt into parts against `foldline plan`'s counts; the split
model against the whole one in eager; the checkpoint's blocks cut with their
weights; the placed programs against the unplaced ones; the tiny presets on 2
CPU devices against eager and against one device; the state each device holds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from foldline.contract.tensor_split import deal_counts, head_parts, shared_head, tensor_state
from foldline.frontend.arch import get_preset
from foldline.frontend.config import ConfigError
from foldline.frontend.deferred_weights import blocks_of, defer, materialize
from foldline.frontend.model import build_model, new_state
from foldline.frontend.quant import quantize
from foldline.frontend.tensor_parallel import split_model
from foldline.passes.manager import run_pipeline
from foldline.passes.place_devices import PLACED, SOURCE_DEVICE, TO_DEVICE
from foldline.passes.shard_plan import deal, read_by, shard_plan
from foldline.runtime import Model
from foldline.testing.golden import compare_units, copy_unit, make_steps
from foldline.testing.parity import SCALED_TOL_FP32, batches_differ, run_parity

from backends.test_multi_device import BATCH_FEEDS, TWO_DEVICE_BATCH
from kernels.test_avx2_kernels import SCALED_TOL_INT8

PRESETS = ["llama-tiny", "gemma3-tiny", "qwen35-tiny", "ripple-tiny"]
PROMPT = list(range(3, 43))  # 40 tokens: several prefill chunks, windows of 16 wrapped twice


@pytest.mark.parametrize("n_query,n_shared,mapping,devices", [
    (9, 3, "blocked", 2),  # SmolLM2: a KV head's query heads on both devices
    (4, 1, "blocked", 2),  # gemma3-tiny: one KV head, held by both
    (8, 4, "interleaved", 2), (8, 2, "interleaved", 4), (80, 8, "blocked", 3), (4, 2, "blocked", 8),
])
def test_parts_hold_every_head_once_and_each_device_the_kv_heads_the_plan_counts(n_query, n_shared, mapping,
                                                                                  devices):
    parts = head_parts(n_query, n_shared, mapping, devices)
    assert sorted(h for p in parts for h in p.query) == list(range(n_query))
    queries = deal(n_query, devices)
    for j in range(devices):
        mine = [p for p in parts if p.device == j]
        assert sum(len(p.query) for p in mine) == queries.per_device[j]
        held = sum(len(p.shared) for p in mine)
        assert held == read_by(queries, n_query, n_shared).per_device[j]
    for p in parts:  # each part is a plain blocked attention over its own heads
        group = len(p.query) // len(p.shared)
        assert group * len(p.shared) == len(p.query)
        for i, h in enumerate(p.query):
            assert shared_head(h, n_query, n_shared, mapping) == p.shared[i // group]


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("devices", [2, 3])
def test_the_split_model_computes_the_whole_model(preset, devices, torch_one_thread):
    """Eager, prefill then decode: the parts' sum is the whole layer up to float rounding, and the state is
    every part's buffers; the whole model is left as it was."""
    cfg = get_preset(preset)
    whole = build_model(cfg, seed=1)
    before = {k: v.clone() for k, v in whole.state_dict().items()}
    split, _ = split_model(whole, {}, devices)
    specs = split.state_specs(1)
    assert [s.name for s in specs] == [b.name for b, _ in tensor_state(cfg.to_dict(), 1, devices)]
    tokens = torch.tensor([PROMPT[:12]])
    state_a, state_b = new_state(cfg, 1), new_state(cfg, 1, specs)
    with torch.no_grad():
        for chunk, start in ((tokens, 0), (tokens[:, :1], 12), (tokens[:, 5:6], 13)):
            args = (chunk, torch.tensor([start]), torch.tensor([chunk.shape[1]]))
            a, b = whole(*args, *state_a), split(*args, *state_b)
            assert (a - b).abs().max() <= 1e-5 * a.abs().max(), preset
    assert all(torch.equal(before[k], v) for k, v in whole.state_dict().items())


def test_parts_keep_the_checkpoints_blocks():
    """Rows cut from blocks, and columns in whole groups, are the blocks of the cut weight; columns that cut
    a group leave the part's weight as floats, equal to the whole weight's columns."""
    cfg = get_preset("llama-tiny")  # 4 heads of 16, 2 KV heads, 160 MLP features
    model = build_model(cfg, seed=1)
    blocks = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and name.startswith("layers.0."):
                blocks[name] = quantize(p.numpy(), "q4" if "mlp" in name else "q8", 32)
                p.copy_(torch.from_numpy(blocks[name].dequantize()))
    mlp = model.layers[0].mlp
    mlp.down_proj.weight = defer(tuple(mlp.down_proj.weight.shape), blocks["layers.0.mlp.down_proj.weight"])
    down = mlp.down_proj.weight
    split, part_blocks = split_model(model, blocks, 2)
    layer = split.layers[0]
    assert len(layer.mixer.parts) == 2 and len(layer.mlp.parts) == 2
    for j, part in enumerate(layer.mixer.parts):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            key = f"layers.0.mixer.parts.{j}.{name}.weight"
            assert key in part_blocks, key  # o_proj: 2 heads of 16 columns = one group of 32
            np.testing.assert_array_equal(part_blocks[key].dequantize(), getattr(part, name).weight.detach().numpy())
        np.testing.assert_array_equal(part.o_proj.weight.detach().numpy(),
                                      model.layers[0].mixer.o_proj.weight.detach()[:, 32 * j: 32 * j + 32].numpy())
    # down_proj: 80 features per part is not whole groups of 32: floats, the whole weight's columns
    assert not any(k.startswith("layers.0.mlp.parts.") and "down_proj" in k for k in part_blocks)
    assert blocks_of(down) is None  # made to be cut
    for j, part in enumerate(layer.mlp.parts):
        np.testing.assert_array_equal(part.down_proj.weight.detach().numpy(),
                                      blocks["layers.0.mlp.down_proj.weight"].dequantize()[:, 80 * j: 80 * j + 80])
        assert f"layers.0.mlp.parts.{j}.gate_proj.weight" in part_blocks
    assert "layers.1.mixer.parts.0.q_proj.weight" not in part_blocks  # layer 1 had no blocks


@pytest.mark.parametrize("preset", ["gemma3-tiny", "qwen35-tiny"])  # a tied head, an untied one
def test_the_tables_split_by_vocabulary_rows_with_their_blocks(preset):
    """Each device holds its run of the embedding's rows (and of an untied head's), cut from the checkpoint's
    blocks; the whole tables are gone from the split model and its blocks."""
    cfg = get_preset(preset)
    model = build_model(cfg, seed=1)
    names = ["embed_tokens.weight"] + ([] if cfg.tie_word_embeddings else ["lm_head.weight"])
    blocks = {name: quantize(model.get_parameter(name).detach().numpy(), "q8", 32) for name in names}
    split, part_blocks = split_model(model, blocks, 3)
    assert not set(names) & set(part_blocks) and not set(names) & {n for n, _ in split.named_parameters()}
    runs = [range(0, 171), range(171, 342), range(342, 512)]  # 512 rows dealt 171, 171, 170
    for j, run in enumerate(runs):
        assert split.vocab[j].start == run.start
        for whole, part in (("embed_tokens.weight", f"vocab.{j}.weight"), ("lm_head.weight", f"vocab_head.{j}.weight")):
            if whole not in blocks:
                assert not hasattr(split, "vocab_head")
                continue
            np.testing.assert_array_equal(part_blocks[part].dequantize(), blocks[whole].dequantize()[run.start:run.stop])
            np.testing.assert_array_equal(split.get_parameter(part).detach().numpy(),
                                          model.get_parameter(whole).detach().numpy()[run.start:run.stop])


def test_deferred_weights_stay_deferred_in_their_parts():
    cfg = get_preset("llama-tiny")
    model = build_model(cfg, seed=1)
    q = model.layers[1].mixer.q_proj
    blocks = quantize(q.weight.detach().numpy(), "q8", 32)
    q.weight = defer(tuple(q.weight.shape), blocks)
    split, part_blocks = split_model(model, {"layers.1.mixer.q_proj.weight": blocks}, 2)
    part = split.layers[1].mixer.parts[1].q_proj.weight
    assert blocks_of(part) is part_blocks["layers.1.mixer.parts.1.q_proj.weight"]
    assert blocks_of(q.weight) is blocks  # the whole model's weight was not made
    np.testing.assert_array_equal(materialize(part).detach().numpy(), blocks.dequantize()[32:])


def test_a_projection_that_is_not_plain_is_refused():
    class Rotated(nn.Linear):
        pass

    model = build_model(get_preset("llama-tiny"), seed=1)
    old = model.layers[2].mixer.o_proj
    model.layers[2].mixer.o_proj = Rotated(old.in_features, old.out_features, bias=False)
    with pytest.raises(ConfigError, match=r"layers\.2\.mixer\.o_proj is a Rotated: .*--scheme pipeline"):
        split_model(model, {}, 2)


def _tensor_unit(preset: str, devices: int = 2):
    from foldline.frontend.export import export_model
    from foldline.passes.manager import CompileUnit

    split, _ = split_model(build_model(get_preset(preset), seed=1), {}, devices)
    with torch.no_grad():
        entries = export_model(split, 1, 8)
    unit = CompileUnit(get_preset(preset), {n: e.program for n, e in entries.items()}, entries["prefill"].state_specs)
    run_pipeline(unit, progress=lambda _m: None)
    placed = copy_unit(unit)
    placed.options.update(devices=devices, scheme="tensor")
    run_pipeline(placed, ["place-on-devices"], progress=lambda _m: None)
    return unit, placed


def _sent(program) -> tuple[list[int], list]:
    """Bytes each device sends in one call of a placed program (its moves of computed values, by source
    device), and the entry point's inputs it moves."""
    sent, inputs = [0, 0], []
    for node in program.graph.nodes:
        if node.target == TO_DEVICE:
            value = node.args[0].meta["val"]
            if node.args[0].op == "placeholder":
                inputs.append(value)
            else:
                sent[node.meta[SOURCE_DEVICE]] += value.numel() * value.element_size()
    return sent, inputs


@pytest.mark.parametrize("preset", ["gemma3-tiny", "qwen35-tiny"])
def test_placement_moves_the_bytes_the_plan_prices_and_changes_no_value(preset, torch_one_thread):
    """The bytes each device sends per decode step, summed over the placed program's moves, are
    `foldline plan --scheme tensor`'s: per mixer and MLP the normed row to device 1 and device 1's partial
    row back, device 1's looked-up embedding row, the final normed row out and device 1's half of the
    logits back; a prefill chunk of 8 moves 8 rows where a row per token moves. Besides, only the integer
    inputs (token ids, positions) move. The placed programs compute exactly what the unplaced ones do."""
    unit, placed = _tensor_unit(preset)
    placement = placed.options[PLACED]
    cfg = unit.config
    assert placement.scheme == "tensor" and placement.result == 0
    assert placement.state == [d for _, d in tensor_state(cfg.to_dict(), 1, 2)]
    plan = shard_plan(cfg, 2, scheme="tensor").traffic
    row = cfg.hidden_size * 4  # float32
    blocks = 2 * cfg.num_layers
    assert list(plan.sent) == [(blocks + 1) * row, (blocks + 1) * row + deal_counts(cfg.vocab_size, 2)[1] * 4]
    decode, decode_inputs = _sent(placed.programs["decode"])
    assert decode == list(plan.sent)
    prefill, prefill_inputs = _sent(placed.programs["prefill"])
    assert prefill == [decode[0] + 7 * blocks * row, decode[1] + 7 * (blocks + 1) * row]  # the head: one row
    assert all(not v.dtype.is_floating_point and v.numel() <= 8 for v in decode_inputs + prefill_inputs)
    report = compare_units(unit, placed, make_steps([40], chunk=8, decode_steps=6, vocab_size=cfg.vocab_size))
    assert report.worst_logit_error == 0.0 and report.worst_state_error == 0.0, report


@pytest.mark.parametrize("preset", PRESETS)
def test_tensor_parallel_on_two_devices_matches_eager_and_one_device(preset, bundle_factory):
    """Greedy decoding through 40 tokens with every layer split over 2 CPU devices: eager's logits within
    fp32 tolerance, the one-device bundle's tokens. qwen35-tiny's bundle is its batch-2 one (TWO_DEVICE_BATCH), run
    through its one-row functions."""
    loaded = load_model_once(preset)
    two = Model.load(bundle_factory(preset, devices=2, scheme="tensor", batch=TWO_DEVICE_BATCH.get(preset, 1)))
    assert two.manifest.placement.scheme == "tensor" and len(two.ctx.devices) == 2
    report = run_parity(loaded.module, two, PROMPT, steps=40)
    assert report.worst_scaled_error < SCALED_TOL_FP32, report
    assert report.compiled_tokens == report.eager_tokens
    one = Model.load(bundle_factory(preset))
    assert list(one.session().generate_ids(PROMPT, 24)) == list(two.session().generate_ids(PROMPT, 24))


def load_model_once(preset: str):
    from foldline.frontend.sources import load_model

    return load_model(preset)


def test_each_device_holds_the_state_the_tensor_plan_gives_it(bundle_factory, capsys):
    """gemma3-tiny's one KV head is held by both devices, as `foldline plan --scheme tensor` counts it; the
    runtime allocates each part's buffers on its device; `foldline inspect` says so."""
    from foldline.tools.cli import main

    bundle = bundle_factory("gemma3-tiny", devices=2, scheme="tensor")
    model = Model.load(bundle)
    session = model.session()
    session.prefill(PROMPT[:5])
    held = [0, 0]
    for i, (spec, buf) in enumerate(zip(model.manifest.state, session._batch.buffers, strict=True)):
        device = model.manifest.state_device(i)
        assert buf._device is model.ctx.devices[device]
        held[device] += spec.nbytes
    plan = shard_plan(get_preset("gemma3-tiny"), 2, scheme="tensor")
    assert held == [d.state for d in plan.devices] and plan.state_copies > 0
    assert main(["inspect", str(bundle)]) == 0
    out = capsys.readouterr().out
    assert (f"devices  2 CPU devices, tensor: every layer's heads and MLP features in parts, device 0 state "
            f"{held[0] / 2**20:,.2f} MiB, device 1 state {held[1] / 2**20:,.2f} MiB; logits on device 0") in out


def test_quantized_parts_give_the_one_device_logits(bundle_factory):
    """q4 blocks through the int8 kernels in every part: the one-device bundle's greedy tokens, and its logits
    within the int8-activation bound. Not to the bit: the parts' partial sums are added in another order, and
    a rounding moved that way can move an activation's int8 code in the next layer."""
    one = Model.load(bundle_factory("gemma3-tiny", weights="int4")).session()
    two = Model.load(bundle_factory("gemma3-tiny", weights="int4", devices=2, scheme="tensor")).session()
    a, b = one.prefill(PROMPT), two.prefill(PROMPT)
    scale = np.abs(a).max()
    assert np.abs(b - a).max() < SCALED_TOL_INT8 * scale
    token = 7
    for _ in range(20):
        a, b = one.decode(token), two.decode(token)
        assert np.abs(b - a).max() < SCALED_TOL_INT8 * scale
        assert int(np.argmax(a)) == int(np.argmax(b))
        token = int(np.argmax(a))


def test_a_batched_tensor_parallel_bundle_gives_each_row_the_one_device_logits(bundle_factory):
    """qwen35-tiny at batch 2, its GDN and attention parts on 2 devices: rows of different lengths prefilled
    together and alone, then decoded, give the one-device batched bundle's logits up to float rounding."""
    batches = [Model.load(bundle_factory("qwen35-tiny", batch=TWO_DEVICE_BATCH["qwen35-tiny"], **options)).batch()
               for options in ({}, {"devices": 2, "scheme": "tensor"})]
    assert batches_differ(batches, BATCH_FEEDS) <= 1e-5


def test_a_cuda_bundle_compiles_its_parts_for_two_gpus(bundle_factory):
    """The same split for CUDA: one device per GPU in the flags, each part's state on its GPU."""
    import json

    bundle = bundle_factory("llama-tiny", target="cuda", devices=2, scheme="tensor")
    data = json.loads((bundle / "manifest.json").read_text())
    assert data["placement"]["scheme"] == "tensor"
    assert data["placement"]["state"] == [d for _, d in tensor_state(get_preset("llama-tiny").to_dict(), 1, 2)]
    (module,) = data["modules"].values()
    assert [f for f in module["flags"] if f.startswith("--iree-hal-target-device")] == [
        f"--iree-hal-target-device=__device_{j}=cuda[{j}]" for j in range(2)]
