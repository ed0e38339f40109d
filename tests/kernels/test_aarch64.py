"""aarch64 executed, not only compiled: bundles and kernels for Arm CPUs run under qemu-user.

The aarch64 side is this checkout's runtime on Debian's arm64 Python with the
aarch64 iree-base-runtime wheel (bench/aarch64_python.py; scripts/setup_arm64.sh
installs it, and CI runs setup). Bundles for a dotprod CPU (cortex-a76: the
int8-activation kernels in their NEON `sdot` form, kernels/arm/) and for
`--cpu generic` (the float kernels any Armv8-A runs), and for an i8mm CPU
(neoverse-v1: the prefill GEMM on `smmla`), are compared with torch eager
and with the x86 module of the same bundle (one bundle holds both arches'
modules, each side's runtime taking its own); each int8 kernel shape is compared
with its int8 emulation in every Arm form, as the x86 forms are
(test_int8_decode.py, test_int8_gemm.py). qemu emulates the CPU (its `max`
model has dotprod and i8mm): this checks what an Arm machine computes, not
how fast.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from foldline.bench.aarch64_python import Arm64Python
from foldline.kernels import int8_decode as vk
from foldline.kernels.arm import NEON_DOTPROD, NEON_I8MM

from kernels import test_int8_decode, test_int8_gemm, test_quant_compile
from kernels.int8_reference import check_form_code

pytestmark = pytest.mark.slow

TRIPLE = "aarch64-unknown-linux-gnu"
PROMPT = list(range(3, 83))  # 80 tokens: two prefill chunks of 64, gemma3-tiny's 16-slot windows wrap 5 times
FORCED = list(range(40, 64))  # 24 decode steps, the same tokens on every side

# Runs on aarch64, in one qemu process for the whole file (each start of the emulated Python is tens of
# seconds): a bundle job prefills PROMPT and decodes FORCED, a kernel job runs its module's `main` on its
# arguments; each result to its file.
RUN_JOBS = """
import json, sys
import numpy as np
import iree.runtime as rt
from foldline.runtime import Model
for job in json.load(open(sys.argv[1])):
    if "bundle" in job:
        with Model.load(job["bundle"]) as model:
            session = model.session()
            steps = [session.prefill(job["prompt"])] + [session.decode(t) for t in job["forced"]]
        np.save(job["out"], np.stack(steps))
        continue
    config = rt.Config("local-task")
    ctx = rt.SystemContext(config=config)
    with open(job["vmfb"], "rb") as f:
        ctx.add_vm_module(rt.VmModule.copy_buffer(config.vm_instance, f.read()))
    args = np.load(job["args"])
    y = ctx.modules.module.main(*[args[f"a{i}"] for i in range(len(args.files))]).to_host()
    np.save(job["out"], y)
"""


@pytest.fixture(scope="module")
def arm64() -> Iterator[Arm64Python]:
    found = Arm64Python.find()
    if isinstance(found, str):
        pytest.skip(found)
    yield found
    found.close()


def _compile(loaded, out: Path, cpu: str, with_host: bool, **options) -> Path:
    """One bundle with a module for `cpu` on aarch64 and, with_host, one for this x86 CPU: one export,
    the runtime on each side taking its own arch's module."""
    from foldline.backends.build import BuildOptions, compile_model
    from foldline.backends.targets import cpu_target

    targets = [cpu_target(cpu, TRIPLE), *([cpu_target("host")] if with_host else [])]
    compile_model(loaded, out, BuildOptions(targets=targets, weights="auto", **options), progress=lambda _m: None)
    return out


def _module(bundle: Path, arch: str) -> dict:
    """The bundle's manifest entry of its one module for `arch`."""
    modules = json.loads((bundle / "manifest.json").read_text())["modules"]
    found = [m for m in modules.values() if m["arch"] == arch]
    assert len(found) == 1, f"{bundle}: {len(found)} modules for {arch}"
    return found[0]


