"""The embedded runtime: numpy + iree.runtime (+ tokenizers for text). Never imports torch."""

from ..contract.errors import BundleError
from ..contract.manifest import Manifest
from .batch import Batch, RowError
from .chat import ChatTemplateError, encode_messages
from .checks import ContextFullError, SessionStateError, TokenIdError
from .conversation import Conversation, ConversationFileError
from .generation import FinishReason, Generation, Usage
from .model import Model, Session, Snapshot
from .sampling import Sampler
from .session_file import SessionFileError

__all__ = ["Batch", "BundleError", "ChatTemplateError", "ContextFullError", "Conversation", "ConversationFileError",
           "FinishReason", "Generation", "Manifest", "Model", "RowError", "Sampler", "Session", "SessionFileError",
           "SessionStateError", "Snapshot", "TokenIdError", "Usage", "encode_messages"]
