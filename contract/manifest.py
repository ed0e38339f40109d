"""manifest.json: the typed manifest the compiler writes and the runtime reads, sealed and checked.

`Manifest` holds every field as a typed attribute. `Manifest.to_json` is the
one place that spells the file's keys, `Manifest.load` the one place that reads
them, after the seal (contract/manifest.py: `check_seal`), the structure and
the schema (contract/schema.py) have passed: nothing outside this package
indexes a manifest dict.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .entry_points import (
    DECLARATION_KEY,
    DYNAMIC,
    declared_inputs,
    kv_tile_size,
    row_entry_name,
    signatures,
    takes_position_shape,
)
from .errors import BundleError
from .schema import check_schema, check_structure
from .state import StateBuffer

FORMAT = "foldline-bundle"
# Version 2: the manifest is sealed (manifest_sha256), tokenizer.json hashed, entry points declared.
# Version 3: q4 codes in ggml's nibble order (frontend/quant.py); a version-2 module reads them wrongly.
# Version 4: one-row decode takes pos_shape, an empty [0, position] int8 tensor.
# Version 5: prefill takes kv_tiles, an empty [0, T] int8 tensor: its attention reads T tiles of the
# cache (manifest `kv_tile` slots each); no more prefill_<L> / decode_<L> entry points.
# Version 6: batched decode takes n_valid[B] after pos: a row given 0 keeps its state.
FORMAT_VERSION = 6
MANIFEST = "manifest.json"
SEAL_KEY = "manifest_sha256"
# Every key manifest.json uses, at any depth: only this package names them (tests/test_layering.py).
TOP_FIELDS = ("format", "format_version", "source", "model", "batch", "row_counts", "prefill_chunk",
              "entry_points", "kv_tile", "state", "state_bytes", "params", "modules", "tokenizer",
              "tokenizer_sha256", "tokenizer_size", "chat_template", "passes", "versions", "placement", SEAL_KEY)
STATE_FIELDS = ("name", "shape", "dtype", "nbytes", "layers", "kind")
PARAMS_FIELDS = ("file", "sha256", "size", "scope", "count")
PLACEMENT_FIELDS = ("devices", "scheme", "layers", "state", "result")
MODULE_FIELDS = ("file", "sha256", "size", "params_sha256", "device", "cpu", "flags", "description", "arch",
                 "cpu_flags", "activations", "kernel_isa", "kernels", "executable_formats", "parts", "window_order",
                 "provider_gaps")


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass
class FileEntry:
    """A file of the bundle and what it must be: its sha256 and size."""

    file: str
    sha256: str
    size: int | None = None

    @classmethod
    def of(cls, path: Path) -> FileEntry:
        """The entry of a file just written into the bundle."""
        return cls(path.name, sha256_file(path), path.stat().st_size)


@dataclass
class ParamsEntry(FileEntry):
    """params.irpa: the weights, under one IRPA scope."""

    scope: str = "model"
    count: int | None = None  # parameters in the archive

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ParamsEntry:
        return cls(data["file"], data["sha256"], data.get("size"), data.get("scope") or "model", data.get("count"))

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "sha256": self.sha256, "size": self.size, "scope": self.scope,
                "count": self.count}


@dataclass
class ModuleEntry:
    """One compiled module: its file, where it runs, and what its kernels were built for."""

    file: str
    sha256: str
    size: int | None = None
    params_sha256: str | None = None  # the params.irpa it was compiled against
    device: str | None = None  # the IREE device; None: the module's key (bundles before multi-ISA ones)
    cpu: str | None = None  # the LLVM CPU of a CPU module
    flags: list[str] = field(default_factory=list)  # iree-compile flags
    description: str = ""
    arch: str | None = None
    cpu_flags: list[str] = field(default_factory=list)  # contract.isa flags its code relies on
    activations: str | None = None  # quantized products' activations: "int8" or "float"
    kernel_isa: dict[str, str] | None = None  # family ("decode", "prefill") -> int8 kernel ISA (or f32)
    kernels: dict[str, int] = field(default_factory=dict)  # kernel -> sites that took it (kernels/sites.py)
    executable_formats: list[str] = field(default_factory=list)  # read from the vmfb (contract/vmfb.py)
    # function -> its own file, for a module kept as one file per function (ONNX: one graph each,
    # `file` holding the weights they share); empty for an IREE module, whose one file has them all
    parts: dict[str, FileEntry] = field(default_factory=dict)
    # how its windowed layers' caches hold the window: None, as rings (position p in slot p mod
    # window); "recent", in order (ONNX Runtime's GroupQueryAttention: backends/onnx/gqa.py)
    window_order: str | None = None
    # an ONNX module: for each GPU execution provider checked (cuda, dml), "op (type)" -> the nodes of its
    # graphs that provider has no kernel for, which run on the next provider (backends/onnx/providers.py)
    provider_gaps: dict[str, dict[str, int]] | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModuleEntry:
        fields = {k: data[k] for k in MODULE_FIELDS if data.get(k) is not None}
        fields["parts"] = {name: FileEntry(p["file"], p["sha256"], p.get("size"))
                           for name, p in (data.get("parts") or {}).items()}
        return cls(**fields)

    def to_json(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in MODULE_FIELDS if k != "parts"}
        if self.parts:
            out["parts"] = {name: {"file": p.file, "sha256": p.sha256, "size": p.size} for name, p in self.parts.items()}
        return out

    def file_entries(self) -> list[FileEntry | ModuleEntry]:
        """Every file of the module with its hash: the module file, then its parts."""
        return [self, *self.parts.values()]


@dataclass
class DevicePlacement:
    """A bundle compiled for several devices (`foldline compile --devices N`): where its layers, state
    buffers and logits live. The modules' own IR carries the full placement; this is what the runtime needs."""

    devices: int
    scheme: str  # "pipeline": each device runs a contiguous run of layers; "tensor": part of every layer
    layers: list[tuple[int, int]]  # per device: the first and last layer it runs
    state: list[int]  # per state buffer, in the entry points' argument order: its device
    result: int  # the device the logits come back from
    # devices 1 .. N-1: the weights each reads, a file and IRPA scope of its own (device 0's: `params`)
    params: list[ParamsEntry] = field(default_factory=list)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DevicePlacement:
        return cls(int(data["devices"]), str(data["scheme"]), [(int(a), int(b)) for a, b in data["layers"]],
                   [int(d) for d in data["state"]], int(data["result"]),
                   [ParamsEntry.from_json(p) for p in data.get("params") or []])

    def to_json(self) -> dict[str, Any]:
        data = {"devices": self.devices, "scheme": self.scheme, "layers": [list(r) for r in self.layers],
                "state": list(self.state), "result": self.result}
        if self.params:
            data["params"] = [p.to_json() for p in self.params]
        return data

    def state_bytes(self, buffers: list[StateBuffer], device: int) -> int:
        """The bytes of state device `device` holds."""
        return sum(b.nbytes for b, d in zip(buffers, self.state, strict=True) if d == device)


