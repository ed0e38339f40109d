"""Bundles compiled for several CPU devices (`foldline compile --devices N`): placement, parity, state.

The tiny presets over 2 `local-task` devices against eager and against the same
bundle on one device; the placement pass against the plan; the state each
device holds against `foldline plan`'s figure; snapshots across devices.
"""

from __future__ import annotations

import numpy as np
import pytest

from foldline.backends.iree.multi_device import multi_device_flags
from foldline.backends.options import BuildOptions, check_devices
from foldline.backends.targets import make_target
from foldline.contract.errors import BundleError
from foldline.contract.manifest import SEAL_KEY, Manifest, seal_manifest
from foldline.errors import InputError
from foldline.frontend.arch import get_preset
from foldline.frontend.sources import load_model
from foldline.passes.manager import run_pipeline
from foldline.passes.place_devices import COPY_SUFFIX, PLACED, TO_DEVICE, pipeline_runs
from foldline.passes.shard_plan import shard_plan
from foldline.runtime import Model
from foldline.testing.golden import compare_units, copy_unit, make_steps
from foldline.testing.parity import SCALED_TOL_FP32, batches_differ, run_parity

PRESETS = ["llama-tiny", "gemma3-tiny", "qwen35-tiny", "ripple-tiny"]
PROMPT = list(range(3, 43))  # 40 tokens: several prefill chunks, windows of 16 wrapped twice
# Steps of a batch of 2: rows of different lengths prefilled together and alone, then decoded together and alone.
BATCH_FEEDS = [{0: PROMPT[:13], 1: PROMPT[20:29]}, {1: PROMPT[29:35]}, {0: [7], 1: [9]}, {0: [11]}, {0: [4], 1: [6]}]
# qwen35-tiny's two-device bundles are the batch-2 ones the batched tests run: a session runs a batched bundle
# through its one-row functions, so one compile per scheme covers the one-row and the batched programs.
TWO_DEVICE_BATCH = {"qwen35-tiny": 2}


def _placed(exported_unit, preset: str, devices: int = 2):
    # An export of its own (seed 1): `lower_to_aten`'s retrace in other tests records answers in the shared
    # export's shape environment, and a placed program rebuilt from it would then carry them as guards.
    unit = copy_unit(exported_unit(get_preset(preset), seed=1))
    run_pipeline(unit, progress=lambda _m: None)
    placed = copy_unit(unit)
    placed.options["devices"] = devices
    run_pipeline(placed, ["place-on-devices"], progress=lambda _m: None)
    return unit, placed


@pytest.mark.parametrize("preset", PRESETS)
def test_placement_follows_the_plans_pipeline_and_changes_no_value(preset, exported_unit, torch_one_thread):
    """The placed programs compute exactly what the unplaced ones do; the layer runs are the plan's."""
    unit, placed = _placed(exported_unit, preset)
    placement = placed.options[PLACED]
    cfg = unit.config
    assert placement.layers == [d.layers for d in shard_plan(cfg, 2, scheme="pipeline").devices]
    assert placement.layers == pipeline_runs(unit, 2)
    first, _ = placement.layers[1]
    assert placement.state == [int(min(s.layers) >= first) for s in unit.state_specs]
    moves = [n for n in placed.programs["decode"].graph.nodes if n.target == TO_DEVICE]
    assert moves and all(n.args[1] == 1 for n in moves)  # the pipeline only ever moves forward
    # What crosses is the hidden rows (and Ripple's embedded rows) and the position input; the positions,
    # counts and slot indices computed from it are computed again on device 1, not moved.
    assert all(n.args[0].op == "placeholder" or n.args[0].meta["val"].is_floating_point() for n in moves)
    assert sum(n.args[0].op == "placeholder" for n in moves) == 1
    # Every weight lives on one device; a table read on both (llama-tiny's tied head) has a copy.
    tied = cfg.tie_word_embeddings and cfg.embed_scale == 1.0
    assert any(COPY_SUFFIX in t for t in placement.weights) == tied
    # The moves are the identity in eager: every logit and state value is the unplaced program's, to the bit.
    report = compare_units(unit, placed, make_steps([40], chunk=8, decode_steps=6, vocab_size=cfg.vocab_size))
    assert report.steps == 11
    assert report.worst_logit_error == 0.0 and report.worst_state_error == 0.0, report


