"""fuse-hadamard: fold mode leaves no rotation, online mode shares them and lowers to a butterfly."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.export import ExportedProgram

from foldline.frontend import hadamard as H
from foldline.frontend.arch import get_preset
from foldline.frontend.export import example_inputs, export_model, position_shape
from foldline.frontend.model import build_model
from foldline.passes.fuse_hadamard import ENV_MODE, HadamardModeError, fuse_hadamard, hadamard_mode
from foldline.passes.manager import CompileUnit

from helpers.rotated_gguf import rotated_model

MATMULS = {"aten.mm.default", "aten.bmm.default", "aten.addmm.default", "aten.matmul.default",
           "aten.linear.default", "aten.baddbmm.default"}
N_LAYERS = 3  # llama-tiny


@pytest.fixture(scope="module")
def exported():
    """Rotated llama-tiny (block 32: 64 = 2 blocks, 160 = 5 blocks), both entry points, exported once."""
    ref = build_model(get_preset("llama-tiny"), seed=0)
    rot, meta = rotated_model(ref, block_size=32, seed=11)
    entries = export_model(rot, batch=1, chunk=8)
    return ref, rot, meta, entries


def _unit(entries, mode: str | None) -> CompileUnit:
    unit = CompileUnit(get_preset("llama-tiny"), {n: e.program for n, e in entries.items()},
                       entries["prefill"].state_specs)
    if mode is not None:
        unit.options = {"hadamard": mode}
    return unit


def _ops(program: ExportedProgram) -> Counter:
    return Counter(str(n.target) for n in program.graph.nodes if n.op == "call_function")


def _hadamard_nodes(program: ExportedProgram) -> int:
    return sum(1 for n in program.graph.nodes if n.op == "call_function" and n.target in H.HADAMARD_OPS)


def _run(program: ExportedProgram, rot, name: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits and the state after the call, from a fixed nonzero input."""
    args = list(example_inputs(rot, name, 1, 8))
    gen = torch.Generator().manual_seed(3)
    args[0] = torch.randint(0, 512, args[0].shape, generator=gen)
    if name == "decode":
        args[1], args[2] = torch.tensor([5]), position_shape(5)
    state = [torch.randn(t.shape, generator=gen) * 0.1 for t in args[3:]]  # after tokens, pos and n_valid/pos_shape
    args = args[: len(args) - len(state)] + state
    with torch.no_grad():
        out = program.module()(*args)
    return out, state


def _assert_same_program_behaviour(before: ExportedProgram, after: ExportedProgram, rot, name: str) -> None:
    out_a, state_a = _run(before, rot, name)
    out_b, state_b = _run(after, rot, name)
    scale = out_a.abs().max()
    assert float((out_a - out_b).abs().max() / scale) < 1e-5
    for a, b in zip(state_a, state_b):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_mode_selection(monkeypatch):
    unit = CompileUnit(get_preset("llama-tiny"), {}, [])
    monkeypatch.delenv(ENV_MODE, raising=False)
    assert hadamard_mode(unit) == "fold"
    monkeypatch.setenv(ENV_MODE, "online")
    assert hadamard_mode(unit) == "online"
    unit.options = {"hadamard": "fold"}
    assert hadamard_mode(unit) == "fold"  # the compile option wins over the environment
    unit.options = {"hadamard": "dense"}
    with pytest.raises(HadamardModeError, match="dense"):
        hadamard_mode(unit)


def test_fold_removes_every_rotation_and_restores_the_weights(exported):
    ref, rot, _, entries = exported
    unit = _unit(entries, "fold")
    before = dict(unit.programs)
    per_entry = 7 * N_LAYERS + 2  # every linear of every layer, the tied head and the lookup
    assert all(_hadamard_nodes(p) == per_entry for p in before.values())
    result = fuse_hadamard(unit)
    assert result.changed
    assert result.details["folded"] == 2 * per_entry
    assert result.details["shared"] == 2 * 3 * N_LAYERS  # q/k/v -> 1 and gate/up -> 1, per layer
    assert result.details["online"] == 0
    for name, program in unit.programs.items():
        assert _hadamard_nodes(program) == 0, name
        assert not any("hadamard" in str(n.target) for n in program.graph.nodes)
        assert not any("hadamard_signs" in (s.target or "") for s in program.graph_signature.input_specs)
        _assert_same_program_behaviour(before[name], program, rot, name)
    # The new weights are the unrotated model's, up to one rounding.
    sd = unit.programs["decode"].state_dict
    ref_params = dict(ref.named_parameters())
    for param in ("layers.0.mlp.down_proj.weight", "layers.2.mixer.q_proj.weight", "embed_tokens.weight"):
        folded = sd[f"model.{param}_unrotated"]
        torch.testing.assert_close(folded, ref_params[param].detach(), rtol=0, atol=2e-6)
        assert f"model.{param}" not in sd  # the stored (rotated) copy is gone
    # Tied table: the lookup and the head read one folded table.
    decode = unit.programs["decode"]
    table = [n for n in decode.graph.nodes if n.op == "placeholder" and n.name.endswith("embed_tokens_weight_unrotated")]
    assert len(table) == 1
    assert {u.target for u in table[0].users} == {torch.ops.aten.embedding.default, torch.ops.aten.linear.default}
    # Entry points share each folded weight: the bundle holds the unrotated model's bytes, once.
    from foldline.backends.iree.importer import INLINE_LIMIT, import_programs

    _, params = import_programs(unit.programs.items())
    expected = sum(p.numel() * p.element_size() for p in ref.parameters() if p.numel() > INLINE_LIMIT)
    assert params.nbytes == expected, (params.nbytes, expected, sorted(params.tensors))
    # Idempotent.
    programs = dict(unit.programs)
    again = fuse_hadamard(unit)
    assert not again.changed and again.sites == 0
    assert all(unit.programs[n] is programs[n] for n in programs)


