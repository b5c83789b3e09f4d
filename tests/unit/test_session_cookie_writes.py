"""A request that changes something and is carried by the session cookie must say
`Content-Type: application/json`, body or not: a form on another site cannot send that, so
SameSite is not the only thing between a logged-in browser and a forged request. Bearer
credentials (the admin token, a session sent as a bearer token) are not sent by a browser
on its own, and are not held to it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest
from litestar import Litestar
from litestar.datastructures import State
from litestar.testing import AsyncTestClient

from llmgw.server.admin import accounts, keys
from llmgw.server.auth import KeyCache
from llmgw.server.auth.sessions import COOKIE, open_session
from llmgw.server.errors import ApiError
from llmgw.store import AccountRecord, Store, open_store, sqlite_url

ADMIN = "admin-token-for-tests"
JSON = {"content-type": "application/json"}
# What a cross-site <form> can send (enctype), and a fetch() without a preflight.
FORM_TYPES = ["text/plain", "application/x-www-form-urlencoded",
              "multipart/form-data; boundary=x"]


class World(SimpleNamespace):
    store: Store
    client: AsyncTestClient
    session: str


@pytest.fixture
async def world(tmp_path) -> AsyncIterator[World]:
    store = await open_store(sqlite_url(tmp_path / "llmgw.db"))
    app = Litestar(
        route_handlers=[*keys.ROUTES, accounts.me, accounts.logout],
        state=State({"store": store, "admin_token": ADMIN, "api_keys": KeyCache(store, 5.0),
                     "controller": SimpleNamespace(catalog=SimpleNamespace(
                         get=lambda name: None))}),
        exception_handlers={ApiError: lambda _request, exc: exc.response()},
        openapi_config=None,
    )
    alice = await store.add_account(AccountRecord(username="alice", password_hash="x",
                                                  role="user", created_at=datetime.now(UTC)))
    session, _ = await open_session(store, alice.id, 3600)
    try:
        async with AsyncTestClient(app) as client:
            yield World(store=store, client=client, session=session)
    finally:
        await store.close()


async def by_cookie(world: World, method: str, path: str, headers: dict | None = None,
                    **kw):
    return await world.client.request(
        method, path, headers={"cookie": f"{COOKIE}={world.session}", **(headers or {})}, **kw)


def refused(resp) -> bool:
    error = resp.json()["error"]
    return (resp.status_code == 415 and error["code"] == "json_required"
            and "Content-Type: application/json" in error["message"])


@pytest.mark.parametrize("content_type", [*FORM_TYPES, None])
async def test_a_cookie_write_without_json_is_refused(world: World, content_type) -> None:
    headers = {"content-type": content_type} if content_type else {}
    resp = await by_cookie(world, "POST", "/api/keys", headers,
                           content=b'{"name": "forged"}')
    assert refused(resp), resp.text
    assert await world.store.list_api_keys() == []  # nothing was made


async def test_json_with_the_cookie_is_served(world: World) -> None:
    made = await by_cookie(world, "POST", "/api/keys",
                           {"content-type": "Application/JSON; charset=utf-8"},
                           content=b'{"name": "mine"}')
    assert made.status_code == 201, made.text
    prefix = made.json()["prefix"]
    # Reading needs nothing: GET changes nothing.
    listed = await by_cookie(world, "GET", "/api/keys")
    assert listed.status_code == 200 and [k["prefix"] for k in listed.json()] == [prefix]

    # PATCH and DELETE too; a DELETE has no body, and still says JSON.
    for method, content in (("PATCH", b'{"limits": {}}'), ("DELETE", None)):
        assert refused(await by_cookie(world, method, f"/api/keys/{prefix}",
                                       {"content-type": "text/plain"}, content=content))
    assert refused(await by_cookie(world, "DELETE", f"/api/keys/{prefix}"))
    assert (await world.store.find_api_key(prefix)).revoked_at is None
    gone = await by_cookie(world, "DELETE", f"/api/keys/{prefix}", JSON)
    assert gone.status_code == 200, gone.text


async def test_logout_by_cookie_needs_json_too(world: World) -> None:
    assert refused(await by_cookie(world, "POST", "/api/auth/logout"))
    assert (await by_cookie(world, "GET", "/api/me")).status_code == 200  # still logged in
    assert (await by_cookie(world, "POST", "/api/auth/logout", JSON)).status_code == 200
    assert (await by_cookie(world, "GET", "/api/me")).status_code == 401


async def test_bearer_credentials_are_not_held_to_it(world: World) -> None:
    for token in (ADMIN, world.session):
        made = await world.client.post("/api/keys", content=b'{"name": "by-bearer"}',
                                       headers={"authorization": f"Bearer {token}",
                                                "content-type": "text/plain"})
        assert made.status_code == 201, made.text
    # The admin token wins over a cookie sent alongside it.
    made = await by_cookie(world, "POST", "/api/keys", {"authorization": f"Bearer {ADMIN}"},
                           content=b'{"name": "both"}')
    assert made.status_code == 201, made.text
