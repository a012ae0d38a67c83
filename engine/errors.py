"""Errors the engine raises for a single request; the worker maps them to wire error codes."""


class RequestRejectedError(ValueError):
    """The request can never run on this engine; nothing was queued. `caused_by_request`: the
    request itself is at fault (too long, a bad token id), so the job fails with `code` and
    nothing is dead-lettered; False when the engine was driven wrongly."""

    code = "invalid_request"
    caused_by_request = True


class ContextLengthExceededError(RequestRejectedError):
    code = "context_length_exceeded"


class InvalidTokenIdError(RequestRejectedError):
    code = "invalid_token_id"


class DuplicateRequestError(RequestRejectedError):
    code = "invalid_request"
    caused_by_request = False
