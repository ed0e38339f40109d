"""The channel-lane int8 decode kernels (kernels/int8_channels.py) against numpy, in each x86 form.

Each form's cases are compiled into one module (one compile per form): every
shape against the int8 emulation (tests/kernels/int8_reference.py), and every
few-row shape's rows against the same kernel on one row, which they must equal
to the bit (each lane computes its channel alone, whatever the rows).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from foldline.kernels import int8_channels as cl
from foldline.kernels import int8_decode as vk
from foldline.runtime.device import host_cpu_features

from kernels.int8_reference import X86_FORMS, check_form_code, compile_on_host
from kernels.test_int8_decode import _case, _module, rows_case

SHAPES = [
    vk.Int8DotShape("q4", 32, "f16", True, 576, 192),  # Q4_1 (SmolLM2), the scales gathered as f16 pairs
    vk.Int8DotShape("q4", 32, "f32", True, 640, 64),  # Q4_K: f32 scales, one word a group
    vk.Int8DotShape("q4", 64, "f16", True, 256, 32),  # group 64: half a word a step, loaded channel by channel
    vk.Int8DotShape("q8", 32, "f16", False, 640, 320, norm=vk.RowNorm(1e-6, 1.0)),  # Q8_0 head with Gemma's norm
    vk.Int8DotShape("q5", 32, "f16", True, 640, 64, norm=vk.RowNorm(1e-6, 1.0), residual=True),  # Q5_0
    vk.Int8DotShape("q8", 16, "f32", False, 2048, 640, gate="gelu_tanh"),  # Q6_K, Gemma 3's down
    vk.Int8DotShape("q4", 32, "f16", True, 1536, 576, residual=True, gate="silu"),  # SmolLM2's down
    vk.Int8DotShape("q8", 32, "f32", True, 1024, 16384),  # mins on q8 codes; large N, 1024 channels a workgroup
]
ROW_SHAPES = [
    (vk.Int8DotShape("q4", 32, "f16", True, 576, 192, norm=vk.RowNorm(1e-5, None)), 8),  # SmolLM2's q/k/v
    (vk.Int8DotShape("q4", 32, "f16", True, 1536, 576, residual=True, gate="silu"), 4),  # SmolLM2's down
    (vk.Int8DotShape("q8", 32, "f16", False, 576, 256, norm=vk.RowNorm(1e-5, None)), 5),  # the head, odd rows
    (vk.Int8DotShape("q5", 16, "f16", True, 128, 32), 2),  # q5 in groups of 16: four groups a step
]


def _shape(shape: vk.Int8DotShape, isa, rows: int = 1) -> vk.Int8DotShape:
    return dataclasses.replace(shape, isa=isa, rows=rows, channel_lanes=True)


@pytest.fixture(scope="module", params=[pytest.param(p.values, id=p.id) for p in X86_FORMS])
def compiled(request, tmp_path_factory):
    """(form, the module of every case of this file compiled for the form's CPU)."""
    isa, cpu = request.param
    if not isa.available(host_cpu_features() or set()):
        pytest.skip(f"this CPU cannot run {isa.name}")
    functions = [(_shape(s, isa), f"one{i}") for i, s in enumerate(SHAPES)]
    for i, (s, rows) in enumerate(ROW_SHAPES):
        functions += [(_shape(s, isa, rows), f"rows{i}"), (_shape(s, isa), f"row{i}")]
    executables, funcs = {}, []
    for shape, name in functions:  # each executable once, however many functions call it
        executable, func = _module(shape, name).split("\nutil.func", 1)
        executables[shape.name] = executable
        funcs.append("\nutil.func" + func)
    text = "".join(executables.values()) + "".join(funcs)
    module, assembly = compile_on_host(text, tmp_path_factory.mktemp("channels") / "dump", cpu)
    check_form_code(assembly, isa)
    return isa, module


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(SHAPES)), ids=[s.name for s in SHAPES])
def test_channel_lane_kernel_matches_int8_emulation(compiled, index):
    isa, module = compiled
    shape = _shape(SHAPES[index], isa)
    for seed in range(2):
        args, emulated, exact = _case(shape, np.random.default_rng(seed))
        y = getattr(module, f"one{index}")(*args).to_host()
        scale = np.abs(exact).max()
        np.testing.assert_allclose(y, emulated, rtol=1e-5, atol=1e-5 * scale)
        rel_rms = np.sqrt(np.mean((y - exact) ** 2)) / np.sqrt(np.mean(exact ** 2))
        assert rel_rms < (2e-2 if shape.gated else 1e-2), f"relative RMS error {rel_rms:.2e} against float activations"


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(ROW_SHAPES)), ids=[f"{s.name}_r{r}" for s, r in ROW_SHAPES])
def test_channel_lane_rows_equal_the_one_row_kernel(compiled, index):
    isa, module = compiled
    shape, rows = ROW_SHAPES[index]
    stacked, ones, emulated, scale = rows_case(_shape(shape, isa, rows))
    y = getattr(module, f"rows{index}")(*stacked).to_host().reshape(rows, shape.n)
    for r, (args, want) in enumerate(zip(ones, emulated)):
        np.testing.assert_array_equal(y[r], getattr(module, f"row{index}")(*args).to_host(),
                                      err_msg=f"row {r} differs from the one-row kernel")
        np.testing.assert_allclose(y[r], want, rtol=1e-5, atol=1e-5 * scale)


def test_channel_lanes_take_whole_vectors_of_channels():
    assert cl.supports(vk.Int8DotShape("q4", 32, "f16", True, 576, 192, channel_lanes=True))
    assert not cl.supports(vk.Int8DotShape("q4", 32, "f16", True, 576, 200, channel_lanes=True))
    with pytest.raises(ValueError, match="channel lanes"):
        vk.int8_dot_executable(vk.Int8DotShape("q4", 32, "f16", True, 576, 192, channel_lanes=True))
    assert "_cl" in vk.Int8DotShape("q4", 32, "f16", True, 576, 192, channel_lanes=True).name


@pytest.mark.parametrize("n,rows", [(192, 1), (576, 8), (3072, 1), (49152, 4), (64, 1), (16, 2)])
def test_channel_lane_workgroups_divide_the_channels(n, rows):
    shape = vk.Int8DotShape("q8", 32, "f16", False, 576, n, rows=rows, channel_lanes=True)
    count = cl.workgroups(shape)
    assert (n // cl.CHANNELS) % count == 0
    assert count <= max(1, shape.workgroups_below_large_n if n < vk.LARGE_N else n // 1024)
