"""Accounts, sessions and API keys against a real server, as two users and an admin."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys

import httpx
import openai
import pytest

from tests.integration.cluster import wait_for
from tests.integration.conftest import SIM_SMALL, one_node_cluster

PASSWORDS = {"alice": "alice's long secret", "bob": "bob's own long secret"}
# OWASP's minimum argon2id: the cheapest the server accepts, to keep floods quick.
FAST_AUTH = {"argon2_memory_kib": 19 * 1024, "argon2_time_cost": 2,
             "argon2_parallelism": 1, "hash_slots": 2}
# Room in the throttle for the flood test's 200 concurrent addresses and its attacker, and
# a few dozen more: the flood's made-up addresses fill it after few hashes.
AUTH = {**FAST_AUTH, "login_attempts": 5, "login_throttle_capacity": 250}


@pytest.fixture
def server(make_cluster):
    """The server alone, for the tests whose requests no engine answers: accounts, keys and
    sessions are the server's."""
    c = make_cluster(auth=AUTH)
    c.start_server()
    return c


@pytest.fixture(scope="module")
def shared(tmp_path_factory, request):
    """The server alone, shared by the tests that change nothing another test reads (no
    setting, no throttle, no account but alice's and bob's, made once)."""
    with one_node_cluster(tmp_path_factory.mktemp("accounts"), request, [SIM_SMALL],
                          {"auth": AUTH}, with_node=False) as c:
        yield c


@pytest.fixture
def cluster(server):
    """The server with a node serving sim-small, for the tests that chat."""
    server.add_agent("node-a")
    server.wait_ready("sim-small")
    return server


def ctl(cluster, *args: str, token: str | None = None, stdin: str | None = None,
        config_home=None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LLMGW_SERVER": cluster.base_url, "COLUMNS": "200"}
    env.pop("LLMGW_TOKEN", None)
    if config_home is not None:
        env["XDG_CONFIG_HOME"] = str(config_home)
    argv = [sys.executable, "-m", "llmgw", "ctl", *args]
    if token:
        argv += ["--token", token]
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, env=env,
                          timeout=60)


def api(cluster, method: str, path: str, token: str | None = None, **kw) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.request(method, cluster.base_url + path, headers=headers, timeout=30, **kw)


def add_users(cluster) -> None:
    for name, password in PASSWORDS.items():
        done = ctl(cluster, "users", "add", name, "--password-stdin", "--json",
                   token=cluster.admin_token, stdin=password + "\n")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == {**json.loads(done.stdout), "username": name,
                                           "role": "user", "disabled": False}


def login(cluster, name: str) -> str:
    resp = api(cluster, "POST", "/api/auth/token",
               json={"username": name, "password": PASSWORDS[name]})
    assert resp.status_code == 200, resp.text
    return resp.json()["token"]


def test_two_users_keep_their_keys_to_themselves(cluster, tmp_path):
    add_users(cluster)
    # alice works through ctl with a saved session; bob through the API.
    home = tmp_path / "alice-config"
    done = ctl(cluster, "login", "alice", "--password-stdin", stdin=PASSWORDS["alice"] + "\n",
               config_home=home)
    assert done.returncode == 0, done.stderr
    assert oct((home / "llmgw" / "session.json").stat().st_mode & 0o777) == "0o600"
    made = ctl(cluster, "keys", "create", "laptop", "--model", "sim-small", "--json",
               config_home=home)
    assert made.returncode == 0, made.stderr
    alice_key = json.loads(made.stdout)
    assert alice_key["key"].startswith("llmgw_") and alice_key["owner"] == "alice"

    bob = login(cluster, "bob")
    bob_key = api(cluster, "POST", "/api/keys", bob, json={"name": "bob's"}).json()

    listed = json.loads(ctl(cluster, "keys", "list", "--json", config_home=home).stdout)
    assert [k["prefix"] for k in listed] == [alice_key["prefix"]]
    assert "key" not in listed[0], "a key is shown once, at creation"
    bobs = api(cluster, "GET", "/api/keys", bob).json()
    assert [k["prefix"] for k in bobs] == [bob_key["prefix"]]

    # bob cannot revoke alice's key, nor learn that it exists.
    refused = api(cluster, "DELETE", f"/api/keys/{alice_key['prefix']}", bob)
    assert refused.status_code == 404
    everything = api(cluster, "GET", "/api/keys", cluster.admin_token).json()
    assert {k["prefix"] for k in everything} >= {alice_key["prefix"], bob_key["prefix"]}

    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key=alice_key["key"],
                           max_retries=0)
    assert client.chat.completions.create(
        model="sim-small", messages=[{"role": "user", "content": "hi"}]).choices
    revoked = ctl(cluster, "keys", "revoke", alice_key["prefix"], config_home=home)
    assert revoked.returncode == 0, revoked.stderr
    with pytest.raises(openai.AuthenticationError) as err:
        client.chat.completions.create(model="sim-small",
                                       messages=[{"role": "user", "content": "hi"}])
    assert "revoked" in str(err.value)

    # A user cannot reach the admin's commands.
    denied = ctl(cluster, "users", "list", config_home=home)
    assert denied.returncode == 1 and "admin" in denied.stderr


