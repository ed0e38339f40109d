"""The one base class of errors caused by what the user gave foldline.

A `FoldlineError` names the problem in its message (an unknown architecture, a
missing tensor, a token id out of range, a full context, a corrupted bundle) and
the CLI prints it as one line with exit status 2. Anything else that escapes is
a bug in foldline or in a library under it, and the CLI shows its traceback.
The concrete classes also derive from the builtin they refine (ValueError,
RuntimeError, FileNotFoundError), so callers that catch those keep working.
"""

from __future__ import annotations


class FoldlineError(Exception):
    """Bad input, named in the message: the user can fix it; foldline is not at fault."""


class InputError(FoldlineError, ValueError):
    """An argument value foldline cannot use (a token id, a sampling parameter, an option)."""
