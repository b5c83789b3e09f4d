"""The admin token: made at first start, or taken from a file every server of a cluster
shares (auth.admin_token_file, which the NixOS module passes as a credential)."""

import pytest

from llmgw.config import ServerConfig, parse
from llmgw.server.auth import SecretsFileError, load_admin_token


def test_made_once_in_the_state_directory(tmp_path):
    token, created = load_admin_token(tmp_path, None)
    assert created and token.startswith("llmgw_admin_")
    assert load_admin_token(tmp_path, None) == (token, False)
    assert (tmp_path / "secrets" / "admin-token").stat().st_mode & 0o077 == 0


def test_taken_from_the_operators_file(tmp_path):
    file = tmp_path / "admin-token"
    file.write_text("shared-by-every-server\n")
    file.chmod(0o400)
    config = parse({"auth": {"admin_token_file": str(file)}}, ServerConfig)
    state = tmp_path / "state"
    assert load_admin_token(state, config.auth.admin_token_file) == (
        "shared-by-every-server", False)
    assert not (state / "secrets").exists()  # none made beside it

    file.chmod(0o644)
    with pytest.raises(SecretsFileError, match=r"readable by other users.*chmod 600"):
        load_admin_token(state, str(file))
    with pytest.raises(SecretsFileError, match="cannot read the admin token"):
        load_admin_token(state, str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.write_text("\n")
    empty.chmod(0o600)
    with pytest.raises(SecretsFileError, match=r"the admin token file .* is empty"):
        load_admin_token(state, str(empty))
