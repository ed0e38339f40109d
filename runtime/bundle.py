"""The bundle on disk: manifest.json, one vmfb per target, params.irpa, tokenizer.json.

Read by the runtime, so it imports only the standard library: no torch.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..dtypes import DTYPES, FLOAT_DTYPES, itemsize
from ..errors import FoldlineError

FORMAT = "foldline-bundle"
REQUIRED_KEYS = ("model", "batch", "prefill_chunk", "state", "modules")
REQUIRED_MODULE_KEYS = ("file", "sha256")
# ELF e_machine -> the runtime's arch spelling (for the executables embedded in a CPU vmfb)
ELF_MACHINES = {3: "x86", 40: "arm", 62: "x86_64", 183: "aarch64", 243: "riscv"}
# IREE executable format prefix/name -> what it runs on
_FORMAT_RE = re.compile(rb"(embedded-elf-[a-z0-9_]+|system-elf-[a-z0-9_]+|vulkan-spirv-fb|cuda-nvptx-fb|rocm-hsaco-fb)")
_PTX_TARGET_RE = re.compile(rb"\.target (sm_[0-9]+a?)")
# IREE keeps each executable's target attributes (as text) in the module: the LLVM CPU features
# its code was compiled for, whatever the manifest says.
_CPU_FEATURES_RE = re.compile(rb'cpu_features = "([^"]*)"')
# Version 2: the manifest is sealed (manifest_sha256), tokenizer.json hashed, entry points declared.
# Version 3: q4 codes in ggml's nibble order (frontend/quant.py); a version-2 module reads them wrongly.
# Version 4: one-row decode takes pos_shape, an empty [0, position] int8 tensor (frontend/export.py).
# Version 5: prefill takes kv_tiles, an empty [0, T] int8 tensor: its attention reads T tiles of the
# cache (manifest `kv_tile` slots each); no more prefill_<L> / decode_<L> entry points.
FORMAT_VERSION = 5
MANIFEST = "manifest.json"
SEAL_KEY = "manifest_sha256"
# State buffer element types and their sizes in bytes: the one table the manifest rules use.
STATE_DTYPES = {name: itemsize(name) for name in FLOAT_DTYPES}  # from foldline.dtypes
# The same element types as MLIR spells them in an entry point's declaration.
MLIR_DTYPES = {d.mlir: d.name for d in DTYPES.values() if d.name in (*FLOAT_DTYPES, "int8", "int64")}
DYNAMIC = -1  # a dynamic dimension (`?`) in an entry point's declared input shape
STATE_KINDS = ("global_kv", "local_kv", "gdn_recurrent", "gdn_conv")
LAYER_TYPES = {"global": ("global_kv",), "local": ("local_kv",), "gdn": ("gdn_recurrent", "gdn_conv")}
# LLVM x86 feature -> its /proc/cpuinfo flag: the ISA extensions a CPU module may rely on
# (the runtime refuses a module that needs one this CPU lacks).
X86_LLVM_FEATURES = {
    "sse4.1": "sse4_1", "sse4.2": "sse4_2", "avx": "avx", "avx2": "avx2", "fma": "fma", "f16c": "f16c",
    "bmi2": "bmi2", "avx512f": "avx512f", "avx512dq": "avx512dq", "avx512cd": "avx512cd",
    "avx512bw": "avx512bw", "avx512vl": "avx512vl", "avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16",
    "avx512fp16": "avx512_fp16", "amx-tile": "amx_tile", "amx-int8": "amx_int8", "amx-bf16": "amx_bf16",
    "avx512vbmi": "avx512vbmi", "avx512vbmi2": "avx512_vbmi2", "avx512ifma": "avx512ifma",
    "avx512vpopcntdq": "avx512_vpopcntdq", "avx512bitalg": "avx512_bitalg", "avxvnni": "avx_vnni",
    "gfni": "gfni", "vaes": "vaes", "vpclmulqdq": "vpclmulqdq",
}
# The same for aarch64 (the `Features` line of its /proc/cpuinfo).
AARCH64_LLVM_FEATURES = {
    "neon": "asimd", "fullfp16": "asimdhp", "dotprod": "asimddp", "i8mm": "i8mm", "sve": "sve", "sve2": "sve2",
}
LLVM_FEATURE_FLAGS = {**X86_LLVM_FEATURES, **AARCH64_LLVM_FEATURES}  # no name is both arches'
# Per arch, the flags a CPU module of that arch may record, in the tables' order.
ARCH_ISA_FLAGS = {"x86_64": tuple(X86_LLVM_FEATURES.values()), "aarch64": tuple(AARCH64_LLVM_FEATURES.values())}


class BundleError(FoldlineError, RuntimeError):
    """A bundle that is missing, corrupted or does not match what it claims."""


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def isa_flags(llvm_features: str) -> list[str]:
    """The LLVM_FEATURE_FLAGS an LLVM feature string enables, in cpuinfo spelling.

    LLVM reads `+a,-a` left to right, the last word wins: a host CPU's string
    lists its model's features, then what the CPU reports (e.g. `-amx-tile`).
    """
    enabled: dict[str, bool] = {}
    for word in llvm_features.split(","):
        word = word.strip()
        if word[:1] in "+-" and word[1:] in LLVM_FEATURE_FLAGS:
            enabled[word[1:]] = word[0] == "+"
    return [flag for name, flag in LLVM_FEATURE_FLAGS.items() if enabled.get(name)]


@dataclass
class VmfbInfo:
    """What a compiled module says about where it runs, read from its bytes."""

    formats: list[str] = field(default_factory=list)  # e.g. embedded-elf-arm_64, cuda-nvptx-fb
    elf_machines: list[str] = field(default_factory=list)  # arch of each embedded ELF executable
    ptx_targets: list[str] = field(default_factory=list)  # e.g. sm_80
    # LLVM_FEATURE_FLAGS (cpuinfo spelling) some embedded executable was compiled to use
    cpu_flags: list[str] = field(default_factory=list)

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
    info.cpu_flags = sorted({f for m in _CPU_FEATURES_RE.findall(data) for f in isa_flags(m.decode())})
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
        _check_structure(path, data)
        check_schema(path, data)
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
    def row_counts(self) -> list[int]:
        """The row counts with entry points of their own, ascending; the last is the batch."""
        return [int(k) for k in self.data.get("row_counts", [self.batch])]

    @property
    def prefill_chunk(self) -> int:
        return int(self.data["prefill_chunk"])

    @property
    def max_context(self) -> int:
        return int(self.data["model"]["max_context"])

    @property
    def kv_tile(self) -> int:
        """Cache slots per tile of prefill's attention reads (its kv_tiles input counts tiles)."""
        return kv_tile_size(self.max_context)

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
        """Module key -> entry: the device name (`cpu`, `vulkan`) for a device's only module,
        `cpu-<CPU>` for each CPU module of a multi-ISA bundle (`foldline compile --cpu x86-all`)."""
        return self.data["modules"]

    def device_of(self, key: str) -> str:
        """The device a module runs on (bundles before multi-ISA ones key their modules by device only)."""
        return self.modules[key].get("device") or key

    def module_keys(self, device: str) -> list[str]:
        return [key for key in self.modules if self.device_of(key) == device]

    def devices(self) -> list[str]:
        return sorted({self.device_of(key) for key in self.modules})

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

    def check_sizes(self, key: str) -> None:
        """Cheap size check of the files module `key` needs, done even without hashing.

        IREE mmaps the .irpa: a truncated archive would otherwise end in SIGBUS
        on first use of a parameter past the end instead of an error here.
        """
        entries = [self.modules[key]]
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

    def verify_module(self, key: str) -> None:
        """The module's bytes are the ones the manifest lists, built against this bundle's params."""
        if key not in self.modules:
            raise BundleError(f"bundle {self.root} has no module {key!r}")
        entry = self.modules[key]
        self.verify_file(entry["file"], entry["sha256"], entry.get("size"))
        params = self.data.get("params")
        if params and entry.get("params_sha256") not in (None, params["sha256"]):
            raise BundleError(
                f"module {entry['file']} was compiled against other parameters than {params['file']}"
            )

    def verify_tokenizer(self) -> None:
        """tokenizer.json is the one written at compile time (sha256): an edited vocabulary would
        decode the model's ids into other text without any error."""
        name = self.data.get("tokenizer")
        if name:
            self.verify_file(name, self.data["tokenizer_sha256"], self.data.get("tokenizer_size"))

    def verify_params(self) -> None:
        """params.irpa is complete and unchanged since the build (sha256)."""
        params = self.data.get("params")
        if params:
            self.verify_file(params["file"], params["sha256"], params.get("size"))


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


