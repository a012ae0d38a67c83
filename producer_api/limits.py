"""Request body size limit, enforced before any route reads the body."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from producer_api.errors import error_response
from schemas import ErrorBody, ErrorCode


class BodySizeLimitMiddleware:
    """Refuses request bodies over `max_bytes` with 413 before any route parses them.

    The body is read here (it is small by construction) and handed on whole, so an oversized
    chunked upload is caught as well as an honest Content-Length. `path_limits` gives exact
    paths their own limit (file uploads are far larger than any JSON request)."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, path_limits: dict[str, int] | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.path_limits = path_limits or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "DELETE", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        limit = self.path_limits.get(scope.get("path", ""), self.max_bytes)
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(scope, send, limit)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > limit:
                await self._refuse(scope, send, limit)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, send: Send, limit: int) -> None:
        body = ErrorBody.of(
            ErrorCode.INVALID_REQUEST, f"the request body is larger than {limit} bytes", "body"
        )
        response = error_response(body, scope.get("path", ""), status=413)
        await response(scope, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}
