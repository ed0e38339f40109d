"""fold-embedding-scale: exact golden tests, tied heads, non-constant multipliers, idempotence."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.export.graph_signature import InputKind

from foldline.frontend.arch import get_preset
from foldline.frontend.types import TORCH_DTYPES
from foldline.passes import fold_embedding_scale as fold
from foldline.passes.manager import CompileUnit, run_pipeline
from foldline.testing.golden import compare_units, copy_unit, golden_check, make_steps

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PASS = "fold-embedding-scale"
EMBEDDING = torch.ops.aten.embedding.default


def _embeddings(program):
    return [n for n in program.graph.nodes if n.op == "call_function" and n.target == EMBEDDING]


def _spec(program, placeholder: str):
    return next(s for s in program.graph_signature.input_specs if getattr(s.arg, "name", None) == placeholder)


def _expected_scale(cfg) -> torch.Tensor | float:
    """The multiplier exactly as the reference module applies it."""
    if cfg.embed_scale_dtype is not None:
        return torch.tensor(cfg.embed_scale, dtype=TORCH_DTYPES[cfg.embed_scale_dtype]).to(TORCH_DTYPES[cfg.dtype])
    return cfg.embed_scale


@pytest.mark.parametrize("preset", ["ripple-tiny", "gemma3-tiny"])
def test_fold_golden_presets(preset, exported_unit):
    """Bit-exact: the folded table holds the products the runtime multiply computed."""
    cfg = get_preset(preset)
    unit = exported_unit(cfg, batch=2, chunk=8)
    steps = make_steps([19, 11], 8, 6, cfg.vocab_size, seed=2)
    after, report, pass_report = golden_check(unit, [PASS], steps)
    assert pass_report[0]["changed"] and pass_report[0]["sites"] == len(unit.programs)
    assert report.worst_logit_error == 0.0 and report.worst_state_error == 0.0, report.summary()

    tables = []
    for name, program in after.programs.items():
        (lookup,) = _embeddings(program)  # one lookup, and the seed reads it: no second table, no multiply
        spec = _spec(program, lookup.args[0].name)
        assert spec.target == "model.embed_tokens.weight_scaled"
        table = program.state_dict[spec.target]
        original = unit.programs[name].state_dict["model.embed_tokens.weight"]
        assert torch.equal(table, torch.ops.aten.mul.Tensor(original, _expected_scale(cfg)))
        tables.append(table)
        # Nothing multiplies the lookup by a constant any more: the scale is applied exactly once.
        for user in lookup.users:
            if user.target == torch.ops.aten.mul.Tensor:
                other = user.args[1] if user.args[0] is lookup else user.args[0]
                assert isinstance(other, torch.fx.Node) and other.op != "placeholder"
        targets = {s.target for s in program.graph_signature.input_specs}
        if cfg.tie_word_embeddings:
            # The head keeps reading the unscaled table.
            linears = [n for n in program.graph.nodes if n.target == torch.ops.aten.linear.default]
            head = linears[-1]
            assert _spec(program, head.args[1].name).target == "model.embed_tokens.weight"
            assert not any(s.kind == InputKind.CONSTANT_TENSOR for s in program.graph_signature.input_specs)
        else:
            assert "model.embed_tokens.weight" not in targets
            assert "model.embed_tokens.weight" not in program.state_dict
    # One folded table shared by the entry points: one parameter after import, not two.
    assert all(t is tables[0] for t in tables)


def test_fold_value_residual_reads_the_lookup_once(exported_unit):
    """Ripple's value-residual seed is the folded lookup itself, in every layer."""
    cfg = get_preset("ripple-tiny")
    after = copy_unit(exported_unit(cfg, batch=2, chunk=8))
    run_pipeline(after, [PASS], progress=lambda _m: None)
    program = after.programs["prefill"]
    (lookup,) = _embeddings(program)
    seed_readers = [u for u in lookup.users if u.target == torch.ops.aten.mul.Tensor
                    and any(getattr(a, "target", None) == torch.ops.aten.rsub.Scalar for a in u.args)]
    assert len(seed_readers) == cfg.num_layers


def test_fold_declines_large_tied_table(exported_unit, monkeypatch):
    monkeypatch.setattr(fold, "TIED_COPY_LIMIT_BYTES", 0)
    unit = copy_unit(exported_unit(get_preset("gemma3-tiny"), batch=2, chunk=8))
    programs = dict(unit.programs)
    report = run_pipeline(unit, [PASS], progress=lambda _m: None)
    assert not report[0]["changed"]
    assert any("declined" in n and "tied head" in n for n in report[0]["notes"])
    assert unit.programs == programs
    # An untied table is not affected by the limit.
    ripple = copy_unit(exported_unit(get_preset("ripple-tiny"), batch=2, chunk=8))
    assert run_pipeline(ripple, [PASS], progress=lambda _m: None)[0]["changed"]


def test_fold_idempotent(exported_unit):
    unit = copy_unit(exported_unit(get_preset("gemma3-tiny"), batch=2, chunk=8))
    first = run_pipeline(unit, [PASS], progress=lambda _m: None)
    programs = dict(unit.programs)
    second = run_pipeline(unit, [PASS], progress=lambda _m: None)
    assert first[0]["changed"] and not second[0]["changed"] and second[0]["sites"] == 0
    assert unit.programs == programs