def test_an_expired_key_is_refused_on_the_next_request(shared):
    key = api(shared, "POST", "/api/keys", shared.admin_token,
              json={"name": "brief", "expires_in_days": 2 / 86400}).json()["key"]
    body = {"model": "sim-small", "messages": [{"role": "user", "content": "x"}]}
    url = f"{shared.base_url}/v1/chat/completions"

    def refused():
        resp = httpx.post(url, json=body, headers={"authorization": f"Bearer {key}"})
        return resp.status_code == 401 and resp.json()["error"]

    error = wait_for(refused, 10, "the key to expire")
    assert "expired" in error["message"] and error["type"] == "authentication_error"


def test_nobody_can_make_themselves_admin(server):
    add_users(server)
    api(server, "PUT", "/api/settings", server.admin_token, json={"signup": "open"})
    attempts = [
        ("POST", "/api/auth/signup", None,
         {"username": "mallory", "password": "mallory's password", "role": "admin"}),
    ]
    bob = login(server, "bob")
    attempts += [
        ("PATCH", "/api/users/bob", bob, {"role": "admin"}),
        ("POST", "/api/keys", bob, {"name": "k", "account_id": 1}),
        ("PUT", "/api/me/password", bob, {"current_password": PASSWORDS["bob"],
                                          "new_password": "another long one", "role": "admin"}),
        ("POST", "/api/users", bob, {"username": "eve", "password": "eve's password",
                                     "role": "admin"}),
    ]
    for method, path, token, payload in attempts:
        resp = api(server, method, path, token, json=payload)
        assert resp.status_code in (400, 403), (path, resp.status_code, resp.text)
        assert resp.json()["error"]["message"]
    roles = {u["username"]: u["role"]
             for u in api(server, "GET", "/api/users", server.admin_token).json()}
    assert roles == {"alice": "user", "bob": "user"}
    assert api(server, "GET", "/api/me", bob).json()["role"] == "user"


def test_signup_modes_and_the_session_cookie(server):
    form = {"username": "carol", "password": "carol's long secret"}
    closed = api(server, "POST", "/api/auth/signup", json=form)
    assert closed.status_code == 403 and "closed" in closed.json()["error"]["message"]

    api(server, "PUT", "/api/settings", server.admin_token, json={"signup": "invite"})
    assert api(server, "POST", "/api/auth/signup", json=form).status_code == 403
    invite = api(server, "POST", "/api/invites", server.admin_token, json={}).json()["invite"]
    joined = api(server, "POST", "/api/auth/signup", json={**form, "invite": invite})
    assert joined.status_code == 201, joined.text
    cookie = joined.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie
    again = api(server, "POST", "/api/auth/signup",
                json={"username": "dave", "password": "dave's long secret", "invite": invite})
    assert again.status_code == 403, "an invite is single-use"

    with httpx.Client(base_url=server.base_url) as browser:
        # A form on another site must not log the browser in as someone (login CSRF).
        as_form = browser.post("/api/auth/login", content=json.dumps(form).encode(),
                               headers={"content-type": "text/plain"})
        assert as_form.status_code == 415 and "set-cookie" not in as_form.headers
        signup_form = browser.post("/api/auth/signup", content=json.dumps(form).encode(),
                                   headers={"content-type": "text/plain"})
        assert signup_form.status_code == 415, signup_form.text
        assert browser.post("/api/auth/login", json=form).status_code == 200
        assert browser.get("/api/me").json() == {"username": "carol", "role": "user"}
        # What a form on another site could send, were the cookie sent with it: refused.
        forged = browser.post("/api/keys", content=b'{"name": "forged"}',
                              headers={"content-type": "text/plain"})
        assert forged.status_code == 415, forged.text
        assert "Content-Type: application/json" in forged.json()["error"]["message"]
        assert browser.post("/api/keys", json={"name": "page"}).status_code == 201
        assert browser.post("/api/auth/logout").status_code == 415  # no JSON: still in
        assert browser.post("/api/auth/logout",
                            headers={"content-type": "application/json"}).status_code == 200
        assert browser.get("/api/me").status_code == 401


async def _post_from(address: str, port: int, path: str, payload: dict) -> int:
    """One HTTP request from a given loopback source address (127.0.0.0/8 is all ours)."""
    data = json.dumps(payload).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(address, 0))
    writer.write(f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json"
                 f"\r\ncontent-length: {len(data)}\r\nconnection: close\r\n\r\n".encode() + data)
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    writer.close()
    await writer.wait_closed()
    return status


