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
from iree.compiler import ir

from ..contract.entry_points import row_entry_name
from ..contract.manifest import Manifest, ModuleEntry, ParamsEntry
from ..frontend.export import ENTRY_POINTS, export_entry_point, export_step, parameter_target
from ..frontend.fingerprint import checkpoint_fingerprint
from ..frontend.sources import load_model
from ..frontend.tensor_parallel import split_model
from ..frontend.types import LoadedModel
from ..kernels.attention import expand_decode_attention_ops
from ..kernels.isa import Int8Kernels
from ..kernels.qlinear import expand_qlinear_ops
from ..passes.manager import CompileUnit, TargetPasses, run_pipeline
from ..passes.place_devices import NAME as PLACE_PASS
from ..passes.place_devices import PLACED, Placement
from ..passes.quantize_weights import FIVE_BIT_CODES
from .bundle_files import (
    MLIR_FILE,
    module_names,
    module_order,
    params_file,
    write_archive,
    write_module,
    write_tokenizer,
    written_files,
)
from .compile_cache import CompileCache
from .iree.abi_declaration import declare_signatures, torch_inputs
from .iree.compile_pool import pool_size, run_concurrently
from .iree.fused_attention import FUSED_ATTENTION_PASS, count_fused_attention, fused_decompositions
from .iree.fused_attention import SITE_NAME as FUSED_SITE
from .iree.importer import import_programs
from .iree.inplace_state import ElideReport, elide_aliases_in
from .iree.input_ir import module_text
from .iree.multi_device import device_scope, multi_device_flags, parameters_by_device, place_module
from .iree.online_attention import expand_online_attention
from .lowering import Lowering
from .options import (
    BuildOptions,
    Progress,
    build_cache_key,
    check_devices,
    check_onnx_opset,
    claimed,
    from_cache,
    row_counts,
)
from .policy import (
    default_chunk,
    import_kind,
    keeps_five_bit_codes,
    resolve_dtypes,
    target_activations,
    target_kernels,
)
from .stage_clock import StageClock
from .targets import ONNX_DEVICE, Target, TargetError


def compile_torch_module(mlir: str, flags: list[str], stop_at: str | None = None) -> tuple[bytes, ElideReport]:
    """torch-dialect MLIR -> vmfb, in two steps so in-place cache updates stay in place (inplace_state).

    stop_at: an iree-compile phase (`stream`, ...) whose IR is returned instead of the vmfb, to read
    what the module allocates (tests/backends/test_fused_attention_memory.py)."""
    converted = ireec.compile_str(mlir, input_type="torch", extra_args=[*flags, "--compile-to=input"])
    text = converted.decode() if isinstance(converted, bytes) else converted
    inputs_of = torch_inputs(mlir)
    with ir.Context():
        module = ir.Module.parse(text)
        report = elide_aliases_in(module)
        declare_signatures(module, inputs_of)  # the runtime compares them with the manifest
        edited = module_text(module)
    stop = [f"--compile-to={stop_at}"] if stop_at is not None else []
    return ireec.compile_str(edited, extra_args=[*flags, "--compile-from=input", *stop]), report


def expand_kernels(mlir: str, target: Target, activations: str,
                   batched: bool = False) -> tuple[str, Int8Kernels, Counter[str]]:
    """An imported module with the target's kernels in place (quantized products, CPU decode attention,
    the fused form's online attention): what iree-compile is given; the int8 kernels and the sites of each.
    batched: the module's decode runs several rows (policy.target_kernels)."""
    cpu = target.device == "cpu"
    int8, float_isa = target_kernels(target, activations, batched)
    target_mlir, sites = expand_qlinear_ops(mlir, cpu_tiles=cpu, int8=int8, float_isa=float_isa)
    if cpu:
        target_mlir, decode_attention = expand_decode_attention_ops(target_mlir, float_isa)
        sites += decode_attention
    fused = count_fused_attention(target_mlir)
    if fused:
        sites[FUSED_SITE] = fused
        target_mlir, _merged = expand_online_attention(target_mlir)
    return target_mlir, int8, sites


def entry_point_variants(options: BuildOptions) -> list[tuple[str, str, int]]:
    """(function name, entry point, rows) of every function the module exports."""
    return [(row_entry_name(kind, rows, options.batch), kind, rows)
            for rows in reversed(row_counts(options)) for kind in ENTRY_POINTS]


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
    check_onnx_opset(options)
    if any(t.genai for t in options.targets):
        return _compile_genai(loaded, out_dir, options, progress)
    key = build_cache_key(loaded.fingerprint, options)
    with claimed(cache, key, progress):
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
        stored = cache.store(key, out, {"model": loaded.source, "name": loaded.config.name,
                                        "targets": [t.description for t in options.targets]},
                             files=written_files(out, options.keep_mlir))
        if not stored:
            progress(f"not cached: the disk of {cache.root} is nearly full (the cache leaves "
                     f"{cache.min_free_bytes / (1 << 30):.1f} GB free; FOLDLINE_CACHE_MIN_FREE_GB)")
    return out


