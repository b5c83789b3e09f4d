"""Accounts, sessions, invites and owned API keys, on SQLite and on PostgreSQL."""

from __future__ import annotations

import asyncio
import hashlib
from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import inspect, text

from llmgw.store import (
    AccountRecord,
    ApiKeyRecord,
    InviteRecord,
    InviteUnusable,
    SessionRecord,
    Store,
    StoreError,
    UsernameTaken,
)

T0 = datetime(2025, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)
PASSWORD = "correct horse battery staple"


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def account(username: str, **changes) -> AccountRecord:
    fields = {
        "username": username,
        "password_hash": digest(f"{PASSWORD} of {username}"),
        "role": "user",
        "created_at": T0,
    }
    return AccountRecord(**(fields | changes))


def session(token: str, account_id: int, **changes) -> SessionRecord:
    fields = {
        "token_hash": digest(token),
        "account_id": account_id,
        "created_at": T0,
        "expires_at": T0 + timedelta(days=7),
    }
    return SessionRecord(**(fields | changes))


def invite(code: str, **changes) -> InviteRecord:
    fields = {"code_hash": digest(code), "created_at": T0, "expires_at": T0 + timedelta(days=2)}
    return InviteRecord(**(fields | changes))


def api_key(prefix: str, secret: str = "s3cr3t", **changes) -> ApiKeyRecord:
    fields = {"prefix": prefix, "secret_hash": digest(secret), "name": prefix, "created_at": T0}
    return ApiKeyRecord(**(fields | changes))


# accounts --------------------------------------------------------------------------


async def test_accounts_add_get_find_list_count(store: Store) -> None:
    assert await store.count_accounts() == 0
    assert await store.list_accounts() == []
    assert await store.find_account("alice") is None

    alice = await store.add_account(account("alice", role="admin", id=99))
    bob = await store.add_account(account("bob"))
    assert alice.id is not None and bob.id is not None and alice.id != bob.id
    assert alice == account("alice", role="admin", id=alice.id)  # the given id is ignored

    assert await store.get_account(alice.id) == alice
    assert await store.get_account(12345) is None
    assert await store.find_account("bob") == bob
    assert await store.find_account("BoB") == bob  # lookups ignore case
    assert await store.list_accounts() == [alice, bob]
    assert await store.count_accounts() == 2


async def test_duplicate_username_is_refused(store: Store) -> None:
    await store.add_account(account("alice"))
    with pytest.raises(UsernameTaken, match="an account named 'alice' already exists"):
        await store.add_account(account("alice", role="admin"))
    assert await store.count_accounts() == 1


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"username": "Alice"}, "username 'Alice' is not lowercase; pass 'alice'"),
        ({"username": " "}, "non-empty username"),
        ({"role": "root"}, "role 'root' is not one of admin, user"),
    ],
)
async def test_bad_account_fields_are_refused(store: Store, changes: dict, message: str) -> None:
    with pytest.raises(StoreError, match=message):
        await store.add_account(account(**({"username": "alice"} | changes)))
    assert await store.count_accounts() == 0


async def test_update_account_changes_only_the_given_fields(store: Store) -> None:
    alice = await store.add_account(account("alice"))
    bob = await store.add_account(account("bob"))

    changed = await store.update_account(alice.id, password_hash="new-hash")
    assert changed == account("alice", id=alice.id, password_hash="new-hash")
    changed = await store.update_account(alice.id, role="admin")
    assert changed == account("alice", id=alice.id, password_hash="new-hash", role="admin")
    assert await store.update_account(alice.id) == changed  # nothing given, nothing changes

    off = T0 + timedelta(hours=1)
    disabled = await store.update_account(alice.id, disabled_at=off)
    assert disabled.disabled_at == off and disabled.role == "admin"
    assert await store.get_account(alice.id) == disabled
    enabled = await store.update_account(alice.id, enable=True)
    assert enabled.disabled_at is None and enabled.password_hash == "new-hash"

    assert await store.get_account(bob.id) == bob  # the other account is untouched


async def test_update_account_refusals(store: Store) -> None:
    alice = await store.add_account(account("alice"))
    with pytest.raises(StoreError, match="no account with id 777"):
        await store.update_account(777, role="admin")
    with pytest.raises(StoreError, match="role 'owner' is not one of admin, user"):
        await store.update_account(alice.id, role="owner")
    with pytest.raises(StoreError, match="both disabled_at and enable=True"):
        await store.update_account(alice.id, disabled_at=T0, enable=True)
    assert await store.get_account(alice.id) == alice


# sessions --------------------------------------------------------------------------


