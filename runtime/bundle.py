"""The bundle on disk: manifest.json, one vmfb per target, params.irpa, tokenizer.json.

Read by the runtime, so it imports only the standard library: no torch.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import FoldlineError

FORMAT = "foldline-bundle"
REQUIRED_KEYS = ("model", "batch", "prefill_chunk", "state", "modules")
REQUIRED_MODULE_KEYS = ("file", "sha256")
# ELF e_machine -> the runtime's arch spelling (for the executables embedded in a CPU vmfb)
ELF_MACHINES = {3: "x86", 40: "arm", 62: "x86_64", 183: "aarch64", 243: "riscv"}
# IREE executable format prefix/name -> what it runs on
_FORMAT_RE = re.compile(rb"(embedded-elf-[a-z0-9_]+|system-elf-[a-z0-9_]+|vulkan-spirv-fb|cuda-nvptx-fb|rocm-hsaco-fb)")
_PTX_TARGET_RE = re.compile(rb"\.target (sm_[0-9]+a?)")
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class BundleError(FoldlineError, RuntimeError):
    """A bundle that is missing, corrupted or does not match what it claims."""


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass
class VmfbInfo:
    """What a compiled module says about where it runs, read from its bytes."""

    formats: list[str] = field(default_factory=list)  # e.g. embedded-elf-arm_64, cuda-nvptx-fb
    elf_machines: list[str] = field(default_factory=list)  # arch of each embedded ELF executable
    ptx_targets: list[str] = field(default_factory=list)  # e.g. sm_80

    @property
    def arches(self) -> set[str]:
        return set(self.elf_machines)


def vmfb_info(path: str | Path) -> VmfbInfo:
    """Executable formats, embedded ELF machines and PTX targets inside a .vmfb.

    The manifest says what a module was built for; this reads what it actually
    contains, so a module swapped in from another build cannot pass for this one.
    """
    data = Path(path).read_bytes()
    info = VmfbInfo()
    info.formats = sorted({m.decode() for m in _FORMAT_RE.findall(data)})
    info.ptx_targets = sorted({m.decode() for m in _PTX_TARGET_RE.findall(data)})
    machines = set()
    start = data.find(b"\x7fELF")
    while start != -1:
        # a little-endian shared object (ET_DYN): what IREE embeds for each CPU executable
        if len(data) >= start + 20 and data[start + 5] == 1 and struct.unpack_from("<H", data, start + 16)[0] == 3:
            (machine,) = struct.unpack_from("<H", data, start + 18)
            machines.add(ELF_MACHINES.get(machine, f"elf-machine-{machine}"))
        start = data.find(b"\x7fELF", start + 4)
    info.elf_machines = sorted(machines)
    return info


@dataclass(frozen=True)
class StateBuffer:
    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    layers: tuple[int, ...]
    kind: str


@dataclass
class Manifest:
    """Typed view of manifest.json."""

    root: Path
    data: dict[str, Any]

    @classmethod
    def load(cls, bundle_dir: str | Path) -> Manifest:
        root = Path(bundle_dir)
        if not root.is_dir():
            raise BundleError(f"bundle directory {root} does not exist")
        path = root / MANIFEST
        if not path.is_file():
            raise BundleError(f"bundle {root} has no {MANIFEST}")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise BundleError(f"{path} is not valid JSON: {e}") from e
        except UnicodeDecodeError as e:
            raise BundleError(f"{path} is not text: {e}") from e
        if not isinstance(data, dict):
            raise BundleError(f"{path} is not a JSON object: not a foldline bundle manifest")
        if data.get("format") != FORMAT:
            raise BundleError(f"{path} is not a foldline bundle manifest")
        if data.get("format_version") != FORMAT_VERSION:
            raise BundleError(
                f"{path} has format version {data.get('format_version')}, this runtime reads {FORMAT_VERSION}"
            )
        _check_structure(path, data)
        manifest = cls(root, data)
        manifest.check_files_present()
        return manifest

    # ---- fields --------------------------------------------------------------
    @property
    def config(self) -> dict[str, Any]:
        return self.data["model"]

    @property
    def batch(self) -> int:
        return int(self.data["batch"])

    @property
    def prefill_chunk(self) -> int:
        return int(self.data["prefill_chunk"])

    @property
    def max_context(self) -> int:
        return int(self.data["model"]["max_context"])

    @property
    def kv_lengths(self) -> list[int]:
        """Attention lengths with their own entry points (prefill_<L>, decode_<L>), ascending."""
        lengths = self.data.get("kv_lengths", [])
        if not (isinstance(lengths, list) and all(type(n) is int for n in lengths)
                and lengths == sorted(set(lengths)) and all(0 < n < self.max_context for n in lengths)):
            raise BundleError(f"{self.root / MANIFEST}: kv_lengths {lengths!r} must be ascending integers "
                              f"between 0 and max_context {self.max_context}")
        return lengths

    @property
    def vocab_size(self) -> int:
        return int(self.data["model"]["vocab_size"])

    @property
    def state(self) -> list[StateBuffer]:
        return [
            StateBuffer(s["name"], tuple(s["shape"]), s["dtype"], int(s["nbytes"]), tuple(s["layers"]), s["kind"])
            for s in self.data["state"]
        ]

    @property
    def modules(self) -> dict[str, dict[str, Any]]:
        return self.data["modules"]

    @property
    def tokenizer_path(self) -> Path | None:
        name = self.data.get("tokenizer")
        return self.root / name if name else None

    @property
    def params_path(self) -> Path | None:
        params = self.data.get("params")
        return self.root / params["file"] if params else None

    def files(self) -> list[str]:
        names = [m["file"] for m in self.modules.values()]
        if self.data.get("params"):
            names.append(self.data["params"]["file"])
        if self.data.get("tokenizer"):
            names.append(self.data["tokenizer"])
        return names

    # ---- integrity -----------------------------------------------------------
    def check_files_present(self) -> None:
        for name in self.files():
            if not (self.root / name).is_file():
                raise BundleError(f"bundle {self.root} is missing {name} (listed in {MANIFEST})")

    def check_sizes(self, device: str) -> None:
        """Cheap size check of the files a device needs, done even without hashing.

        IREE mmaps the .irpa: a truncated archive would otherwise end in SIGBUS
        on first use of a parameter past the end instead of an error here.
        """
        entries = [self.modules[device]]
        if self.data.get("params"):
            entries.append(self.data["params"])
        for entry in entries:
            path = self.root / entry["file"]
            expected = entry.get("size")
            size = path.stat().st_size
            if expected is not None and size != expected:
                raise BundleError(
                    f"{path} is {size} bytes, the manifest says {expected}: truncated or replaced"
                )

    def verify_file(self, name: str, expected_sha256: str, expected_size: int | None) -> None:
        path = self.root / name
        size = path.stat().st_size
        if expected_size is not None and size != expected_size:
            raise BundleError(
                f"{path} is {size} bytes, the manifest says {expected_size}: truncated or replaced"
            )
        actual = sha256_file(path)
        if actual != expected_sha256:
            raise BundleError(f"{path} does not match the manifest's sha256: corrupted or from another build")

    def verify_module(self, target: str) -> None:
        """The module's bytes are the ones the manifest lists, built against this bundle's params."""
        if target not in self.modules:
            raise BundleError(f"bundle {self.root} has no module for device {target!r}")
        entry = self.modules[target]
        self.verify_file(entry["file"], entry["sha256"], entry.get("size"))
        params = self.data.get("params")
        if params and entry.get("params_sha256") not in (None, params["sha256"]):
            raise BundleError(
                f"module {entry['file']} was compiled against other parameters than {params['file']}"
            )

    def verify_params(self) -> None:
        """params.irpa is complete and unchanged since the build (sha256)."""
        params = self.data.get("params")
        if params:
            self.verify_file(params["file"], params["sha256"], params.get("size"))


def _check_structure(path: Path, data: Any) -> None:
    """Reject a manifest that parses but lacks what the runtime reads, before a KeyError deep inside."""
    if not isinstance(data, dict):
        raise BundleError(f"{path} is not a JSON object")
    missing = [k for k in REQUIRED_KEYS if k not in data]
    if missing:
        raise BundleError(f"{path} lacks {', '.join(missing)}: corrupted or not written by foldline compile")
    modules = data["modules"]
    if not isinstance(modules, dict):
        raise BundleError(f"{path}: 'modules' must map a device name to its module")
    for device, entry in modules.items():
        bad = [k for k in REQUIRED_MODULE_KEYS if not isinstance(entry, dict) or k not in entry]
        if bad:
            raise BundleError(f"{path}: module {device!r} lacks {', '.join(bad)}")
    params = data.get("params")
    if params is not None and (not isinstance(params, dict) or "file" not in params or "sha256" not in params):
        raise BundleError(f"{path}: 'params' must name a file and its sha256")