@pytest.mark.parametrize("preset", PRESETS)
def test_two_devices_match_eager_and_one_device(preset, bundle_factory):
    """Greedy decoding through 40 tokens on 2 CPU devices: eager's logits within fp32 tolerance, and the
    same tokens as the bundle on one device. qwen35-tiny's bundle is its batch-2 one (TWO_DEVICE_BATCH), run
    through its one-row functions."""
    loaded = load_model(preset)
    two = Model.load(bundle_factory(preset, devices=2, batch=TWO_DEVICE_BATCH.get(preset, 1)))
    assert len(two.ctx.devices) == 2 and two.manifest.device_count == 2
    report = run_parity(loaded.module, two, PROMPT, steps=40)
    assert report.worst_scaled_error < SCALED_TOL_FP32, report
    assert report.compiled_tokens == report.eager_tokens
    one = Model.load(bundle_factory(preset))
    assert list(one.session().generate_ids(PROMPT, 24)) == list(two.session().generate_ids(PROMPT, 24))


def test_quantized_kernels_on_two_devices_give_the_one_device_logits(bundle_factory):
    """q4 blocks through the CPU kernels on both devices: the logits of the one-device bundle."""
    one = Model.load(bundle_factory("gemma3-tiny", weights="int4")).session()
    two = Model.load(bundle_factory("gemma3-tiny", weights="int4", devices=2)).session()
    np.testing.assert_allclose(two.prefill(PROMPT), one.prefill(PROMPT), rtol=0, atol=1e-5)
    token = 7
    for _ in range(20):
        a, b = one.decode(token), two.decode(token)
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)
        token = int(np.argmax(a))


def test_a_batched_bundle_on_two_devices_gives_each_row_the_one_device_logits(bundle_factory):
    """qwen35-tiny at batch 2 (recurrent and conv state per row): rows of different lengths, prefilled
    together and alone, then decoded together and alone, give the one-device batched bundle's logits."""
    batches = [Model.load(bundle_factory("qwen35-tiny", batch=TWO_DEVICE_BATCH["qwen35-tiny"], devices=d)).batch()
               for d in (1, 2)]
    assert batches_differ(batches, BATCH_FEEDS) <= 1e-5


def test_each_device_holds_the_state_the_plan_gives_it(bundle_factory, capsys):
    """The runtime allocates each buffer on its device, and per device the bytes `foldline plan` prints;
    `foldline inspect` names each device's layers and state."""
    from foldline.tools.cli import main

    bundle = bundle_factory("gemma3-tiny", devices=2)
    model = Model.load(bundle)
    session = model.session()
    session.prefill(PROMPT[:5])
    buffers = session._batch.buffers
    held = [0, 0]
    for i, (spec, buf) in enumerate(zip(model.manifest.state, buffers, strict=True)):
        device = model.manifest.state_device(i)
        assert buf._device is model.ctx.devices[device]
        held[device] += spec.nbytes
    plan = shard_plan(get_preset("gemma3-tiny"), 2, scheme="pipeline")
    assert held == [d.state for d in plan.devices]
    assert main(["inspect", str(bundle)]) == 0
    out = capsys.readouterr().out
    (first0, last0), (first1, last1) = (d.layers for d in plan.devices)
    assert (f"devices  2 CPU devices, pipeline: device 0 layers {first0}-{last0} (state {held[0] / 2**20:,.2f} MiB), "
            f"device 1 layers {first1}-{last1} (state {held[1] / 2**20:,.2f} MiB); logits on device 1") in out
    archive = model.manifest.placement.params[0]
    assert f"{archive.file} (device 1, scope device1): {archive.count} tensors" in out
    listed = [line.rsplit("device ", 1)[1] for line in out.splitlines()
              if line.startswith("  ") and "device" in line and "scope" not in line]
    assert [int(d) for d in listed] == model.manifest.placement.state


def test_each_device_reads_its_own_parameter_archive(bundle_factory):
    """Device 1's weights are an IRPA file and scope of their own: each layer's parameters are in the
    archive of the device that runs it, and only there; the table tied to the head is in both."""
    import iree.runtime as rt

    from foldline.passes.place_devices import layer_in_path

    bundle = bundle_factory("llama-tiny", devices=2)
    manifest = Manifest.load(bundle)
    manifest.verify_params()
    assert [(a.file, a.scope) for a in manifest.params_files] == [("params.irpa", "model"),
                                                                   ("params.device1.irpa", "device1")]
    held = []
    for archive in manifest.params_files:
        index = rt.ParameterIndex()
        index.load(str(bundle / archive.file))
        held.append({key for key, _entry in index.items()})
        assert len(held[-1]) == archive.count
    runs = manifest.placement.layers
    for key in held[0] | held[1]:
        layer = layer_in_path(key)
        if layer is None:
            continue
        owner = next(j for j, (first, last) in enumerate(runs) if first <= layer <= last)
        assert key in held[owner] and key not in held[1 - owner], key
    shared = held[0] & held[1]
    assert shared and all(layer_in_path(key) is None for key in shared), shared  # the tied table
    one = Manifest.load(bundle_factory("llama-tiny"))
    index = rt.ParameterIndex()
    index.load(str(one.root / one.params.file))
    assert {key for key, _ in index.items()} == held[0] | held[1]


