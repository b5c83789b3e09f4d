"""The cluster page in Chromium against one real cluster: a server and an agent whose NVML
says it has an RTX 4090 (tests/fakes/nvml_process.py), a sim model serving and one scaled
to 0. An admin logs in and out, looks at the node and its GPU, chooses the node's llama.cpp
build and sees the agent told, makes a key and calls /v1 with it through the official
client, scales a model and watches its replica come up; a form without its CSRF token is
refused and changes nothing.

server.yaml asks for llama.cpp from a mirror on a closed loopback port, as
tests/integration/test_engine_build_choice.py does: nothing leaves the machine and
nothing is installed, but the node is asked for a build and says what became of it.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
from playwright.sync_api import Browser, Locator, Page, expect

from tests.browser.browsing import add_admin, log_in, running, send, signed_in_state
from tests.fakes.nvml_process import fake_node_prefix
from tests.integration.cluster import Cluster, free_port, wait_for

NODE = "gpu-1"
SERVING = "sim-small"
SCALED = "sim-scaled"
MODELS = [{"name": SERVING, "profiles": [{"engine": "sim"}], "replicas": 1},
          {"name": SCALED, "profiles": [{"engine": "sim"}], "replicas": 0}]
# How long the cluster may take to act on a form (a controller pass is 0.5 s, an engine
# starts in about a second) on a loaded two-core machine.
ACTS_S = 30


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    made = Cluster(tmp_path_factory.mktemp("cluster"), MODELS, {
        "engines": {"llama.cpp": {}}, "engine_mirror": f"http://127.0.0.1:{free_port()}/"})
    with running(made):
        made.add_agent(NODE, prefix=fake_node_prefix("fake_single_4090"),
                       install_os_packages=False)
        made.wait_ready(SERVING, timeout_s=60)
        add_admin(made, "ops")
        yield made


@pytest.fixture(scope="module")
def ops(browser: Browser, cluster: Cluster) -> dict:
    """The cookies of ops's session (an admin), opened once through the login form."""
    return signed_in_state(browser, cluster, "ops")


