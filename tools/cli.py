"""The `foldline` command line. Each subcommand lives in its own module."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import traceback
import warnings

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
}


class CliError(FoldlineError):
    """A bad command-line value: printed as one line, exit status 2."""


# Exit statuses (docs/runtime.md): 0 success; 1 an internal error (a bug: its traceback is shown);
# 2 bad input (one line naming it) or a usage error (argparse); 130 interrupted.
EXIT_OK, EXIT_INTERNAL, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
DEBUG_ENV = "FOLDLINE_DEBUG"

# Errors about what the user named: a FoldlineError, or a path the OS could not open.
USER_ERRORS = (FoldlineError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="foldline",
        description="Ahead-of-time compiler and embedded runtime for hybrid language models.",
        epilog=f"Exit status: 0 ok, 1 internal error (traceback shown), 2 bad input or usage, 130 interrupted. "
        f"--debug (or {DEBUG_ENV}=1) shows the traceback of every error.",
    )
    parser.add_argument("--debug", action="store_true", help=f"show tracebacks for every error (also {DEBUG_ENV}=1)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS.values():
        importlib.import_module(f"{__package__}.{module}").add_parser(sub)
    return parser


def debug_requested(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
    except Exception:
        traceback.print_exc()
        print(f"foldline {args.command}: internal error (a bug in foldline or a library it uses; "
              "the traceback above says where)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
