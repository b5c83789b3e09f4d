"""The models pages over plain HTTP, against a real server and a real agent running the
sim engine: the list with ready/wanted replicas, scaling from its form, adding a model
with server.yaml's checks (and refusals naming the key), removing one, placement's reason
per node, a shard's output, and who may do what. One cluster for the module.
(tests/browser/ drives the same pages in Chromium.)"""

from __future__ import annotations

import html
import re
from collections.abc import Iterator

import httpx
import pytest

from llmgw.server.admin.status import ReplicaView, ShardView
from llmgw.server.ui.models import SHOWN_SHARD_ROWS, _first_rows, written_model
from tests.integration.cluster import Cluster, wait_for
from tests.integration.conftest import SIM_SMALL, one_node_cluster

PASSWORD = "a-long-password"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request) -> Iterator[Cluster]:
    with one_node_cluster(tmp_path_factory.mktemp("ui-models"), request, [SIM_SMALL]) as c:
        for username, role in (("ops", "admin"), ("viewer", "user")):
            c.admin("POST", "/api/users", json={"username": username, "password": PASSWORD,
                                                "role": role}).raise_for_status()
        yield c


def _logged_in(cluster: Cluster, username: str) -> httpx.Client:
    browser = httpx.Client(base_url=cluster.base_url, timeout=30)
    login = browser.get("/ui/login")
    done = browser.post("/ui/login", data={"csrf": _csrf(login.text), "username": username,
                                           "password": PASSWORD, "next": "/ui/models"})
    assert done.status_code == 303, done.text
    return browser


@pytest.fixture(scope="module")
def ops(cluster) -> Iterator[httpx.Client]:
    browser = _logged_in(cluster, "ops")
    yield browser
    browser.close()


@pytest.fixture(scope="module")
def viewer(cluster) -> Iterator[httpx.Client]:
    browser = _logged_in(cluster, "viewer")
    yield browser
    browser.close()


