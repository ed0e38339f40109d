"""Python scripts on aarch64 under qemu-user: foldline's runtime running aarch64 bundles on an x86 machine.

scripts/setup_arm64.sh puts an aarch64 userland in .arm64/ (Debian's arm64
Python unpacked into `sysroot/`, the aarch64 wheels of numpy, ml_dtypes and
iree-base-runtime in `site/`); $FOLDLINE_ARM64_ROOT names another. The scripts
import this foldline (runtime only: no torch on that side) and talk to the
caller through files. qemu-user emulates the CPU (its `max` model has dotprod
and i8mm), so this checks what an Arm machine computes, not its speed. The
aarch64 tests (tests/kernels/test_aarch64.py) and the instruction counts of
bench/arm_instructions.py run through it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

ARM64_ROOT_ENV = "FOLDLINE_ARM64_ROOT"
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # the foldline package root (the checkout, installed editable)
DEFAULT_ROOT = PACKAGE_DIR / ".arm64"


class Arm64Python:
    """An aarch64 Python under qemu-aarch64, with numpy, iree.runtime and this foldline importable."""

    def __init__(self, root: Path):
        self.root = root
        self.python = root / "sysroot" / "usr" / "bin" / "python3.11"
        self._imports = Path(tempfile.mkdtemp(prefix="foldline-arm64-"))
        (self._imports / "foldline").symlink_to(PACKAGE_DIR, target_is_directory=True)

    @classmethod
    def find(cls) -> Arm64Python | str:
        """The userland, or why there is none (a skip reason)."""
        root = Path(os.environ.get(ARM64_ROOT_ENV) or DEFAULT_ROOT)
        if shutil.which("qemu-aarch64") is None:
            return "qemu-aarch64 is not installed (scripts/setup_arm64.sh installs Debian's qemu-user)"
        if not (root / "sysroot" / "usr" / "bin" / "python3.11").exists() or not (root / "site").is_dir():
            return f"no aarch64 userland in {root} (run scripts/setup_arm64.sh)"
        return cls(root)

    def run(self, script: str, *args: str, timeout: float = 900, qemu_options: Sequence[str] = (),
            paths: Sequence[Path] = (), env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run `script` (Python source) on aarch64 with `args`; a failure raises with its output.

        qemu_options go to qemu-aarch64 (a `-plugin`); paths are importable beside foldline; env is added.
        """
        path = self._imports / "script.py"
        path.write_text(script)
        search = [self._imports, *paths, self.root / "site"]
        env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(map(str, search)),
               "PYTHONDONTWRITEBYTECODE": "1"}
        env.pop("PYTHONHOME", None)
        cmd = ["qemu-aarch64", *qemu_options, "-L", str(self.root / "sysroot"), str(self.python), str(path), *args]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"aarch64 script exited with {done.returncode}:\n{done.stdout}\n{done.stderr}")
        return done

    def close(self) -> None:
        """Remove the folder the scripts are imported from."""
        shutil.rmtree(self._imports, ignore_errors=True)


def main() -> int:
    """`python -m foldline.bench.aarch64_python SCRIPT ARGS...`: run a script on aarch64 (for a person trying it)."""
    found = Arm64Python.find()
    if isinstance(found, str):
        print(found, file=sys.stderr)
        return 2
    try:
        done = found.run(Path(sys.argv[1]).read_text(), *sys.argv[2:])
    finally:
        found.close()
    print(done.stdout, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
