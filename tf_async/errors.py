"""The project's error types: bad input is one type, everything else is a bug."""

from __future__ import annotations


class TfAsyncError(Exception):
    """Base class of every error tf_async raises on purpose."""


class BadInputError(TfAsyncError, ValueError):
    """Bad user input (request, file, flag). Becomes HTTP 400 with the OpenAI error JSON.

    `param` names the offending field when there is one; `code` is a short machine tag.
    """

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ModelFormatError(BadInputError):
    """A checkpoint that cannot be loaded: missing or corrupt file, unknown architecture,
    unsupported quant type, a tensor shape that does not match the config. The message
    names the file and, where there is one, the tensor."""


class QueueFullError(TfAsyncError):
    """The bounded request queue is full (HTTP 429)."""


class ShuttingDownError(QueueFullError):
    """The server is draining before it stops: no new requests (HTTP 429, retry elsewhere)."""


class RequestFailedError(TfAsyncError):
    """A request failed inside the engine (a step raised); other streams go on."""
