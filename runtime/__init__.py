"""The embedded runtime: numpy + iree.runtime (+ tokenizers for text). Never imports torch."""

from .bundle import BundleError, Manifest
from .model import ContextFullError, Model, Session, SessionStateError, Snapshot, TokenIdError
from .sampling import Sampler

__all__ = ["BundleError", "ContextFullError", "Manifest", "Model", "Sampler", "Session", "SessionStateError", "Snapshot",
           "TokenIdError"]