def reload_until(page: Page, shown: Callable[[], Locator], what: str,
                 timeout_s: float = ACTS_S) -> None:
    """Reload the page until ``shown()`` is visible on it: the pages do not refresh
    themselves, a person reloads."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            expect(shown()).to_be_visible(timeout=1000)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s:g} s reloading the page "
                                     f"for {what}") from None
        page.reload()


def row_of(page: Page, name: str) -> Locator:
    """The table row whose link is ``name``."""
    return page.get_by_role("row").filter(
        has=page.get_by_role("link", name=name, exact=True))


def test_log_in_see_the_overview_and_log_out(cluster, browse, shot):
    page = browse(cluster)
    page.goto("/ui/nodes")
    expect(page).to_have_url(re.compile(r"/ui/login\?next=/ui/nodes$"))
    expect(page.get_by_role("heading", name="Log in")).to_be_visible()
    shot(page, "login")

    log_in(page, "ops")
    # Back where it was going.
    expect(page).to_have_url(re.compile(r"/ui/nodes$"))
    expect(page.get_by_role("heading", name="Nodes", exact=True)).to_be_visible()
    page.get_by_role("navigation", name="Sections").get_by_role("link",
                                                                 name="Overview").click()
    expect(page.get_by_role("heading", name="Overview", exact=True)).to_be_visible()
    expect(page.get_by_text("ops (admin)")).to_be_visible()
    nodes = page.get_by_role("region", name="Nodes")
    expect(nodes).to_contain_text("ready 1:")
    expect(nodes.get_by_role("link", name=NODE)).to_be_visible()
    expect(row_of(page, SERVING)).to_contain_text("1 / 1")
    shot(page, "overview")

    send(page, page.get_by_role("button", name="Log out"))
    expect(page.get_by_role("heading", name="Log in")).to_be_visible()
    page.goto("/ui/")
    expect(page).to_have_url(re.compile(r"/ui/login\?next=/ui/?$"))


def test_a_node_and_its_gpu(cluster, browse, ops, shot):
    page = browse(cluster, storage_state=ops)
    page.goto("/ui/nodes")
    row = row_of(page, NODE)
    expect(row).to_contain_text("1x NVIDIA GeForce RTX 4090")
    # NVML's 24,564 MiB, 487 MiB of them in use (tests/fakes/nvml.py fake_single_4090).
    expect(row).to_contain_text("487 MiB / 24.0 GiB")
    expect(row.get_by_role("button", name=f"Drain {NODE}")).to_be_visible()
    shot(page, "nodes")

    row.get_by_role("link", name=NODE).click()
    expect(page.get_by_role("heading", name=f"Node {NODE}")).to_be_visible()
    gpus = page.get_by_role("region", name="GPUs")
    expect(gpus).to_contain_text("1 NVIDIA GPU, 487 MiB of 24.0 GiB in use.")
    expect(gpus).to_contain_text("NVIDIA driver 570.172.08, CUDA 12.8")
    expect(gpus.get_by_role("row", name="NVIDIA GeForce RTX 4090")).to_contain_text(
        "487 / 24,564 MiB")
    replicas = page.get_by_role("region", name="Replicas on this node")
    expect(replicas).to_contain_text(f"({SERVING})")
    shot(page, "node")


def asked_builds(cluster: Cluster) -> dict[str, str] | None:
    """Engine -> build, as the agent was last told (its engines/wanted.json, written as
    the message arrives; a build left out is auto)."""
    path = Path(cluster.agents[NODE].state_dir) / "engines" / "wanted.json"
    if not path.exists():
        return None
    return {e["name"]: e.get("build", "auto") for e in json.loads(path.read_text())}


def test_a_build_chosen_on_the_page_reaches_the_agent(cluster, browse, ops, shot):
    wait_for(lambda: asked_builds(cluster) == {"llama.cpp": "auto"}, ACTS_S,
             "the node to be asked for llama.cpp, auto")
    page = browse(cluster, storage_state=ops)
    page.goto(f"/ui/nodes/{NODE}")
    # Each engine's row has its own form: "Build of ENGINE" and "Set the ENGINE build".
    llama = page.get_by_role("region", name="Engine builds").get_by_role("row").filter(
        has=page.get_by_label("Build of llama.cpp"))
    expect(llama).to_contain_text("nothing chose one: the node takes its best")
    llama.get_by_label("Build of llama.cpp").select_option("vulkan")
    send(page, llama.get_by_role("button", name="Set the llama.cpp build"))

    expect(page.get_by_role("status")).to_contain_text(
        f"{NODE} llama.cpp: vulkan (chosen for this node)")
    expect(llama).to_contain_text("chosen for this node")
    wait_for(lambda: asked_builds(cluster) == {"llama.cpp": "vulkan"}, ACTS_S,
             "the agent to be told to install the vulkan build")
    shot(page, "node build chosen")

    # default: back to server.yaml's word, and the node is told so.
    llama.get_by_label("Build of llama.cpp").select_option("default")
    send(page, llama.get_by_role("button", name="Set the llama.cpp build"))
    expect(page.get_by_role("status")).to_contain_text(f"{NODE} llama.cpp: auto")
    wait_for(lambda: asked_builds(cluster) == {"llama.cpp": "auto"}, ACTS_S,
             "the agent to be told auto again")


def test_make_a_key_copy_it_and_call_v1(cluster, browse, ops, shot):
    page = browse(cluster, storage_state=ops, permissions=["clipboard-read", "clipboard-write"])
    page.goto("/ui/keys")
    expect(page.get_by_role("heading", name="API keys")).to_be_visible()
    shot(page, "keys")
    page.get_by_label("Name", exact=True).fill("notebook")
    page.get_by_role("checkbox", name=SERVING).check()
    send(page, page.get_by_role("button", name="Make the key"))

    expect(page.get_by_role("heading", name="Key notebook made")).to_be_visible()
    expect(page.get_by_text("It is shown this once.")).to_be_visible()
    shown = page.locator("output#new-key").inner_text().strip()
    page.get_by_role("button", name="Copy", exact=True).click()
    expect(page.get_by_role("status").filter(has_text="Copied.")).to_be_visible()
    copied = page.evaluate("navigator.clipboard.readText()")
    assert copied == shown and copied.startswith("llmgw_"), (copied, shown)
    shot(page, "key made")

    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key=copied, max_retries=0)
    answer = client.chat.completions.create(
        model=SERVING, messages=[{"role": "user", "content": "hello from the page"}])
    assert answer.choices[0].message.content
    # The key may use only the model it was made for.
    with pytest.raises(openai.PermissionDeniedError) as refused:
        client.chat.completions.create(model=SCALED,
                                       messages=[{"role": "user", "content": "hi"}])
    assert f"this API key may not use model {SCALED!r}" in str(refused.value)

    page.get_by_role("link", name="All keys").click()
    expect(row_of(page, "notebook")).to_contain_text("active")
    expect(row_of(page, "notebook")).to_contain_text(SERVING)
    # The usage page counts it (each server writes usage down once a second).
    page.goto("/ui/usage")
    reload_until(page, lambda: page.get_by_role("region", name="Tokens per key").get_by_role(
        "row", name=re.compile("notebook")), "the key's tokens on the usage page")
    shot(page, "usage")


def test_scale_a_model_and_watch_its_replica_come_up(cluster, browse, ops, shot):
    page = browse(cluster, storage_state=ops)
    page.goto("/ui/models")
    row = row_of(page, SCALED)
    expect(row).to_contain_text("0 / 0")
    row.get_by_label("Replicas").fill("1")
    send(page, row.get_by_role("button", name="Scale"))
    expect(page.get_by_role("status")).to_have_text(f"{SCALED}: scaled to 1 replica")
    expect(row_of(page, SCALED)).to_contain_text("(scaled here; server.yaml says 0)")
    shot(page, "models")

    row_of(page, SCALED).get_by_role("link", name=SCALED).click()
    expect(page.get_by_role("heading", name=f"Model {SCALED}")).to_be_visible()
    replicas = page.get_by_role("region", name="Its replicas")
    reload_until(page, lambda: replicas.get_by_role("row").filter(
        has=page.get_by_role("link", name=NODE)).filter(has_text="ready"),
        f"a ready replica of {SCALED} on {NODE}")
    expect(page.get_by_role("region", name="Replicas", exact=True)).to_contain_text(
        "1 / 1 ready / wanted")
    shot(page, "model")
    assert [r["state"] for r in cluster.replicas(SCALED)] == ["ready"]


def test_a_form_without_its_csrf_token_is_refused(cluster, browse, ops, shot):
    page = browse(cluster, storage_state=ops)
    page.goto("/ui/keys")
    form = page.locator("form[action='/ui/keys']")
    form.get_by_label("Name", exact=True).fill("forged")
    form.locator("input[name=csrf]").evaluate("input => input.remove()")
    send(page, form.get_by_role("button", name="Make the key"))

    expect(page.get_by_role("alert")).to_have_text(
        "this form was not sent from this cluster's page (its CSRF token is missing or "
        "wrong); reload the page and send it again")
    shot(page, "csrf refused")
    keys = cluster.admin("GET", "/api/keys")
    assert keys.status_code == 200, keys.text
    assert "forged" not in {k["name"] for k in keys.json()}
    # Still signed in: the refusal ended nothing either.
    page.goto("/ui/keys")
    expect(page.get_by_role("heading", name="API keys")).to_be_visible()
    expect(row_of(page, "forged")).to_have_count(0)
