"""What every /api handler needs: who is asking, and strict decoding of what they sent."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
from litestar import Request

from llmgw.server.auth.sessions import Principal, resolve
from llmgw.server.errors import ApiError

T = TypeVar("T")


class Input(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Request bodies: a field this endpoint does not take is an error, never ignored, so
    nobody can set (say) their own role by adding it to a body."""


async def require(request: Request, *, admin: bool = False) -> Principal:
    principal = await resolve(request)
    if principal is None:
        raise ApiError(401, "log in first (POST /api/auth/login), or send the admin token "
                       "as `Authorization: Bearer …`", code="login_required")
    if admin and not principal.is_admin:
        raise ApiError(403, "this needs an admin", code="admin_required")
    return principal


def decode_json(raw: bytes, kind: Any = Any) -> Any:
    """A JSON body, every way it can be malformed a 400 that names it; a body that does not
    fit ``kind`` raises msgspec's ValidationError for the caller to word."""
    try:
        return msgspec.json.decode(raw, type=kind, strict=True)
    except msgspec.ValidationError:
        raise
    except msgspec.DecodeError as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}",
                       code="invalid_json") from None
    except UnicodeDecodeError as err:
        raise ApiError(400, f"the request body is not valid UTF-8 ({err.reason} at byte "
                       f"{err.start}); a JSON body must be UTF-8", code="invalid_json") from None
    except RecursionError:
        # msgspec recurses once a level, as deep as CPython's recursion limit lets it
        # (about 980 levels on Python 3.11); no body here nests more than a few.
        raise ApiError(400, "the JSON body is nested too deeply: a few levels are all any "
                       "request here needs", code="invalid_json") from None


async def body(request: Request, kind: type[T]) -> T:
    raw = await request.body()
    try:
        return decode_json(raw or b"{}", kind)
    except msgspec.ValidationError as err:
        text = str(err)
        field = text.rsplit("$.", 1)[-1].rstrip("`") if "$." in text else None
        if "unknown field" in text:
            name = text.split("unknown field", 1)[1].strip(" `")
            raise ApiError(400, f"`{name}` cannot be set here", param=name,
                           code="unknown_field") from None
        raise ApiError(400, f"invalid request: {text.replace('`', '')}", param=field,
                       code="invalid_value") from None


def client_address(request: Request) -> str:
    return request.client.host if request.client else "unknown"
