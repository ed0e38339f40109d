"""The bundle on disk: manifest.json, one vmfb per target, params.irpa, tokenizer.json.

Read by the runtime, so it imports only the standard library: no torch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = "foldline-bundle"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class BundleError(RuntimeError):
    """A bundle that is missing, corrupted or does not match what it claims."""


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


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
        if data.get("format") != FORMAT:
            raise BundleError(f"{path} is not a foldline bundle manifest")
        if data.get("format_version") != FORMAT_VERSION:
            raise BundleError(
                f"{path} has format version {data.get('format_version')}, this runtime reads {FORMAT_VERSION}"
            )
        manifest = cls(root, data)
        manifest.check_files_present()
        return manifest

    # ---- fields ------------------------------------------------------------
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
        entry = self.modules[target]
        self.verify_file(entry["file"], entry["sha256"], entry.get("size"))
        params = self.data.get("params")
        if params and entry.get("params_sha256") not in (None, params["sha256"]):
            raise BundleError(
                f"module {entry['file']} was compiled against other parameters than {params['file']}"
            )

    def verify_params(self) -> None:
        params = self.data.get("params")
        if params:
            self.verify_file(params["file"], params["sha256"], params.get("size"))