def _eager(loaded) -> tuple[np.ndarray, np.ndarray]:
    """Teacher-forced float32 eager logits and each logit's term scale (testing/parity.py)."""
    from foldline.testing.parity import EagerRunner

    runner = EagerRunner(loaded.module, 64)
    logits, scales = [runner.prefill(PROMPT)], [runner.term_scale()]
    for token in FORCED:
        logits.append(runner.decode(token))
        scales.append(runner.term_scale())
    return np.stack(logits), np.stack(scales)


def _x86_logits(bundle: Path) -> np.ndarray:
    from foldline.runtime import Model

    with Model.load(bundle) as model:
        session = model.session()
        return np.stack([session.prefill(PROMPT)] + [session.decode(t) for t in FORCED])


# (preset, block format, aarch64 CPU, build options): llama with q4 blocks and gemma3 (windows, a q8
# table tied to the head) with q8 on a dotprod core; gemma3 with q4 on an i8mm core (prefill on smmla);
# llama on any Armv8-A, float kernels and caches.
CASES = {
    "llama-q4-dotprod": ("llama-tiny", "q4", "cortex-a76", {}),
    "gemma3-q8-dotprod": ("gemma3-tiny", "q8", "cortex-a76", {}),
    "gemma3-q4-i8mm": ("gemma3-tiny", "q4", "neoverse-v1", {}),
    "llama-q4-generic": ("llama-tiny", "q4", "generic", {"kv_dtype": "float32"}),
}
# the prefill form each case's CPU takes
PREFILL_FORM = {"llama-q4-dotprod": NEON_DOTPROD, "gemma3-q8-dotprod": NEON_DOTPROD, "gemma3-q4-i8mm": NEON_I8MM}


def _bundle_jobs(root: Path) -> tuple[dict, list[dict]]:
    """Every case compiled for aarch64 (the int8 ones in one bundle with this x86 CPU's module)."""
    runs, jobs = {}, []
    for name, (preset, fmt, cpu, options) in CASES.items():
        loaded = test_quant_compile._blocked(preset, fmt)
        arm = _compile(loaded, root / name / "bundle", cpu, with_host=cpu != "generic", **options)
        runs[name] = {"loaded": loaded, "arm": arm, "x86": arm if cpu != "generic" else None,
                      "out": root / name / "logits.npy"}
        jobs.append({"bundle": str(arm), "prompt": PROMPT, "forced": FORCED, "out": str(runs[name]["out"])})
    return runs, jobs


@pytest.mark.parametrize("case", ["llama-q4-dotprod", "gemma3-q8-dotprod", "gemma3-q4-i8mm"])
def test_int8_bundle_on_arm_matches_x86_and_eager(case, arm_runs):
    """The sdot and smmla kernels compute what the x86 int8 kernels compute, and stay within int8 bounds
    of eager."""
    run = arm_runs[case]
    manifest = _module(run["arm"], "aarch64")
    assert "asimddp" in manifest["cpu_flags"]
    _module(run["x86"], "x86_64")  # the x86 side runs the same bundle's module for this CPU
    prefill = PREFILL_FORM[case]
    assert manifest["kernel_isa"] == {"decode": NEON_DOTPROD.name, "prefill": prefill.name}
    assert manifest["kernels"][f"qlinear decode {NEON_DOTPROD.name}"] > 0
    assert manifest["kernels"][f"qlinear prefill {prefill.name}"] > 0
    arm, x86 = run["logits"], _x86_logits(run["x86"])
    assert arm.shape == (1 + len(FORCED), 512)
    # The same activation quantization and integer dots on both, but not the same float32 rounding
    # before it (the norms, GELU): where that moves an activation across an int8 step, the logits move
    # by a fraction of that step's 1/127. On llama-tiny that happens in one step of 25, on gemma3-tiny
    # in most; a wrong kernel is off by far more, and further from eager than x86 is.
    scaled = np.abs(arm - x86).max(axis=1) / np.abs(x86).max(axis=1)
    assert scaled.max() < 2e-2, f"aarch64 and x86 differ by {scaled.max():.2e} of the largest logit"
    assert (arm.argmax(axis=1) == x86.argmax(axis=1)).all()
    eager, _ = _eager(run["loaded"])
    err_arm, err_x86 = ((np.abs(a - eager).max(axis=1) / np.abs(eager).max(axis=1)).max() for a in (arm, x86))
    assert err_arm < 3e-2, f"int8 activations on aarch64: {err_arm:.2e} of the largest logit from eager"
    assert err_arm <= 1.25 * err_x86 + 1e-3, f"aarch64 {err_arm:.2e} from eager, x86 {err_x86:.2e}"


