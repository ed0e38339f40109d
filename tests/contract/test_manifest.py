"""The manifest rules, its seal, the entry-point declarations and the CPU features of a module.

No model compile here: manifests are built from preset configs with the same
layout functions the compiler uses, and the one compiled module is a four-element add.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from foldline.contract.entry_points import declared_inputs
from foldline.contract.errors import BundleError
from foldline.contract.isa import isa_flags
from foldline.contract.manifest import (
    Manifest,
    ModuleEntry,
    ParamsEntry,
    check_seal,
    manifest_digest,
    seal_manifest,
)
from foldline.contract.schema import check_schema
from foldline.contract.vmfb import vmfb_info
from foldline.frontend.arch import PRESETS, get_preset
from foldline.passes.state_layout import planned_state_specs, reference_state_specs

PATH = Path("bundle/manifest.json")
HEX = "ab" * 32
TINY_MLIR = """
func.func @add(%a: tensor<4xf32>, %b: tensor<4xf32>) -> tensor<4xf32> {
  %0 = arith.addf %a, %b : tensor<4xf32>
  return %0 : tensor<4xf32>
}
"""


def manifest_for(preset: str, batch: int = 1, chunk: int = 16, compact: bool = True) -> dict[str, Any]:
    """A sealed manifest as `foldline compile` writes it for `preset` (the state from passes/state_layout)."""
    cfg = get_preset(preset)
    specs = (planned_state_specs if compact else reference_state_specs)(cfg, batch)
    return Manifest(
        model=cfg.to_dict(), batch=batch, prefill_chunk=chunk, state=specs, source=f"preset:{preset}",
        modules={"cpu": ModuleEntry("model.cpu.vmfb", HEX, 10, params_sha256=HEX, arch="x86_64")},
        params=ParamsEntry("params.irpa", HEX, 10),
    ).to_json()


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("compact", [True, False])
def test_every_preset_layout_passes_the_rules(preset, compact):
    """Ring or full local caches, GDN state, f16 caches: what the compiler writes is accepted."""
    data = manifest_for(preset, compact=compact)
    check_seal(PATH, data)
    check_schema(PATH, data)


def test_a_sealed_manifest_loads_from_disk(tmp_path):
    data = manifest_for("llama-tiny")
    for name in ("params.irpa", "model.cpu.vmfb"):
        (tmp_path / name).write_bytes(b"x" * 10)
    (tmp_path / "manifest.json").write_text(json.dumps(data, indent=2))
    assert Manifest.load(tmp_path).max_context == get_preset("llama-tiny").max_context


def _state(data: dict, i: int = 0) -> dict:
    return data["state"][i]


def _set_shape(data: dict, shape: list[int]) -> None:
    """A state shape edited with its nbytes kept consistent, so only the layout rule can object."""
    s = _state(data)
    s["shape"] = shape
    s["nbytes"] = math.prod(shape) * 4
    data["state_bytes"] = sum(b["nbytes"] for b in data["state"])


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(batch="1"), r"batch: must be an integer, got '1'"),
    (lambda d: d.update(batch=0), r"batch: must be positive, got 0"),
    (lambda d: d["model"].update(vocab_size=-5), r"model.vocab_size: must be positive, got -5"),
    (lambda d: d["model"].update(max_context=2.5), r"model.max_context: must be an integer, got 2.5"),
    (lambda d: d["model"].update(layer_types=["global", "mystery", "global"]),
     r"model.layer_types\[1\]: unknown value 'mystery'"),
    (lambda d: d["model"].update(dtype="float8"), r"model.dtype: unknown value 'float8'"),
    (lambda d: d["model"].update(eos_token_ids=[512]), r"model.eos_token_ids\[0\]: must be between 0 and 511"),
    (lambda d: d.update(prefill_chunk=4096), r"prefill_chunk: must be between 1 and 128, got 4096"),
    (lambda d: d.update(kv_tile=32), r"kv_tile: 32 is not the tile of a 128-slot cache \(64\)"),
    (lambda d: d.pop("kv_tile"), r"kv_tile"),
    (lambda d: d.update(state=[]), r"state: lists no buffer"),
    (lambda d: _state(d).update(dtype="int3"), r"state\[0\].dtype: unknown value 'int3'"),
    (lambda d: _state(d).update(shape=[1, -2, 128, 16]), r"state\[0\].shape: must be a list of positive integers"),
    (lambda d: _state(d).update(shape="1x2"), r"state\[0\].shape: must be a list"),
    (lambda d: _state(d).update(nbytes=_state(d)["nbytes"] + 4), r"state\[0\].nbytes: 16388 is not prod"),
    (lambda d: _state(d).update(kind="kv"), r"state\[0\].kind: unknown value 'kv'"),
    (lambda d: _state(d).update(layers=[3]), r"state\[0\].layers\[0\]: must be between 0 and 2, got 3"),
    (lambda d: _state(d).update(kind="gdn_conv"), r"state\[0\].kind: gdn_conv buffer for layer 0, a global layer"),
    (lambda d: _state(d, 1).update(name="layer0.k"), r"state\[1\].name: 'layer0.k' is listed twice"),
    (lambda d: _set_shape(d, [1, 2, 64, 16]), r"state\[0\].shape: \[1, 2, 64, 16\] does not match a global_kv "
                                              r"buffer of this model: \[1, 2, 128, 16\] \(batch, num_kv_heads, "
                                              r"max_context, head_dim\)"),
    (lambda d: _state(d).update(dtype="float16", nbytes=_state(d)["nbytes"] // 2),
     r"state\[0\].dtype: float16; a global_kv buffer of this model is float32"),
    (lambda d: d.update(state_bytes=1), r"state_bytes: 1 is not the sum"),
    (lambda d: d["modules"]["cpu"].update(file="../../etc/passwd"), r"modules.cpu.file: must name a file inside"),
    (lambda d: d["modules"]["cpu"].update(sha256="abc"), r"modules.cpu.sha256: must be a sha256 hex digest"),
    (lambda d: d["modules"]["cpu"].update(size=-1), r"modules.cpu.size: must be positive"),
    (lambda d: d["modules"]["cpu"].update(window_order="sorted"), r"modules.cpu.window_order: unknown value 'sorted'"),
    (lambda d: d.update(tokenizer="tokenizer.json"), r"tokenizer_sha256: must be a sha256 hex digest, got None"),
    (lambda d: d.update(row_counts=[1, 2]), r"row_counts\[1\]: must be between 1 and 1, got 2"),
    (lambda d: d.update(row_counts=[]), r"row_counts: \[\] must ascend without repeats and end with the batch 1"),
    (lambda d: d.update(row_counts="1"), r"row_counts: must be a list"),
])
def test_schema_violations_name_the_field(edit, message):
    data = manifest_for("llama-tiny")
    edit(data)
    with pytest.raises(BundleError, match=message):
        check_schema(PATH, data)


def test_layouts_of_local_and_gdn_buffers_are_checked():
    """A ring must hold sliding_window slots; a GDN state its heads x dims; a conv window kernel - 1."""
    gemma = manifest_for("gemma3-tiny")
    local = next(s for s in gemma["state"] if s["kind"] == "local_kv")
    local["shape"][2] += 1
    local["nbytes"] = math.prod(local["shape"]) * 4
    gemma["state_bytes"] = sum(b["nbytes"] for b in gemma["state"])
    with pytest.raises(BundleError, match=r"does not match a local_kv buffer .* or a ring of sliding_window"):
        check_schema(PATH, gemma)
    for kind, dim in (("gdn_recurrent", 1), ("gdn_conv", 2)):
        qwen = manifest_for("qwen35-tiny")
        buf = next(s for s in qwen["state"] if s["kind"] == kind)
        buf["shape"][dim] += 1
        buf["nbytes"] = math.prod(buf["shape"]) * {"float32": 4, "float16": 2, "bfloat16": 2}[buf["dtype"]]
        qwen["state_bytes"] = sum(b["nbytes"] for b in qwen["state"])
        with pytest.raises(BundleError, match=f"does not match a {kind} buffer"):
            check_schema(PATH, qwen)


# ---- the seal ---------------------------------------------------------------------------------

def test_seal_covers_every_field_and_ignores_key_order():
    data = manifest_for("llama-tiny")
    reordered = json.loads(json.dumps(dict(reversed(list(data.items())))))
    assert manifest_digest(reordered) == data["manifest_sha256"]
    check_seal(PATH, reordered)
    for edit in (lambda d: d.update(prefill_chunk=32), lambda d: d["model"].update(vocab_size=1024),
                 lambda d: d["model"].update(max_context=64), lambda d: _state(d)["shape"].__setitem__(2, 64)):
        edited = copy.deepcopy(data)
        edit(edited)
        with pytest.raises(BundleError, match="was edited or corrupted after compile"):
            check_seal(PATH, edited)


def test_unsealed_manifest_is_refused():
    data = manifest_for("llama-tiny")
    del data["manifest_sha256"]
    with pytest.raises(BundleError, match="has no manifest_sha256: not written by foldline compile"):
        check_seal(PATH, data)


# ---- entry-point declarations -----------------------------------------------------------------

DECODE = ("sync func @decode(%input0: tensor<1x1xi64>, %input1: tensor<1xi64>, %input2: tensor<1x2x128x16xf32>, "
          "%input3: tensor<1x2x128x16xf16>) -> (%output0: tensor<1x512xf32>)")


def test_declared_inputs_are_parsed_without_the_outputs():
    assert declared_inputs(DECODE) == [([1, 1], "int64"), ([1], "int64"), ([1, 2, 128, 16], "float32"),
                                       ([1, 2, 128, 16], "float16")]


def _typed(data: dict) -> Manifest:
    """The typed manifest of a dict that passed the schema (no files needed)."""
    return Manifest.from_json(data, PATH.parent)


def _declarations(data: dict) -> dict[str, dict[str, str]]:
    """The declarations a module compiled for `data` carries."""
    b, c = data["batch"], data["prefill_chunk"]
    elem = {"float32": "f32", "float16": "f16"}
    state = [f"{'x'.join(map(str, s['shape']))}x{elem[s['dtype']]}" for s in data["state"]]

    def decl(name: str, types: list[str]) -> dict[str, str]:
        args = ", ".join(f"%input{i}: tensor<{t}>" for i, t in enumerate([*types, *state]))
        return {"iree.abi.declaration": f"sync func @{name}({args}) -> (%output0: tensor<{b}x512xf32>)"}

    prefill = [f"{b}x{c}xi64", f"{b}xi64", f"{b}xi64", "0x?xi8"]
    decode = [f"{b}x1xi64", f"{b}xi64", "0x?xi8" if b == 1 else f"{b}xi64"]  # pos_shape for one row, else n_valid
    return {"prefill": decl("prefill", prefill), "decode": decl("decode", decode)}


def test_entry_points_matching_the_manifest_pass_and_mismatches_are_named():
    data = manifest_for("llama-tiny")
    module = _declarations(data)
    _typed(data).check_entry_points("cpu", module.get)

    edited = copy.deepcopy(data)
    _set_shape(edited, [1, 2, 64, 16])
    with pytest.raises(BundleError, match=r"prefill takes state buffer 'layer0.k' as float32\[1, 2, 128, 16\]; "
                                          r"the manifest says float32\[1, 2, 64, 16\]: module and manifest"):
        _typed(edited).check_entry_points("cpu", module.get)

    fewer = copy.deepcopy(data)
    fewer["state"] = fewer["state"][:-1]
    with pytest.raises(BundleError, match=r"prefill takes 10 inputs, the manifest implies 9 \(5 state buffers\)"):
        _typed(fewer).check_entry_points("cpu", module.get)

    chunk = copy.deepcopy(data)
    chunk["prefill_chunk"] = 32
    with pytest.raises(BundleError, match=r"prefill takes tokens as int64\[1, 16\]; the manifest says int64\[1, 32\]"):
        _typed(chunk).check_entry_points("cpu", module.get)

    missing = {name: d for name, d in module.items() if name != "decode"}
    with pytest.raises(BundleError, match="has no entry point 'decode'"):
        _typed(data).check_entry_points("cpu", missing.get)

    # A prefill without kv_tiles (the ABI before format 5) is named, not run.
    old_prefill = {name: {k: v.replace(", %input3: tensor<0x?xi8>", "") for k, v in d.items()}
                   if name == "prefill" else d for name, d in module.items()}
    with pytest.raises(BundleError, match=r"prefill takes 9 inputs, the manifest implies 10 \(6 state buffers\)"):
        _typed(data).check_entry_points("cpu", old_prefill.get)

    with pytest.raises(BundleError, match="declares no signature"):
        _typed(data).check_entry_points("cpu", lambda name: {})

    # A decode without pos_shape (the ABI before format 4) is named, not run.
    old = {name: {k: re.sub(r", %input2: tensor<0x\?xi8>", "", v) for k, v in d.items()} if name.startswith("decode")
           else d for name, d in module.items()}
    assert "0x?xi8" not in old["decode"]["iree.abi.declaration"]
    with pytest.raises(BundleError, match=r"decode takes 8 inputs, the manifest implies 9 \(6 state buffers\)"):
        _typed(data).check_entry_points("cpu", old.get)


def test_a_batched_manifest_implies_an_entry_point_per_row_count():
    """Row counts below the batch: prefill_rows{k} and decode_rows{k} over the first k rows of each state buffer."""
    data = manifest_for("llama-tiny", batch=4)
    data["row_counts"] = [1, 4]
    check_schema(PATH, data)
    full = _declarations(data)
    one = copy.deepcopy(data)
    one["batch"] = 1
    for spec in one["state"]:
        spec["shape"][0] = 1
    rows1 = {f"{name}_rows1": {k: v.replace(f"@{name}(", f"@{name}_rows1(") for k, v in d.items()}
             for name, d in _declarations(one).items()}
    _typed(data).check_entry_points("cpu", {**full, **rows1}.get)
    with pytest.raises(BundleError, match="has no entry point 'prefill_rows1'"):
        _typed(data).check_entry_points("cpu", full.get)
    bad = {**full, **rows1, "prefill_rows1": full["prefill"]}  # the 4-row function under the 1-row name
    with pytest.raises(BundleError, match=r"prefill_rows1 takes tokens as int64\[4, 16\]; the manifest says "
                                          r"int64\[1, 16\]"):
        _typed(data).check_entry_points("cpu", bad.get)


_TORCH_FUNCTION = """
module {
  func.func @f(%arg0: !torch.vtensor<[1,?],si64>, %arg1: !torch.int, %arg2: !torch.tensor<[1,2,4],f16>, %arg3: !torch.vtensor<[0,?],ui8>) -> !torch.vtensor<[1,8],f32> {
    %0 = torch.vtensor.literal(dense<0.0> : tensor<1x8xf32>) : !torch.vtensor<[1,8],f32>
    return %0 : !torch.vtensor<[1,8],f32>
  }
}
"""
# what IREE's torch input conversion makes of it: @f$async imports the arguments it reads and exports the
# results; @f, the synchronous entry point, calls it and waits
_INPUT_FUNCTIONS = """
module {
  util.func public @f$async(%arg0: !hal.buffer_view, %arg1: !hal.fence, %arg2: !hal.fence) -> (!hal.buffer_view, !hal.buffer_view) attributes {iree.abi.model = "coarse-fences", iree.abi.stub} {
    %logits = arith.constant dense<0.0> : tensor<1x8xf32>
    %n = arith.constant 3 : index
    %rows = tensor.empty(%n) : tensor<?x4xf16>
    %0 = hal.tensor.export %logits : tensor<1x8xf32> -> !hal.buffer_view
    %1 = hal.tensor.export %rows : tensor<?x4xf16>{%n} -> !hal.buffer_view
    util.return %0, %1 : !hal.buffer_view, !hal.buffer_view
  }
  util.func public @f(%arg0: !hal.buffer_view) -> (!hal.buffer_view, !hal.buffer_view) attributes {SYNC_ATTRIBUTES} {
    %0 = util.null : !hal.fence
    %1:2 = util.call @f$async(%arg0, %0, %0) : (!hal.buffer_view, !hal.fence, !hal.fence) -> (!hal.buffer_view, !hal.buffer_view)
    util.return %1#0, %1#1 : !hal.buffer_view, !hal.buffer_view
  }
}
"""
_F = ("sync func @f(%input0: tensor<1x?xi64>, %input1: tensor<1x2x4xf16>, %input2: tensor<0x?xi8>) -> "
      "(%output0: tensor<1x8xf32>, %output1: tensor<?x4xf16>)")


def _reflections(mlir: str, torch_mlir: str, generic: bool = False) -> tuple[list[str], dict[str, dict[str, str]]]:
    """Declare the entry points of `mlir` (from `torch_mlir`'s arguments; both printed in MLIR's generic form
    when `generic`), then read back each function's reflection through the bindings."""
    from iree.compiler import ir

    from foldline.backends.iree.abi_declaration import declare_signatures, torch_inputs

    with ir.Context():
        if generic:
            torch_mlir = ir.Module.parse(torch_mlir).operation.get_asm(print_generic_op_form=True)
            mlir = ir.Module.parse(mlir).operation.get_asm(print_generic_op_form=True)
            assert "util.func public @" not in mlir and "func.func @" not in torch_mlir
        module = ir.Module.parse(mlir)
        declared = declare_signatures(module, torch_inputs(torch_mlir))
        found = {}
        for op in module.body.operations:
            op = op.operation
            reflection = ir.DictAttr(op.attributes["iree.reflection"]) if "iree.reflection" in op.attributes else []
            found[ir.StringAttr(op.attributes["sym_name"]).value] = {
                reflection[i].name: ir.StringAttr(reflection[i].attr).value for i in range(len(reflection))}
    return declared, found