def _compile(loaded: LoadedModel, out_dir: str | Path, options: BuildOptions, progress: Progress) -> Path:
    activations = [target_activations(t, options.activations, options.batch) for t in options.targets]  # refuse early
    check_devices(options)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = loaded.config
    t0 = time.time()
    clock = StageClock(progress)

    chunk = options.chunk or min(default_chunk(loaded, options.weights), cfg.max_context)
    if chunk > cfg.max_context:
        raise TargetError(f"--chunk {chunk} is longer than the context ({cfg.max_context} tokens): a prefill call "
                          f"cannot take more tokens than the context holds; give --chunk {cfg.max_context} or less")
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
    onnx_activations = [a for t, a in zip(options.targets, activations) if t.device == ONNX_DEVICE]
    if onnx_activations:
        modules[ONNX_DEVICE] = _export_onnx(onnx_activations[0], unit, out, clock, options, progress)
    iree_targets = [(t, a) for t, a in zip(options.targets, activations) if t.device != ONNX_DEVICE]
    archives: list[ParamsEntry] = []
    if iree_targets:
        archives = _compile_iree([t for t, _ in iree_targets], [a for _, a in iree_targets], unit, out, clock,
                                     options, progress, modules, placement)
    modules = {key: modules[key] for key in module_order(options.targets)}

    Manifest(
        model=cfg.to_dict(),
        batch=options.batch,
        prefill_chunk=chunk,
        state=list(unit.state_specs),
        modules=modules,
        row_counts=row_counts(options),
        params=archives[0] if archives else None,
        tokenizer=write_tokenizer(out, loaded.tokenizer_json),
        chat_template=loaded.chat_template,
        source=loaded.source,
        passes=report,
        versions=_versions(),
        placement=placement.manifest_entry(archives[1:]) if placement is not None else None,
    ).write(out)
    progress(clock.summary())
    progress(f"bundle written to {out} in {time.time() - t0:.0f} s")
    return out


def _compile_genai(loaded: LoadedModel, out_dir: str | Path, options: BuildOptions, progress: Progress) -> Path:
    """--target onnx-genai: the step function through the default passes, written as ONNX Runtime GenAI's
    model directory (backends/onnx/genai.py). Not a bundle: no manifest, so not in the compile cache."""
    from .onnx.genai import check, export_genai

    if len(options.targets) != 1:
        raise TargetError("--target onnx-genai writes a GenAI model directory, not a bundle: give it alone")
    activations = target_activations(options.targets[0], options.activations, options.batch)
    dtype, kv_dtype = resolve_dtypes(loaded, options)
    check(loaded.config, options.batch, options.devices, kv_dtype)  # before any work
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with loaded.reconfigured(dtype=dtype, kv_dtype=kv_dtype if kv_dtype != dtype else None), _fewer_collections():
        cfg = loaded.config
        clock = StageClock(progress)
        clock.stage("export", f"[1/3] exporting {cfg.name}: {cfg.dtype} compute, context {cfg.max_context} "
                    f"(K/V {cfg.cache_dtype}), one step function for any token count; quantized-product "
                    f"activations {activations}", total=1)
        entry = export_step(loaded.module)
        clock.advance(entry.name)
        unit = CompileUnit(cfg, {entry.name: entry.program}, entry.state_specs,
                           options={"hadamard": options.hadamard, "weights": options.weights, "group": options.group,
                                    "devices": 1, "scheme": options.scheme, FIVE_BIT_CODES: False},
                           source_blocks={parameter_target(k): v for k, v in loaded.source_blocks.items()})
        del entry
        clock.stage("passes", "[2/3] running passes")
        run_pipeline(unit, options.passes, dump_after=options.dump_after, progress=progress)
        clock.stage("onnx", "[3/3] exporting the ONNX Runtime GenAI model", total=1)
        export_genai(unit, out, activations, loaded.tokenizer_json, loaded.chat_template, progress,
                     options.dump_after, options.onnx_opset)
        clock.advance("step")
        progress(clock.summary())
    progress(f"ONNX Runtime GenAI model written to {out} in {time.time() - t0:.0f} s")
    return out