def test_instruction_count_runs_the_bundle_on_aarch64(arm64, arm_runs, tmp_path):
    """bench/arm_instructions.py's foldline side on the dotprod bundle: it counts a prefill and decodes
    whose greedy tokens are x86's (each within int8 bounds of x86's best logit on the same path)."""
    from foldline.bench.arm_instructions import build_plugin, count_foldline
    from foldline.runtime import Model

    run, prompt, new_tokens = arm_runs["llama-q4-dotprod"], PROMPT[:24], 3
    counted = count_foldline(arm64, build_plugin(tmp_path), run["arm"], "cortex-a76", prompt, new_tokens,
                             pages=True)
    assert counted.per_prompt_token > 0 and counted.per_decoded_token > 0
    assert len(counted.tokens) == new_tokens
    assert sum(counted.decode_where.values()) == round(counted.per_decoded_token * new_tokens)
    with Model.load(run["x86"]) as model:
        session = model.session()
        logits = session.prefill(prompt)
        for token in counted.tokens:
            assert logits[token] >= logits.max() - 2e-2 * np.abs(logits).max(), (token, int(logits.argmax()))
            logits = session.decode(token)


def test_generic_armv8_bundle_takes_the_float_kernels_and_matches_eager(arm_runs):
    """No dotprod named: the portable float kernels, within fp32 tolerance of eager."""
    from foldline.testing.parity import SCALED_TOL_FP32

    run = arm_runs["llama-q4-generic"]
    manifest = _module(run["arm"], "aarch64")
    assert manifest["cpu_flags"] == []
    assert manifest["kernel_isa"] == {"decode": "f32", "prefill": "f32"}
    eager, scale = _eager(run["loaded"])
    worst = (np.abs(run["logits"].astype(np.float64) - eager) / np.maximum(scale, 1e-30)).max()
    assert worst <= SCALED_TOL_FP32, f"worst scaled error {worst:.2e}"
    assert (run["logits"].argmax(axis=1) == eager.argmax(axis=1)).all()


def _compile_for_arm(text: str, dump: Path, cpu: str) -> tuple[bytes, str]:
    import iree.compiler as ireec

    from foldline.backends.targets import cpu_target

    vmfb = ireec.compile_str(text, extra_args=[*cpu_target(cpu, TRIPLE).flags,
                                               f"--iree-hal-dump-executable-files-to={dump}"])
    return vmfb, "\n".join(p.read_text() for p in dump.glob("*.s"))


# (family, Arm form, the CPU compiled for, shape): every decode shape in the sdot form, every prefill
# shape in the sdot and smmla forms
FORM_CPU = {NEON_DOTPROD.name: "cortex-a76", NEON_I8MM.name: "neoverse-v1"}
KERNELS = ([("decode", NEON_DOTPROD, s) for s in test_int8_decode.SHAPES]
           + [("prefill", form, s) for form in (NEON_DOTPROD, NEON_I8MM) for s in test_int8_gemm.SHAPES])


def _kernel_id(family: str, form, shape) -> str:
    return f"{form.name}-{shape.name}"