def test_the_declaration_takes_every_torch_argument_and_the_exported_results():
    """Tensor arguments in order (si64 and ui8 as IREE's i64 and i8, unknown sizes as ?), other arguments
    skipped; one output per export of the $async body; only the synchronous entry point is declared."""
    declared, found = _reflections(_INPUT_FUNCTIONS.replace("SYNC_ATTRIBUTES", "iree.abi.stub"), _TORCH_FUNCTION)
    assert declared == ["f"]
    assert found == {"f$async": {}, "f": {"iree.abi.declaration": _F}}
    assert declared_inputs(_F) == [([1, -1], "int64"), ([1, 2, 4], "float16"), ([0, -1], "int8")]


def test_the_declaration_reads_the_modules_not_their_spelling():
    """The same modules spelled otherwise (MLIR's generic form; a synchronous entry point that already has a
    reflection entry, before its stub marker) get the same declaration, and keep what they had."""
    plain = _INPUT_FUNCTIONS.replace("SYNC_ATTRIBUTES", "iree.abi.stub")
    assert _reflections(plain, _TORCH_FUNCTION, generic=True) == (["f"], {"f$async": {}, "f": {
        "iree.abi.declaration": _F}})
    reflected = _INPUT_FUNCTIONS.replace("SYNC_ATTRIBUTES", 'iree.reflection = {note = "kept"}, iree.abi.stub')
    assert _reflections(reflected, _TORCH_FUNCTION) == (["f"], {"f$async": {}, "f": {
        "iree.abi.declaration": _F, "note": "kept"}})


