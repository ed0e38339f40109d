"""The `foldline` command line. Each subcommand lives in its own module."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import re
import sys
import traceback
import warnings
from importlib import metadata
from pathlib import Path

from ..errors import FoldlineError

# torch.export's own deprecation noise; it says nothing about the user's model.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)

# subcommand -> module under foldline.tools that defines add_parser(subparsers)
COMMANDS = {
    "compile": "compile_cmd",
    "generate": "generate_cmd",
    "verify": "verify_cmd",
    "plan": "plan_cmd",
    "passes": "passes_cmd",
    "bench": "bench_cmd",
    "inspect": "inspect_cmd",
    "serve": "serve_cmd",
    "cache": "cache_cmd",
    "chat": "chat_cmd",
}

# Optional dependencies by extra (pyproject.toml): a command that needs one refuses, in one line,
# to run without it. The runtime-only install (no extra) runs generate, chat, inspect, passes, cache, bench.
EXTRAS: dict[str, tuple[str, ...]] = {
    "compiler": ("torch", "iree.compiler", "gguf", "safetensors", "rich", "onnx", "onnxscript"),
    "serve": ("starlette", "uvicorn", "pydantic"),
    "onnx": ("onnxruntime",),
    "plot": ("matplotlib",),
}


class CliError(FoldlineError):
    """A bad command-line value: printed as one line, exit status 2."""


# Exit statuses (docs/runtime.md): 0 success; 1 an internal error (a bug: its traceback is shown);
# 2 bad input (one line naming it) or a usage error (argparse); 130 interrupted.
EXIT_OK, EXIT_INTERNAL, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
DEBUG_ENV = "FOLDLINE_DEBUG"

# Errors about what the user named: a FoldlineError, or a path the OS could not open.
USER_ERRORS = (FoldlineError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)


def positive_int(text: str) -> int:
    """argparse type of a count (tokens, rounds, devices, ...): an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def foldline_version() -> str:
    """The installed package's version; in a source tree that is not installed, pyproject.toml's."""
    try:
        return metadata.version("foldline")
    except metadata.PackageNotFoundError:
        pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
        found = re.search(r'^version\s*=\s*"([^"]+)"', pyproject, re.MULTILINE)
        return found.group(1) if found else "unknown"


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def missing_modules(extra: str) -> list[str]:
    """The modules of an extra (EXTRAS) that this environment cannot import."""
    return [m for m in EXTRAS[extra] if not _importable(m)]


def require_extra(extra: str, modules: tuple[str, ...] | None = None, what: str = "this command") -> None:
    """Refuse, in one line, a command (or `what` option of it) whose extra, or the given modules of
    it, is not installed."""
    missing = [m for m in modules if not _importable(m)] if modules is not None else missing_modules(extra)
    if missing:
        raise CliError(f"{what} needs the {extra} extra ({', '.join(missing)} not installed): "
                       f"pip install 'foldline[{extra}]'")


def extra_of(module: str) -> str | None:
    """The extra that provides a module (or one of its submodules), if any."""
    for extra, modules in EXTRAS.items():
        if any(module == m or module.startswith(m + ".") for m in modules):
            return extra
    return None


def _add_commands(sub) -> None:
    """Every command whose module this installation holds."""
    for module in COMMANDS.values():
        name = f"{__package__}.{module}"
        try:
            command = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:  # the command exists but an import inside it failed: a bug
                raise
            continue
        command.add_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="foldline",
        description="Ahead-of-time compiler and embedded runtime for hybrid language models.",
        epilog=f"Exit status: 0 ok, 1 internal error (traceback shown), 2 bad input or usage, 130 interrupted. "
        f"--debug (or {DEBUG_ENV}=1) shows the traceback of every error. The runtime-only install runs "
        "generate, chat, inspect, passes, cache and bench; compile, verify, plan and bench's reference peers need "
        "pip install 'foldline[compiler]', serve needs pip install 'foldline[serve]'.",
    )
    parser.add_argument("--version", action="version", version=f"foldline {foldline_version()}")
    parser.add_argument("--debug", action="store_true", help=f"show tracebacks for every error (also {DEBUG_ENV}=1)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_commands(sub)
    return parser


def debug_requested(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version (0) or a usage error (2, argparse's message printed)
        return EXIT_OK if e.code is None else e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
    debug = debug_requested(args)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader went away (`foldline inspect B | head`): stop writing, quietly, as Unix tools do
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except USER_ERRORS as e:
        if debug:
            traceback.print_exc()
        print(f"foldline {args.command}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as e:
        extra = extra_of(e.name or "") if isinstance(e, ModuleNotFoundError) else None
        if extra is not None:  # an optional dependency this installation lacks: bad input, not a bug
            if debug:
                traceback.print_exc()
            print(f"foldline {args.command}: error: this needs the {extra} extra ({e.name} is not installed): "
                  f"pip install 'foldline[{extra}]'", file=sys.stderr)
            return EXIT_BAD_INPUT
        traceback.print_exc()
        print(f"foldline {args.command}: internal error (a bug in foldline or a library it uses; "
              "the traceback above says where)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