def _kernel_jobs(root: Path) -> tuple[dict, list[dict]]:
    """Every kernel case compiled for aarch64, with its arguments and int8 emulation."""
    cases, jobs = {}, []
    for i, (family, form, shape) in enumerate(KERNELS):
        shape = dataclasses.replace(shape, isa=form)
        tests = test_int8_decode if family == "decode" else test_int8_gemm
        vmfb, assembly = _compile_for_arm(tests._module(shape), root / f"dump{i}", FORM_CPU[form.name])
        args, emulated, exact = tests._case(shape, np.random.default_rng(0))
        (root / f"k{i}.vmfb").write_bytes(vmfb)
        np.savez(root / f"k{i}.npz", **{f"a{j}": a for j, a in enumerate(args)})
        cases[_kernel_id(family, form, shape)] = {"assembly": assembly, "emulated": emulated, "exact": exact,
                                                  "out": root / f"k{i}.npy"}
        jobs.append({"vmfb": str(root / f"k{i}.vmfb"), "args": str(root / f"k{i}.npz"), "out": str(root / f"k{i}.npy")})
    return cases, jobs


# The few-row decode kernel in the sdot form: each row against the one-row kernel on it, to the bit.
ROW_KERNELS = [dataclasses.replace(s, isa=NEON_DOTPROD, rows=r) for s, r in test_int8_decode.ROW_SHAPES[:5]]


def _row_kernel_jobs(root: Path) -> tuple[dict, list[dict]]:
    """Every few-row case and its one-row kernel on each row, compiled for aarch64."""
    cases, jobs = {}, []
    for i, shape in enumerate(ROW_KERNELS):
        cpu = FORM_CPU[NEON_DOTPROD.name]
        rows_vmfb, assembly = _compile_for_arm(test_int8_decode._module(shape), root / f"dump{i}", cpu)
        one_vmfb, _ = _compile_for_arm(test_int8_decode._module(dataclasses.replace(shape, rows=1)),
                                       root / f"dump{i}-one", cpu)
        (root / f"r{i}.vmfb").write_bytes(rows_vmfb)
        (root / f"o{i}.vmfb").write_bytes(one_vmfb)
        stacked, ones, emulated, scale = test_int8_decode.rows_case(shape)
        for name, vmfb, args in [(f"r{i}", "r", stacked)] + [(f"o{i}-{r}", "o", a) for r, a in enumerate(ones)]:
            np.savez(root / f"{name}.npz", **{f"a{j}": a for j, a in enumerate(args)})
            jobs.append({"vmfb": str(root / f"{vmfb}{i}.vmfb"), "args": str(root / f"{name}.npz"),
                         "out": str(root / f"{name}.npy")})
        cases[shape.name] = {"assembly": assembly, "emulated": emulated, "scale": scale, "rows": root / f"r{i}.npy",
                             "ones": [root / f"o{i}-{r}.npy" for r in range(shape.rows)]}
    return cases, jobs


@pytest.fixture(scope="module")
def arm_results(arm64, tmp_path_factory) -> dict[str, dict]:
    """The bundles, the kernels and the few-row kernels compiled for aarch64 and all run in one qemu process:
    {"bundles": ..., "kernels": ..., "row_kernels": ...}, each case with the path of what aarch64 computed."""
    root = tmp_path_factory.mktemp("aarch64")
    results, jobs = {}, []
    for name, make in (("bundles", _bundle_jobs), ("kernels", _kernel_jobs), ("row_kernels", _row_kernel_jobs)):
        (root / name).mkdir()
        results[name], more = make(root / name)
        jobs += more
    (root / "jobs.json").write_text(json.dumps(jobs))
    arm64.run(RUN_JOBS, str(root / "jobs.json"))
    for run in results["bundles"].values():
        run["logits"] = np.load(run["out"])
    return results


@pytest.fixture(scope="module")
def arm_runs(arm_results):
    return arm_results["bundles"]


