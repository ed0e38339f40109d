"""A batched bundle compiled with `--activations int8` decodes with the int8 kernels, each row as fewer rows
compute it.

A quantized tiny model (llama-tiny with block-exact q4 weights and an MLP width
of 128, so every projection takes an int8 kernel and its fusions:
test_fusion.py) is compiled with `--batch 4 --rows 1,2 --activations int8` for this host. Four
rows with different prompts run through the 4-row entry points, the first two
again through the 2-row ones, each sequence alone through the 1-row ones. The
int8 kernels compute each row to the bit as the one-row kernel does
(test_int8_channels.py on x86, whose batched bundles take the channel-lane
kernels; test_int8_decode.py), and every decode entry point attends with the same
kernel (kernels/attention.py), so a row's logits, prefill and decode, are the
same to the bit over 1, 2 or 4 rows. Every row is within the int8 bound of the
float32 eager model (test_avx2_kernels.py's).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from foldline.backends.targets import host_arch
from foldline.kernels.select import cpu_has_int8_dot
from foldline.runtime.device import host_cpu_features

from kernels.test_fusion import _blocked

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not cpu_has_int8_dot(host_cpu_features() or set()),
                                 reason="this CPU has no int8 dot product")]

PRESET, FMT, INTERMEDIATE = "llama-tiny", "q4", 128
ROWS = 4
ROW_COUNTS = (1, 2)  # entry points below the batch
PROMPTS = [list(range(3, 15)), list(range(50, 59)), list(range(7, 23)), [90, 4, 17, 33, 2]]
DECODE_STEPS = 12
SCALED_TOL_INT8 = 3e-2  # |bundle - eager| over the step's largest |eager| logit (test_avx2_kernels.py)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from foldline.backends.build import BuildOptions, compile_model

    out = tmp_path_factory.mktemp("batched-int8") / "bundle"
    compile_model(_blocked(PRESET, FMT, INTERMEDIATE), out, BuildOptions(weights="auto", activations="int8", batch=ROWS, rows=ROW_COUNTS),
                  progress=lambda _m: None)
    return out


def _tokens(prompt: list[int]) -> list[int]:
    """The tokens each sequence is fed after its prompt (fixed, so every run feeds the same ones)."""
    return [(prompt[0] * 7 + 11 * i) % 97 + 2 for i in range(DECODE_STEPS)]


def _batched(model, rows: int) -> list[np.ndarray]:
    """Per sequence of the first `rows`, its logits after the prompt and after each token, all rows in every
    call: the `rows`-row entry points."""
    batch = model.batch()
    for row in range(rows):
        batch.open_row(row)
    steps = [batch.step(dict(enumerate(PROMPTS[:rows])), prompt_rows=set(range(rows)))]
    for i in range(DECODE_STEPS):
        steps.append(batch.step({row: [_tokens(p)[i]] for row, p in enumerate(PROMPTS[:rows])}))
    batch.close()
    return [np.stack([step[row] for step in steps]) for row in range(rows)]


def _alone(model, prompt: list[int]) -> np.ndarray:
    """A sequence's logits in row 0 of a fresh batch, no other row open: the 1-row entry points."""
    batch = model.batch()
    batch.open_row(0)
    steps = [batch.step({0: prompt}, prompt_rows={0})[0]]
    steps += [batch.step({0: [t]})[0] for t in _tokens(prompt)]
    batch.close()
    return np.stack(steps)


def test_batched_bundle_decodes_with_int8_kernels(bundle):
    manifest = json.loads((bundle / "manifest.json").read_text())
    module = manifest["modules"]["cpu"]
    assert module["activations"] == "int8"
    isa = module["kernel_isa"]["decode"]
    assert isa != "f32"
    # x86 forms: output channels in the lanes for every row count (kernels/int8_channels.py); aarch64: k lanes
    lanes = " channel-lanes" if host_arch() == "x86_64" else ""
    assert module["kernels"].get(f"qlinear decode {isa}{lanes}", 0) > 0, module["kernels"]
    assert not any(kind.startswith("qlinear rows") for kind in module["kernels"]), \
        "a decode row took the float multi-row kernel"
    names = {m.decode() for m in re.findall(rb"foldline_i8dot_\w+", (bundle / module["file"]).read_bytes())}
    assert all(("_cl" in n) == bool(lanes) for n in names), sorted(names)
    rows = {n: int(m.group(1)) if (m := re.search(r"_n\d+_r(\d+)", n)) else 1 for n in names}
    assert set(rows.values()) == {*ROW_COUNTS, ROWS}, f"kernels over 1, 2 and {ROWS} rows expected: {sorted(names)}"
    for marker in ("_rms", "_swiglu", "_res"):  # the fusions of the one-row kernels, over rows too
        assert {rows[n] for n in names if marker in n} == {*ROW_COUNTS, ROWS}, marker
    attention = {m.decode() for m in re.findall(rb"foldline_attn_b(\d+)_", (bundle / module["file"]).read_bytes())}
    assert attention == {str(r) for r in (*ROW_COUNTS, ROWS)}, f"decode attention kernels over rows {sorted(attention)}"


def test_rows_get_the_same_logits_over_any_rows_and_match_eager(bundle):
    from foldline.runtime import Model
    from foldline.testing.parity import EagerRunner

    with Model.load(bundle) as model:
        assert model.batch_size == ROWS and model.rows_for(2) == 2
        four, two = _batched(model, ROWS), _batched(model, 2)
        alone = [_alone(model, p) for p in PROMPTS]
    eager_module = _blocked(PRESET, FMT, INTERMEDIATE).module
    for row, prompt in enumerate(PROMPTS):
        for k, other in ((2, two), (1, alone)):
            if row < len(other):  # the prefill, then every decode step
                np.testing.assert_array_equal(four[row], other[row], err_msg=f"row {row}: 4-row and {k}-row entry points")
        runner = EagerRunner(eager_module, 16)
        eager = np.stack([np.asarray(runner.prefill(prompt)).reshape(-1)]
                         + [np.asarray(runner.decode(t)).reshape(-1) for t in _tokens(prompt)])
        scaled = np.abs(four[row] - eager).max(axis=1) / np.abs(eager).max(axis=1)
        assert scaled.max() < SCALED_TOL_INT8, f"row {row}: worst scaled difference {scaled.max():.2e}"
        assert (four[row].argmax(axis=1) == eager.argmax(axis=1)).mean() >= 0.75, f"row {row}"
