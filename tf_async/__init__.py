"""tf_async: an LLM serving engine with an asyncio server and an async Python API."""

from .api import Engine
from .api_types import Completion, Delta, SamplingParams, Usage
from .errors import BadInputError, ModelFormatError, QueueFullError, RequestFailedError

__all__ = ["Engine", "Completion", "Delta", "SamplingParams", "Usage", "BadInputError",
           "ModelFormatError", "QueueFullError", "RequestFailedError"]
__version__ = "0.1.0"
