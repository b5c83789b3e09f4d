"""Key limits and usage over the admin API and `llmgw ctl keys`, on a SQLite store.

The key routes run in a small Litestar app of their own; ctl's HTTP calls are carried to
it in process (its urlopen is swapped), so the commands are tested end to end.
"""

from __future__ import annotations

import asyncio
import io
import json
import urllib.error
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest
from litestar import Litestar
from litestar.datastructures import State
from litestar.testing import AsyncTestClient

from llmgw.cli.ctl import client as ctl
from llmgw.cli.ctl.keys import _limit_value
from llmgw.cli.main import parser
from llmgw.core.usage import Limits
from llmgw.server.admin import keys as admin_keys
from llmgw.server.auth import KeyCache
from llmgw.server.auth.sessions import open_session
from llmgw.server.errors import ApiError
from llmgw.store import AccountRecord, Store, open_store, sqlite_url

ADMIN = "admin-token-for-tests"
NO_LIMITS = {"rpm": None, "tpm": None, "tokens_per_day": None, "tokens_per_month": None}


class World(SimpleNamespace):
    store: Store
    client: AsyncTestClient
    alice: str  # a user's session token


@pytest.fixture
async def world(tmp_path) -> AsyncIterator[World]:
    store = await open_store(sqlite_url(tmp_path / "llmgw.db"))
    catalog = SimpleNamespace(get=lambda name: object() if name in ("qwen", "llama") else None)
    app = Litestar(
        route_handlers=admin_keys.ROUTES,
        state=State({"store": store, "admin_token": ADMIN, "api_keys": KeyCache(store, 5.0),
                     "controller": SimpleNamespace(catalog=catalog)}),
        exception_handlers={ApiError: lambda _request, exc: exc.response()},
        openapi_config=None,
    )
    now = datetime.now(UTC)
    alice = await store.add_account(AccountRecord(username="alice", password_hash="x",
                                                  role="user", created_at=now))
    token, _ = await open_session(store, alice.id, 3600)
    try:
        async with AsyncTestClient(app) as client:
            yield World(store=store, client=client, alice=token)
    finally:
        await store.close()


async def api(world: World, method: str, path: str, token: str = ADMIN, **kw):
    return await world.client.request(method, path,
                                      headers={"authorization": f"Bearer {token}"}, **kw)


# --- the admin API ---------------------------------------------------------------------


async def test_an_admin_makes_a_key_with_limits_and_changes_them(world: World) -> None:
    made = await api(world, "POST", "/api/keys", json={
        "name": "ci", "limits": {"rpm": 60, "tokens_per_day": 1_000_000}})
    assert made.status_code == 201, made.text
    prefix = made.json()["prefix"]
    assert made.json()["limits"] == {**NO_LIMITS, "rpm": 60, "tokens_per_day": 1_000_000}
    assert (await world.store.find_api_key(prefix)).limits == Limits(
        rpm=60, tokens_per_day=1_000_000)

    changed = await api(world, "PATCH", f"/api/keys/{prefix}",
                        json={"limits": {"tpm": 20_000, "rpm": None}})
    assert changed.status_code == 200, changed.text
    assert changed.json()["limits"] == {**NO_LIMITS, "tpm": 20_000, "tokens_per_day": 1_000_000}
    listed = (await api(world, "GET", "/api/keys")).json()
    assert [k["limits"] for k in listed] == [changed.json()["limits"]]


@pytest.mark.parametrize(("limits", "status", "words"), [
    ({"rpm": 0}, 400, "Expected int >= 1 - at $.limits.rpm"),
    ({"rpm": "60"}, 400, "Expected int | null, got str"),
    ({"tpm": 1.5}, 400, "Expected int | null, got float"),
    ({"rpm": 10**16}, 400, "<= 1000000000000000"),
    ({"rph": 5}, 400, "`rph`"),
])
async def test_bad_limits_are_refused(world: World, limits, status, words) -> None:
    made = await api(world, "POST", "/api/keys", json={"name": "k"})
    prefix = made.json()["prefix"]
    for method, path, payload in [("POST", "/api/keys", {"name": "k2", "limits": limits}),
                                  ("PATCH", f"/api/keys/{prefix}", {"limits": limits})]:
        refused = await api(world, method, path, json=payload)
        assert refused.status_code == status, refused.text
        assert words in refused.json()["error"]["message"]
    assert (await world.store.find_api_key(prefix)).limits == Limits()
    assert len(await world.store.list_api_keys()) == 1