async def test_sessions_add_find_delete(store: Store) -> None:
    alice = await store.add_account(account("alice"))
    bob = await store.add_account(account("bob"))
    await store.add_session(session("tok-a1", alice.id))
    await store.add_session(session("tok-a2", alice.id, expires_at=T0 + timedelta(hours=1)))
    await store.add_session(session("tok-b1", bob.id, expires_at=T0 + timedelta(hours=2)))

    assert await store.find_session(digest("tok-a1")) == session("tok-a1", alice.id)
    assert await store.find_session(digest("tok-zz")) is None

    assert await store.delete_session(digest("tok-a1")) is True
    assert await store.delete_session(digest("tok-a1")) is False
    assert await store.find_session(digest("tok-a1")) is None

    # expires_at <= now is expired: tok-a2 (at +1h) goes, tok-b1 (at +2h) stays
    assert await store.delete_expired_sessions(T0 + timedelta(hours=1)) == 1
    assert await store.find_session(digest("tok-a2")) is None
    assert await store.find_session(digest("tok-b1")) is not None

    await store.add_session(session("tok-b2", bob.id))
    assert await store.delete_sessions_of(bob.id) == 2
    assert await store.delete_sessions_of(bob.id) == 0
    assert await store.find_session(digest("tok-b2")) is None


async def test_session_refusals(store: Store) -> None:
    alice = await store.add_account(account("alice"))
    with pytest.raises(StoreError, match="no account with id 404"):
        await store.add_session(session("tok", 404))
    await store.add_session(session("tok", alice.id))
    with pytest.raises(StoreError, match="session with this token hash already exists"):
        await store.add_session(session("tok", alice.id))


# invites ---------------------------------------------------------------------------


async def test_invite_is_used_once(store: Store) -> None:
    admin = await store.add_account(account("root", role="admin"))
    alice = await store.add_account(account("alice"))
    bob = await store.add_account(account("bob"))
    await store.add_invite(invite("join-1", created_by=admin.id))
    at = T0 + timedelta(hours=1)

    assert await store.use_invite(digest("join-1"), alice.id, at) is True
    assert await store.use_invite(digest("join-1"), bob.id, at) is False
    assert await store.use_invite(digest("nope"), bob.id, at) is False
    assert await store.find_invite(digest("join-1")) == invite(
        "join-1", created_by=admin.id, used_by=alice.id, used_at=at
    )
    assert await store.find_invite(digest("nope")) is None


async def test_expired_invite_is_not_used(store: Store) -> None:
    alice = await store.add_account(account("alice"))
    await store.add_invite(invite("late"))
    expires = T0 + timedelta(days=2)
    assert await store.use_invite(digest("late"), alice.id, expires) is False  # at the end
    assert await store.use_invite(digest("late"), alice.id, expires + timedelta(days=1)) is False
    assert (await store.find_invite(digest("late"))).used_by is None
    assert await store.use_invite(digest("late"), alice.id, expires - timedelta(seconds=1))


async def test_invite_refusals(store: Store) -> None:
    with pytest.raises(StoreError, match="no account with id 5"):
        await store.add_invite(invite("x", created_by=5))
    await store.add_invite(invite("x"))
    with pytest.raises(StoreError, match="invite with this code hash already exists"):
        await store.add_invite(invite("x"))
    with pytest.raises(StoreError, match="no account with id 5"):
        await store.use_invite(digest("x"), 5, T0)
    with pytest.raises(StoreError, match=r"add_account\(\.\.\., invite_code_hash=\.\.\.\)"):
        await store.use_invite(digest("x"), None, T0)  # type: ignore[arg-type]
    assert (await store.find_invite(digest("x"))).used_at is None


async def test_concurrent_use_of_one_invite_has_one_winner(store: Store) -> None:
    accounts = [await store.add_account(account(f"user{i}")) for i in range(20)]
    await store.add_invite(invite("shared"))
    at = T0 + timedelta(minutes=1)

    won = await asyncio.gather(*(store.use_invite(digest("shared"), a.id, at) for a in accounts))

    assert won.count(True) == 1
    winner = accounts[won.index(True)]
    assert (await store.find_invite(digest("shared"))).used_by == winner.id


async def test_add_account_with_invite_is_all_or_nothing(store: Store) -> None:
    await store.add_invite(invite("signup"))
    alice = await store.add_account(account("alice"), invite_code_hash=digest("signup"))
    used = await store.find_invite(digest("signup"))
    assert used.used_by == alice.id and used.used_at == alice.created_at

    with pytest.raises(InviteUnusable, match="invite is unknown, already used or expired"):
        await store.add_account(account("bob"), invite_code_hash=digest("signup"))
    assert await store.find_account("bob") is None  # no account without its invite

    await store.add_invite(invite("race"))
    results = await asyncio.gather(
        *(
            store.add_account(account(f"racer{i}"), invite_code_hash=digest("race"))
            for i in range(10)
        ),
        return_exceptions=True,
    )
    made = [r for r in results if isinstance(r, AccountRecord)]
    assert len(made) == 1
    assert all(isinstance(r, InviteUnusable) for r in results if r not in made)
    assert await store.count_accounts() == 2  # alice and the one racer


