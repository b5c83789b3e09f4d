"""The Nodes pages over plain HTTP, against a real server and two real agents on loopback:
``gpu-1`` with an NVML-shaped fake of an 8x H100 server, ``old-cpu`` with no NVIDIA driver
and a CPU without AVX2 (a cpuinfo-shaped file). server.yaml asks for llama.cpp from a
mirror on a closed loopback port, so each node reports, in its own words, why its install
failed, and nothing leaves the machine. (tests/browser/ drives the same pages in Chromium.)
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fakes.nvml_process import fake_node_prefix
from tests.integration.cluster import Cluster, free_port, wait_for

SIM = {"name": "sim-small", "profiles": [{"engine": "sim"}], "replicas": 1}
ADMIN, USER, PASSWORD = "ops", "viewer", "a-long-password"
# What a node reports of an install its mirror does not answer (agent/install's words).
MIRROR_DOWN = "cannot read the sha256 list http://127.0.0.1:{port}/llama.cpp/b11434/SHA256SUMS"
# A CPU from before AVX2 (Sandy Bridge), as /proc/cpuinfo shows it.
OLD_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) CPU E5-2670 0 @ 2.60GHz
flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx aes
"""
REPORTED_S = 20  # a registration and a failed install, on a busy two-core machine


class Nodes:
    def __init__(self, cluster: Cluster, mirror_port: int) -> None:
        self.cluster = cluster
        self.mirror_port = mirror_port

    def node(self, node_id: str) -> dict:
        return next(n for n in self.cluster.admin("GET", "/api/nodes").json()
                    if n["id"] == node_id)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory, request) -> Iterator[Nodes]:
    root = tmp_path_factory.mktemp("ui-nodes")
    mirror_port = free_port()  # nothing listens: every download fails at once
    cluster = Cluster(root / "cluster", [SIM], {
        "engines": {"llama.cpp": {}}, "engine_mirror": f"http://127.0.0.1:{mirror_port}/"})
    cluster.root.mkdir()
    cpuinfo = root / "cpuinfo"
    cpuinfo.write_text(OLD_CPUINFO)
    failed_before = request.session.testsfailed
    try:
        cluster.start_server()
        cluster.add_agent("gpu-1", prefix=fake_node_prefix("fake_h100_x8"),
                          install_os_packages=False, labels={"rack": "r7"})
        cluster.add_agent("old-cpu", prefix=fake_node_prefix("fake_no_library", cpuinfo),
                          install_os_packages=False)
        for name, password, role in ((ADMIN, PASSWORD, "admin"), (USER, PASSWORD, "user")):
            made = cluster.admin("POST", "/api/users",
                                 json={"username": name, "password": password, "role": role})
            assert made.status_code == 201, made.text
        found = Nodes(cluster, mirror_port)
        for node_id in ("gpu-1", "old-cpu"):
            wait_for(lambda n=node_id: any(e["name"] == "llama.cpp" and e["state"] == "failed"
                                           for e in found.node(n)["engines"]),
                     REPORTED_S, f"{node_id} to report its llama.cpp install failed")
        yield found
    except BaseException:
        print(cluster.logs())
        raise
    finally:
        if request.session.testsfailed > failed_before:
            print(cluster.logs())
        cluster.stop()


def log_in(cluster: Cluster, username: str) -> httpx.Client:
    browser = httpx.Client(base_url=cluster.base_url, timeout=15)
    form = browser.get("/ui/login")
    done = browser.post("/ui/login", data={"csrf": csrf_of(form.text), "username": username,
                                           "password": PASSWORD})
    assert done.status_code == 303, done.text
    return browser


@pytest.fixture
def admin(nodes) -> Iterator[httpx.Client]:
    browser = log_in(nodes.cluster, ADMIN)
    yield browser
    browser.close()


@pytest.fixture
def user(nodes) -> Iterator[httpx.Client]:
    browser = log_in(nodes.cluster, USER)
    yield browser
    browser.close()