def test_a_snapshot_covers_every_device(bundle_factory):
    """Restoring a snapshot taken mid-stream gives the continuation that followed it, on both devices."""
    model = Model.load(bundle_factory("gemma3-tiny", devices=2))
    session = model.session()
    session.prefill(PROMPT)
    snap = session.snapshot()
    first = [int(np.argmax(session.decode(5 + i))) for i in range(12)]
    session.restore(snap)
    again = [int(np.argmax(session.decode(5 + i))) for i in range(12)]
    assert again == first
    other = model.session()
    other.restore(snap)
    assert [int(np.argmax(other.decode(5 + i))) for i in range(12)] == first


def test_device_counts_the_compile_refuses():
    cpu = [make_target("cpu")]
    for bad in (0, -1, True):
        with pytest.raises(InputError, match="--devices must be a positive integer"):
            check_devices(BuildOptions(targets=cpu, devices=bad))
    with pytest.raises(InputError, match="does not apply to onnxruntime"):
        check_devices(BuildOptions(targets=[make_target("cpu"), make_target("onnx")], devices=2))
    flags = multi_device_flags(make_target("cpu").flags, 3)
    assert "--iree-hal-target-device=__device_2=local[2]" in flags
    assert "--iree-hal-local-target-device-backends=llvm-cpu" in flags
    assert not any(f.startswith("--iree-hal-target-backends") for f in flags)
    flags = multi_device_flags(make_target("cuda").flags, 2)
    assert [f for f in flags if f.startswith("--iree-hal-target-device")] == [
        "--iree-hal-target-device=__device_0=cuda[0]", "--iree-hal-target-device=__device_1=cuda[1]"]
    assert not any("local-target" in f or f.startswith("--iree-hal-target-backends") for f in flags)


def test_gpu_bundles_compile_for_two_devices_and_want_two_gpus(bundle_factory, vulkan_device):
    """CUDA and Vulkan modules are compiled for two devices of their kind; on a machine with one GPU
    (lavapipe here) loading one is refused, naming the count, not failed inside IREE."""
    import json

    for target, kind in (("cuda", "cuda"), ("vulkan", "vulkan")):
        bundle = bundle_factory("llama-tiny", target=target, devices=2)
        data = json.loads((bundle / "manifest.json").read_text())
        assert data["placement"]["devices"] == 2
        (module,) = data["modules"].values()
        assert [f for f in module["flags"] if f.startswith("--iree-hal-target-device")] == [
            f"--iree-hal-target-device=__device_{j}={kind}[{j}]" for j in range(2)]
    from foldline.runtime.device import available_devices

    if len(available_devices("vulkan")) == 1:
        with pytest.raises(BundleError, match="runs on 2 vulkan devices, one GPU each; this machine has 1"):
            Model.load(bundle, device="vulkan")


def test_the_manifest_refuses_a_placement_that_does_not_fit_the_bundle(bundle_factory, tmp_path):
    import json
    import shutil

    bundle = tmp_path / "bundle"
    shutil.copytree(bundle_factory("llama-tiny", devices=2), bundle)
    data = json.loads((bundle / "manifest.json").read_text())
    data["placement"]["state"][0] = 2  # a third device the bundle was not compiled for
    data.pop(SEAL_KEY)
    (bundle / "manifest.json").write_text(json.dumps(seal_manifest(data)))
    with pytest.raises(BundleError, match=r"placement\.state\[0\]"):
        Manifest.load(bundle)
    data["placement"]["state"][0] = 0
    data["placement"]["params"].append(dict(data["placement"]["params"][0]))  # an archive for a third device
    (bundle / "manifest.json").write_text(json.dumps(seal_manifest(data)))
    with pytest.raises(BundleError, match=r"placement\.params: 2 archives; devices 1 to 1 have one each"):
        Manifest.load(bundle)
    data["placement"]["params"].pop()
    data.pop(SEAL_KEY)
    (bundle / "manifest.json").write_text(json.dumps(seal_manifest(data)))
    archive = bundle / "params.device1.irpa"
    raw = bytearray(archive.read_bytes())
    raw[-1] ^= 1
    archive.write_bytes(bytes(raw))  # device 1's weights changed after the build
    with pytest.raises(BundleError, match=r"params\.device1\.irpa does not match the manifest's sha256"):
        Model.load(bundle)


