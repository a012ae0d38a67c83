"""Errors the engine raises for a single request; the worker maps them to wire error codes."""


class RequestRejectedError(ValueError):
    """The request can never run on this engine; nothing was queued."""

    code = "invalid_request"


class ContextLengthExceededError(RequestRejectedError):
    code = "context_length_exceeded"


class DuplicateRequestError(RequestRejectedError):
    code = "invalid_request"
