"""Every benchmarked engine runs in a child process of its own.

Its peak RSS is then its own, and the runtime's process never imports torch.
One protocol for every engine: the child runs a script that has the timing
loop's code in scope (bench/timer.py, sent as text, since a peer's
interpreter need not have foldline installed) and its arguments as `args`
(JSON in argv[1]), and prints one line `BENCH <json>` with its figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..errors import FoldlineError, InputError
from . import timer

_PRELUDE = Path(timer.__file__).read_text() + "\n\nimport json, sys\nargs = json.loads(sys.argv[1])\n"
MARK = "BENCH "


class BenchError(InputError):
    """A bench run that cannot be made as asked (a bad option, a run longer than the context)."""


class PeerUnavailable(FoldlineError, RuntimeError):
    """A peer engine that cannot run here (not installed): reported, not fatal."""


def run_script(script: str, args: dict[str, Any], what: str, python: str | None = None,
               peer: bool = False) -> dict[str, Any]:
    """`script` in a child interpreter (`python`, default this one); the figures it printed.

    A peer whose interpreter lacks its package raises PeerUnavailable; any other failure RuntimeError.
    """
    proc = subprocess.run([python or sys.executable, "-c", _PRELUDE + script, json.dumps(args)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        err = proc.stderr.strip()
        if peer and "ModuleNotFoundError" in err:
            raise PeerUnavailable(f"{what}: {err.splitlines()[-1]} (interpreter {python or sys.executable})")
        raise RuntimeError(f"{what} benchmark failed:\n{err[-2000:]}")
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)), None)
    if line is None:
        raise RuntimeError(f"{what} benchmark printed no figures:\n{proc.stdout[-2000:]}")
    return json.loads(line[len(MARK):])


def run_foldline(module: str, function: str, args: dict[str, Any]) -> dict[str, Any]:
    """`foldline.bench.<module>.<function>(**args)` in a child process of this interpreter."""
    script = f"from foldline.bench.{module} import {function}\nprint({MARK!r} + json.dumps({function}(**args)))\n"
    return run_script(script, args, f"foldline ({function})")