def test_fold_not_applicable_to_llama(exported_unit):
    unit = copy_unit(exported_unit(get_preset("llama-tiny")))
    programs = dict(unit.programs)
    assert not run_pipeline(unit, [PASS], progress=lambda _m: None)[0]["changed"]
    assert unit.programs == programs


def test_fold_bf16_gemma_cast_normaliser(exported_unit):
    """Gemma casts its fp32 normaliser to bf16 before multiplying: the fold must use that rounded value."""
    cfg = get_preset("gemma3-tiny").replace(
        name="gemma-bf16", layer_types=("local", "global"), dtype="bfloat16", embed_scale=10.3
    )
    unit = exported_unit(cfg, batch=1, chunk=4)
    steps = make_steps([9], 4, 3, cfg.vocab_size)
    after, report, pass_report = golden_check(unit, [PASS], steps)
    assert pass_report[0]["changed"]
    assert report.worst_logit_error == 0.0 and report.worst_state_error == 0.0, report.summary()
    table = after.programs["decode"].state_dict["model.embed_tokens.weight_scaled"]
    original = unit.programs["decode"].state_dict["model.embed_tokens.weight"]
    assert table.dtype == torch.bfloat16
    bf16_scale = torch.tensor(10.3).to(torch.bfloat16)
    assert float(bf16_scale) != 10.3  # the cast matters, so the test can tell
    assert torch.equal(table, original * bf16_scale)


class _Scaled(nn.Module):
    """A hand-made lookup whose multiplier is chosen per test."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.embed = nn.Embedding(32, 8)
        self.gain = nn.Parameter(torch.tensor(3.0))
        self.head = nn.Linear(8, 32, bias=False)

    def forward(self, ids, runtime_scale):
        x = self.embed(ids)
        if self.mode == "input":
            x = x * runtime_scale
        elif self.mode == "parameter":
            x = x * self.gain
        elif self.mode == "twice":
            x = x * 2.5 * 0.3
        elif self.mode == "left":
            x = torch.mul(torch.tensor(1.7), x)
        return self.head(x + runtime_scale)


def _hand_unit(mode: str) -> CompileUnit:
    torch.manual_seed(0)
    module = _Scaled(mode).eval()
    args = (torch.randint(0, 32, (2, 5)), torch.tensor(1.25))
    with torch.no_grad():
        program = torch.export.export(module, args, strict=False).run_decompositions({})
    return CompileUnit(get_preset("llama-tiny"), {"prefill": program}, [])


def _run(program, mode):
    torch.manual_seed(1)
    ids = torch.randint(0, 32, (2, 5))
    with torch.no_grad():
        return program.module()(ids, torch.tensor(0.75))


@pytest.mark.parametrize("mode", ["input", "parameter"])
def test_fold_leaves_non_constant_multiplier(mode):
    unit = _hand_unit(mode)
    before = unit.programs["prefill"]
    report = run_pipeline(unit, [PASS], progress=lambda _m: None)
    assert not report[0]["changed"]
    assert unit.programs["prefill"] is before


@pytest.mark.parametrize("mode", ["twice", "left"])
def test_fold_constant_chains_exactly_once(mode):
    unit = _hand_unit(mode)
    before = unit.programs["prefill"]
    first = run_pipeline(unit, [PASS], progress=lambda _m: None)
    after = unit.programs["prefill"]
    assert first[0]["changed"] and first[0]["sites"] == (2 if mode == "twice" else 1)
    assert not run_pipeline(unit, [PASS], progress=lambda _m: None)[0]["changed"]  # nothing left to fold
    assert torch.equal(_run(after, mode), _run(before, mode))
    (lookup,) = _embeddings(after)
    assert not [u for u in lookup.users if u.target == torch.ops.aten.mul.Tensor]
    # Only the final table is kept: intermediate folds and the lifted constants are gone.
    lifted = [s for s in after.graph_signature.input_specs if s.kind != InputKind.USER_INPUT]
    table = "embed.weight_scaled" + ("_scaled" if mode == "twice" else "")
    assert sorted(s.target for s in lifted) == [table, "gain", "head.weight"]


def test_golden_catches_a_doubled_scale(exported_unit):
    """The harness must fail a fold that leaves the runtime multiply in place as well."""
    cfg = get_preset("ripple-tiny")
    unit = exported_unit(cfg, batch=2, chunk=8)
    after = copy_unit(unit)
    run_pipeline(after, [PASS], progress=lambda _m: None)
    for name, program in after.programs.items():
        table = program.state_dict["model.embed_tokens.weight_scaled"]
        state_dict = dict(program.state_dict)
        state_dict["model.embed_tokens.weight_scaled"] = nn.Parameter(table * cfg.embed_scale, requires_grad=False)
        after.programs[name] = program._update(program.graph_module, program.graph_signature,
                                               state_dict=state_dict)
    report = compare_units(unit, after, make_steps([9, 4], 8, 2, cfg.vocab_size))
    assert report.worst_logit_error > 1e-2, report.summary()
