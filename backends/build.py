"""Compile a model into a bundle: export -> passes -> MLIR import -> iree-compile -> files."""

from __future__ import annotations

import gc
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

import iree.compiler as ireec
import iree.runtime as rt

from ..contract.entry_points import row_entry_name
from ..contract.manifest import MANIFEST, FileEntry, Manifest, ModuleEntry, ParamsEntry, sha256_file
from ..contract.vmfb import vmfb_info
from ..dtypes import FLOAT_DTYPES, DTypeError
from ..frontend.export import ENTRY_POINTS, export_entry_point, parameter_target
from ..frontend.fingerprint import checkpoint_fingerprint
from ..frontend.sources import load_model
from ..frontend.tensor_parallel import split_model
from ..frontend.types import LoadedModel
from ..kernels.attention import expand_decode_attention_ops
from ..kernels.isa import FLOAT_KERNELS, Int8Kernels
from ..kernels.mlir import HARDWARE_FLOAT, FloatIsa
from ..kernels.qlinear import expand_qlinear_ops
from ..kernels.select import choose_kernels, cpu_has_int8_dot
from ..passes.manager import CompileUnit, run_pipeline
from ..passes.place_devices import NAME as PLACE_PASS
from ..passes.place_devices import PLACED, Placement
from ..passes.quantize_weights import FIVE_BIT_CODES
from .abi_declaration import declare_entry_points
from .compile_cache import CompileCache
from .compile_pool import pool_size, run_concurrently
from .fused_attention import SITE_NAME as FUSED_SITE
from .fused_attention import attention_form, count_fused_attention
from .importer import import_programs, params_to_numpy
from .inplace_state import ElideReport, elide_inplace_aliases
from .lowering import Lowering
from .multi_device import (
    device_scope,
    multi_device_flags,
    parameters_by_device,
    params_file,
    place_module,
)
from .onnx_export import DEVICE as ONNX_DEVICE
from .onnx_export import export_module as export_onnx_module
from .options import BuildOptions, Progress, build_cache_key, check_devices, from_cache, row_counts
from .targets import Target, TargetError


class StageClock:
    """Times the stages of a compile and tells the progress display where it is.

    `progress` is called with each message; a display that also has
    `start_stage(name, total)` and `advance(detail)` (tools/compile_progress.py)
    draws a bar per stage from them.
    """

    def __init__(self, progress: Progress):
        self.progress = progress
        self.times: dict[str, float] = {}
        self.steps: dict[str, dict[str, float]] = {}  # stage -> step (entry point, module) -> seconds
        self._current: str | None = None
        self._since = self._last_step = time.perf_counter()

    def stage(self, name: str, message: str, total: int | None = None) -> None:
        self._close()
        self._current, self._since = name, time.perf_counter()
        self._last_step = self._since
        self.progress(message)
        start = getattr(self.progress, "start_stage", None)
        if start is not None:
            start(name, total)

    def advance(self, detail: str, seconds: float | None = None) -> None:
        """A step of the current stage is done: `seconds` it took (default: since the previous step)."""
        now = time.perf_counter()
        if self._current is not None:
            took = now - self._last_step if seconds is None else seconds
            self.steps.setdefault(self._current, {})[detail] = took
        self._last_step = now
        step = getattr(self.progress, "advance", None)
        if step is not None:
            step(detail)

    def _close(self) -> None:
        if self._current is not None:
            self.times[self._current] = self.times.get(self._current, 0.0) + time.perf_counter() - self._since
            self._current = None

    def summary(self) -> str:
        """One line, `stage times: export N s [prefill N, decode N], passes N s, ... (total N s)`."""
        self._close()
        total = sum(self.times.values())

        def stage(name: str, seconds: float) -> str:
            steps = self.steps.get(name, {})
            detail = f" [{', '.join(f'{s} {t:.1f}' for s, t in steps.items())}]" if len(steps) > 1 else ""
            return f"{name} {seconds:.1f} s{detail}"

        return "stage times: " + ", ".join(stage(n, t) for n, t in self.times.items()) + f" (total {total:.1f} s)"


def compile_torch_module(mlir: str, flags: list[str]) -> tuple[bytes, ElideReport]:
    """torch-dialect MLIR -> vmfb, in two steps so in-place cache updates stay in place (inplace_state)."""
    converted = ireec.compile_str(mlir, input_type="torch", extra_args=[*flags, "--compile-to=input"])
    text = converted.decode() if isinstance(converted, bytes) else converted
    edited, report = elide_inplace_aliases(text)
    edited, _declared = declare_entry_points(edited, mlir)  # the runtime compares them with the manifest
    return ireec.compile_str(edited, extra_args=[*flags, "--compile-from=input"]), report


