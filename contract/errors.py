"""The error of a bundle that breaks its contract."""

from __future__ import annotations

from ..errors import FoldlineError


class BundleError(FoldlineError, RuntimeError):
    """A bundle that is missing, corrupted or does not match what it claims."""
