"""The setup form in Chromium, on a server started on an empty state directory: every page
leads there; with the server's admin token it makes the admin account and the first
model, lands on the overview signed in, and never shows again."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from playwright.sync_api import expect

from tests.browser.browsing import PASSWORD, running, send
from tests.integration.cluster import Cluster


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Iterator[Cluster]:
    """A server alone, on an empty state directory, with an empty catalog."""
    cluster = Cluster(tmp_path_factory.mktemp("fresh"), [])
    # Cluster would make an API key in a new store first; this server makes its own store.
    cluster.api_key = "unused: no key is made before this server starts"
    with running(cluster):
        yield cluster


def test_a_fresh_server_is_set_up_from_the_form(fresh, browse, shot):
    page = browse(fresh)
    page.goto("/")
    expect(page).to_have_url(re.compile(r"/ui/setup$"))
    expect(page.get_by_role("heading", name="Set up llmgw")).to_be_visible()
    shot(page, "setup form")

    def fill(password_again: str) -> None:
        page.get_by_label("Admin token").fill(fresh.admin_token)
        page.get_by_label("Username").fill("ops")
        page.get_by_label("Password (10 characters or more)").fill(PASSWORD)
        page.get_by_label("The same password again").fill(password_again)

    # A slip is marked beside its field and nothing is saved.
    fill(PASSWORD + " but different")
    send(page, page.get_by_role("button", name="Set up"))
    expect(page.get_by_text("Nothing was saved: fix what is marked below")).to_be_visible()
    expect(page.get_by_label("The same password again")).to_have_accessible_description(
        "the two passwords differ; type the same one twice")
    shot(page, "setup form refused")
    assert fresh.admin("GET", "/api/users").json() == []

    fill(PASSWORD)
    expect(page.get_by_role("radio", name="SQLite on this server")).to_be_checked()
    expect(page.get_by_role("radio", name="Declare this model")).to_be_checked()
    expect(page.get_by_label("Name clients ask for")).to_have_value("smollm2-135m")
    send(page, page.get_by_role("button", name="Set up"))

    expect(page).to_have_url(re.compile(r"/ui/$"))
    expect(page.get_by_role("status")).to_have_text(
        "Set up: admin account 'ops' made; model 'smollm2-135m' declared.")
    expect(page.get_by_role("heading", name="Overview", exact=True)).to_be_visible()
    expect(page.get_by_text("ops (admin)")).to_be_visible()
    # Declared, wanted once, and nowhere to go yet: no node has joined.
    expect(page.get_by_role("row", name="smollm2-135m")).to_contain_text("0 / 1")
    expect(page.get_by_role("link", name="smollm2-135m has no place")).to_be_visible()
    shot(page, "overview after setup")

    page.goto("/ui/setup")
    expect(page).to_have_url(re.compile(r"/ui/$"))
    expect(page.get_by_role("status")).to_have_text("setup is done; it is not shown again")

    models = fresh.admin("GET", "/api/models")
    assert models.status_code == 200, models.text
    [model] = models.json()
    assert (model["name"], model["source"], model["replicas"]) == ("smollm2-135m", "api", 1)
    assert [p["engine"] for p in model["profiles"]] == ["llama.cpp"]
    [admin] = fresh.admin("GET", "/api/users").json()
    assert (admin["username"], admin["role"]) == ("ops", "admin")