# Prefill chunk lengths. A quantized linear dequantizes each weight once per prefill call
# (kernels/qlinear.py), so longer chunks amortize it (docs/history.md, "Prefill chunk, and how
# the kernels changed the figures").
FLOAT_CHUNK = 16
MLIR_FILE = "model.mlir"  # --keep-mlir: the torch-dialect MLIR as imported for the first target
QUANTIZED_CHUNK = 64


KV_DTYPES = FLOAT_DTYPES
COMPUTE_DTYPES = FLOAT_DTYPES


def entry_point_variants(options: BuildOptions) -> list[tuple[str, str, int]]:
    """(function name, entry point, rows) of every function the module exports."""
    return [(row_entry_name(kind, rows, options.batch), kind, rows)
            for rows in reversed(row_counts(options)) for kind in ENTRY_POINTS]


def holds_quantized_weights(loaded: LoadedModel, weights: str) -> bool:
    return weights in ("int8", "int4") or (weights == "auto" and bool(loaded.source_blocks))


def default_chunk(loaded: LoadedModel, weights: str) -> int:
    """The prefill chunk when none is given: longer when the bundle will hold quantized weights."""
    return QUANTIZED_CHUNK if holds_quantized_weights(loaded, weights) else FLOAT_CHUNK


def default_kv_dtype(loaded: LoadedModel, weights: str, dtype: str | None = None,
                     targets: list[Target] | None = None) -> str:
    """The K/V cache type for --kv-dtype auto: float16 beside quantized weights, else the compute
    dtype (`dtype`; None: the model's).

    Half the cache bytes at no measurable cost in decode speed (docs/models.md, "bf16 and f16
    checkpoints"), as llama.cpp does by default; the rounding (2^-11
    relative) is far below the weights' own. Float bundles keep their dtype, so they stay
    within fp32 tolerance of the eager reference. A bundle for ONNX Runtime alone keeps the
    compute dtype: its CPU GroupQueryAttention computes in float32 and, over float16 caches,
    casts q, k and v every call (docs/onnx.md: decode 1.16x faster over float32 caches).
    """
    cfg = loaded.config if dtype is None else loaded.config.replace(dtype=dtype)
    if targets and all(t.device == ONNX_DEVICE for t in targets):
        return cfg.auto_cache_dtype(False)
    return cfg.auto_cache_dtype(holds_quantized_weights(loaded, weights))


def default_compute_dtype(loaded: LoadedModel, targets: list[Target]) -> str:
    """The compute dtype for --dtype auto: float32, whatever the checkpoint stores.

    A bf16 or f16 checkpoint widens to float32 exactly, so the bundle computes what
    the checkpoint's weights say with float32 rounding: the safe choice on every
    target. On llvm-cpu it is also the only one that works for bf16 (IREE 3.13
    fails to compile bf16 arithmetic, see unsupported_compute_dtype); f16 compiles
    there but rounds every activation to 11 bits, so it stays an explicit choice.
    """
    del loaded, targets  # one answer today; the signature is where a per-target choice goes
    return "float32"


def unsupported_compute_dtype(dtype: str, targets: list[Target]) -> str | None:
    """Why `dtype` cannot be the compute dtype for one of `targets`, or None when it can."""
    if dtype == "bfloat16" and any(t.device == ONNX_DEVICE for t in targets):
        return "the ONNX target keeps no bfloat16 state or activations; compute in float32 (--dtype f32 or auto)"
    if dtype == "bfloat16" and any(t.device == "cpu" for t in targets):
        return ("IREE 3.13's llvm-cpu backend fails to compile bfloat16 arithmetic "
                "('arith.constant' op failed to verify); compute in float32 (--dtype f32 or auto: "
                "bf16 weights widen to f32 exactly) and keep bf16 caches with --kv-dtype bf16")
    return None


