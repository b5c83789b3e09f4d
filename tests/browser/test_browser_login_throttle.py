"""A failed login in Chromium: the one answer for a wrong name or password, then, past the
server's limit of attempts from one address, the throttle's words, which refuse even
the right password until the window has passed. A server of its own: the throttle counts
every login from 127.0.0.1, the other modules' too."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from playwright.sync_api import expect

from tests.browser.browsing import PASSWORD, add_admin, log_in, running
from tests.integration.cluster import Cluster

ATTEMPTS = 2  # auth.login_attempts


@pytest.fixture(scope="module")
def strict(tmp_path_factory) -> Iterator[Cluster]:
    """A server alone (no node, no model) allowing two login attempts per address."""
    cluster = Cluster(tmp_path_factory.mktemp("strict"), [],
                      {"auth": {"login_attempts": ATTEMPTS, "login_window_s": 600}})
    with running(cluster):
        add_admin(cluster, "ops")
        yield cluster


def test_wrong_passwords_then_the_throttle(strict, browse, shot):
    page = browse(strict)
    page.goto("/ui/login")
    for _ in range(ATTEMPTS):
        log_in(page, "ops", "not the password")
        expect(page.get_by_role("alert")).to_have_text("wrong username or password")
        # What was typed stays, but for the password.
        expect(page.get_by_label("Username")).to_have_value("ops")
        expect(page.get_by_label("Password")).to_have_value("")
    shot(page, "login refused")

    log_in(page, "ops", PASSWORD)
    throttled = page.get_by_role("alert")
    expect(throttled).to_have_text(re.compile(
        r"^too many login attempts from 127\.0\.0\.1; try again in \d+ s$"))
    # The rest of the window that began with the first attempt.
    assert 0 < int(re.findall(r"\d+", throttled.inner_text())[-1]) <= 600
    expect(page.get_by_role("heading", name="Log in")).to_be_visible()
    shot(page, "login throttled")
    page.goto("/ui/")
    expect(page).to_have_url(re.compile(r"/ui/login\?next=/ui/?$"))
