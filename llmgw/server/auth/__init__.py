"""Who may do what: API keys for /v1, the admin token, accounts and their sessions."""

from llmgw.server.auth.admin_token import (
    SecretsFileError,
    admin_token_ok,
    load_admin_token,
    load_or_create_admin_token,
    read_secret_file,
)
from llmgw.server.auth.keys import (
    KeyCache,
    bearer,
    check_api_key,
    create_api_key,
    hash_key,
    key_id,
)

__all__ = [
    "KeyCache",
    "SecretsFileError",
    "admin_token_ok",
    "bearer",
    "check_api_key",
    "create_api_key",
    "hash_key",
    "key_id",
    "load_admin_token",
    "load_or_create_admin_token",
    "read_secret_file",
]
