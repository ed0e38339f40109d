"""The registry of int8 kernel forms (contract/isa/): one rank that the compiler's choice of kernels and
the runtime's choice of CPU module both follow, and a form added in one call that both then see."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from foldline.contract.isa import FAMILIES, KernelForm, kernel_form, kernel_forms, register_form
from foldline.kernels.isa import Int8Kernels
from foldline.kernels.select import (
    ISAS,
    choose_kernels,
    cpu_has_int8_dot,
    register_isa,
    unregister_isa,
)
from foldline.kernels.x86 import AVX2, AVX512_VNNI
from foldline.runtime import Manifest
from foldline.runtime.cpu_select import kernel_rank, select_cpu_module

from contract.test_manifest import CASCADELAKE, X86_V3, multi_isa_manifest

TOY_FLAG = "toy_dot"
TOY = KernelForm("int8-toy", "x86_64", frozenset({"avx2", "fma", "f16c", TOY_FLAG}), rank=4)


@pytest.fixture
def toy_isa():
    """A toy x86 form above AVX-512 VNNI, emitted as AVX2 is; registered in one call, forgotten after."""
    before = kernel_forms()
    isa = register_isa(dataclasses.replace(AVX2, form=TOY))
    yield isa
    unregister_isa(TOY.name)
    assert kernel_forms() == before and TOY.name not in ISAS


def _manifest_with_toy_module() -> Manifest:
    """The x86-all manifest plus a module whose kernels are the toy form, compiled for fewer extensions
    than cascadelake's."""
    data = multi_isa_manifest()
    entry = dict(data["modules"]["cpu-cascadelake"])
    entry.update(file="model.cpu-toy.vmfb", cpu="toy", cpu_flags=[*X86_V3, TOY_FLAG],
                 kernel_isa={"decode": TOY.name, "prefill": TOY.name})
    data["modules"]["cpu-toy"] = entry
    return Manifest.from_json(data, Path("bundle"))


def test_a_registered_form_is_chosen_for_the_cpus_that_run_it(toy_isa):
    assert choose_kernels({*CASCADELAKE, TOY_FLAG}) == Int8Kernels(toy_isa, toy_isa)
    assert choose_kernels({*X86_V3, TOY_FLAG}) == Int8Kernels(toy_isa, toy_isa)
    assert choose_kernels(CASCADELAKE) == Int8Kernels(AVX512_VNNI, AVX512_VNNI)  # no toy_dot
    assert choose_kernels({*CASCADELAKE, TOY_FLAG}, "aarch64") == Int8Kernels()  # another arch's form
    assert choose_kernels({*X86_V3, TOY_FLAG}).record() == {"decode": TOY.name, "prefill": TOY.name}


def test_a_registered_form_ranks_its_module_in_the_runtime(toy_isa):
    manifest = _manifest_with_toy_module()
    toy, cascadelake = manifest.modules["cpu-toy"], manifest.modules["cpu-cascadelake"]
    assert kernel_rank(toy) > kernel_rank(cascadelake)  # by its kernels, though it has fewer cpu_flags
    assert select_cpu_module(manifest, {*CASCADELAKE, TOY_FLAG}, "x86_64") == "cpu-toy"
    assert select_cpu_module(manifest, set(CASCADELAKE), "x86_64") == "cpu-cascadelake"
    assert select_cpu_module(manifest, {*X86_V3, TOY_FLAG}, "x86_64") == "cpu-toy"


def test_an_unregistered_form_ranks_as_the_float_kernels():
    """A manifest naming a form this runtime does not know (a newer compiler's) ranks it as float."""
    manifest = _manifest_with_toy_module()
    assert kernel_rank(manifest.modules["cpu-toy"])[0] == 0
    assert select_cpu_module(manifest, {*CASCADELAKE, TOY_FLAG}, "x86_64") == "cpu-cascadelake"


def test_every_form_has_its_emitter_and_every_emitter_its_form():
    assert set(ISAS) == {form.name for form in kernel_forms()}
    assert all(ISAS[form.name].form is kernel_form(form.name) for form in kernel_forms())
    assert {form for family in FAMILIES for form in family.forms} == set(kernel_forms())


def test_the_forms_are_tried_best_first_per_arch_and_kernel_family():
    assert [f.name for f in kernel_forms("x86_64", "decode")] == ["int8-avx512vnni", "int8-avxvnni", "int8-avx2"]
    assert [f.name for f in kernel_forms("aarch64", "prefill")] == ["int8-neon-i8mm", "int8-neon-dotprod"]
    assert [f.name for f in kernel_forms("aarch64", "decode")] == ["int8-neon-dotprod"]  # smmla needs two rows
    assert cpu_has_int8_dot({"asimd", "asimddp", "i8mm"}, "aarch64")


@pytest.mark.parametrize("form, message", [
    (dataclasses.replace(TOY, name="int8-avx2"), "'int8-avx2' is already known"),
    (dataclasses.replace(TOY, name="f32"), "'f32' is already known"),
    (dataclasses.replace(TOY, rank=3), "ranks 3 on x86_64, as 'int8-avx512vnni' does"),
    (dataclasses.replace(TOY, rank=0), "the float kernels rank 0"),
    (dataclasses.replace(TOY, kernel_families=("attention",)), "names kernel families"),
])
def test_a_form_that_would_make_the_choice_ambiguous_is_refused(form, message):
    with pytest.raises(ValueError, match=message):
        register_form(form)
    assert TOY.name not in {f.name for f in kernel_forms()}