@dataclass
class Manifest:
    """What a bundle holds and how to call it: the model config, rows, state, files and modules."""

    model: dict[str, Any]  # the ModelConfig, as ModelConfig.to_dict() writes it
    batch: int  # rows each state buffer holds
    prefill_chunk: int
    state: list[StateBuffer]  # in the entry points' argument order
    modules: dict[str, ModuleEntry]  # `cpu`, `vulkan`, ... or `cpu-<CPU>` for each CPU module of several
    row_counts: list[int] = field(default_factory=list)  # ascending, ending with batch; default [batch]
    params: ParamsEntry | None = None
    tokenizer: FileEntry | None = None
    chat_template: str | None = None
    source: str = ""  # what was compiled (a preset, a GGUF path, ...)
    passes: list[dict[str, Any]] = field(default_factory=list)  # the pipeline's report
    versions: dict[str, str] = field(default_factory=dict)  # of the packages that built it
    placement: DevicePlacement | None = None  # several devices; None: one
    root: Path = field(default=Path("."), compare=False)  # the bundle directory

    def __post_init__(self) -> None:
        if not self.row_counts:
            self.row_counts = [self.batch]

    # ---- derived fields --------------------------------------------------------
    @property
    def device_count(self) -> int:
        """How many devices the modules run on together (1 unless compiled with --devices)."""
        return self.placement.devices if self.placement else 1

    def state_device(self, index: int) -> int:
        """The device state buffer `index` lives on."""
        return self.placement.state[index] if self.placement else 0

    @property
    def config(self) -> dict[str, Any]:
        return self.model

    @property
    def model_name(self) -> str | None:
        return self.model.get("name")

    @property
    def max_context(self) -> int:
        return int(self.model["max_context"])

    @property
    def vocab_size(self) -> int:
        return int(self.model["vocab_size"])

    @property
    def kv_tile(self) -> int:
        """Cache slots per tile of prefill's attention reads (its kv_tiles input counts tiles)."""
        return kv_tile_size(self.max_context)

    @property
    def state_bytes(self) -> int:
        return sum(s.nbytes for s in self.state)

    @property
    def tokenizer_path(self) -> Path | None:
        return self.root / self.tokenizer.file if self.tokenizer else None


    def pass_names(self) -> list[tuple[str, bool]]:
        """(pass, whether it changed the program) for each pass the pipeline ran."""
        return [(str(p.get("name")), bool(p.get("changed"))) for p in self.passes]

    # ---- modules ---------------------------------------------------------------
    def device_of(self, key: str) -> str:
        """The device a module runs on (bundles before multi-ISA ones key their modules by device only)."""
        return self.modules[key].device or key

    def module_keys(self, device: str) -> list[str]:
        return [key for key in self.modules if self.device_of(key) == device]

    def devices(self) -> list[str]:
        return sorted({self.device_of(key) for key in self.modules})

    @property
    def params_files(self) -> list[ParamsEntry]:
        """Every parameter archive: `params`, then devices 1 .. N-1's of a bundle for several devices."""
        return ([self.params] if self.params else []) + (self.placement.params if self.placement else [])

    def files(self) -> list[str]:
        names = [e.file for m in self.modules.values() for e in m.file_entries()]
        names += [e.file for e in (*self.params_files, self.tokenizer) if e is not None]
        return names

    # ---- entry points ----------------------------------------------------------
    def entry_point_inputs(self) -> dict[str, list[tuple[list[int], str, str]]]:
        """function -> (shape, dtype, what) of each input the runtime passes it, from the manifest."""
        c = self.prefill_chunk
        tiles = DYNAMIC if self.max_context // self.kv_tile > 1 else 1  # one tile: a static dimension
        out = {}
        for b in self.row_counts:
            state = [([b, *s.shape[1:]], s.dtype, f"state buffer {s.name!r}") for s in self.state]
            prefill = [([b, c], "int64", "tokens"), ([b], "int64", "start_pos"), ([b], "int64", "n_valid"),
                       ([0, tiles], "int8", "kv_tiles"), *state]
            third = ([0, DYNAMIC], "int8", "pos_shape") if takes_position_shape(b) else ([b], "int64", "n_valid")
            decode = [([b, 1], "int64", "tokens"), ([b], "int64", "pos"), third, *state]
            out[row_entry_name("prefill", b, self.batch)] = prefill
            out[row_entry_name("decode", b, self.batch)] = decode
        return out

    def check_entry_points(self, key: str, reflection: Callable[[str], dict[str, Any] | None]) -> None:
        """The compiled module `key` takes the buffers the manifest lists, checked before the first call.

        `reflection(name)` gives an entry point's reflection dict, or None when the module
        lacks it. A mismatch would otherwise surface as a raw IREE shape error mid-call.
        """
        vmfb = self.modules[key].file
        for name, want in self.entry_point_inputs().items():
            info = reflection(name)
            if info is None:
                raise BundleError(f"{vmfb} has no entry point {name!r}, which the manifest implies: "
                                  "the module is from another build; recompile the bundle")
            declaration = info.get(DECLARATION_KEY)
            if not declaration:
                raise BundleError(f"{vmfb}: entry point {name!r} declares no signature; recompile with foldline compile")
            have = declared_inputs(declaration)
            if len(have) != len(want):
                raise BundleError(f"{vmfb}: {name} takes {len(have)} inputs, the manifest implies {len(want)} "
                                  f"({len(self.state)} state buffers): module and manifest are from different builds")
            for (shape, dtype), (want_shape, want_dtype, what) in zip(have, want):
                if (shape, dtype) != (want_shape, want_dtype):
                    raise BundleError(f"{vmfb}: {name} takes {what} as {dtype}{shape}; the manifest says "
                                      f"{want_dtype}{want_shape}: module and manifest are from different builds")

    # ---- JSON ------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """The manifest as manifest.json holds it, sealed."""
        data = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "source": self.source,
            "model": self.model,
            "batch": self.batch,
            # prefill/decode take `batch` rows, prefill_rows{k}/decode_rows{k} the first k rows
            "row_counts": list(self.row_counts),
            "prefill_chunk": self.prefill_chunk,
            "entry_points": signatures(self.batch),
            # prefill's attention over full caches reads its kv_tiles input's T tiles of kv_tile slots
            "kv_tile": self.kv_tile,
            "state": [{"name": s.name, "shape": list(s.shape), "dtype": s.dtype, "nbytes": s.nbytes,
                       "layers": list(s.layers), "kind": s.kind} for s in self.state],
            "state_bytes": self.state_bytes,
            "params": None if self.params is None else self.params.to_json(),
            "modules": {key: m.to_json() for key, m in self.modules.items()},
            "tokenizer": self.tokenizer.file if self.tokenizer else None,
            "tokenizer_sha256": self.tokenizer.sha256 if self.tokenizer else None,
            "tokenizer_size": self.tokenizer.size if self.tokenizer else None,
            "chat_template": self.chat_template,
            "passes": self.passes,
            "versions": self.versions,
        }
        if self.placement is not None:
            data["placement"] = self.placement.to_json()
        return seal_manifest(data)

    @classmethod
    def from_json(cls, data: dict[str, Any], root: Path) -> Manifest:
        """The typed manifest of a dict that passed `check_structure` and `check_schema`."""
        params = data.get("params")
        tokenizer = data.get("tokenizer")
        return cls(
            model=data["model"],
            batch=int(data["batch"]),
            prefill_chunk=int(data["prefill_chunk"]),
            state=[StateBuffer(s["name"], tuple(s["shape"]), s["dtype"], s["kind"], tuple(s["layers"]))
                   for s in data["state"]],
            modules={key: ModuleEntry.from_json(entry) for key, entry in data["modules"].items()},
            row_counts=[int(k) for k in data.get("row_counts") or [data["batch"]]],
            params=None if params is None else ParamsEntry.from_json(params),
            tokenizer=None if not tokenizer else FileEntry(tokenizer, data["tokenizer_sha256"],
                                                           data.get("tokenizer_size")),
            chat_template=data.get("chat_template"),
            source=data.get("source") or "",
            passes=list(data.get("passes") or []),
            versions=dict(data.get("versions") or {}),
            placement=DevicePlacement.from_json(data["placement"]) if data.get("placement") else None,
            root=root,
        )

    def write(self, bundle_dir: Path) -> Path:
        path = Path(bundle_dir) / MANIFEST
        path.write_text(json.dumps(self.to_json(), indent=2))
        return path

    @classmethod
    def load(cls, bundle_dir: str | Path) -> Manifest:
        """Read, unseal and check a bundle's manifest; every listed file must be present."""
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
        except RecursionError:
            raise BundleError(f"{path} is nested too deeply to be a foldline bundle manifest") from None
        if not isinstance(data, dict):
            raise BundleError(f"{path} is not a JSON object: not a foldline bundle manifest")
        if data.get("format") != FORMAT:
            raise BundleError(f"{path} is not a foldline bundle manifest")
        if data.get("format_version") != FORMAT_VERSION:
            raise BundleError(
                f"{path} has format version {data.get('format_version')}, this runtime reads {FORMAT_VERSION}: "
                "recompile with foldline compile"
            )
        check_seal(path, data)
        check_structure(path, data)
        check_schema(path, data)
        manifest = cls.from_json(data, root)
        manifest.check_files_present()
        return manifest

    # ---- integrity -------------------------------------------------------------
    def check_files_present(self) -> None:
        for name in self.files():
            if not (self.root / name).is_file():
                raise BundleError(f"bundle {self.root} is missing {name} (listed in {MANIFEST})")

    def check_sizes(self, key: str) -> None:
        """Cheap size check of the files module `key` needs, done even without hashing.

        IREE mmaps the .irpa: a truncated archive would otherwise end in SIGBUS
        on first use of a parameter past the end instead of an error here.
        """
        for entry in (*self.modules[key].file_entries(), *self.params_files):
            path = self.root / entry.file
            size = path.stat().st_size
            if entry.size is not None and size != entry.size:
                raise BundleError(f"{path} is {size} bytes, the manifest says {entry.size}: truncated or replaced")

    def verify_file(self, entry: FileEntry | ModuleEntry) -> None:
        path = self.root / entry.file
        size = path.stat().st_size
        if entry.size is not None and size != entry.size:
            raise BundleError(f"{path} is {size} bytes, the manifest says {entry.size}: truncated or replaced")
        if sha256_file(path) != entry.sha256:
            raise BundleError(f"{path} does not match the manifest's sha256: corrupted or from another build")

    def verify_module(self, key: str) -> None:
        """The module's bytes are the ones the manifest lists, built against this bundle's params."""
        if key not in self.modules:
            raise BundleError(f"bundle {self.root} has no module {key!r}")
        entry = self.modules[key]
        for part in entry.file_entries():
            self.verify_file(part)
        if self.params and entry.params_sha256 not in (None, self.params.sha256):
            raise BundleError(f"module {entry.file} was compiled against other parameters than {self.params.file}")

    def verify_tokenizer(self) -> None:
        """tokenizer.json is the one written at compile time (sha256): an edited vocabulary would
        decode the model's ids into other text without any error."""
        if self.tokenizer:
            self.verify_file(self.tokenizer)

    def verify_params(self) -> None:
        """params.irpa (and each device's archive) is complete and unchanged since the build (sha256)."""
        for entry in self.params_files:
            self.verify_file(entry)


def manifest_digest(data: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of a manifest, its seal left out."""
    body = {k: v for k, v in data.items() if k != SEAL_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def seal_manifest(data: dict[str, Any]) -> dict[str, Any]:
    """Set `manifest_sha256` over the rest of the manifest (in place; returned for chaining).

    Written by `foldline compile`; a test that edits a manifest on purpose seals
    it again so the load reaches the check the test is about.
    """
    data[SEAL_KEY] = manifest_digest(data)
    return data


def check_seal(path: Path, data: dict[str, Any]) -> None:
    """Refuse a manifest changed since compile time: an edited shape, vocab size or context
    would otherwise reach IREE and fail there, or silently run with wrong buffers."""
    seal = data.get(SEAL_KEY)
    if not isinstance(seal, str):
        raise BundleError(f"{path} has no {SEAL_KEY}: not written by foldline compile; recompile the bundle")
    if seal != manifest_digest(data):
        raise BundleError(f"{path} was edited or corrupted after compile: its content does not match its "
                          f"{SEAL_KEY}; recompile the bundle with foldline compile")