def test_online_shares_rotations_and_lowers_to_a_butterfly(exported):
    from foldline.backends.lowering import lower_to_aten

    _, rot, _, entries = exported
    online = _unit(entries, "online")
    before = dict(online.programs)
    result = fuse_hadamard(online)
    per_entry = 4 * N_LAYERS + 2  # qkv, o, gate/up, down per layer; head; lookup
    assert result.details == {**result.details, "mode": "online", "folded": 0, "shared": 2 * 3 * N_LAYERS,
                              "online": 2 * per_entry}
    for name, program in online.programs.items():
        assert _hadamard_nodes(program) == per_entry, name
        _assert_same_program_behaviour(before[name], program, rot, name)
    rotations = [n for n in online.programs["decode"].graph.nodes if n.target == torch.ops.foldline.hadamard_rotate.default]
    q_rot = next(n for n in rotations if any("q_proj" in str(u.args[1]) for u in n.users))
    assert len(q_rot.users) == 3  # q, k and v read one rotation

    again = fuse_hadamard(online)
    assert not again.changed

    folded = _unit(entries, "fold")
    fuse_hadamard(folded)
    low_online = _ops(lower_to_aten(online.programs["decode"]))
    low_fold = _ops(lower_to_aten(folded.programs["decode"]))
    assert not any("hadamard" in op for op in low_online)  # decomposed before MLIR import
    mm_online = sum(c for op, c in low_online.items() if op in MATMULS)
    mm_fold = sum(c for op, c in low_fold.items() if op in MATMULS)
    assert mm_online == mm_fold, (mm_online, mm_fold)  # no dense n x n matmul was added for any rotation
    addsub_extra = sum(low_online[k] - low_fold[k] for k in ("aten.add.Tensor", "aten.sub.Tensor"))
    # Each rotation of a block-32 activation is 5 butterfly stages of one add and one sub.
    assert addsub_extra >= per_entry * 5 * 2
    lowered = lower_to_aten(online.programs["decode"])
    square = [n for n in lowered.graph.nodes if n.op == "placeholder"
              and [str(d) for d in getattr(n.meta.get("val"), "shape", ())] in (["32", "32"], ["160", "160"])]
    assert square == []


def test_compile_cli_and_build_options_carry_the_mode():
    from foldline.backends.build import BuildOptions
    from foldline.tools.cli import build_parser

    assert BuildOptions().hadamard == "fold"
    args = build_parser().parse_args(["compile", "llama-tiny", "-o", "out", "--hadamard", "online"])
    assert args.hadamard == "online"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["compile", "llama-tiny", "-o", "out", "--hadamard", "dense"])


def test_folding_first_lets_the_embedding_scale_fold():
    """gemma3-tiny (scaled, tied table): after fuse-hadamard the lookup is plain again, so the scale folds."""
    from foldline.frontend.export import export_entry_point
    from foldline.passes.manager import run_pipeline

    ref = build_model(get_preset("gemma3-tiny"), seed=0)
    rot, _ = rotated_model(ref, block_size=32, seed=13)
    entry = export_entry_point(rot, "decode")
    unit = CompileUnit(rot.cfg, {"decode": entry.program}, entry.state_specs, options={"hadamard": "fold"})
    before = unit.programs["decode"]
    report = run_pipeline(unit, ["fuse-hadamard", "fold-embedding-scale"], progress=lambda _m: None)
    assert [r["changed"] for r in report] == [True, True]
    after = unit.programs["decode"]
    assert _hadamard_nodes(after) == 0
    lookups = [n for n in after.graph.nodes if n.target == torch.ops.aten.embedding.default]
    assert len(lookups) == 1
    spec = next(s for s in after.graph_signature.input_specs if s.arg.name == lookups[0].args[0].name)
    assert spec.target.endswith("embed_tokens.weight_unrotated_scaled"), spec.target  # unrotated, then scaled
    assert any(note.startswith("decode: folded x8") for note in report[1]["notes"]), report[1]["notes"]
    _assert_same_program_behaviour(before, after, rot, "decode")
