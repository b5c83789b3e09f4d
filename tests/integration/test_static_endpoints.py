"""Static endpoints on a real `llmgw server` with no agent at all, in front of an
OpenAI-shaped server someone else runs: the sim engine's app under a path prefix, behind
a bearer key, over http and https, in a thread of this process. Through the official
`openai` client: answers whole and streamed, the key and the upstream's model name sent,
usage counted for the API key, a key's model list applied; the endpoint stopped → 503
naming it, started again → served; its key rotated and the server reloaded (SIGHUP);
its health in the models API and /metrics, the key nowhere; a config whose key file is
missing refused at start, naming the key."""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
import signal
import ssl
import subprocess
import sys
import threading

import httpx
import msgspec
import openai
import pytest
import yaml
from aiohttp import web

from llmgw import pki
from llmgw.cli.main import main
from llmgw.sim.server import SimServer
from tests.integration.cluster import Cluster, free_port, wait_for
from tests.integration.ui_session import logged_in

KEY = "upstream-secret-1"
ROTATED = "upstream-secret-2"
HI = [{"role": "user", "content": "hi"}]


class Upstream:
    """The sim engine's app serving ``served-name`` under /prefix, on a plain and a TLS
    port, answering only requests with ``Bearer <key>``; each request's path,
    Authorization header and body's ``model`` noted. Runs on its own loop in a thread;
    stopped and started again on the same ports."""

    def __init__(self, cert: bytes, key_pem: bytes, root) -> None:
        self.key = KEY
        self.seen: list[tuple[str, str | None, str | None]] = []
        self.port, self.tls_port = free_port(), free_port()
        (root / "up.pem").write_bytes(cert)
        (root / "up.key").write_bytes(key_pem)
        self._tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._tls.load_cert_chain(root / "up.pem", root / "up.key")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._runner: web.AppRunner | None = None

    def _app(self) -> web.Application:
        @web.middleware
        async def keyed(request: web.Request, handler):
            body = await request.read()  # kept: the handler reads it again
            model = msgspec.json.decode(body).get("model") if body else None
            self.seen.append((request.path, request.headers.get("authorization"), model))
            if request.headers.get("authorization") != f"Bearer {self.key}":
                return web.json_response({"error": {"message": "bad key"}}, status=401)
            return await handler(request)

        app = web.Application(middlewares=[keyed])
        app.add_subapp("/prefix", SimServer("served-name", 0, 4).app())
        return app

    async def _start(self) -> None:
        self._runner = web.AppRunner(self._app(), access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        for port, tls in ((self.port, None), (self.tls_port, self._tls)):
            await web.TCPSite(self._runner, "127.0.0.1", port, ssl_context=tls,
                              reuse_address=True).start()

    def start(self) -> None:
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._runner = None

    def close(self) -> None:
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("endpoints")
    ca_key, ca_pem = pki.create_ca()
    key_pem, cert_pem = pki.issue_server_cert(ca_key, ca_pem, ["127.0.0.1"])
    (root / "ca.pem").write_bytes(ca_pem)
    upstream = Upstream(cert_pem, key_pem, root)
    upstream.start()
    key_file = root / "remote.key"
    key_file.write_text(KEY + "\n")
    models = [
        {"name": "big-remote", "aliases": ["gpt-4o-mini"],
         "endpoints": [{"url": f"http://127.0.0.1:{upstream.port}/prefix/v1/",
                        "api_key_file": str(key_file), "model": "served-name",
                        "slots": 4}]},
        {"name": "tls-remote",
         "endpoints": [{"url": f"https://127.0.0.1:{upstream.tls_port}/prefix/v1",
                        "api_key_file": str(key_file), "model": "served-name",
                        "ca_file": str(root / "ca.pem")}]},
        # Nothing listens there: its requests go to its fallback.
        {"name": "dead-remote", "fallbacks": ["big-remote"],
         "endpoints": [{"url": f"http://127.0.0.1:{free_port()}/v1"}]},
    ]
    cluster = Cluster(root / "cluster", models)
    cluster.root.mkdir()
    failed_before = request.session.testsfailed
    try:
        cluster.start_server()
    except BaseException:
        print(cluster.logs())
        cluster.stop()
        upstream.close()
        raise
    yield cluster, upstream, key_file
    if request.session.testsfailed > failed_before:
        print(cluster.logs())
    cluster.stop()
    upstream.close()


def _key_for(c: Cluster, *models: str) -> tuple[str, str]:
    made = c.admin("POST", "/api/keys", json={"name": "only " + " ".join(models),
                                              "models": list(models)})
    assert made.status_code == 201, made.text
    return made.json()["key"], made.json()["prefix"]


def _client(c: Cluster, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{c.base_url}/v1", api_key=key, max_retries=0,
                         timeout=20)


def _logged_in(c: Cluster) -> httpx.Client:
    """The cluster page as an admin account sees it."""
    password = "a-long-password"
    c.admin("POST", "/api/users", json={"username": "ops", "password": password,
                                        "role": "admin"}).raise_for_status()
    return logged_in(c, "ops", password)


def _endpoint(c: Cluster, model: str) -> dict:
    [shown] = next(m for m in c.admin("GET", "/api/models").json()
                   if m["name"] == model)["endpoints"]
    return shown


def test_an_endpoint_serves_its_model_with_no_agent_key_and_name_sent(setup):
    cluster, upstream, _ = setup
    key, prefix = _key_for(cluster, "big-remote", "tls-remote")
    client = _client(cluster, key)
    chat = client.chat.completions.create(model="big-remote", messages=HI, max_tokens=3)
    assert chat.model == "served-name" and chat.usage.completion_tokens == 3
    chunks = list(client.chat.completions.create(
        model="big-remote", messages=HI, max_tokens=4, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 4
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    over_tls = client.chat.completions.create(model="tls-remote", messages=HI, max_tokens=2)
    assert over_tls.usage.completion_tokens == 2
    # Under the URL's path, with the key, the body naming the upstream's model.
    posts = [s for s in upstream.seen if s[0].endswith("/chat/completions")]
    assert posts and set(posts) == {("/prefix/v1/chat/completions", f"Bearer {KEY}",
                                     "served-name")}
    assert ("/prefix/v1/models", f"Bearer {KEY}", None) in upstream.seen  # its check

    # The key's model list applies: to a model it does not list, and to the model of an
    # alias it lists (by the alias only).
    tls_only, _ = _key_for(cluster, "tls-remote")
    with pytest.raises(openai.PermissionDeniedError):
        _client(cluster, tls_only).chat.completions.create(model="big-remote", messages=HI,
                                                            max_tokens=1)
    only, _ = _key_for(cluster, "gpt-4o-mini")
    assert _client(cluster, only).chat.completions.create(
        model="gpt-4o-mini", messages=HI, max_tokens=1).usage.completion_tokens == 1
    with pytest.raises(openai.PermissionDeniedError):
        _client(cluster, only).chat.completions.create(model="big-remote", messages=HI,
                                                        max_tokens=1)

    def recorded():
        usage = cluster.admin("GET", f"/api/keys/{prefix}/usage").json()["models"]
        return sum(m["requests"] for m in usage) >= 3 and {m["model"]: m for m in usage}
    used = wait_for(recorded, 10, "the usage of three requests to be written")
    assert (used["big-remote"]["requests"], used["big-remote"]["completion_tokens"]) == (2, 7)
    assert used["tls-remote"]["completion_tokens"] == 2


def test_the_endpoint_s_health_shows_and_its_key_does_not(setup, ctl_environment):
    cluster, upstream, _ = setup
    shown = wait_for(lambda: _endpoint(cluster, "big-remote")["health"] == "up"
                     and _endpoint(cluster, "big-remote"), 10, "a first check")
    assert shown["name"] == "big-remote@endpoint-0" and shown["model"] == "served-name"
    assert shown["url"] == f"http://127.0.0.1:{upstream.port}/prefix/v1"
    listed = cluster.admin("GET", "/api/models").text
    assert '"replicas":0' in listed.replace(" ", "")
    metrics = httpx.get(f"{cluster.base_url}/metrics", timeout=10).text
    assert 'llmgw_endpoint_up{endpoint="big-remote@endpoint-0",model="big-remote"} 1.0' \
        in metrics
    browser = _logged_in(cluster)
    try:
        page = browser.get("/ui/models/big-remote").text
        listing = browser.get("/ui/models").text
        wait_for(lambda: _endpoint(cluster, "dead-remote")["health"] == "down", 10,
                 "the dead endpoint's check to fail")
        overview = browser.get("/ui/").text
    finally:
        browser.close()
    assert "big-remote@endpoint-0" in page and shown["url"] in page
    assert "1 / 1 endpoint" in listing
    # What needs attention: the dead endpoint, not the live one.
    assert re.search(r"endpoint http://127\.0\.0\.1:\d+/v1 of dead-remote is down: "
                     r"connection refused", overview), overview
    assert "of big-remote is down" not in overview
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # `llmgw ctl models list`, in this process
        assert main(["ctl", "models", "list", "--server", cluster.base_url, "--token",
                     cluster.admin_token]) == 0
    table = out.getvalue()
    assert f"http://127.0.0.1:{upstream.port}/prefix/v1 up" in table
    for text in (listed, metrics, page, overview, table,
                 (cluster.root / "server.log").read_text()):
        assert KEY not in text


def test_a_model_whose_endpoint_does_not_answer_goes_to_its_fallback(setup):
    cluster, _, _ = setup
    key, _ = _key_for(cluster, "dead-remote", "big-remote")
    client = _client(cluster, key)
    for _ in range(2):  # its endpoint refusing connections, then out of routing
        raw = client.chat.completions.with_raw_response.create(
            model="dead-remote", messages=HI, max_tokens=1)
        assert raw.headers["x-llmgw-model"] == "big-remote"
        assert raw.parse().model == "served-name"
        wait_for(lambda: _endpoint(cluster, "dead-remote")["health"] == "down", 10,
                 "the dead endpoint's check to fail")


def test_a_stopped_endpoint_is_refused_by_name_until_it_answers_again(setup):
    cluster, upstream, _ = setup
    key, _ = _key_for(cluster, "big-remote")
    client = _client(cluster, key)
    upstream.stop()
    try:
        # The request that finds no connection has the endpoint checked at once.
        with pytest.raises(openai.InternalServerError) as refused:
            client.chat.completions.create(model="big-remote", messages=HI, max_tokens=1)
        assert refused.value.status_code == 503
        wait_for(lambda: _endpoint(cluster, "big-remote")["health"] == "down", 10,
                 "the endpoint's check to fail")
        with pytest.raises(openai.InternalServerError) as refused:
            client.chat.completions.create(model="big-remote", messages=HI, max_tokens=1)
        assert refused.value.status_code == 503
        assert refused.value.body["message"] == (
            "no endpoint of 'big-remote' can take the request: endpoint "
            f"http://127.0.0.1:{upstream.port}/prefix/v1 did not answer its health check: "
            "connection refused")
        metrics = httpx.get(f"{cluster.base_url}/metrics", timeout=10).text
        assert 'llmgw_endpoint_up{endpoint="big-remote@endpoint-0",model="big-remote"} 0.0' \
            in metrics
    finally:
        upstream.start()
    wait_for(lambda: client.chat.completions.create(model="big-remote", messages=HI,
                                                    max_tokens=1), 10,
             "the endpoint to be served again")


def test_a_rotated_key_is_read_again_at_reload(setup):
    cluster, upstream, key_file = setup
    key, _ = _key_for(cluster, "big-remote")
    client = _client(cluster, key)
    upstream.key = ROTATED
    try:
        # Refused as llmgw's key, not the client's: a 503 saying whose, not a 401.
        for _ in range(2):  # the endpoint's refusal, then its check's
            with pytest.raises(openai.InternalServerError) as refused:
                client.chat.completions.create(model="big-remote", messages=HI,
                                               max_tokens=1)
            assert f"it refused the key in {key_file}" in refused.value.body["message"]
            wait_for(lambda: _endpoint(cluster, "big-remote")["health"] == "down", 10,
                     "the endpoint's check to fail")
        key_file.write_text(ROTATED + "\n")
        cluster.server.send_signal(signal.SIGHUP)
        wait_for(lambda: client.chat.completions.create(model="big-remote", messages=HI,
                                                        max_tokens=1), 10,
                 "the new key to be sent")
        assert upstream.seen[-1][1] == f"Bearer {ROTATED}"
    finally:
        upstream.key = KEY
        key_file.write_text(KEY + "\n")
        cluster.server.send_signal(signal.SIGHUP)


def test_a_config_whose_key_file_is_missing_is_refused_naming_the_key(setup, tmp_path):
    _, upstream, _ = setup
    config = {"listen": {"port": free_port()}, "state_dir": str(tmp_path / "state"),
              "engines": {},
              "models": [{"name": "m", "endpoints": [
                  {"url": f"http://127.0.0.1:{upstream.port}/v1",
                   "api_key_file": str(tmp_path / "absent")}]}]}
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run([sys.executable, "-m", "llmgw", "server", "--config", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert (f"models[0].endpoints[0].api_key_file: cannot read {tmp_path / 'absent'}: "
            "No such file or directory") in done.stderr