def test_a_function_without_its_torch_arguments_or_its_stub_is_not_declared():
    no_stub = _INPUT_FUNCTIONS.replace("SYNC_ATTRIBUTES", 'iree.abi.model = "sync"')
    assert _reflections(no_stub, _TORCH_FUNCTION) == ([], {"f$async": {}, "f": {}})
    other = _TORCH_FUNCTION.replace("func.func @f(", "func.func @g(")
    assert _reflections(_INPUT_FUNCTIONS.replace("SYNC_ATTRIBUTES", "iree.abi.stub"), other) == (
        [], {"f$async": {}, "f": {}})


# ---- CPU features -----------------------------------------------------------------------------

def test_llvm_feature_strings_map_to_cpuinfo_flags_last_word_wins():
    assert isa_flags("+avx,+avx2,+sse4.1,+avx512vnni,+amx-tile,-amx-tile,+cx8") == \
        ["sse4_1", "avx", "avx2", "avx512_vnni"]
    assert isa_flags("") == []
    # aarch64 (the `Features` line of its cpuinfo): cortex-a76's string as LLVM resolves it
    assert isa_flags("+v8.2a,+aes,+crc,+dotprod,+fp-armv8,+fullfp16,+lse,+neon,+rdm,+reserve-x18") == \
        ["asimd", "asimdhp", "asimddp"]