class _Rules:
    """Typed checks of manifest fields; each failure names the field and the problem."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, where: str, problem: str) -> BundleError:
        return BundleError(f"{self.path}: {where}: {problem}")

    def obj(self, value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(where, f"must be an object, got {type(value).__name__}")
        return value

    def key(self, obj: dict[str, Any], key: str, where: str) -> Any:
        if key not in obj:
            raise self.fail(f"{where}.{key}" if where else key, "is missing")
        return obj[key]

    def integer(self, value: Any, where: str, lo: int = 1, hi: int | None = None, optional: bool = False) -> int | None:
        if value is None and optional:
            return None
        if type(value) is not int:
            raise self.fail(where, f"must be an integer, got {value!r}")
        if value < lo or (hi is not None and value > hi):
            bound = f"between {lo} and {hi}" if hi is not None else ("positive" if lo == 1 else f">= {lo}")
            raise self.fail(where, f"must be {bound}, got {value}")
        return value

    def string(self, value: Any, where: str, choices: Any = None, optional: bool = False) -> str | None:
        if value is None and optional:
            return None
        if not isinstance(value, str):
            raise self.fail(where, f"must be a string, got {value!r}")
        if choices is not None and value not in choices:
            raise self.fail(where, f"unknown value {value!r}; expected one of {', '.join(choices)}")
        return value

    def filename(self, value: Any, where: str) -> str:
        name = self.string(value, where)
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            raise self.fail(where, f"must name a file inside the bundle, got {name!r}")
        return name

    def sha256(self, value: Any, where: str) -> str:
        if not (isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value)):
            raise self.fail(where, f"must be a sha256 hex digest, got {value!r}")
        return value

    def array(self, value: Any, where: str) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(where, f"must be a list, got {value!r}")
        return value

    def shape(self, value: Any, where: str) -> list[int]:
        dims = self.array(value, where)
        if not dims or any(type(d) is not int or d < 1 for d in dims):
            raise self.fail(where, f"must be a list of positive integers, got {value!r}")
        return dims


def check_schema(path: Path, data: dict[str, Any]) -> None:
    """Every field the runtime reads has its type and range, and the sizes agree with each other.

    The state buffers must have the shapes the model's layout implies (frontend
    StateSpec, passes/state_layout): global caches [batch, kv heads, max_context,
    head_dim], local ones the same or a ring of sliding_window slots, GDN state
    [batch, v heads, v dim, k dim] and its conv window [batch, channels, kernel-1].
    """
    r = _Rules(path)
    cfg = r.obj(r.key(data, "model", ""), "model")
    vocab = r.integer(r.key(cfg, "vocab_size", "model"), "model.vocab_size")
    context = r.integer(r.key(cfg, "max_context", "model"), "model.max_context")
    layer_types = r.array(r.key(cfg, "layer_types", "model"), "model.layer_types")
    if not layer_types:
        raise r.fail("model.layer_types", "must list at least one layer")
    for i, kind in enumerate(layer_types):
        r.string(kind, f"model.layer_types[{i}]", LAYER_TYPES)
    dtype = r.string(r.key(cfg, "dtype", "model"), "model.dtype", STATE_DTYPES)
    cache_dtype = r.string(cfg.get("kv_dtype"), "model.kv_dtype", STATE_DTYPES, optional=True) or dtype
    for key in ("num_kv_heads", "head_dim"):
        r.integer(cfg.get(key), f"model.{key}")
    r.integer(cfg.get("sliding_window", 0), "model.sliding_window", lo=0)
    for key in ("gdn_num_k_heads", "gdn_num_v_heads", "gdn_head_k_dim", "gdn_head_v_dim", "gdn_conv_kernel"):
        r.integer(cfg.get(key, 0), f"model.{key}", lo=0)
    r.integer(cfg.get("bos_token_id"), "model.bos_token_id", lo=0, hi=vocab - 1, optional=True)
    for i, eos in enumerate(r.array(cfg.get("eos_token_ids", []), "model.eos_token_ids")):
        r.integer(eos, f"model.eos_token_ids[{i}]", lo=0, hi=vocab - 1)

    batch = r.integer(data["batch"], "batch")
    counts = [r.integer(k, f"row_counts[{i}]", hi=batch)
              for i, k in enumerate(r.array(data.get("row_counts", [batch]), "row_counts"))]
    if not counts or counts != sorted(set(counts)) or counts[-1] != batch:
        raise r.fail("row_counts", f"{counts} must ascend without repeats and end with the batch {batch}")
    r.integer(data["prefill_chunk"], "prefill_chunk", hi=context)
    tile = r.integer(r.key(data, "kv_tile", ""), "kv_tile")
    if tile != kv_tile_size(context):
        raise r.fail("kv_tile", f"{tile} is not the tile of a {context}-slot cache ({kv_tile_size(context)})")

    state = r.array(data["state"], "state")
    if not state:
        raise r.fail("state", "lists no buffer")
    names: set[str] = set()
    total = 0
    for i, entry in enumerate(state):
        where = f"state[{i}]"
        entry = r.obj(entry, where)
        name = r.string(r.key(entry, "name", where), f"{where}.name")
        if name in names:
            raise r.fail(f"{where}.name", f"{name!r} is listed twice")
        names.add(name)
        shape = r.shape(r.key(entry, "shape", where), f"{where}.shape")
        sdtype = r.string(r.key(entry, "dtype", where), f"{where}.dtype", STATE_DTYPES)
        nbytes = r.integer(r.key(entry, "nbytes", where), f"{where}.nbytes")
        if nbytes != math.prod(shape) * STATE_DTYPES[sdtype]:
            raise r.fail(f"{where}.nbytes", f"{nbytes} is not prod({shape}) * {STATE_DTYPES[sdtype]} bytes "
                         f"of {sdtype} = {math.prod(shape) * STATE_DTYPES[sdtype]}")
        total += nbytes
        kind = r.string(r.key(entry, "kind", where), f"{where}.kind", STATE_KINDS)
        layers = r.array(r.key(entry, "layers", where), f"{where}.layers")
        if not layers:
            raise r.fail(f"{where}.layers", "names no layer")
        for j, layer in enumerate(layers):
            r.integer(layer, f"{where}.layers[{j}]", lo=0, hi=len(layer_types) - 1)
            if kind not in LAYER_TYPES[layer_types[layer]]:
                raise r.fail(f"{where}.kind", f"{kind} buffer for layer {layer}, a {layer_types[layer]} layer")
        expected = _layout(cfg, kind, batch, context, cache_dtype, dtype)
        if expected is not None:
            want_shapes, want_dtype, meaning = expected
            if shape not in want_shapes:
                raise r.fail(f"{where}.shape", f"{shape} does not match a {kind} buffer of this model: "
                             f"{' or '.join(map(str, want_shapes))} ({meaning})")
            if sdtype != want_dtype:
                raise r.fail(f"{where}.dtype", f"{sdtype}; a {kind} buffer of this model is {want_dtype}")
    if "state_bytes" in data and data["state_bytes"] != total:
        raise r.fail("state_bytes", f"{data['state_bytes']!r} is not the sum of the buffers' nbytes, {total}")

    files: dict[str, str] = {}
    for key, entry in data["modules"].items():
        where = f"modules.{key}"
        name = r.filename(entry["file"], f"{where}.file")
        if name in files:
            raise r.fail(f"{where}.file", f"{name!r} is also the file of modules.{files[name]}")
        files[name] = key
        device = r.string(entry.get("device"), f"{where}.device", optional=True) or key
        cpu = r.string(entry.get("cpu"), f"{where}.cpu", optional=True)
        if device != key and not (cpu and key == f"{device}-{cpu}"):
            raise r.fail(where, f"a {device} module is keyed {device!r}, or {device + '-<cpu>'!r} with its cpu "
                         f"recorded (got cpu {cpu!r})")
        r.sha256(entry["sha256"], f"{where}.sha256")
        r.integer(entry.get("size"), f"{where}.size", optional=True)
        if entry.get("params_sha256") is not None:
            r.sha256(entry["params_sha256"], f"{where}.params_sha256")
        r.string(entry.get("arch"), f"{where}.arch", optional=True)
        for j, flag in enumerate(r.array(entry.get("cpu_flags", []), f"{where}.cpu_flags")):
            r.string(flag, f"{where}.cpu_flags[{j}]")
        isa = entry.get("kernel_isa")
        if isa is not None:
            for family in ("decode", "prefill"):
                r.string(r.key(r.obj(isa, f"{where}.kernel_isa"), family, f"{where}.kernel_isa"),
                         f"{where}.kernel_isa.{family}")
        for kind, count in r.obj(entry.get("kernels", {}), f"{where}.kernels").items():
            r.integer(count, f"{where}.kernels[{kind!r}]", lo=0)
    params = data.get("params")
    if params is not None:
        r.filename(params["file"], "params.file")
        r.sha256(params["sha256"], "params.sha256")
        r.integer(params.get("size"), "params.size", optional=True)
    tokenizer = data.get("tokenizer")
    if tokenizer is not None:
        r.filename(tokenizer, "tokenizer")
        r.sha256(data.get("tokenizer_sha256"), "tokenizer_sha256")
        r.integer(data.get("tokenizer_size"), "tokenizer_size", lo=0, optional=True)


def _layout(cfg: dict[str, Any], kind: str, batch: int, context: int, cache_dtype: str,
            dtype: str) -> tuple[list[list[int]], str, str] | None:
    """The shapes a state buffer of `kind` may have for this config, its dtype, and what the dims mean."""
    heads, head_dim = cfg["num_kv_heads"], cfg["head_dim"]
    if kind == "global_kv":
        return [[batch, heads, context, head_dim]], cache_dtype, "batch, num_kv_heads, max_context, head_dim"
    if kind == "local_kv":
        window = cfg.get("sliding_window", 0)
        slots = [context] + ([window] if 0 < window < context else [])
        return ([[batch, heads, n, head_dim] for n in slots], cache_dtype,
                "batch, num_kv_heads, max_context or a ring of sliding_window slots, head_dim")
    g = {k: cfg.get(k, 0) for k in ("gdn_num_k_heads", "gdn_num_v_heads", "gdn_head_k_dim", "gdn_head_v_dim",
                                     "gdn_conv_kernel")}
    if kind == "gdn_recurrent":
        return ([[batch, g["gdn_num_v_heads"], g["gdn_head_v_dim"], g["gdn_head_k_dim"]]], "float32",
                "batch, gdn_num_v_heads, gdn_head_v_dim, gdn_head_k_dim")
    if kind == "gdn_conv":
        channels = 2 * g["gdn_num_k_heads"] * g["gdn_head_k_dim"] + g["gdn_num_v_heads"] * g["gdn_head_v_dim"]
        return ([[batch, channels, g["gdn_conv_kernel"] - 1]], dtype, "batch, conv channels, gdn_conv_kernel - 1")
    return None


DECLARATION_KEY = "iree.abi.declaration"
_INPUT_RE = re.compile(r"%input(\d+): tensor<([^>]*)>")


def declared_inputs(declaration: str) -> list[tuple[list[int], str]]:
    """(shape, dtype) of each tensor input of an entry point's `iree.abi.declaration`, in order.

    The declaration reads `sync func @decode(%input0: tensor<1x1xi64>, ...) -> (...)`;
    only its inputs are parsed, never its outputs. A dynamic dimension reads as DYNAMIC.
    """
    head = declaration.split(") -> ", 1)[0]
    out = []
    for _index, spec in _INPUT_RE.findall(head):
        *dims, elem = spec.split("x")
        shape = [int(d) if d.isdigit() else DYNAMIC for d in dims if d.isdigit() or d == "?"]
        out.append((shape, MLIR_DTYPES.get(elem, elem)))
    return out


def takes_position_shape(batch: int) -> bool:
    """Whether decode takes pos_shape: one-row bundles only.

    A batched step's rows sit at different positions, so its cache writes take
    the general form and read no host position; IREE drops an input that nothing
    reads, and the entry point's signature would not match the manifest.
    """
    return batch == 1


def position_shape(position: int) -> np.ndarray:
    """decode's pos_shape input at `position`: no data, the position is its second dimension.

    The compiled module reads a dimension on the host, so the decode step's cache
    writes need no read of device memory to find their slot.
    """
    return np.empty((0, position), np.int8)


KV_TILE = 64  # cache slots per attention tile, when the cache length allows it


def kv_tile_size(slots: int) -> int:
    """Slots per tile of a full cache of `slots` slots: 64, or the largest power of two dividing `slots`.

    Prefill's attention reads a whole number of tiles (`kv_tiles`). A static tile
    size under the dynamic tile count lets IREE's CPU codegen keep its static
    tiles: the reads then cost what a static length does (docs/architecture.md).
    """
    tile = KV_TILE
    while slots % tile:
        tile //= 2
    return tile


def kv_tile_count(end: int, slots: int) -> int:
    """The tiles prefill's attention reads for a chunk whose last position is below `end`."""
    tile = kv_tile_size(slots)
    return min(max(1, -(-end // tile)), slots // tile)


def kv_tiles_input(end: int, slots: int) -> np.ndarray:
    """prefill's kv_tiles input: no data, the tile count is its second dimension."""
    return np.empty((0, kv_tile_count(end, slots)), np.int8)


def decode_inputs(tokens: np.ndarray, pos: np.ndarray) -> list[np.ndarray]:
    """decode's inputs before the state: tokens, pos and, for one row, pos_shape."""
    extra = [position_shape(int(pos[0]))] if takes_position_shape(tokens.shape[0]) else []
    return [tokens, pos, *extra]


def row_entry_name(entry: str, rows: int, batch: int) -> str:
    """The function that runs `entry` ("prefill" or "decode") over the first `rows` rows of a batch-`batch` bundle."""
    return entry if rows == batch else f"{entry}_rows{rows}"


def entry_point_inputs(manifest: Manifest) -> dict[str, list[tuple[list[int], str, str]]]:
    """function -> (shape, dtype, what) of each input the runtime passes it, from the manifest."""
    c = manifest.prefill_chunk
    tiles = DYNAMIC if manifest.max_context // manifest.kv_tile > 1 else 1  # one tile: a static dimension
    out = {}
    for b in manifest.row_counts:
        state = [([b, *s.shape[1:]], s.dtype, f"state buffer {s.name!r}") for s in manifest.state]
        prefill = [([b, c], "int64", "tokens"), ([b], "int64", "start_pos"), ([b], "int64", "n_valid"),
                   ([0, tiles], "int8", "kv_tiles"), *state]
        pos_shape = [([0, DYNAMIC], "int8", "pos_shape")] if takes_position_shape(b) else []
        decode = [([b, 1], "int64", "tokens"), ([b], "int64", "pos"), *pos_shape, *state]
        out[row_entry_name("prefill", b, manifest.batch)] = prefill
        out[row_entry_name("decode", b, manifest.batch)] = decode
    return out


def check_entry_points(manifest: Manifest, key: str, reflection: Any) -> None:
    """The compiled module `key` takes the buffers the manifest lists, checked before the first call.

    `reflection(name)` gives an entry point's reflection dict, or None when the module
    lacks it. A mismatch would otherwise surface as a raw IREE shape error mid-call.
    """
    vmfb = manifest.modules[key]["file"]
    for name, want in entry_point_inputs(manifest).items():
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
                              f"({len(manifest.state)} state buffers): module and manifest are from different builds")
        for (shape, dtype), (want_shape, want_dtype, what) in zip(have, want):
            if (shape, dtype) != (want_shape, want_dtype):
                raise BundleError(f"{vmfb}: {name} takes {what} as {dtype}{shape}; the manifest says "
                                  f"{want_dtype}{want_shape}: module and manifest are from different builds")


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