async def test_a_taken_name_is_told_only_to_a_good_invite_and_costs_it_nothing(
        store: Store) -> None:
    await store.add_account(account("alice"))
    # A made-up invite learns nothing of which names exist.
    with pytest.raises(InviteUnusable):
        await store.add_account(account("alice"), invite_code_hash=digest("made-up"))
    await store.add_invite(invite("good"))
    with pytest.raises(UsernameTaken):
        await store.add_account(account("alice"), invite_code_hash=digest("good"))
    # The invite is still unused, and takes another name.
    assert (await store.find_invite(digest("good"))).used_at is None
    bob = await store.add_account(account("bob"), invite_code_hash=digest("good"))
    assert (await store.find_invite(digest("good"))).used_by == bob.id


# API keys by account ---------------------------------------------------------------


async def test_api_keys_by_account(store: Store) -> None:
    alice = await store.add_account(account("alice"))
    bob = await store.add_account(account("bob"))
    up_key = await store.add_api_key(api_key("llmgw_up01"))
    a1 = await store.add_api_key(api_key("llmgw_a001", account_id=alice.id))
    b1 = await store.add_api_key(api_key("llmgw_b001", account_id=bob.id))
    a2 = await store.add_api_key(api_key("llmgw_a002", account_id=alice.id))

    assert a1.account_id == alice.id and up_key.account_id is None
    assert await store.find_api_key("llmgw_b001") == b1
    assert await store.list_api_keys(alice.id) == [a1, a2]
    assert await store.list_api_keys(account_id=bob.id) == [b1]
    assert await store.list_api_keys() == [up_key, a1, b1, a2]
    with pytest.raises(StoreError, match="no account with id 31337"):
        await store.add_api_key(api_key("llmgw_x001", account_id=31337))


async def test_deleting_an_account_takes_its_sessions_and_keys(store: Store) -> None:
    """No method deletes accounts yet; the foreign keys must still be right for when one
    does: sessions and keys go with the account, invites forget it."""
    alice = await store.add_account(account("alice"))
    bob = await store.add_account(account("bob"))
    await store.add_session(session("tok-a", alice.id))
    await store.add_session(session("tok-b", bob.id))
    await store.add_api_key(api_key("llmgw_a001", account_id=alice.id))
    await store.add_api_key(api_key("llmgw_b001", account_id=bob.id))
    await store.add_invite(invite("from-alice", created_by=alice.id))
    await store.add_invite(invite("for-alice"))
    assert await store.use_invite(digest("for-alice"), alice.id, T0)

    async with store.engine.begin() as conn:
        await conn.execute(text("DELETE FROM accounts WHERE id = :id"), {"id": alice.id})

    assert await store.find_session(digest("tok-a")) is None
    assert await store.find_session(digest("tok-b")) is not None
    assert [k.prefix for k in await store.list_api_keys()] == ["llmgw_b001"]
    assert (await store.find_invite(digest("from-alice"))).created_by is None
    used = await store.find_invite(digest("for-alice"))
    assert used.used_by is None and used.used_at == T0
    assert await store.use_invite(digest("for-alice"), bob.id, T0) is False  # still used


# secrets and datetimes ---------------------------------------------------------------


async def test_no_plaintext_secret_in_any_table(store: Store) -> None:
    token = "sess_7Hq2mXw9LpV4rT8sK1nB"
    key_secret = "llmgw_sk_plain_3c4d5e6f7a8b9c0d"
    code = "inv_Zx81Qw72Er63"
    alice = await store.add_account(account("alice", password_hash=digest(PASSWORD)))
    await store.add_session(session(token, alice.id))
    await store.add_api_key(api_key("llmgw_sk_p", secret=key_secret, account_id=alice.id))
    await store.add_invite(invite(code, created_by=alice.id))

    async with store.engine.connect() as conn:
        tables = await conn.run_sync(lambda c: inspect(c).get_table_names())
        dump = repr(
            {table: (await conn.execute(text(f"SELECT * FROM {table}"))).all() for table in tables}
        )
    for plain in (PASSWORD, token, key_secret, key_secret.removeprefix("llmgw_sk_p"), code):
        assert plain not in dump
        assert plain.lower() not in dump.lower()
    for plain in (PASSWORD, token, key_secret, code):
        assert digest(plain) in dump  # only the hash the caller made is kept


async def test_datetimes_come_back_aware_utc(store: Store) -> None:
    berlin = timezone(timedelta(hours=2))
    local = datetime(2025, 6, 1, 14, 30, 15, 654321, tzinfo=berlin)
    alice = await store.add_account(account("alice", created_at=local, disabled_at=local))
    await store.add_session(session("t", alice.id, created_at=local, expires_at=local))
    await store.add_invite(invite("c", created_at=local, expires_at=local))

    got_account = await store.get_account(alice.id)
    got_session = await store.find_session(digest("t"))
    got_invite = await store.find_invite(digest("c"))
    values = [
        got_account.created_at,
        got_account.disabled_at,
        got_session.created_at,
        got_session.expires_at,
        got_invite.created_at,
        got_invite.expires_at,
    ]
    for value in values:
        assert value == local
        assert value.utcoffset() == timedelta(0)

    with pytest.raises(StoreError, match="naive datetime"):
        await store.add_account(account("bob", created_at=datetime(2025, 1, 1)))