def csrf_of(page: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', page).group(1)


def read(page: str) -> str:
    """What a person reads: the text without tags, entities decoded, spaces folded."""
    main = page[page.index("<main"):]
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", main)).split())


def flash(page: str) -> str:
    return html.unescape(re.search(r'class="flash" role="status">([^<]*)<', page).group(1))


def asked(cluster: Cluster, node_id: str) -> dict[str, str]:
    """Engine -> build, as the node was last told (the agent's own record of it)."""
    path = Path(cluster.agents[node_id].state_dir) / "engines" / "wanted.json"
    return {e["name"]: e.get("build", "auto") for e in json.loads(path.read_text())}


def test_the_list_shows_each_node_its_gpus_and_warnings(nodes, admin):
    page = admin.get("/ui/nodes")
    assert page.status_code == 200 and len(page.content) < 100_000
    text = read(page.text)
    assert "2 nodes: ready 2" in text
    assert re.search(r"gpu-1 127\.0\.0\.1 ready 8x NVIDIA H100 80GB HBM3 "
                     r"[\d.]+ GiB / 637\.2 GiB \S+ 0 Drain", text), text
    # The node without AVX2 has one warning, linked to where its fix is said.
    assert re.search(r"old-cpu 127\.0\.0\.1 ready none \(CPU only\) \S \S+ 1 Drain", text), text
    assert 'href="/ui/nodes/old-cpu#warnings-h"' in page.text
    assert 'href="/ui/nodes/gpu-1"' in page.text
    assert admin.get("/ui/nodes?state=ready&page=7").status_code == 200  # past the end: the last
    wrong = admin.get("/ui/nodes?page=first")
    assert wrong.status_code == 400
    assert "page='first' is not a page number; use 1, 2, …" in read(wrong.text)


def test_a_nodes_page_shows_its_hardware_and_engines_in_its_words(nodes, admin):
    page = admin.get("/ui/nodes/gpu-1")
    assert page.status_code == 200 and len(page.content) < 100_000
    text = read(page.text)
    assert "Node gpu-1 ready" in text
    assert "8 NVIDIA GPUs" in text
    assert "NVIDIA driver 580.65.06, CUDA 13.0" in text
    for index in range(8):
        assert re.search(rf"\b{index} NVIDIA H100 80GB HBM3 [\d,]+ / 81,559 MiB", text), index
    assert "rack=r7" in text
    # The install's state in the node's own words, each build it tried.
    down = MIRROR_DOWN.format(port=nodes.mirror_port)
    assert f"llama.cpp b11434 failed failed: cuda-13.3 build: {down}" in text
    assert "Engine builds" in text and "llama.cpp auto nothing chose one" in text
    # The replica on whichever node it was placed links to its model's page.
    replica = next(r for r in nodes.cluster.status()["replicas"] if r["model"] == "sim-small")
    holder = admin.get(f"/ui/nodes/{replica['shards'][0]['node']}").text
    assert f'<a href="/ui/models/sim-small">{replica["id"]}</a>' in holder

    old = read(admin.get("/ui/nodes/old-cpu").text)
    assert "Intel(R) Xeon(R) CPU E5-2670 0 @ 2.60GHz" in old
    assert "Vector extensions avx no AVX2: CPU engines run several times slower here" in old
    # node_view's warning, with what to do about it.
    assert ("CPU without AVX2: CPU engines run several times slower; on a VM, give it the "
            "host's CPU model (e.g. QEMU -cpu host)") in old
    assert "No NVIDIA GPU: a CPU-only node" in old
    assert f"llama.cpp b11434 failed failed: {down}" in old

    missing = admin.get("/ui/nodes/nobody")
    assert missing.status_code == 404
    assert ("no node 'nobody' has registered; `llmgw ctl nodes` and the Nodes page list "
            "those that have") in read(
        missing.text)


def test_a_build_chosen_on_the_page_reaches_the_node(nodes, admin):
    page = admin.get("/ui/nodes/gpu-1").text
    chose = admin.post("/ui/nodes/gpu-1/engine-builds/llama.cpp",
                       data={"csrf": csrf_of(page), "build": "vulkan"})
    assert chose.status_code == 303 and chose.headers["location"] == "/ui/nodes/gpu-1"
    after = admin.get(chose.headers["location"]).text
    assert flash(after) == ("gpu-1 llama.cpp: vulkan (chosen for this node); "
                            "gpu-1 was told now")
    assert "llama.cpp vulkan chosen for this node" in read(after)
    assert re.search(r'<option value="vulkan" selected>', after)
    wait_for(lambda: asked(nodes.cluster, "gpu-1") == {"llama.cpp": "vulkan"}, REPORTED_S,
             "gpu-1 to be asked for the vulkan build")

    wrong = admin.post("/ui/nodes/gpu-1/engine-builds/llama.cpp",
                       data={"csrf": csrf_of(page), "build": "cu129"})
    assert wrong.status_code == 400
    assert ("'cu129' is not a build of llama.cpp; use default, auto, none or one of "
            "cuda-13.3, cuda-12.8, vulkan, cpu") in read(wrong.text)

    back = admin.post("/ui/nodes/gpu-1/engine-builds/llama.cpp",
                      data={"csrf": csrf_of(page), "build": "default"})
    assert "auto (nothing chose one: the node takes its best)" in flash(
        admin.get(back.headers["location"]).text)
    wait_for(lambda: asked(nodes.cluster, "gpu-1") == {"llama.cpp": "auto"}, REPORTED_S,
             "gpu-1 to be asked for llama.cpp, auto, again")


def test_only_an_admin_drains_and_only_with_the_csrf_token(nodes, admin, user):
    # The nodes are for admins, as /api/nodes is: a user is told so, and changes nothing.
    for path in ("/ui/nodes", "/ui/nodes/gpu-1"):
        seen = user.get(path)
        assert seen.status_code == 403
        assert "this page is for admins; ask one to give you the admin role" in read(seen.text)
        assert "/drain" not in seen.text and 'name="build"' not in seen.text
    token = csrf_of(user.get("/ui/").text)  # the user's own, valid token
    refused = user.post("/ui/nodes/gpu-1/drain", data={"csrf": token})
    assert refused.status_code == 403 and "this needs an admin" in read(refused.text)
    refused = user.post("/ui/nodes/gpu-1/engine-builds/llama.cpp",
                        data={"csrf": token, "build": "cpu"})
    assert refused.status_code == 403
    assert nodes.node("gpu-1")["state"] == "ready"
    assert nodes.node("gpu-1")["engine_builds"]["llama.cpp"]["source"] == "default"

    forged = admin.post("/ui/nodes/gpu-1/drain", data={"back": "list"})
    assert forged.status_code == 403
    assert "CSRF token is missing or wrong" in read(forged.text)
    assert nodes.node("gpu-1")["state"] == "ready"

    token = csrf_of(admin.get("/ui/nodes").text)
    drained = admin.post("/ui/nodes/gpu-1/drain", data={"csrf": token, "back": "list"})
    assert drained.status_code == 303 and drained.headers["location"] == "/ui/nodes"
    listed = admin.get("/ui/nodes").text
    assert flash(listed).startswith("gpu-1 is draining: its replicas move to other nodes")
    assert nodes.node("gpu-1")["state"] == "draining"
    assert "gpu-1 127.0.0.1 draining" in read(listed) and "Undrain" in listed

    undrained = admin.post("/ui/nodes/gpu-1/undrain", data={"csrf": token, "back": "node"})
    assert undrained.headers["location"] == "/ui/nodes/gpu-1"
    assert flash(admin.get("/ui/nodes/gpu-1").text) == (
        "gpu-1 is undrained: replicas may be placed there again")
    wait_for(lambda: nodes.node("gpu-1")["state"] == "ready", REPORTED_S,
             "gpu-1 to be ready again")
    assert admin.post("/ui/nodes/nobody/drain", data={"csrf": token}).status_code == 404
