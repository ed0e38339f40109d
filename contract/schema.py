"""The manifest's schema: every field the runtime reads has its type and range, and the sizes agree.

A manifest is checked before any of it is used: an edited or corrupted field
is refused with the field's name and the problem, never a KeyError deep inside
the runtime or a raw IREE shape error mid-call.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from ..dtypes import FLOAT_DTYPES, itemsize
from .entry_points import kv_tile_size
from .errors import BundleError
from .state import LAYER_TYPES, STATE_KINDS, WINDOW_ORDERS, allowed_shapes
from .tensor_split import allowed_part_shapes

# State buffer element types and their sizes in bytes.
STATE_DTYPES = {name: itemsize(name) for name in FLOAT_DTYPES}
REQUIRED_KEYS = ("model", "batch", "prefill_chunk", "state", "modules")
REQUIRED_MODULE_KEYS = ("file", "sha256")


def check_structure(path: Path, data: Any) -> None:
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

    The state buffers must have the shapes their kind's layout rule gives
    (contract/state.py): global caches [batch, kv heads, max_context, head_dim],
    local ones the same or a ring of sliding_window slots, GDN state
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
    r.string(r.key(cfg, "dtype", "model"), "model.dtype", STATE_DTYPES)
    r.string(cfg.get("kv_dtype"), "model.kv_dtype", STATE_DTYPES, optional=True)
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
    placement = data.get("placement")
    # A tensor-parallel bundle's buffers hold each part's heads (contract/tensor_split.py).
    parts = (placement.get("devices") if isinstance(placement, dict) and placement.get("scheme") == "tensor"
             and isinstance(placement.get("devices"), int) and placement["devices"] > 1 else None)
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
        shapes, want_dtype, meaning = (allowed_shapes(cfg, kind, batch, context) if parts is None
                                       else allowed_part_shapes(cfg, kind, batch, context, parts))
        want_shapes = [list(w) for w in shapes]
        if shape not in want_shapes:
            raise r.fail(f"{where}.shape", f"{shape} does not match a {kind} buffer of this model: "
                         f"{' or '.join(map(str, want_shapes))} ({meaning})")
        if sdtype != want_dtype:
            raise r.fail(f"{where}.dtype", f"{sdtype}; a {kind} buffer of this model is {want_dtype}")
    if "state_bytes" in data and data["state_bytes"] != total:
        raise r.fail("state_bytes", f"{data['state_bytes']!r} is not the sum of the buffers' nbytes, {total}")

    if placement is not None:
        _check_placement(r, r.obj(placement, "placement"), len(state), len(layer_types))

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
        for field in ("flags", "executable_formats"):
            for j, word in enumerate(r.array(entry.get(field) or [], f"{where}.{field}")):
                r.string(word, f"{where}.{field}[{j}]")
        for field in ("description", "activations"):
            r.string(entry.get(field), f"{where}.{field}", optional=True)
        r.string(entry.get("window_order"), f"{where}.window_order", choices=WINDOW_ORDERS, optional=True)
        for part, value in r.obj(entry.get("parts") or {}, f"{where}.parts").items():
            there = f"{where}.parts[{part!r}]"
            value = r.obj(value, there)
            part_file = r.filename(r.key(value, "file", there), f"{there}.file")
            if part_file in files:
                raise r.fail(f"{there}.file", f"{part_file!r} is also the file of modules.{files[part_file]}")
            files[part_file] = key
            r.sha256(r.key(value, "sha256", there), f"{there}.sha256")
            r.integer(value.get("size"), f"{there}.size", optional=True)
    params = data.get("params")
    if params is not None:
        _check_params_entry(r, r.obj(params, "params"), "params")
    tokenizer = data.get("tokenizer")
    if tokenizer is not None:
        r.filename(tokenizer, "tokenizer")
        r.sha256(data.get("tokenizer_sha256"), "tokenizer_sha256")
        r.integer(data.get("tokenizer_size"), "tokenizer_size", lo=0, optional=True)
    for field in ("source", "chat_template"):
        r.string(data.get(field), field, optional=True)
    for i, record in enumerate(r.array(data.get("passes") or [], "passes")):
        r.string(r.key(r.obj(record, f"passes[{i}]"), "name", f"passes[{i}]"), f"passes[{i}].name")
    for package, version in r.obj(data.get("versions") or {}, "versions").items():
        r.string(version, f"versions[{package!r}]", optional=True)


def _check_params_entry(r: _Rules, params: dict[str, Any], where: str) -> None:
    r.filename(r.key(params, "file", where), f"{where}.file")
    r.sha256(r.key(params, "sha256", where), f"{where}.sha256")
    r.integer(params.get("size"), f"{where}.size", optional=True)
    r.string(params.get("scope"), f"{where}.scope", optional=True)
    r.integer(params.get("count"), f"{where}.count", lo=0, optional=True)


def _check_placement(r: _Rules, placement: dict[str, Any], buffers: int, layers: int) -> None:
    """A bundle for several devices: a device for every state buffer and the logits, layer runs that cover
    every layer once."""
    devices = r.integer(r.key(placement, "devices", "placement"), "placement.devices", lo=2)
    scheme = r.string(r.key(placement, "scheme", "placement"), "placement.scheme", {"pipeline": None, "tensor": None})
    state = r.array(r.key(placement, "state", "placement"), "placement.state")
    if len(state) != buffers:
        raise r.fail("placement.state", f"places {len(state)} buffers; the bundle has {buffers}")
    for i, device in enumerate(state):
        r.integer(device, f"placement.state[{i}]", lo=0, hi=devices - 1)
    r.integer(r.key(placement, "result", "placement"), "placement.result", lo=0, hi=devices - 1)
    runs = [r.array(run, f"placement.layers[{j}]") for j, run in enumerate(
        r.array(r.key(placement, "layers", "placement"), "placement.layers"))]
    if scheme == "tensor":
        if runs != [[0, layers - 1]] * devices:
            raise r.fail("placement.layers", f"{runs}: in a tensor-parallel bundle each of the {devices} devices "
                         f"runs layers 0-{layers - 1}")
    else:
        covered = [i for run in runs if len(run) == 2 for i in range(int(run[0]), int(run[1]) + 1)]
        if len(runs) != devices or covered != list(range(layers)):
            raise r.fail("placement.layers", f"{runs} must be {devices} contiguous runs covering layers 0-{layers - 1}")
    archives = r.array(placement.get("params") or [], "placement.params")
    if archives and len(archives) != devices - 1:
        raise r.fail("placement.params", f"{len(archives)} archives; devices 1 to {devices - 1} have one each")
    for j, entry in enumerate(archives):
        _check_params_entry(r, r.obj(entry, f"placement.params[{j}]"), f"placement.params[{j}]")
