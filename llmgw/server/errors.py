"""OpenAI-shaped error envelopes, built in one place.

Every refusal on ``/v1`` is ``{"error": {"message", "type", "param", "code"}}`` with a
4xx or 5xx status, so any OpenAI client shows the message instead of a parse failure.
"""

from __future__ import annotations

import msgspec
from litestar import Response


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorEnvelope(msgspec.Struct):
    error: ErrorBody


_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable",
    504: "server_error",
}


def error_body(status: int, message: str, *, code: str | None = None,
               param: str | None = None) -> bytes:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return msgspec.json.encode(ErrorEnvelope(ErrorBody(message, kind, param, code)))


def error_response(status: int, message: str, *, code: str | None = None,
                   param: str | None = None, headers: dict[str, str] | None = None
                   ) -> Response:
    return Response(
        content=error_body(status, message, code=code, param=param),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


class ApiError(Exception):
    """Raised anywhere under a route; turned into an envelope by the app's handler."""

    def __init__(self, status: int, message: str, *, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers

    def raw(self) -> tuple[list[tuple[bytes, bytes]], bytes]:
        """Its headers and body as a server writes them (ASGI's ``send``, or a
        BodyWriter), without Litestar."""
        headers = [(b"content-type", b"application/json"),
                   *((k.encode(), v.encode()) for k, v in (self.headers or {}).items())]
        return headers, error_body(self.status, self.message, code=self.code,
                                   param=self.param)

    def response(self) -> Response:
        return error_response(self.status, self.message, code=self.code, param=self.param,
                              headers=self.headers)
