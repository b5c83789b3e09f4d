"""OpenAI-shaped error envelopes, built in one place.

Every refusal on ``/v1`` is ``{"error": {"message", "type", "param", "code"}}`` with a
4xx or 5xx status, so any OpenAI client shows the message instead of a parse failure.
"""

from __future__ import annotations

import msgspec
from litestar import Response
from litestar.openapi import ResponseSpec

from llmgw.store import StoreSchemaMissing, StoreUnavailable


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    # The request's field the refusal is about, if one is.
    param: str | None = None
    # A stable name for the refusal (``login_required``, ``model_not_found`` …).
    code: str | None = None


class ErrorEnvelope(msgspec.Struct):
    """Every refusal's body, on ``/v1`` and ``/api`` alike."""

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


# What each refusal means, for the OpenAPI document; the message says the particulars.
_MEANINGS = {
    400: "the request is not one this takes: the message names what to change",
    401: "no credentials, or credentials that are not (or no longer) valid",
    403: "the credentials are good, but not for this",
    404: "what the request names does not exist, or is not the caller's to see",
    409: "the request conflicts with what exists",
    413: "the request body is too large",
    415: "a request a browser form could have sent: it must say `Content-Type: "
         "application/json`",
    429: "too many attempts or requests: `Retry-After` says when to try again",
    502: "the engine failed while answering",
    503: "nothing can serve this now (no ready replica, or a part the server needs)",
    504: "the engine did not answer in time",
}


def refusals(*statuses: int) -> dict[int, ResponseSpec]:
    """The refusals a handler answers with, each an ``ErrorEnvelope``, as its OpenAPI
    ``responses``."""
    return {status: ResponseSpec(ErrorEnvelope, description=_MEANINGS[status],
                                 generate_examples=False)
            for status in statuses}


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


def store_refusal(err: StoreUnavailable) -> ApiError:
    """The 503 of a request that needed the store while it did not answer. The client is
    told no more than that (the store's address is the operator's business: the server
    logs it once per outage)."""
    if isinstance(err, StoreSchemaMissing):
        return ApiError(503, "the control plane's store has lost its tables; an operator "
                        "must restore it (the server's log says how)",
                        code="store_schema_missing", headers={"retry-after": "30"})
    return ApiError(503, "the control plane's store is not answering; try again shortly",
                    code="store_unavailable", headers={"retry-after": "5"})