@pytest.fixture(scope="module")
def arm_kernels(arm_results):
    return arm_results["kernels"]


@pytest.fixture(scope="module")
def arm_row_kernels(arm_results):
    return arm_results["row_kernels"]


@pytest.mark.parametrize("shape", ROW_KERNELS, ids=lambda s: s.name)
def test_arm_few_row_kernel_gives_each_row_the_one_row_result(shape, arm_row_kernels):
    case = arm_row_kernels[shape.name]
    check_form_code(case["assembly"], NEON_DOTPROD)
    y = np.load(case["rows"]).reshape(shape.rows, shape.n)
    for r, (one, want) in enumerate(zip(case["ones"], case["emulated"])):
        np.testing.assert_array_equal(y[r], np.load(one), err_msg=f"row {r} differs from the one-row kernel")
        assert np.all(np.abs(y[r] - want) <= 1e-5 * case["scale"]), "differs from the int8 emulation"


@pytest.mark.parametrize("family,form,shape", KERNELS,
                         ids=[_kernel_id(*case).replace("int8-neon-", "") for case in KERNELS])
def test_arm_kernel_matches_int8_emulation(family, form, shape, arm_kernels):
    case = arm_kernels[_kernel_id(family, form, shape)]
    check_form_code(case["assembly"], form)
    y, emulated, exact = np.load(case["out"]), case["emulated"], case["exact"]
    axis = 1 if y.ndim == 2 else None  # prefill: per row (rows of very different magnitudes)
    scale = np.abs(exact).max(axis=axis, keepdims=axis is not None)
    assert np.all(np.abs(y - emulated) <= 1e-5 * scale), "differs from the int8 emulation beyond float32 rounding"


def _instructions(assembly: str) -> int:
    """Instructions in a dump's assembly (lines with a mnemonic; no labels, directives or comments)."""
    return sum(bool(re.match(r"\s+[a-z][a-z0-9.]*(\s|$)", line)) and not line.strip().startswith(".")
               for line in assembly.splitlines())


def test_arm_q5_fifth_bits_cost_a_few_instructions(arm_kernels):
    """A q5 row's fifth bits are spread with a table lookup and a compare, not bit by bit: its decode
    kernel is within 1.3x the instructions of q8's at the same K and N (1.12x; 1.74x when LLVM expanded a
    bitcast to i1 lanes, 2.9 instructions per weight against q8's 0.6 in Gemma's decode)."""
    q8, q5 = (vk.Int8DotShape(fmt, 32, "f16", fmt == "q5", 640, 320) for fmt in ("q8", "q5"))
    sizes = {s.fmt: _instructions(arm_kernels[_kernel_id("decode", NEON_DOTPROD, s)]["assembly"]) for s in (q8, q5)}
    assert sizes["q5"] <= 1.3 * sizes["q8"], sizes


@pytest.mark.parametrize("fmt, most", [("q8", 32), ("q4", 40)])
def test_arm_decode_step_sums_groups_before_scaling(fmt, most, tmp_path):
    """On NEON a decode step adds each group's int32 lanes before the float work, one register a group
    rather than four: instructions per 64-code step (the difference between K = 640 and K = 256 over
    their 6 steps) at most `most` (27.8 for q8, 35.5 for q4; 48.3 and 53.7 scaling all 16 lanes)."""
    sizes = []
    for k in (256, 640):
        shape = vk.Int8DotShape(fmt, 32, "f16", fmt == "q4", k, 32, isa=NEON_DOTPROD)
        _, assembly = _compile_for_arm(test_int8_decode._module(shape), tmp_path / f"{k}", "cortex-a76")
        sizes.append(_instructions(assembly))
    per_step = (sizes[1] - sizes[0]) / ((640 - 256) // vk.CODES_PER_STEP)
    assert per_step <= most, f"{per_step:.1f} instructions per step"