def test_the_placed_module_tells_iree_where_every_value_lives(exported_unit):
    """Moves become transfers; state arguments, logits and weights carry the devices the pass chose."""
    import re

    from foldline.backends.iree.importer import import_programs
    from foldline.backends.iree.multi_device import place_module

    _unit, placed = _placed(exported_unit, "llama-tiny")
    placement = placed.options[PLACED]
    mlir, _params = import_programs(placed.programs.items())
    text, moves = place_module(mlir, placement)
    placed_moves = sum(n.target == TO_DEVICE for p in placed.programs.values() for n in p.graph.nodes)
    assert 0 < moves <= placed_moves  # the lowering may fold a move whose value it computes on both sides
    assert len(re.findall(r"flow\.tensor\.transfer .* to #hal\.device\.promise<@__device_1>", text)) == moves
    assert "foldline.to_device" not in text
    decode = next(line for line in text.splitlines() if "func.func @decode(" in line)
    state_args = re.findall(r"!torch\.tensor<[^>]*> \{iree\.abi\.affinity = #hal\.device\.promise<@__device_(\d)>\}",
                            decode)
    assert [int(d) for d in state_args] == placement.state
    results = decode.split(") -> (", 1)[1]
    assert re.match(r"!torch\.vtensor<[^>]*> \{iree\.abi\.affinity = #hal\.device\.promise<@__device_1>\}\)",
                    results)  # the logits come back from the last device
    copies = re.findall(r'util\.global private @"([^"]+@device1)" \{stream\.affinity = '
                        r'#hal\.device\.promise<@__device_1>\} = #flow\.parameter\.named<"device1"::"([^"]+)">', text)
    assert copies and all(name.split("@")[0] == key for name, key in copies)  # the copy reads the same entry
    # every weight reads its device's scope: device 1's from its own archive
    for scope, affinity in re.findall(r'\{stream\.affinity = #hal\.device\.promise<@__device_(\d)>\} = '
                                      r'#flow\.parameter\.named<"(\w+)"::', text):
        assert (scope, affinity) in (("0", "model"), ("1", "device1")), (scope, affinity)


_WEIGHTS = """
module {
  util.global private @"a.weight" = #flow.parameter.named<"model"::"a.weight"> : tensor<4x4xf32>
  util.global private @"b.weight" = #flow.parameter.named<"model"::"b.weight"> : tensor<4x4xf32>
  util.global private @"a.weight@device1" = #flow.parameter.named<"model"::"a.weight"> : tensor<4x4xf32>
  util.global private @"inline" = dense<1.0> : tensor<4xf32>
  func.func @f(%arg0: !torch.vtensor<[4],f32>) -> !torch.vtensor<[4],f32> {
    return %arg0 : !torch.vtensor<[4],f32>
  }
}
"""


def _weights_placed(mlir: str) -> dict[str, tuple[str, str]]:
    """util.global name -> (its affinity, its initial value), after place_module over two devices."""
    from iree.compiler import ir

    from foldline.backends.iree.multi_device import place_module
    from foldline.passes.place_devices import Placement

    weights = {"model.a.weight": 0, "model.b.weight": 1, "model.a.weight@device1": 1, "inline": 1}
    placement = Placement(2, "pipeline", [(0, 0), (1, 1)], [], weights, {"f": [0]}, 1)
    text, moves = place_module(mlir, placement)
    assert moves == 0
    with ir.Context():
        module = ir.Module.parse(text)
        return {ir.StringAttr(op.attributes["sym_name"]).value: (str(op.attributes["stream.affinity"]),
                                                                 str(op.attributes["initial_value"]))
                for op in (o.operation for o in module.body.operations) if op.name == "util.global"}


def test_each_weight_reads_its_devices_parameter_scope():
    """Device 1's weights read their entries from scope device1 (a copy the entry of the weight it copies),
    device 0's stay in model; a global that holds its value keeps it, on its device."""
    device = "#hal.device.promise<@__device_{}>"
    assert _weights_placed(_WEIGHTS) == {
        "a.weight": (device.format(0), '#flow.parameter.named<"model"::"a.weight"> : tensor<4x4xf32>'),
        "b.weight": (device.format(1), '#flow.parameter.named<"device1"::"b.weight"> : tensor<4x4xf32>'),
        "a.weight@device1": (device.format(1), '#flow.parameter.named<"device1"::"a.weight"> : tensor<4x4xf32>'),
        "inline": (device.format(1), "dense<1.000000e+00> : tensor<4xf32>"),
    }


def test_a_weight_reading_another_parameter_is_refused():
    from foldline.backends.iree.multi_device import PlacementError

    other = _WEIGHTS.replace('"model"::"b.weight"', '"model"::"c.weight"')
    with pytest.raises(PlacementError, match=r'util.global @b.weight reads #flow.parameter.named<"model"::"c.weight">'):
        _weights_placed(other)