@pytest.mark.parametrize("arch,cpuinfo,expected", [
    ("x86_64", "processor\t: 0\nflags\t\t: fpu sse4_2 avx2\n", {"fpu", "sse4_2", "avx2"}),
    ("aarch64", "processor\t: 0\nFeatures\t: fp asimd asimddp i8mm\nCPU part\t: 0xd0b\n",
     {"fp", "asimd", "asimddp", "i8mm"}),
    # an aarch64 process under qemu-user reads the x86 host's cpuinfo: no Features line, so unknown
    ("aarch64", "processor\t: 0\nflags\t\t: fpu sse4_2 avx2\n", None),
    ("riscv64", "processor\t: 0\nisa\t\t: rv64imafdc\n", None),
])
def test_host_cpu_features_read_the_lines_of_each_arch(arch, cpuinfo, expected, tmp_path, monkeypatch):
    from foldline.runtime import device

    fake = tmp_path / "cpuinfo"
    fake.write_text(cpuinfo)
    monkeypatch.setattr(device, "host_arch", lambda: arch)
    monkeypatch.setattr(device, "Path", lambda _p: fake)
    assert device.host_cpu_features() == expected


def test_a_module_records_the_cpu_features_it_was_compiled_for(tmp_path, monkeypatch):
    """The vmfb keeps its executables' target attributes: the runtime reads them, not only the manifest."""
    import iree.compiler as ireec

    from foldline.runtime import device
    from foldline.runtime.device import check_vmfb_arch, host_arch

    if host_arch() != "x86_64":
        pytest.skip("x86 CPU features")
    vmfb = tmp_path / "m.vmfb"
    vmfb.write_bytes(ireec.compile_str(TINY_MLIR, extra_args=[
        "--iree-hal-target-backends=llvm-cpu", "--iree-llvmcpu-target-cpu=skylake-avx512"]))
    flags = vmfb_info(vmfb).cpu_flags
    assert {"avx2", "avx512f", "avx512bw"} <= set(flags) and "amx_tile" not in flags
    monkeypatch.setattr(device, "host_cpu_features", lambda: {"sse4_1", "sse4_2", "avx", "avx2", "fma"})
    with pytest.raises(BundleError, match="m.vmfb was compiled for CPU features this machine lacks: .*avx512f"):
        check_vmfb_arch(vmfb)
    monkeypatch.setattr(device, "host_cpu_features", lambda: set(flags))
    check_vmfb_arch(vmfb)