async def test_only_admins_set_limits(world: World) -> None:
    refused = await api(world, "POST", "/api/keys", world.alice,
                        json={"name": "mine", "limits": {"rpm": 1000}})
    assert refused.status_code == 403
    assert refused.json()["error"] == {**refused.json()["error"],
                                       "message": "only an admin may set a key's limits",
                                       "code": "admin_required", "param": "limits"}
    assert await world.store.list_api_keys() == []
    mine = (await api(world, "POST", "/api/keys", world.alice, json={"name": "mine"})).json()
    assert mine["limits"] == NO_LIMITS
    lifted = await api(world, "PATCH", f"/api/keys/{mine['prefix']}", world.alice,
                       json={"limits": {"rpm": None}})
    assert lifted.status_code == 403
    admins = (await api(world, "POST", "/api/keys", json={"name": "admin's"})).json()
    hidden = await api(world, "PATCH", f"/api/keys/{admins['prefix']}", world.alice,
                       json={"limits": {"rpm": 5}})
    assert hidden.status_code == 404  # not hers: not even there
    gone = await api(world, "PATCH", "/api/keys/llmgw_nosuchkey00", json={"limits": {}})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "key_not_found"


async def test_usage_per_model_and_day(world: World) -> None:
    made = (await api(world, "POST", "/api/keys", json={
        "name": "ci", "owner": "alice", "limits": {"rpm": 10, "tokens_per_day": 500}})).json()
    key = await world.store.find_api_key(made["prefix"])
    now = datetime.now(UTC)
    yesterday = now - timedelta(days=1)
    assert await world.store.admit(key.id, key.limits, now) is None
    await world.store.record_usage(key.id, "qwen", 100, 20, now)
    await world.store.record_usage(key.id, "qwen", 5, 5, yesterday)
    await world.store.record_usage(key.id, "llama", 7, 0, now)
    await world.store.record_usage(key.id, "qwen", 1, 1, now - timedelta(days=40))

    reply = await api(world, "GET", f"/api/keys/{made['prefix']}/usage", world.alice)
    assert reply.status_code == 200, reply.text
    usage = reply.json()
    assert usage["until"] == now.date().isoformat()
    assert usage["since"] == (now.date() - timedelta(days=29)).isoformat()
    assert usage["models"] == [
        {"model": "llama", "requests": 1, "prompt_tokens": 7, "completion_tokens": 0,
         "total_tokens": 7},
        {"model": "qwen", "requests": 2, "prompt_tokens": 105, "completion_tokens": 25,
         "total_tokens": 130},
    ]
    assert [(d["day"], d["model"], d["total_tokens"]) for d in usage["days"]] == [
        (yesterday.date().isoformat(), "qwen", 10),
        (now.date().isoformat(), "llama", 7),
        (now.date().isoformat(), "qwen", 120),
    ]
    limits = {row["limit"]: row for row in usage["limits"]}
    assert limits["rpm"]["value"] == 10 and limits["tpm"]["value"] is None
    assert limits["tokens_per_day"] == {**limits["tokens_per_day"], "value": 500, "used": 127}
    assert 1 <= limits["rpm"]["resets_in_s"] <= 60

    today = now.date().isoformat()
    only_today = (await api(world, "GET", f"/api/keys/{made['prefix']}/usage?since={today}"
                            f"&until={today}")).json()
    assert [d["model"] for d in only_today["days"]] == ["llama", "qwen"]


@pytest.mark.parametrize(("query", "words"), [
    ("since=yesterday", "since must be a date like 2025-03-01, not 'yesterday'"),
    ("until=2025-13-01", "until must be a date like 2025-03-01, not '2025-13-01'"),
    ("since=2025-03-02&until=2025-03-01", "since (2025-03-02) is after until (2025-03-01)"),
])
async def test_usage_refuses_bad_dates(world: World, query: str, words: str) -> None:
    prefix = (await api(world, "POST", "/api/keys", json={"name": "k"})).json()["prefix"]
    refused = await api(world, "GET", f"/api/keys/{prefix}/usage?{query}")
    assert refused.status_code == 400 and refused.json()["error"]["message"] == words


async def test_someone_elses_usage_is_not_found(world: World) -> None:
    prefix = (await api(world, "POST", "/api/keys", json={"name": "k"})).json()["prefix"]
    assert (await api(world, "GET", f"/api/keys/{prefix}/usage", world.alice)).status_code == 404


# --- llmgw ctl keys --------------------------------------------------------------------


