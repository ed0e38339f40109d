"""The `foldline` command line. Each subcommand lives in its own module."""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings

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
}


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="foldline",
        description="Ahead-of-time compiler and embedded runtime for hybrid language models.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS.values():
        importlib.import_module(f"{__package__}.{module}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # user-facing errors: one clear line, no traceback
        from ..runtime.bundle import BundleError

        known = (CliError, BundleError, ValueError, FileNotFoundError, KeyError, RuntimeError)
        if isinstance(e, known) and not getattr(args, "traceback", False):
            print(f"foldline {args.command}: error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
