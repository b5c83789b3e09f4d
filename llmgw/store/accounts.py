"""Accounts, browser sessions and signup invites: the part of `Store` about people.

`AccountsMixin` is inherited by `Store` and split out only to keep store.py short; the
house rules of store.py hold here too: each method is one short transaction, no network
call inside it, and races are settled by single atomic statements (an invite is used by
one UPDATE ... WHERE used_by IS NULL, so two signups cannot both use it).

The store only ever sees hashes (of passwords, session tokens, invite codes): it looks
rows up by the hash the caller made and never learns the plaintext.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from datetime import datetime

from sqlalchemy import delete, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from llmgw.store.records import (
    ACCOUNT_ROLES,
    AccountRecord,
    InviteRecord,
    InviteUnusable,
    SessionRecord,
    StoreError,
    UsernameTaken,
)
from llmgw.store.tables import AccountRow, InviteRow, SessionRow


class AccountsMixin:
    """Accounts, sessions and invites; mixed into `Store`, which provides `_tx`."""

    _tx: Callable[..., AbstractAsyncContextManager[AsyncSession]]

    # accounts ----------------------------------------------------------------------

    async def add_account(
        self, account: AccountRecord, *, invite_code_hash: str | None = None
    ) -> AccountRecord:
        """Store a new account and return it with its id set (`account.id` is ignored).

        With `invite_code_hash`, the invite is used for the new account in the same
        transaction (at `account.created_at`): if it is unknown, used or expired, no
        account is made either. Raises UsernameTaken or InviteUnusable (both StoreError).
        """
        _check_username(account.username)
        _check_role(account.role)
        row = AccountRow(
            username=account.username,
            password_hash=account.password_hash,
            role=account.role,
            created_at=account.created_at,
            disabled_at=account.disabled_at,
        )
        async with self._tx() as s:
            # The invite first: whether a name is taken is told only to someone holding a
            # good invite. Claimed here, it is given back if the name is taken (the
            # transaction rolls back).
            if invite_code_hash is not None and not await _use_invite(
                s, invite_code_hash, None, account.created_at
            ):
                raise InviteUnusable(
                    "the invite is unknown, already used or expired; ask for a new one"
                )
            s.add(row)
            try:
                await s.flush()
            except IntegrityError as exc:
                raise UsernameTaken(
                    f"an account named {account.username!r} already exists; choose another username"
                ) from exc
            if invite_code_hash is not None:
                await s.execute(update(InviteRow)
                                .where(InviteRow.code_hash == invite_code_hash)
                                .values(used_by=row.id))
            return row.to_record()

    async def get_account(self, account_id: int) -> AccountRecord | None:
        async with self._tx() as s:
            row = await s.get(AccountRow, account_id)
            return None if row is None else row.to_record()

    async def find_account(self, username: str) -> AccountRecord | None:
        """The account with this username, in any case ("Alice" finds "alice")."""
        stmt = select(AccountRow).where(AccountRow.username == username.lower())
        async with self._tx() as s:
            row = await s.scalar(stmt)
            return None if row is None else row.to_record()

    async def list_accounts(self) -> list[AccountRecord]:
        """Every account, disabled ones included, by id."""
        async with self._tx() as s:
            rows = await s.scalars(select(AccountRow).order_by(AccountRow.id))
            return [row.to_record() for row in rows]

    async def count_accounts(self) -> int:
        """How many accounts exist, disabled ones included."""
        async with self._tx() as s:
            return (await s.scalar(select(func.count()).select_from(AccountRow))) or 0

    async def update_account(
        self,
        account_id: int,
        *,
        password_hash: str | None = None,
        role: str | None = None,
        disabled_at: datetime | None = None,
        enable: bool = False,
    ) -> AccountRecord:
        """Change only the fields given and return the account as it is now.

        `disabled_at` disables the account, `enable=True` clears it. Disabling does not
        end the account's sessions: call `delete_sessions_of` for that.
        """
        if enable and disabled_at is not None:
            raise StoreError("update_account got both disabled_at and enable=True; pass one")
        if role is not None:
            _check_role(role)
        async with self._tx(write=True) as s:
            row = await _require_account(s, account_id)
            if password_hash is not None:
                row.password_hash = password_hash
            if role is not None:
                row.role = role
            if disabled_at is not None:
                row.disabled_at = disabled_at
            if enable:
                row.disabled_at = None
            await s.flush()
            return row.to_record()

    # sessions ----------------------------------------------------------------------

    async def add_session(self, session: SessionRecord) -> None:
        async with self._tx(write=True) as s:
            await _require_account(s, session.account_id)
            s.add(
                SessionRow(
                    token_hash=session.token_hash,
                    account_id=session.account_id,
                    created_at=session.created_at,
                    expires_at=session.expires_at,
                )
            )
            try:
                await s.flush()
            except IntegrityError as exc:
                raise StoreError(
                    "a session with this token hash already exists; generate a new token"
                ) from exc

    async def find_session(self, token_hash: str) -> SessionRecord | None:
        """The session with this token hash, expired ones included: the caller decides."""
        async with self._tx() as s:
            row = await s.get(SessionRow, token_hash)
            return None if row is None else row.to_record()

    async def delete_session(self, token_hash: str) -> bool:
        """End one session; False if there was none."""
        async with self._tx() as s:
            result = await s.execute(delete(SessionRow).where(SessionRow.token_hash == token_hash))
            return result.rowcount > 0

    async def delete_sessions_of(self, account_id: int) -> int:
        """End every session of the account; how many there were."""
        async with self._tx() as s:
            result = await s.execute(delete(SessionRow).where(SessionRow.account_id == account_id))
            return result.rowcount

    async def delete_expired_sessions(self, now: datetime) -> int:
        """Delete the sessions expired at `now` (expires_at <= now); how many there were."""
        async with self._tx() as s:
            result = await s.execute(delete(SessionRow).where(SessionRow.expires_at <= now))
            return result.rowcount

    # invites -----------------------------------------------------------------------

    async def add_invite(self, invite: InviteRecord) -> None:
        async with self._tx(write=True) as s:
            if invite.created_by is not None:
                await _require_account(s, invite.created_by)
            s.add(
                InviteRow(
                    code_hash=invite.code_hash,
                    created_at=invite.created_at,
                    expires_at=invite.expires_at,
                    created_by=invite.created_by,
                    used_by=invite.used_by,
                    used_at=invite.used_at,
                )
            )
            try:
                await s.flush()
            except IntegrityError as exc:
                raise StoreError(
                    "an invite with this code hash already exists; generate a new code"
                ) from exc

    async def find_invite(self, code_hash: str) -> InviteRecord | None:
        """The invite with this code hash, used or expired ones included."""
        async with self._tx() as s:
            row = await s.get(InviteRow, code_hash)
            return None if row is None else row.to_record()

    async def use_invite(self, code_hash: str, account_id: int, at: datetime) -> bool:
        """Mark the invite used by the account at `at`; False if it is unknown, already
        used, or expired at `at`. Of concurrent callers on one code, exactly one wins.

        For a signup, where the account does not exist yet, pass `invite_code_hash` to
        `add_account` instead: it makes the account and uses the invite in one transaction.
        """
        if account_id is None:
            raise StoreError(
                "use_invite needs the id of the account that uses the invite; to use one "
                "while making the account, call add_account(..., invite_code_hash=...)"
            )
        async with self._tx(write=True) as s:
            await _require_account(s, account_id)
            return await _use_invite(s, code_hash, account_id, at)


async def _use_invite(s: AsyncSession, code_hash: str, account_id: int | None,
                      at: datetime) -> bool:
    # One statement: PostgreSQL re-checks the WHERE after waiting on a concurrent
    # update of the row, SQLite has one writer at a time. "Unused" is used_at IS NULL:
    # used_by turns NULL again if the account that used it is deleted.
    stmt = (
        update(InviteRow)
        .where(
            InviteRow.code_hash == code_hash,
            InviteRow.used_at.is_(None),
            InviteRow.expires_at > at,
        )
        .values(used_by=account_id, used_at=at)
    )
    return (await s.execute(stmt)).rowcount == 1


async def _require_account(s: AsyncSession, account_id: int) -> AccountRow:
    row = await s.get(AccountRow, account_id)
    if row is None:
        raise StoreError(f"no account with id {account_id} in the store; create it first")
    return row


def _check_username(username: str) -> None:
    if not username.strip():
        raise StoreError("an account needs a non-empty username")
    if username != username.lower():
        raise StoreError(
            f"username {username!r} is not lowercase; pass {username.lower()!r} "
            "(usernames are stored lowercase so that they are unique in any case)"
        )


def _check_role(role: str) -> None:
    if role not in ACCOUNT_ROLES:
        raise StoreError(f"role {role!r} is not one of {', '.join(ACCOUNT_ROLES)}")