@pytest.fixture
async def run_ctl(world: World, monkeypatch: pytest.MonkeyPatch, capsys):
    """Run `llmgw ctl ...` in a thread; its HTTP calls are served by the test app."""
    loop = asyncio.get_running_loop()

    def urlopen(request, timeout, context=None):
        assert context is None  # plain http: no TLS context
        path = request.full_url.removeprefix("http://llmgw.test")
        reply = asyncio.run_coroutine_threadsafe(world.client.request(
            request.get_method(), path, headers=dict(request.header_items()),
            content=request.data), loop).result(timeout)
        if reply.status_code >= 400:
            raise urllib.error.HTTPError(request.full_url, reply.status_code, "refused", {},
                                         io.BytesIO(reply.content))
        return io.BytesIO(reply.content)

    monkeypatch.setattr(ctl.urllib.request, "urlopen", urlopen)
    monkeypatch.setenv("LLMGW_SERVER", "http://llmgw.test")
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("LLMGW_TOKEN", raising=False)

    async def run(*argv: str, token: str = ADMIN) -> tuple[int, str, str]:
        args = parser().parse_args(["ctl", *argv, "--token", token])
        code = await asyncio.to_thread(args.func, args)
        out, err = capsys.readouterr()
        return code, out, err

    return run


async def test_ctl_makes_a_key_with_limits_then_shows_and_changes_them(world, run_ctl) -> None:
    code, out, err = await run_ctl("keys", "create", "ci", "--rpm", "60", "--tokens-per-day",
                                   "1_000_000", "--json")
    assert code == 0, err
    made = json.loads(out)
    prefix = made["prefix"]
    assert made["limits"] == {**NO_LIMITS, "rpm": 60, "tokens_per_day": 1_000_000}

    code, out, err = await run_ctl("keys", "list")
    assert code == 0, err
    assert "60 rpm, 1,000,000 tokens/day" in out

    code, out, err = await run_ctl("keys", "limits", prefix, "--rpm", "none", "--tpm", "5000")
    assert code == 0, err
    assert out.strip() == (f"{prefix}: 5,000 tpm, 1,000,000 tokens/day "
                           "(from its next request on)")
    assert (await world.store.find_api_key(prefix)).limits == Limits(
        tpm=5000, tokens_per_day=1_000_000)

    code, out, err = await run_ctl("keys", "limits", prefix)
    assert code == 0, err
    assert "tokens_per_day" in out and "1,000,000" in out and "none" in out

    code, out, err = await run_ctl("keys", "limits", prefix, "--json")
    assert code == 0, err
    assert [row["value"] for row in json.loads(out)] == [None, 5000, 1_000_000, None]


async def test_ctl_usage_tables_and_json(world, run_ctl) -> None:
    prefix = (await api(world, "POST", "/api/keys", json={"name": "ci"})).json()["prefix"]
    code, out, err = await run_ctl("keys", "usage", prefix)
    assert code == 0, err
    assert "no usage recorded from" in out

    key = await world.store.find_api_key(prefix)
    now = datetime.now(UTC)
    await world.store.record_usage(key.id, "qwen", 1200, 34, now)
    code, out, err = await run_ctl("keys", "usage", prefix)
    assert code == 0, err
    assert "usage per model" in out and "1,234" in out and "qwen" in out

    today = now.date().isoformat()
    code, out, err = await run_ctl("keys", "usage", prefix, "--since", today, "--json")
    assert code == 0, err
    assert json.loads(out)["models"][0]["total_tokens"] == 1234


async def test_ctl_refusals_are_clear(world, run_ctl) -> None:
    with pytest.raises(SystemExit) as bad:  # argparse: usage error, exit 2
        parser().parse_args(["ctl", "keys", "limits", "llmgw_x", "--rpm", "0"])
    assert bad.value.code == 2
    with pytest.raises(SystemExit):
        parser().parse_args(["ctl", "keys", "usage", "llmgw_x", "--since", "last week"])
    code, _, err = await run_ctl("keys", "create", "mine", "--rpm", "5", token=world.alice)
    assert code == ctl.EXIT_REFUSED
    assert "403 only an admin may set a key's limits" in err
    code, _, err = await run_ctl("keys", "limits", "llmgw_nosuchkey00", "--rpm", "5")
    assert code == ctl.EXIT_REFUSED and "404 you have no key 'llmgw_nosuchkey00'" in err


def test_limit_values_parse() -> None:
    assert _limit_value("none") is None and _limit_value("Unlimited") is None
    assert _limit_value("1,000,000") == 1_000_000
    for bad in ("0", "-3", "lots", "1.5"):
        with pytest.raises(Exception, match="is not a limit"):
            _limit_value(bad)