def test_login_floods_stay_bounded(server):
    add_users(server)
    port = server.port
    wrong = {"username": "alice", "password": "not her password"}

    async def concurrent_wrong_logins() -> list[int]:
        # 200 at once, each from its own address so the throttle lets every one through.
        return await asyncio.gather(*(
            _post_from(f"127.2.{i // 200}.{i % 200 + 1}", port, "/api/auth/login", wrong)
            for i in range(200)))

    assert set(asyncio.run(concurrent_wrong_logins())) == {401}
    logins = server.status()["logins"]
    assert logins["peak"] <= logins["slots"] == 2

    async def flood() -> tuple[list[int], list[int], int]:
        attacker = "127.0.0.9"
        first = [await _post_from(attacker, port, "/api/auth/login", wrong) for _ in range(6)]
        made_up = []
        for start in range(0, 1000, 50):  # bounded: 1,000 requests, 50 at a time
            made_up += await asyncio.gather(*(
                _post_from(f"127.1.{i // 250}.{i % 250 + 1}", port, "/api/auth/login", wrong)
                for i in range(start, start + 50)))
        last = await _post_from(attacker, port, "/api/auth/login",
                                {"username": "alice", "password": PASSWORDS["alice"]})
        return first, made_up, last

    first, made_up, last = asyncio.run(flood())
    assert first == [401] * 5 + [429]
    assert set(made_up) == {401, 429} and made_up.count(429) > 500
    assert last == 429, "the flood did not reset the attacker's count, right password or not"
    logins = server.status()["logins"]
    assert logins["tracked_addresses"] <= logins["throttle_capacity"] == 250


def test_the_store_holds_no_plaintext_secret(shared):
    add_users(shared)
    token = login(shared, "alice")
    key = api(shared, "POST", "/api/keys", token, json={"name": "k"}).json()["key"]
    dump = "\n".join(sqlite3.connect(shared.server_state / "llmgw.db").iterdump())
    assert "alice" in dump, "the dump is of the right database"
    for secret in (*PASSWORDS.values(), key, token, shared.api_key):
        assert secret not in dump


def test_disabling_an_account_stops_its_keys_and_sessions(cluster):
    add_users(cluster)
    token = login(cluster, "bob")
    key = api(cluster, "POST", "/api/keys", token, json={"name": "k"}).json()["key"]
    body = {"model": "sim-small", "messages": [{"role": "user", "content": "x"}]}
    url = f"{cluster.base_url}/v1/chat/completions"
    assert httpx.post(url, json=body, headers={"authorization": f"Bearer {key}"}).is_success

    done = ctl(cluster, "users", "set", "bob", "--disable", token=cluster.admin_token)
    assert done.returncode == 0, done.stderr
    refused = httpx.post(url, json=body, headers={"authorization": f"Bearer {key}"})
    assert refused.status_code == 401 and "disabled" in refused.json()["error"]["message"]
    assert api(cluster, "GET", "/api/me", token).status_code == 401


def test_bodies_are_read_strictly_and_refused_in_llmgws_words(shared):
    admin = shared.admin_token

    def refusal(method: str, path: str, **kw) -> tuple[int, dict]:
        resp = api(shared, method, path, admin, **kw)
        return resp.status_code, resp.json().get("error", {})

    # No body where one is needed: the field it lacks, named.
    status, error = refusal("POST", "/api/users")
    assert (status, error["code"]) == (400, "invalid_value")
    assert error["message"] == "invalid request: Object missing required field username"
    # One where every field has a default: taken as {}.
    assert api(shared, "POST", "/api/invites", admin).status_code == 201
    # A field the request does not take, and a number written as text: refused.
    status, error = refusal("POST", "/api/keys", json={"name": "k", "role": "admin"})
    assert (status, error["message"]) == (400, "`role` cannot be set here")
    status, error = refusal("POST", "/api/keys", json={"name": "k", "limits": {"rpm": "60"}})
    assert (status, error["param"]) == (400, "limits.rpm"), error
    status, error = refusal("POST", "/api/keys", json={"name": "k", "limits": {"rpm": 1.5}})
    assert (status, error["param"]) == (400, "limits.rpm"), error
    # A whole number written 60.0 is the 60 JSON takes it for.
    made = api(shared, "POST", "/api/keys", admin, json={"name": "k", "limits": {"rpm": 60.0}})
    assert made.status_code == 201 and made.json()["limits"]["rpm"] == 60, made.text
    # The document of it all is public.
    assert httpx.get(f"{shared.base_url}/openapi.json").json()["paths"]["/api/keys"]