# ---- several CPU modules ----------------------------------------------------------------------

# What LLVM enables for the CPUs of --cpu x86-all (targets.llvm_cpu_features), and the kernels each takes.
X86_V2 = ["sse4_1", "sse4_2"]
X86_V3 = [*X86_V2, "avx", "avx2", "fma", "f16c", "bmi2"]
CASCADELAKE = [*X86_V3, "avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl", "avx512_vnni"]
MULTI_ISA = {"x86-64-v2": (X86_V2, "f32", "f32"), "x86-64-v3": (X86_V3, "int8-avx2", "f32"),
             "cascadelake": (CASCADELAKE, "int8-avx512vnni", "int8-avx512vnni")}


def multi_isa_manifest(cpus: list[str] | None = None) -> dict[str, Any]:
    """A sealed manifest with one CPU module per name of MULTI_ISA, as `--cpu x86-all` writes it."""
    data = manifest_for("llama-tiny")
    data["modules"] = {}
    for cpu in cpus or list(MULTI_ISA):
        flags, decode, prefill = MULTI_ISA[cpu]
        data["modules"][f"cpu-{cpu}"] = {
            "file": f"model.cpu-{cpu}.vmfb", "sha256": HEX, "size": 10, "params_sha256": HEX, "device": "cpu",
            "cpu": cpu, "arch": "x86_64", "cpu_flags": flags, "kernel_isa": {"decode": decode, "prefill": prefill}}
    return seal_manifest(data)