def _csrf(page: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', page).group(1)


def _text(fragment: str) -> str:
    """What a person reads: tags dropped, entities read, spaces collapsed."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", fragment)).split())


def _alerts(page: str) -> list[str]:
    return [_text(m) for m in re.findall(r'role="alert"[^>]*>(.*?)</p>', page, re.S)]


def _flash(page: str) -> str:
    found = re.search(r'class="flash"[^>]*>(.*?)</p>', page, re.S)
    return _text(found.group(1)) if found else ""


def _row(page: str, model: str) -> str:
    """The list's row of ``model``, as read."""
    for row in re.findall(r"<tr>(.*?)</tr>", page, re.S):
        if f'href="/ui/models/{model}"' in row:
            return _text(row)
    raise AssertionError(f"no row for {model} in the list")


def _section(page: str, heading_id: str) -> str:
    found = re.search(rf'<section[^>]*aria-labelledby="{heading_id}"[^>]*>(.*?)</section>',
                      page, re.S)
    assert found, f"no section {heading_id}"
    return found.group(1)


def _replica_ids(page: str) -> list[str]:
    return re.findall(r'<span class="mono">([^<]+)</span>', _section(page, "replicas-h"))


def _wanted(cluster: Cluster, model: str) -> int:
    return next(m["replicas"] for m in cluster.admin("GET", "/api/models").json()
                if m["name"] == model)


def test_the_list_shows_each_model_with_ready_and_wanted_replicas(ops):
    page = ops.get("/ui/models")
    assert page.status_code == 200 and "<h1>Models</h1>" in page.text
    row = _row(page.text, "sim-small")
    assert "sim-small server.yaml 1 / 1 node-a" in row
    # server.yaml's models cannot be removed from the page, and it says why.
    assert "declared in server.yaml: remove it there and reload the server" in row
    assert "Scale" in row and "Add a model" in page.text


def test_scaling_from_the_form_starts_a_second_replica(cluster, ops):
    listed = ops.get("/ui/models")
    before = _replica_ids(ops.get("/ui/models/sim-small").text)
    assert len(before) == 1
    try:
        scaled = ops.post("/ui/models/sim-small", data={
            "csrf": _csrf(listed.text), "action": "scale", "replicas": "2", "back": "list"})
        assert scaled.status_code == 303 and scaled.headers["location"] == "/ui/models"
        back = ops.get("/ui/models")
        assert _flash(back.text) == "sim-small: scaled to 2 replicas"
        assert "sim-small server.yaml" in _row(back.text, "sim-small")
        assert "/ 2" in _row(back.text, "sim-small")

        def two_ready() -> list[str] | None:
            page = ops.get("/ui/models/sim-small").text
            ready = re.findall(r'<td rowspan="\d+"><span class="state state-ready">ready<',
                               _section(page, "replicas-h"))
            return _replica_ids(page) if len(ready) == 2 else None

        ids = wait_for(two_ready, 20, "a second ready replica on the model's page")
        assert before[0] in ids
        assert "2 / 2" in _row(ops.get("/ui/models").text, "sim-small")
        # The model's page says it was scaled here, over server.yaml's number.
        assert "Scaled here; server.yaml says 1." in _text(ops.get("/ui/models/sim-small").text)
    finally:
        cluster.admin("PATCH", "/api/models/sim-small", json={"replicas": None})
        wait_for(lambda: len(cluster.replicas("sim-small")) == 1, 20,
                 "sim-small back to one replica")


def test_a_bad_model_is_refused_naming_the_key_and_nothing_is_stored(cluster, ops):
    csrf = _csrf(ops.get("/ui/models").text)
    form = {"csrf": csrf, "name": "bad-one", "engine": "sim", "replicas": "1", "gpus": "two"}
    refused = ops.post("/ui/models", data=form)
    assert refused.status_code == 400
    assert _alerts(refused.text) == [
        "Nothing was added: model.profiles[0].gpus: expected int, got str"]
    # The form comes back as it was filled in, the field marked.
    assert re.search(r'id="add-gpus"[^>]*value="two"[^>]*aria-invalid="true"', refused.text)
    unknown = ops.post("/ui/models", data={**form, "gpus": "", "engine": "nonesuch"})
    assert unknown.status_code == 400
    assert "model.profiles[0].engine: unknown engine 'nonesuch'" in _alerts(unknown.text)[0]
    assert "bad-one" not in [m["name"] for m in cluster.admin("GET", "/api/models").json()]

    taken = ops.post("/ui/models", data={**form, "gpus": "", "name": "sim-small"})
    assert taken.status_code == 409
    assert "model 'sim-small' exists (server.yaml declares it)" in _alerts(taken.text)[0]


def test_a_model_added_on_the_page_shows_why_it_is_not_placed_and_is_removed(cluster, ops):
    csrf = _csrf(ops.get("/ui/models").text)
    added = ops.post("/ui/models", data={
        "csrf": csrf, "name": "team/needs-gpus", "description": "wants two GPUs",
        "engine": "sim", "replicas": "1", "gpus": "2"})
    assert added.status_code == 303, _alerts(added.text)
    assert added.headers["location"] == "/ui/models/team/needs-gpus"
    stored = next(m for m in cluster.admin("GET", "/api/models").json()
                  if m["name"] == "team/needs-gpus")
    assert stored["spec"] == {"name": "team/needs-gpus", "description": "wants two GPUs",
                              "replicas": 1, "profiles": [{"engine": "sim", "gpus": 2}]}

    def refused_on_node_a() -> str | None:
        page = ops.get("/ui/models/team/needs-gpus").text
        return page if "unplaced-h" in page else None

    page = wait_for(refused_on_node_a, 10, "placement's reasons on the model's page")
    assert "Why not every replica is placed" in page
    assert "node-a needs 2 GPUs, has no GPUs" in _text(_section(page, "unplaced-h"))
    assert "over the API" in _text(page)

    unticked = ops.post("/ui/models/team/needs-gpus", data={"csrf": csrf, "action": "remove"})
    assert unticked.status_code == 400
    assert "to confirm" in _alerts(unticked.text)[0]
    removed = ops.post("/ui/models/team/needs-gpus",
                       data={"csrf": csrf, "action": "remove", "confirm": "yes"})
    assert removed.status_code == 303 and removed.headers["location"] == "/ui/models"
    assert (_flash(ops.get("/ui/models").text)
            == "model 'team/needs-gpus' removed; its replicas stop")
    assert "team/needs-gpus" not in [m["name"]
                                     for m in cluster.admin("GET", "/api/models").json()]

    # server.yaml's model is refused in the API's words.
    kept = ops.post("/ui/models/sim-small", data={"csrf": csrf, "action": "remove",
                                                  "confirm": "yes"})
    assert kept.status_code == 409
    assert _alerts(kept.text)[0].startswith(
        "model 'sim-small' is declared in server.yaml: remove it there and reload the server")


def test_a_form_without_its_csrf_token_is_refused(cluster, ops):
    wanted = _wanted(cluster, "sim-small")
    refused = ops.post("/ui/models/sim-small", data={"action": "scale", "replicas": "3"})
    assert refused.status_code == 403
    assert "CSRF token is missing or wrong" in _alerts(refused.text)[0]
    forged = ops.post("/ui/models", data={"csrf": "0" * 64, "name": "forged", "engine": "sim"})
    assert forged.status_code == 403
    assert _wanted(cluster, "sim-small") == wanted
    assert "forged" not in [m["name"] for m in cluster.admin("GET", "/api/models").json()]


def test_a_user_sees_what_the_api_tells_them_and_their_posts_are_refused(cluster, viewer):
    page = viewer.get("/ui/models")
    assert page.status_code == 200
    # As GET /api/models tells a user: no nodes, no placement, no form that changes.
    assert _row(page.text, "sim-small") == "sim-small server.yaml 1 / 1"
    assert "Add a model" not in page.text and 'name="action"' not in page.text
    model = viewer.get("/ui/models/sim-small")
    assert model.status_code == 200
    assert "1 / 1 ready / wanted" in _text(model.text)
    assert 'id="replicas-h"' not in model.text and "node-a" not in model.text
    assert "Change it" not in model.text and "?log=" not in model.text

    csrf = _csrf(page.text)  # the logout form's: a good token, of a user
    scale = viewer.post("/ui/models/sim-small", data={"csrf": csrf, "action": "scale",
                                                      "replicas": "3"})
    assert scale.status_code == 403 and _alerts(scale.text) == ["this needs an admin"]
    add = viewer.post("/ui/models", data={"csrf": csrf, "name": "mine", "engine": "sim"})
    assert add.status_code == 403
    assert _wanted(cluster, "sim-small") == 1
    [replica] = cluster.ready_replicas("sim-small")
    log = viewer.get(f"/ui/models/sim-small?log={replica['id']}&rank=0")
    assert log.status_code == 403 and "for admins" in _alerts(log.text)[0]


def test_aliases_and_fallbacks_are_shown_and_a_key_may_be_made_for_an_alias(cluster, viewer):
    added = cluster.admin("POST", "/api/models", json={
        "name": "team/big", "aliases": ["big-alias", "gpt-x"], "fallbacks": ["sim-small"],
        "replicas": 0, "profiles": [{"engine": "sim"}]})
    assert added.status_code == 201, added.text
    try:
        # A user sees them, on the API as on the pages: a user may send an alias.
        [big] = [m for m in viewer.get("/api/models").json() if m["name"] == "team/big"]
        assert (big["aliases"], big["fallbacks"]) == (["big-alias", "gpt-x"], ["sim-small"])
        assert "spec" not in big
        assert (_row(viewer.get("/ui/models").text, "team/big")
                == "team/big also big-alias, gpt-x falls back to sim-small API 0 / 0")
        page = _text(viewer.get("/ui/models/team/big").text)
        # (_text leaves a space where a tag closed before the comma.)
        assert ('Clients ask for it as "model": "team/big" , "big-alias" or "gpt-x" on /v1'
                in page)
        assert "this serves it: sim-small (and their own fallbacks after them)" in page
        keys = viewer.get("/ui/keys").text
        offered = re.findall(r'name="models" value="([^"]+)"', keys)
        assert offered == ["sim-small", "team/big", "big-alias", "gpt-x"]
        assert "big-alias (alias of team/big)" in _text(keys)
    finally:
        cluster.admin("DELETE", "/api/models/team/big").raise_for_status()


def test_a_replicas_page_shows_the_sim_engines_output(cluster, ops):
    [replica] = cluster.ready_replicas("sim-small")
    page = ops.get("/ui/models/sim-small").text
    link = html.unescape(re.search(rf'href="([^"]*\?log={replica["id"]}&amp;rank=0#log)"',
                                   page).group(1))
    shown = ops.get(link)
    assert shown.status_code == 200
    log = _section(shown.text, "log-h")
    assert f"Output of {replica['id']}, rank 0" in _text(log)
    port = replica["shards"][0]["port"]
    assert (f"sim: serving sim-small on 127.0.0.1:{port}"
            in html.unescape(re.search(r"<pre>(.*?)</pre>", log, re.S).group(1)))

    missing = ops.get("/ui/models/sim-small?log=no-such-replica&rank=0")
    assert missing.status_code == 404
    assert _alerts(missing.text) == [
        "no-such-replica is not a replica of this model now; its replicas are listed above"]


def test_the_add_form_is_read_as_a_server_yaml_entry():
    fields = {"name": " qwen ", "engine": "llama.cpp", "source": "hf://Qwen/Qwen3-0.6B-GGUF",
              "files": "*Q8_0.gguf, *.json", "replicas": "2", "gpus": "", "weights": ""}
    assert written_model(fields) == {
        "name": "qwen", "replicas": 2,
        "profiles": [{"engine": "llama.cpp", "source": "hf://Qwen/Qwen3-0.6B-GGUF",
                      "files": ["*Q8_0.gguf", "*.json"]}]}
    # What is not a number is passed on as typed, for server.yaml's rules to name.
    assert written_model({**fields, "replicas": "x"})["replicas"] == "x"


def test_a_models_page_shows_a_bounded_number_of_shard_rows():
    def replica(i: int, shards: int) -> ReplicaView:
        return ReplicaView(f"r{i}", "m", "default", i, "ready", "", 0,
                           [ShardView(k, f"n{k}", 8000 + k, "ready", "") for k in range(shards)])

    big = [replica(i, 8) for i in range(40)]
    assert [r.id for r in _first_rows(big)] == [f"r{i}" for i in range(SHOWN_SHARD_ROWS // 8)]
    unplaced = [replica(i, 0) for i in range(3)]
    assert _first_rows(unplaced) == unplaced
