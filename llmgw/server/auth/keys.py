"""API keys and the admin token.

An API key looks like ``llmgw_<12-char id><32-char secret><6-char checksum>``: the fixed
prefix and the CRC let secret scanners recognise a leaked key and reject typos without a
database round trip. Only the key's SHA-256 is stored (a 190-bit random secret needs no
slow hash), and it is looked up by its id part, which is also how keys are listed.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import string
import zlib
from datetime import UTC, datetime

from llmgw.store import ApiKeyRecord, Store

KEY_PREFIX = "llmgw_"
_ALPHABET = string.digits + string.ascii_letters
_ID_LEN, _SECRET_LEN, _CRC_LEN = 12, 32, 6
KEY_LEN = len(KEY_PREFIX) + _ID_LEN + _SECRET_LEN + _CRC_LEN


def _base62(number: int, width: int) -> str:
    out = []
    for _ in range(width):
        number, digit = divmod(number, 62)
        out.append(_ALPHABET[digit])
    return "".join(reversed(out))


def _checksum(body: str) -> str:
    return _base62(zlib.crc32(body.encode()), _CRC_LEN)


def new_api_key() -> str:
    body = "".join(secrets.choice(_ALPHABET) for _ in range(_ID_LEN + _SECRET_LEN))
    return KEY_PREFIX + body + _checksum(KEY_PREFIX + body)


def key_id(key: str) -> str | None:
    """The listed, stored id of a well-formed key (``llmgw_`` plus 12 characters), or
    ``None`` when the string cannot be one of our keys."""
    if len(key) != KEY_LEN or not key.startswith(KEY_PREFIX):
        return None
    body, crc = key[:-_CRC_LEN], key[-_CRC_LEN:]
    if not hmac.compare_digest(_checksum(body), crc):
        return None
    return key[: len(KEY_PREFIX) + _ID_LEN]


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


async def create_api_key(store: Store, name: str, allowed_models: list[str] | None = None,
                         *, account_id: int | None = None, expires_at: datetime | None = None
                         ) -> tuple[str, ApiKeyRecord]:
    """Make and store a key; the plaintext is returned once and never kept."""
    key = new_api_key()
    record = await store.add_api_key(ApiKeyRecord(
        prefix=key_id(key), secret_hash=hash_key(key), name=name,
        allowed_models=allowed_models, created_at=datetime.now(UTC),
        account_id=account_id, expires_at=expires_at))
    return key, record


async def check_api_key(store: Store, key: str, now: datetime) -> ApiKeyRecord | str:
    """The key's record, or why it was refused (in words for the client)."""
    prefix = key_id(key)
    if prefix is None:
        return "the API key is malformed; it should start with llmgw_ and be copied whole"
    record = await store.find_api_key(prefix)
    if record is None or not hmac.compare_digest(record.secret_hash, hash_key(key)):
        return "the API key is not valid"
    if record.revoked_at is not None:
        return "the API key has been revoked"
    if record.expires_at is not None and record.expires_at <= now:
        return "the API key has expired"
    if record.account_id is not None:
        owner = await store.get_account(record.account_id)
        if owner is None or owner.disabled_at is not None:
            return "the account that owns this API key is disabled"
    return record


def bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