def test_a_multi_isa_manifest_passes_the_rules():
    data = multi_isa_manifest()
    check_seal(PATH, data)
    check_schema(PATH, data)


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["cpu-x86-64-v3"].update(file="model.cpu-x86-64-v2.vmfb"),
     r"modules.cpu-x86-64-v3.file: 'model.cpu-x86-64-v2.vmfb' is also the file of modules.cpu-x86-64-v2"),
    (lambda m: m["cpu-x86-64-v3"].update(cpu="znver4"),
     r"modules.cpu-x86-64-v3: a cpu module is keyed 'cpu', or 'cpu-<cpu>' with its cpu recorded \(got cpu 'znver4'\)"),
    (lambda m: m["cpu-x86-64-v3"].pop("cpu"), r"modules.cpu-x86-64-v3: a cpu module is keyed 'cpu'"),
    (lambda m: m["cpu-x86-64-v3"].update(device=3), r"modules.cpu-x86-64-v3.device: must be a string, got 3"),
    (lambda m: m["cpu-x86-64-v3"]["kernel_isa"].pop("prefill"), r"modules.cpu-x86-64-v3.kernel_isa.prefill: is missing"),
])
def test_multi_isa_module_entries_are_checked(edit, message):
    data = multi_isa_manifest()
    edit(data["modules"])
    with pytest.raises(BundleError, match=message):
        check_schema(PATH, data)


def test_a_multi_isa_manifest_loads_from_disk_and_lists_its_modules(tmp_path):
    data = multi_isa_manifest()
    for name in ("params.irpa", *(m["file"] for m in data["modules"].values())):
        (tmp_path / name).write_bytes(b"x" * 10)
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    manifest = Manifest.load(tmp_path)
    assert manifest.devices() == ["cpu"]
    assert manifest.module_keys("cpu") == ["cpu-x86-64-v2", "cpu-x86-64-v3", "cpu-cascadelake"]
    (tmp_path / "model.cpu-x86-64-v3.vmfb").unlink()
    with pytest.raises(BundleError, match="is missing model.cpu-x86-64-v3.vmfb"):
        Manifest.load(tmp_path)