def resolve_dtypes(loaded: LoadedModel, options: BuildOptions) -> tuple[str, str]:
    """(compute dtype, K/V cache dtype) for a build; DTypeError for a choice that cannot work."""
    dtype = default_compute_dtype(loaded, options.targets) if options.dtype == "auto" else options.dtype
    if dtype not in COMPUTE_DTYPES:
        raise DTypeError(f"compute dtype {dtype!r} is not supported; choose one of {', '.join(COMPUTE_DTYPES)}")
    why = unsupported_compute_dtype(dtype, options.targets)
    if why is not None:
        raise DTypeError(f"compute dtype {dtype} is not available for this target: {why}")
    kv_dtype = (default_kv_dtype(loaded, options.weights, dtype, options.targets) if options.kv_dtype == "auto"
                else options.kv_dtype)
    if kv_dtype not in KV_DTYPES:
        raise DTypeError(f"K/V cache dtype {kv_dtype!r} is not supported; choose one of {', '.join(KV_DTYPES)}")
    if kv_dtype == "bfloat16" and any(t.device == ONNX_DEVICE for t in options.targets):
        raise DTypeError("the ONNX target keeps no bfloat16 caches (ONNX Runtime's Python API takes no bfloat16 "
                         "arrays): choose --kv-dtype f16 or f32")
    return dtype, kv_dtype


ACTIVATIONS = ("auto", "int8", "f32")


def keeps_five_bit_codes(targets: list[Target], activations: list[str]) -> bool:
    """Whether 5-bit checkpoint blocks stay 5-bit (q5) or are widened to bytes (q8) at compile time.

    The int8 kernels of an IREE CPU module read q5's planes as they lie; the float kernels
    (GPU targets, --activations f32, batched bundles) read them through a widening copy each
    call (kernels/qlinear._widen_q5), slower than reading bytes. The codes stay 5-bit where
    some IREE CPU module decodes with int8 activations: a multi-ISA bundle's baseline module
    then takes the slower read, as its fallback. The ONNX export widens its own copy.
    """
    return any(t.device == "cpu" and a == "int8" for t, a in zip(targets, activations))


def target_activations(target: Target, activations: str, batch: int = 1) -> str:
    """What a quantized decode product multiplies its codes by on this target: "int8" or "f32".

    int8 (kernels/int8_decode.py) needs a CPU one of the int8 dot-product forms runs
    on (kernels/select.py: x86 AVX2 or VNNI, aarch64 dotprod); auto takes it there
    and on the ONNX target (MatMulNBits' int8 kernels), f32 everywhere else (GPU
    targets, other CPUs, `--cpu generic`). A batched
    bundle takes f32: its rows decode with the float multi-row kernel, and the entry
    points over fewer rows must compute each row as it does, or a stream's text would
    depend on how many other streams run (kernels/qlinear.uses_int8_gemm).
    """
    if activations not in ACTIVATIONS:
        raise TargetError(f"unknown activations {activations!r}; expected one of {', '.join(ACTIVATIONS)}")
    if batch > 1:
        if activations == "int8":
            raise TargetError(f"--activations int8 is for --batch 1: a batched bundle's rows decode with float "
                              f"activations, whatever rows a call computes (--batch {batch} asked for)")
        return "f32"
    # ONNX Runtime picks MatMulNBits' int8 kernel by the CPU it runs on, and multiplies in float where it has none
    capable = target.device == ONNX_DEVICE or (target.device == "cpu" and cpu_has_int8_dot(target.cpu_flags, target.arch))
    if activations == "int8" and not capable:
        raise TargetError(f"--activations int8 needs a CPU target with an int8 dot product: x86 AVX2 (avx2, fma, "
                          f"f16c) or AVX-512 VNNI (avx512f, avx512bw, avx512_vnni), or aarch64 dotprod (asimddp); "
                          f"{target.description} has none: use --activations f32 or name such a CPU with --cpu "
                          "(e.g. x86-64-v3, znver4, cortex-a76)")
    return "int8" if activations != "f32" and capable else "f32"


