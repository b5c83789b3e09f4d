"""The setup form and the way in, over plain HTTP against a real server: a fresh install
shows only the setup form, which takes effect only with the admin token and a CSRF
token; after it, never again. Choosing PostgreSQL moves the store there and the server
starts again in the same process. (tests/browser/ drives the same pages in Chromium.)"""

from __future__ import annotations

import os
import re

import httpx
import yaml

from llmgw.bundle.mirror import current_manifest
from llmgw.store import open_store
from tests.integration.activation import listener, start_activated
from tests.integration.bundles import Signer, make_bundle
from tests.integration.cluster import wait_for
from tests.pg import run_blocking

SETUP = "/ui/setup"
COMMIT = "4f1e2d3c4b5a69788796a5b4c3d2e1f0a1b2c3d4"  # the revision the bundle pins


def _csrf(html: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', html).group(1)


def _alerts(html: str) -> list[str]:
    return [re.sub(r"<[^>]+>", "", m).replace("&#39;", "'")
            for m in re.findall(r'role="alert"[^>]*>(.*?)</p>', html, re.S)]


def _form(token: str, **fields: str) -> dict[str, str]:
    return {"admin_token": token, "username": "ops", "password": "a-long-password",
            "password_again": "a-long-password", "store": "sqlite", "model": "add",
            "model_name": "smollm2-135m", "model_description": "SmolLM2 on the CPU",
            "model_source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct-GGUF",
            "model_files": "*q8_0.gguf", **fields}


def _fresh(make_cluster):
    c = make_cluster()
    c.start_server()
    return c, httpx.Client(base_url=c.base_url, timeout=30)


def test_a_fresh_install_is_set_up_from_the_form_once(make_cluster):
    c, browser = _fresh(make_cluster)
    with browser:
        assert browser.get("/").headers["location"] == "/ui/"
        landing = browser.get("/ui/", follow_redirects=True)
        assert landing.url.path == SETUP and "Set up llmgw" in landing.text
        # Nothing else answers without the admin token: no account exists to log in with.
        assert browser.get("/api/models").status_code == 401
        csrf = _csrf(landing.text)

        refused = browser.post(SETUP, data=_form(c.admin_token))  # no CSRF token
        assert refused.status_code == 403
        assert "CSRF token is missing or wrong" in " ".join(_alerts(refused.text))
        wrong = browser.post(SETUP, data={**_form("not-the-token"), "csrf": csrf})
        assert wrong.status_code == 400
        assert any("not this server's admin token; it is in "
                   f"{c.server_state}/secrets/admin-token" in a for a in _alerts(wrong.text))
        short = browser.post(SETUP, data={**_form(c.admin_token, password_again="other"),
                                          "csrf": csrf})
        assert "the two passwords differ" in " ".join(_alerts(short.text))
        # Refused three times: nothing was made.
        assert c.admin("GET", "/api/users").json() == []
        assert browser.get("/ui/", follow_redirects=True).url.path == SETUP

        done = browser.post(SETUP, data={**_form(c.admin_token), "csrf": csrf})
        assert done.status_code == 303 and done.headers["location"] == "/ui/"
        overview = browser.get("/ui/")
        assert overview.status_code == 200
        assert ("Set up: admin account 'ops' made; model 'smollm2-135m' declared."
                in overview.text.replace("&#39;", "'"))
        assert browser.get(SETUP).headers["location"] == "/ui/"
        assert browser.post(SETUP, data={**_form(c.admin_token), "csrf": csrf}
                            ).headers["location"] == "/ui/"
    users = c.admin("GET", "/api/users").json()
    assert [(u["username"], u["role"]) for u in users] == [("ops", "admin")]
    assert "smollm2-135m" in [m["name"] for m in c.admin("GET", "/api/models").json()]

    # Another browser logs in with the account, and out again.
    with httpx.Client(base_url=c.base_url, timeout=30) as other:
        login = other.get("/ui/", follow_redirects=True)
        assert login.url.path == "/ui/login"
        fields = {"csrf": _csrf(login.text), "username": "ops", "password": "wrong-password",
                  "next": "/ui/"}
        bad = other.post("/ui/login", data=fields)
        assert bad.status_code == 401 and _alerts(bad.text) == ["wrong username or password"]
        good = other.post("/ui/login", data={**fields, "password": "a-long-password"})
        assert good.status_code == 303 and good.headers["location"] == "/ui/"
        page = other.get("/ui/")
        assert "<h1>Overview</h1>" in page.text and "ops (admin)" in page.text
        out = other.post("/ui/logout", data={"csrf": _csrf(page.text)})
        assert out.headers["location"] == "/ui/login"
        assert other.get("/ui/").headers["location"].startswith("/ui/login")

    # A user sees the models, not the nodes nor the traffic, as on the admin API.
    assert c.admin("POST", "/api/users", json={"username": "dev",
                                               "password": "another-password"}).is_success
    with httpx.Client(base_url=c.base_url, timeout=30) as user:
        login = user.get("/ui/login")
        assert user.post("/ui/login", data={"csrf": _csrf(login.text), "username": "dev",
                                            "password": "another-password"}).is_redirect
        page = user.get("/ui/").text
        assert "smollm2-135m" in page and 'class="who">dev</span>' in page
        assert 'id="nodes-h"' not in page and "Needs attention" not in page
        assert "per minute" not in page


def test_setup_on_postgresql_moves_the_store_and_restarts_in_place(postgres_database,
                                                                   make_cluster):
    # Under socket activation (as the NixOS module runs it): the restart keeps systemd's
    # socket, so the browser's next request waits in its queue instead of being refused.
    sock = listener()
    c = make_cluster()
    c.port = sock.getsockname()[1]
    c.server_state.mkdir(parents=True)
    log = c.root / "server.log"
    c.server = start_activated(sock, c.write_server_config(), log)
    wait_for(lambda: "socket passed by systemd" in log.read_text(), 60, "the server to serve")
    c.admin_token = (c.server_state / "secrets" / "admin-token").read_text().strip()
    browser = httpx.Client(base_url=c.base_url, timeout=30)
    pid = c.server.pid
    with browser:
        csrf = _csrf(browser.get(SETUP).text)
        unreachable = "postgresql://llmgw@127.0.0.1:1/nothing"
        refused = browser.post(SETUP, data={**_form(c.admin_token, store="postgresql",
                                                     store_url=unreachable), "csrf": csrf})
        assert refused.status_code == 400
        assert any("127.0.0.1:1" in a for a in _alerts(refused.text)), _alerts(refused.text)
        assert c.admin("GET", "/api/users").json() == []

        # Typed as operators write it: plain postgresql://, which llmgw takes for asyncpg.
        typed = postgres_database.replace("postgresql+asyncpg://", "postgresql://")
        done = browser.post(SETUP, data={**_form(c.admin_token, store="postgresql",
                                                  store_url=typed), "csrf": csrf})
        assert done.status_code == 303
        config = yaml.safe_load((c.root / "server.yaml").read_text())
        assert config["store"]["url"] == postgres_database
        assert list(c.root.glob("server.yaml.before-postgres-*"))
        def started_again() -> bool:
            _, _, after = log.read_text().partition("starting again")
            return "Application startup complete" in after

        wait_for(started_again, 60, "the server to start again and serve")

        def serving_from_postgres() -> bool:
            try:
                return browser.get("/ui/").status_code == 200 and c.admin(
                    "GET", "/api/users").status_code == 200
            except httpx.TransportError:
                return False

        wait_for(serving_from_postgres, 60, "the server to serve again")
        # The same process, on PostgreSQL, with the account and the session copied.
        assert c.server.poll() is None and c.server.pid == pid
        assert [u["username"] for u in c.admin("GET", "/api/users").json()] == ["ops"]
        assert "<h1>Overview</h1>" in browser.get("/ui/").text
        assert "socket passed by systemd" in log.read_text().partition("starting again")[2]
    sock.close()
    assert [a.username for a in run_blocking(_accounts(postgres_database))] == ["ops"]


async def _accounts(url: str) -> list:
    store = await open_store(url)
    try:
        return await store.list_accounts()
    finally:
        await store.close()


def test_setup_from_a_bundle_imports_it_and_declares_its_models(make_cluster, tmp_path):
    signer = Signer.new()
    gguf = tmp_path / "smollm2.Q8_0.gguf"
    gguf.write_bytes(b"GGUF" + os.urandom(512))
    made = make_bundle(tmp_path / "bundle", signer, models={
        "smollm2": ("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", COMMIT,
                    {"smollm2.Q8_0.gguf": gguf})})
    c, browser = _fresh(make_cluster)
    mirror = c.server_state / "mirror"
    with browser:
        csrf = _csrf(browser.get(SETUP).text)
        bundle = {"bundle": str(made.root), "model": "bundle", "csrf": csrf}
        # Signed by someone else: refused, the mirror and the store as they were.
        stranger = browser.post(SETUP, data={**_form(c.admin_token), **bundle,
                                             "bundle_key": Signer.new().line})
        assert stranger.status_code == 400
        assert any(f"was not imported: the bundle is signed by key {signer.key_id}" in a
                   for a in _alerts(stranger.text)), _alerts(stranger.text)
        assert current_manifest(mirror) is None
        assert c.admin("GET", "/api/users").json() == []

        done = browser.post(SETUP, data={**_form(c.admin_token), **bundle,
                                         "bundle_key": signer.line,
                                         "bundle_sha256": made.sha256})
        assert done.status_code == 303, _alerts(done.text)
        flash = browser.get("/ui/").text.replace("&#39;", "'")
        assert "imported into the mirror; model 'smollm2' declared." in flash
    assert current_manifest(mirror) == made.manifest
    [model] = [m for m in c.admin("GET", "/api/models").json() if m["name"] == "smollm2"]
    [profile] = model["spec"]["profiles"]
    assert profile["source"] == f"hf://HuggingFaceTB/SmolLM2-135M-Instruct-GGUF@{COMMIT}"
    assert (profile["engine"], profile["files"]) == ("llama.cpp", ["smollm2.Q8_0.gguf"])
