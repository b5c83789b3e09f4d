"""What every /api handler shares: strict reading of what a person sends, and the server's
parts as dependencies.

A handler takes its body as Litestar's ``data``, typed with an ``Input`` struct, and
``dto=StrictBody``: Litestar documents the struct in the OpenAPI document, while the body
is read as llmgw reads anything a person writes (strictly: ``"5"`` is no number, an
unknown field is an error) with each mistake a 400 in llmgw's words. Litestar's own
reading converts leniently and words its errors its own way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from litestar import Request

# Litestar's own plugin for msgspec structs, extended below (it has no public name).
from litestar._openapi.schema_generation.plugins.struct import StructSchemaPlugin
from litestar.dto import AbstractDTO
from litestar.exceptions import ValidationException
from litestar.openapi.spec import Operation, Schema
from litestar.typing import FieldDefinition

from llmgw.server.auth.guards import PRINCIPAL, SECURITY, admin_only, signed_in
from llmgw.server.dependencies import from_states
from llmgw.server.errors import ApiError

T = TypeVar("T")

# The parts /api handlers name (``store: Store``), and the caller (``principal``).
SERVICES = {**from_states("config", "store", "controller", "router", "hasher", "throttle",
                          "api_keys", "leadership"),
            "principal": PRINCIPAL}
# A handler's options for who may call it (``@get(path, **ADMIN)``): the guard, the
# credentials it takes as the document names them, and the parts.
SIGNED_IN = {"guards": [signed_in], "security": SECURITY, "dependencies": SERVICES}
ADMIN = {"guards": [admin_only], "security": SECURITY, "dependencies": SERVICES}


class Input(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Request bodies: a field this endpoint does not take is an error, never ignored, so
    nobody can set (say) their own role by adding it to a body."""


_BOUNDS = {"gt": "exclusive_minimum", "ge": "minimum", "lt": "exclusive_maximum",
           "le": "maximum"}


def _numeric(kind: msgspec.inspect.Type) -> msgspec.inspect.Type | None:
    """The int or float type of a field, out of ``X | None``."""
    if isinstance(kind, msgspec.inspect.Metadata):
        kind = kind.type
    if isinstance(kind, msgspec.inspect.UnionType):
        found = [t for t in kind.types if not isinstance(t, msgspec.inspect.NoneType)]
        kind = found[0] if len(found) == 1 else kind
    if isinstance(kind, msgspec.inspect.Metadata):
        kind = kind.type
    return kind if isinstance(kind, msgspec.inspect.IntType | msgspec.inspect.FloatType) \
        else None


class StructSchemas(StructSchemaPlugin):
    """Litestar's OpenAPI schema of a struct, and two things it leaves out: that the struct
    forbids unknown fields (``Input``, server.yaml's ``Model``), as ``additionalProperties:
    false``, so a client learns an extra field is refused, not ignored; and a bound of 0 on
    an optional number (``ge=0`` of ``int | None``), which Litestar drops as if unset."""

    def to_openapi_schema(self, field_definition: FieldDefinition, schema_creator: Any
                          ) -> Schema:
        schema = super().to_openapi_schema(field_definition, schema_creator)
        info = msgspec.inspect.type_info(field_definition.type_)
        if info.forbid_unknown_fields:
            schema.additional_properties = False
        for field in info.fields:
            number = _numeric(field.type)
            shown = (schema.properties or {}).get(field.encode_name)
            if number is None or not isinstance(shown, Schema):
                continue
            for bound, key in _BOUNDS.items():
                if getattr(number, bound) is not None and getattr(shown, key) is None:
                    setattr(shown, key, getattr(number, bound))
        return schema


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


def read(raw: bytes, kind: type[T]) -> T:
    """A request body as ``kind``; an empty one is ``{}``. Each mistake is a 400 that
    names the field."""
    try:
        return decode_json(raw or b"{}", kind)
    except msgspec.ValidationError as err:
        text = str(err)
        if "got `float`" in text and (whole := _with_whole_numbers(raw, kind)) is not None:
            return whole
        field = text.rsplit("$.", 1)[-1].rstrip("`") if "$." in text else None
        if "unknown field" in text:
            name = text.split("unknown field", 1)[1].strip(" `")
            raise ApiError(400, f"`{name}` cannot be set here", param=name,
                           code="unknown_field") from None
        raise ApiError(400, f"invalid request: {text.replace('`', '')}", param=field,
                       code="invalid_value") from None


def _with_whole_numbers(raw: bytes, kind: type[T]) -> T | None:
    """``raw`` as ``kind`` with each whole float (``60.0``) read as the integer it is, as
    JSON (and JSON Schema) has it: msgspec takes only ``60`` for an int. None if that does
    not make it fit; the caller words the first error."""
    def whole(value: Any) -> Any:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, list):
            return [whole(v) for v in value]
        if isinstance(value, dict):
            return {k: whole(v) for k, v in value.items()}
        return value

    try:
        return msgspec.convert(whole(msgspec.json.decode(raw)), kind, strict=True)
    except (msgspec.MsgspecError, RecursionError, OverflowError):
        return None


@dataclass
class OptionalBody(Operation):
    """The OpenAPI operation of a handler whose body may be left out: every field has a
    default, and the handler's ``data`` too (Litestar marks every body required)."""

    def __post_init__(self) -> None:
        if self.request_body is not None:
            self.request_body.required = False


class StrictBody(AbstractDTO):
    """A handler's ``data``, read with ``read`` as the type its annotation names, and
    described in the OpenAPI document as that type."""

    def decode_bytes(self, value: bytes) -> Any:
        return read(value, self.asgi_connection.route_handler.parsed_data_field.annotation)

    @classmethod
    def create_openapi_schema(cls, field_definition: FieldDefinition, handler_id: str,
                              schema_creator: Any) -> Any:
        return schema_creator.for_field_definition(
            FieldDefinition.from_annotation(field_definition.annotation))

    # Litestar's DTO machinery (field plans, transfer models) is not used: ``read`` is.
    @classmethod
    def create_for_field_definition(cls, field_definition: FieldDefinition, handler_id: str,
                                    backend_cls: Any = None) -> None:
        return None

    @classmethod
    def generate_field_definitions(cls, model_type: type[Any]) -> Any:
        return iter(())

    @classmethod
    def detect_nested_field(cls, field_definition: FieldDefinition) -> bool:
        return False

    @classmethod
    def is_supported_model_type_field(cls, field_definition: FieldDefinition) -> bool:
        return False  # never the handler's return value


def empty_body_refusal(request: Request, exc: ValidationException) -> ApiError | None:
    """The refusal for a handler's missing body, as its ``StrictBody`` words it: Litestar
    calls no DTO for an empty body, and its own error says only that ``data`` is missing.
    None when ``exc`` is about something else."""
    handler = request.route_handler
    dto = handler.resolve_data_dto() if handler.parsed_data_field is not None else None
    missing = any(isinstance(m, dict) and m.get("key") == "data" for m in exc.extra or ())
    if dto is None or not missing:
        return None
    try:
        dto(request).decode_bytes(b"")
    except ApiError as refusal:
        return refusal
    return ApiError(400, "the request body is empty: send a JSON object",
                    code="invalid_json")


def client_address(request: Request) -> str:
    return request.client.host if request.client else "unknown"