def _export_onnx(activations: str, unit: CompileUnit, out: Path, clock: StageClock, options: BuildOptions,
                 progress: Progress) -> ModuleEntry:
    """Stage 3 for the ONNX target: the post-pass programs as ONNX graphs; their module's manifest entry."""
    # Imported here, not at the top: onnx and the exporter load in seconds, and only an ONNX target needs them.
    from .onnx.export import export_module

    clock.stage("onnx", "[3/4] exporting ONNX graphs (core aten: standard ONNX ops and MatMulNBits)", total=len(unit.programs))
    rows = {name: n for name, _kind, n in entry_point_variants(options)}
    return export_module(unit, rows, out, progress, activations, options.dump_after, options.onnx_opset)


def _compile_iree(targets: list[Target], activations: list[str], unit: CompileUnit, out: Path, clock: StageClock,
                  options: BuildOptions, progress: Progress, modules: dict[str, ModuleEntry],
                  placement: Placement | None) -> list[ParamsEntry]:
    """Stages 3-4 for the IREE targets: import to MLIR, weights to params.irpa, iree-compile; adds their modules."""
    # One import per kind of target asked for (policy.import_kind).
    kinds = sorted({import_kind(t, options.attention) for t in targets}, reverse=True)
    clock.stage("import", "[3/4] importing to MLIR (torch dialect), weights to params.irpa",
                total=len(unit.programs) * len(kinds))
    lowerings = {fused: Lowering(fused_decompositions() if fused else None) for fused in {fused for _, fused in kinds}}
    fused_attention = TargetPasses(unit, [FUSED_ATTENTION_PASS], options.dump_after)
    imported = {}
    for kind in kinds:
        cpu, fused = kind
        imported[kind] = import_programs(unit.programs.items(), decode_attention_kernel=cpu,
                                         lowering=lowerings[fused], progress=clock.advance,
                                         target_passes=fused_attention if fused else None)
    del lowerings
    mlir, params = imported[kinds[0]]
    if options.keep_mlir:
        (out / MLIR_FILE).write_text(mlir)
    # One archive per device of a placed bundle (multi_device.device_scope), else params.irpa alone.
    per_device = (parameters_by_device(params.keys, placement) if placement is not None
                  else [set(params.tensors)])
    archives = [write_archive(out / params_file(j), {k: t for k, t in params.tensors.items() if k in keys},
                              device_scope(j)) for j, keys in enumerate(per_device)]
    params_sha = archives[0].sha256
    del params  # written to the archives
    unit.programs.clear()  # what iree-compile needs is in the MLIR text now
    modules.update(_compile_targets(targets, activations, imported, params_sha, out, clock, progress,
                                    options.attention, placement, options.batch > 1))
    return archives


def _compile_targets(targets: list[Target], activations: list[str], imported: dict, params_sha: str, out: Path,
                     clock: StageClock, progress: Progress, attention: str,
                     placement: Placement | None = None, batched: bool = False) -> dict[str, ModuleEntry]:
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
        target_mlir, int8, sites = expand_kernels(imported[import_kind(target, attention)][0], target, acts, batched)
        if placement is not None:
            target_mlir, _moves = place_module(target_mlir, placement)
        vmfb, inplace = compile_torch_module(target_mlir, module_flags(target))
        return int8, sites, vmfb, inplace, time.time() - t1

    def module_flags(target: Target) -> list[str]:
        return target.flags if placement is None else multi_device_flags(target.flags, placement.devices)

    modules: dict[str, ModuleEntry] = {}
    for (target, acts, (key, name)), (int8, sites, vmfb, inplace, seconds) in run_concurrently(
            build, jobs, size.workers):
        modules[key] = write_module(out / name, vmfb, target, module_flags(target), params_sha, acts,
                                    kernel_isa=int8.record(), kernels=sites)
        progress(f"      {name} ({target.description}): {len(vmfb) / 1e6:.1f} MB in {seconds:.0f} s; "
                 f"{inplace.elided} cache update(s) kept in place, {inplace.kept} state result(s) placed by IREE")
        clock.advance(target.cpu if target.device == "cpu" and target.cpu else target.device, seconds)
    return {key: modules[key] for key, _ in module_names(targets)}  # in the order the targets were given


def compile_spec(spec: str, out_dir: str | Path, options: BuildOptions, progress: Progress = print,
                 cache: CompileCache | None = None) -> Path:
    """Compile MODEL (a preset, shipped name, .gguf or HF dir); the cache is asked before anything is loaded."""
    key = build_cache_key(checkpoint_fingerprint(spec, options.max_context), options)
    with claimed(cache, key, progress):
        if from_cache(cache, key, out_dir, progress):
            return Path(out_dir)
        progress(f"loading {spec}")
        # The blocks are what a weights=auto compile keeps: their float values are never made.
        loaded = load_model(spec, max_context=options.max_context, defer_block_weights=options.weights == "auto")
        if any(t.genai for t in options.targets):
            return _compile_genai(loaded, out_dir, options, progress)
        return _compile_and_store(loaded, out_dir, options, progress, cache, key)