def _versions() -> dict[str, str]:
    out = {}
    for pkg in ("foldline", "torch", "iree-base-compiler", "iree-base-runtime"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "unknown"
    return out


def compile_model(loaded: LoadedModel, out_dir: str | Path, options: BuildOptions, progress: Progress = print,
                  cache: CompileCache | None = None) -> Path:
    """Write a bundle for an already-loaded model; returns the bundle directory.

    With a `cache`, a model whose checkpoint fingerprint and options were compiled
    before is copied from it, and a new bundle is stored in it.
    """
    key = build_cache_key(loaded.fingerprint, options)
    if from_cache(cache, key, out_dir, progress):
        return Path(out_dir)
    return _compile_and_store(loaded, out_dir, options, progress, cache, key)


@contextmanager
def _fewer_collections() -> Iterator[None]:
    """The cyclic garbage collector run less often, and never over what existed before, during a compile.

    Tracing and lowering allocate millions of objects, and each full collection
    walks every live object, the loaded model's and, in a test session or a
    server, everything else the process holds, so a compile in a long-lived process
    took far longer than in a fresh one (docs/benchmarks.md, "Compile time"). What
    exists when the compile starts is frozen (excluded from collections) until it
    ends; cycles made during the compile are still collected, in larger batches.
    """
    saved = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(max(saved[0], 100_000), *saved[1:])
    try:
        yield
    finally:
        gc.set_threshold(*saved)
        gc.unfreeze()


def _compile_and_store(loaded: LoadedModel, out_dir: str | Path, options: BuildOptions, progress: Progress,
                       cache: CompileCache | None, key: str | None) -> Path:
    """Compile (the cache already missed) and keep the bundle in the cache under `key`."""
    dtype, kv_dtype = resolve_dtypes(loaded, options)
    with loaded.reconfigured(dtype=dtype, kv_dtype=kv_dtype if kv_dtype != dtype else None), _fewer_collections():
        out = _compile(loaded, out_dir, options, progress)
    if cache is not None and key is not None:
        cache.store(key, out, {"model": loaded.source, "name": loaded.config.name,
                               "targets": [t.description for t in options.targets]},
                    files=bundle_files(out, options.keep_mlir))
    return out


def bundle_files(out: Path, keep_mlir: bool) -> list[str]:
    """The files a compile wrote into `out`: the manifest, every file it lists, and model.mlir when kept
    (an IREE target's import writes it)."""
    mlir = [MLIR_FILE] if keep_mlir and (out / MLIR_FILE).is_file() else []
    return [MANIFEST, *Manifest.load(out).files(), *mlir]


def _compile(loaded: LoadedModel, out_dir: str | Path, options: BuildOptions, progress: Progress) -> Path:
    activations = [target_activations(t, options.activations, options.batch) for t in options.targets]  # refuse early
    check_devices(options)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = loaded.config
    t0 = time.time()
    clock = StageClock(progress)

    chunk = options.chunk or default_chunk(loaded, options.weights)
    clock.stage("export", f"[1/4] exporting {cfg.name}: {cfg.dtype} compute, context {cfg.max_context} (K/V {cfg.cache_dtype}), "
             f"prefill chunk {chunk}, decode, batch {options.batch}"
             + (f" (entry points for {', '.join(map(str, row_counts(options)))} rows)" if options.batch > 1 else "")
             + "; quantized-product activations "
             + ", ".join(f"{a} ({t.description})" for t, a in zip(options.targets, activations)),
                total=len(entry_point_variants(options)))
    module, blocks = loaded.module, loaded.source_blocks
    if options.devices > 1 and options.scheme == "tensor":
        module, blocks = split_model(module, blocks, options.devices)
    entries = {}
    for name, kind, rows in entry_point_variants(options):
        entries[name] = export_entry_point(module, kind, rows, chunk)
        clock.advance(name)
    unit = CompileUnit(cfg, {n: e.program for n, e in entries.items()}, entries["prefill"].state_specs,
                       options={"hadamard": options.hadamard, "weights": options.weights, "group": options.group,
                                "devices": options.devices, "scheme": options.scheme,
                                FIVE_BIT_CODES: keeps_five_bit_codes(options.targets, activations)},
                       source_blocks={parameter_target(k): v for k, v in blocks.items()})

    del entries  # the unit holds the programs; their first copies can go
    clock.stage("passes", "[2/4] running passes")
    report = run_pipeline(unit, options.passes, dump_after=options.dump_after, progress=progress)
    if options.devices > 1:  # placement comes last: it moves the values the other passes leave
        report += run_pipeline(unit, [PLACE_PASS], dump_after=options.dump_after, progress=progress)
    placement: Placement | None = unit.options.get(PLACED)

    modules: dict[str, ModuleEntry] = {}
    if any(t.device == ONNX_DEVICE for t in options.targets):
        clock.stage("onnx", "[3/4] exporting ONNX graphs (core aten: standard ONNX ops and MatMulNBits)", total=len(unit.programs))
        rows = {name: n for name, _kind, n in entry_point_variants(options)}
        onnx_activations = next(a for t, a in zip(options.targets, activations) if t.device == ONNX_DEVICE)
        modules[ONNX_DEVICE] = export_onnx_module(
            {name: (program, rows[name]) for name, program in unit.programs.items()}, unit.state_specs, out,
            unit.config.max_context, progress, onnx_activations)
    iree_targets = [(t, a) for t, a in zip(options.targets, activations) if t.device != ONNX_DEVICE]
    archives: list[ParamsEntry] = []
    if iree_targets:
        archives = _compile_iree([t for t, _ in iree_targets], [a for _, a in iree_targets], unit, out, clock,
                                     options, progress, modules, placement)
    modules = {key: modules[key] for key in module_order(options.targets)}

    tokenizer = None
    if loaded.tokenizer_json is not None:
        (out / "tokenizer.json").write_text(loaded.tokenizer_json)
        tokenizer = FileEntry.of(out / "tokenizer.json")
    Manifest(
        model=cfg.to_dict(),
        batch=options.batch,
        prefill_chunk=chunk,
        state=list(unit.state_specs),
        modules=modules,
        row_counts=row_counts(options),
        params=archives[0] if archives else None,
        tokenizer=tokenizer,
        chat_template=loaded.chat_template,
        source=loaded.source,
        passes=report,
        versions=_versions(),
        placement=placement.manifest_entry(archives[1:]) if placement is not None else None,
    ).write(out)
    progress(clock.summary())
    progress(f"bundle written to {out} in {time.time() - t0:.0f} s")
    return out


def _compile_iree(targets: list[Target], activations: list[str], unit: CompileUnit, out: Path, clock: StageClock,
                  options: BuildOptions, progress: Progress, modules: dict[str, ModuleEntry],
                  placement: Placement | None) -> list[ParamsEntry]:
    """Stages 3-4 for the IREE targets: import to MLIR, weights to params.irpa, iree-compile; adds their modules."""
    # CPU targets keep the decode attention ops for their hand-written kernel; GPU targets
    # import the decomposed form; targets whose prefill attention is fused import it so
    # (one import per kind of target asked for).
    kinds = sorted({import_kind(t, options.attention) for t in targets}, reverse=True)
    clock.stage("import", "[3/4] importing to MLIR (torch dialect), weights to params.irpa",
                total=len(unit.programs) * len(kinds))
    lowerings = {fused: Lowering(fused_attention=fused) for fused in {fused for _, fused in kinds}}
    imported = {}
    for kind in kinds:
        cpu, fused = kind
        imported[kind] = import_programs(unit.programs.items(), decode_attention_kernel=cpu,
                                         lowering=lowerings[fused], progress=clock.advance)
    del lowerings
    mlir, params = imported[kinds[0]]
    if options.keep_mlir:
        (out / MLIR_FILE).write_text(mlir)
    # One archive per device of a placed bundle (multi_device.device_scope), else params.irpa alone.
    per_device = (parameters_by_device(params.keys, placement) if placement is not None
                  else [set(params.tensors)])
    archives = [_write_archive(out / params_file(j), {k: t for k, t in params.tensors.items() if k in keys},
                               device_scope(j)) for j, keys in enumerate(per_device)]
    params_sha = archives[0].sha256
    del params  # written to the archives
    unit.programs.clear()  # what iree-compile needs is in the MLIR text now
    modules.update(_compile_targets(targets, activations, imported, params_sha, out, clock, progress,
                                    options.attention, placement))
    return archives


def _write_archive(path: Path, tensors: dict, scope: str) -> ParamsEntry:
    """An IRPA file of `tensors` (name -> tensor), and its manifest entry."""
    index = rt.ParameterIndex()
    for name, tensor in tensors.items():
        index.add_buffer(name, params_to_numpy(tensor))
    index.create_archive_file(str(path))
    return ParamsEntry(path.name, sha256_file(path), path.stat().st_size, scope=scope, count=len(tensors))


def module_order(targets: list[Target]) -> list[str]:
    """The manifest keys of the targets' modules, in the order the targets were given."""
    iree = iter(key for key, _ in module_names([t for t in targets if t.device != ONNX_DEVICE]))
    return [ONNX_DEVICE if t.device == ONNX_DEVICE else next(iree) for t in targets]


def module_names(targets: list[Target]) -> list[tuple[str, str]]:
    """(manifest key, file) of each target's module: `cpu` / model.cpu.vmfb while a bundle holds one CPU
    module, `cpu-<CPU>` / model.cpu-<CPU>.vmfb for each of several (runtime/cpu_select.py picks one)."""
    several = sum(t.device == "cpu" for t in targets) > 1
    keys = [f"cpu-{t.cpu}" if several and t.device == "cpu" else t.device for t in targets]
    return [(key, f"model.{key}.vmfb") for key in keys]


def import_kind(target: Target, attention: str) -> tuple[bool, bool]:
    """(CPU, fused prefill attention): the import a target's module is compiled from."""
    return target.device == "cpu", attention_form(target.device, attention) == "fused"


def _compile_targets(targets: list[Target], activations: list[str], imported: dict, params_sha: str, out: Path,
                     clock: StageClock, progress: Progress, attention: str,
                     placement: Placement | None = None) -> dict[str, ModuleEntry]:
    """Stage 4: each target's kernels expanded and its iree-compile run, several at once; the manifest's modules.

    With a placement over several devices, each module is compiled for that many devices of its backend.
    """
    jobs = list(zip(targets, activations, module_names(targets)))
    size = pool_size(len(jobs))
    clock.stage("iree-compile", f"[4/4] iree-compile for {', '.join(t.description for t in targets)}"
                + (f": {size.describe(len(jobs))}" if len(jobs) > 1 else ""), total=len(jobs))

    def build(job: tuple[Target, str, tuple[str, str]]) -> tuple[Int8Kernels, Counter[str], bytes, ElideReport, float]:
        target, acts, _ = job
        t1 = time.time()
        cpu = target.device == "cpu"
        int8 = choose_kernels(target.cpu_flags, target.arch) if acts == "int8" else FLOAT_KERNELS
        float_isa = FloatIsa.of(target.cpu_flags, target.arch) if cpu else HARDWARE_FLOAT
        target_mlir, sites = expand_qlinear_ops(imported[import_kind(target, attention)][0], cpu_tiles=cpu,
                                                int8=int8, float_isa=float_isa)
        if cpu:
            target_mlir, decode_attention = expand_decode_attention_ops(target_mlir, float_isa)
            sites += decode_attention
        fused = count_fused_attention(target_mlir)
        if fused:
            sites[FUSED_SITE] = fused
        if placement is not None:
            target_mlir, _moves = place_module(target_mlir, placement)
        vmfb, inplace = compile_torch_module(target_mlir, module_flags(target))
        return int8, sites, vmfb, inplace, time.time() - t1

    def module_flags(target: Target) -> list[str]:
        return target.flags if placement is None else multi_device_flags(target.flags, placement.devices)

    modules: dict[str, ModuleEntry] = {}
    for (target, acts, (key, name)), (int8, sites, vmfb, inplace, seconds) in run_concurrently(
            build, jobs, size.workers):
        (out / name).write_bytes(vmfb)
        modules[key] = ModuleEntry(
            file=name, sha256=sha256_file(out / name), size=len(vmfb), params_sha256=params_sha,
            device=target.device, cpu=target.cpu, flags=module_flags(target), description=target.description,
            arch=target.arch, cpu_flags=target.cpu_flags, activations=acts,
            kernel_isa=int8.record(),  # which int8 kernels (or f32) decode and prefill products took
            kernels=dict(sorted(sites.items())),  # how many sites took each kernel (kernels/sites.py)
            executable_formats=vmfb_info(out / name).formats,
        )
        progress(f"      {name} ({target.description}): {len(vmfb) / 1e6:.1f} MB in {seconds:.0f} s; "
                 f"{inplace.elided} cache update(s) kept in place, {inplace.kept} state result(s) placed by IREE")
        clock.advance(target.cpu if target.device == "cpu" and target.cpu else target.device, seconds)
    return {key: modules[key] for key, _ in module_names(targets)}  # in the order the targets were given


def compile_spec(spec: str, out_dir: str | Path, options: BuildOptions, progress: Progress = print,
                 cache: CompileCache | None = None) -> Path:
    """Compile MODEL (a preset, shipped name, .gguf or HF dir); the cache is asked before anything is loaded."""
    key = build_cache_key(checkpoint_fingerprint(spec, options.max_context), options)
    if from_cache(cache, key, out_dir, progress):
        return Path(out_dir)
    progress(f"loading {spec}")
    # The blocks are what a weights=auto compile keeps: their float values are never made.
    loaded = load_model(spec, max_context=options.max_context, defer_block_weights=options.weights == "auto")
    return _compile_and_store(loaded, out_dir, options, progress, cache, key)
