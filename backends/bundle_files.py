"""The files a compile writes into a bundle: their names, and each written with its manifest entry.

One place names every file of a bundle (modules, parameter archives, tokenizer,
the kept MLIR), so the compile, the compile cache's copy of a bundle and the
manifest agree on them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import iree.runtime as rt
import torch

from ..contract.manifest import MANIFEST, FileEntry, Manifest, ModuleEntry, ParamsEntry, sha256_file
from ..contract.vmfb import vmfb_info
from .iree.importer import params_to_numpy
from .iree.multi_device import device_scope
from .targets import ONNX_DEVICE, Target

MLIR_FILE = "model.mlir"  # --keep-mlir: the torch-dialect MLIR as imported for the first target
TOKENIZER_FILE = "tokenizer.json"


def params_file(index: int) -> str:
    """The parameter archive of device `index`: params.irpa for device 0 (every one-device bundle)."""
    return "params.irpa" if index == 0 else f"params.{device_scope(index)}.irpa"


def module_names(targets: list[Target]) -> list[tuple[str, str]]:
    """(manifest key, file) of each target's module: `cpu` / model.cpu.vmfb while a bundle holds one CPU
    module, `cpu-<CPU>` / model.cpu-<CPU>.vmfb for each of several (runtime/cpu_select.py picks one)."""
    several = sum(t.device == "cpu" for t in targets) > 1
    keys = [f"cpu-{t.cpu}" if several and t.device == "cpu" else t.device for t in targets]
    return [(key, f"model.{key}.vmfb") for key in keys]


def module_order(targets: list[Target]) -> list[str]:
    """The manifest keys of the targets' modules, in the order the targets were given."""
    iree = iter(key for key, _ in module_names([t for t in targets if t.device != ONNX_DEVICE]))
    return [ONNX_DEVICE if t.device == ONNX_DEVICE else next(iree) for t in targets]


def write_archive(path: Path, tensors: Mapping[str, torch.Tensor], scope: str) -> ParamsEntry:
    """An IRPA file of `tensors` (name -> tensor), and its manifest entry."""
    index = rt.ParameterIndex()
    for name, tensor in tensors.items():
        index.add_buffer(name, params_to_numpy(tensor))
    index.create_archive_file(str(path))
    return ParamsEntry(path.name, sha256_file(path), path.stat().st_size, scope=scope, count=len(tensors))


def write_module(path: Path, vmfb: bytes, target: Target, flags: list[str], params_sha256: str,
                 activations: str, kernel_isa: dict[str, str], kernels: Mapping[str, int]) -> ModuleEntry:
    """A compiled IREE module's file, and its manifest entry: where it runs and what its kernels were built for.

    `kernel_isa`: which int8 kernels (or f32) decode and prefill products took; `kernels`: how many
    sites took each kernel (kernels/sites.py).
    """
    path.write_bytes(vmfb)
    return ModuleEntry(
        file=path.name, sha256=sha256_file(path), size=len(vmfb), params_sha256=params_sha256,
        device=target.device, cpu=target.cpu, flags=flags, description=target.description,
        arch=target.arch, cpu_flags=target.cpu_flags, activations=activations,
        kernel_isa=kernel_isa, kernels=dict(sorted(kernels.items())),
        executable_formats=vmfb_info(path).formats,
    )


def write_tokenizer(out: Path, tokenizer_json: str | None) -> FileEntry | None:
    """The model's tokenizer.json in the bundle, and its manifest entry; None for a model without one."""
    if tokenizer_json is None:
        return None
    (out / TOKENIZER_FILE).write_text(tokenizer_json)
    return FileEntry.of(out / TOKENIZER_FILE)


def written_files(out: Path, keep_mlir: bool) -> list[str]:
    """The files a compile wrote into `out`: the manifest, every file it lists, and model.mlir when kept
    (an IREE target's import writes it)."""
    mlir = [MLIR_FILE] if keep_mlir and (out / MLIR_FILE).is_file() else []
    return [MANIFEST, *Manifest.load(out).files(), *mlir]
