"""The embedded runtime: numpy + iree.runtime (+ tokenizers for text). Never imports torch."""

from ..contract.errors import BundleError
from ..contract.manifest import Manifest
from .batch import Batch, RowError
from .checks import ContextFullError, SessionStateError, TokenIdError
from .model import Model, Session, Snapshot
from .sampling import Sampler
from .session_file import SessionFileError

__all__ = ["Batch", "BundleError", "ContextFullError", "Manifest", "Model", "RowError", "Sampler", "Session",
           "SessionStateError", "Snapshot",
           "SessionFileError", "TokenIdError"]
