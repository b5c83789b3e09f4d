"""What the browser tests share besides fixtures (those are in conftest.py): how Chromium
is launched, a cluster started for a module, and the few steps every test takes (log in,
send a form).

Sync Playwright keeps this thread's asyncio loop marked as running while the browser is
open (its calls run that loop in a greenlet), so nothing on the test's thread may call
``asyncio.run``: ``running`` starts a cluster on a thread of its own, and the tests are
plain functions, which pytest-asyncio leaves alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from playwright.sync_api import Browser, Locator, Page, expect

from tests.integration.cluster import Cluster

CHROMIUM = Path("/usr/bin/chromium")
# Launched as Debian ships it, headless, and kept off the network: every host name fails
# to resolve (the servers are reached by address), and nothing phones home.
CHROMIUM_ARGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
    "--disable-background-networking", "--disable-component-update", "--no-first-run",
    "--disable-sync", "--disable-default-apps", "--disable-extensions",
    "--disable-domain-reliability", "--disable-client-side-phishing-detection",
    "--no-pings", "--dns-prefetch-disable", "--metrics-recording-only",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1, EXCLUDE [::1]",
    "--disable-features=Translate,OptimizationHints,MediaRouter,AutofillServerCommunication",
]
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
# A loaded two-core machine: a page, a replica or an agent's report may take a while.
WAIT_MS = 15_000
PASSWORD = "a long password for tests"

_running: list[Cluster] = []  # the clusters of the module running now


@contextlib.contextmanager
def running(cluster: Cluster) -> Iterator[Cluster]:
    """The cluster's server started, for a module's tests; stopped after them. The
    processes' logs are printed with each test that fails while it runs, and when the
    module's setup fails."""
    cluster.root.mkdir(parents=True, exist_ok=True)
    try:
        # On a thread of its own: start_server uses asyncio.run, which sync Playwright's
        # loop refuses on this one.
        with ThreadPoolExecutor(1) as pool:
            pool.submit(cluster.start_server).result()
    except BaseException:
        print(cluster.logs())
        cluster.stop()
        raise
    _running.append(cluster)
    try:
        yield cluster
    except BaseException:  # the rest of the module's setup failed (an agent, a model)
        print(cluster.logs())
        raise
    finally:
        _running.remove(cluster)
        cluster.stop()


def print_running_logs() -> None:
    for cluster in _running:
        print(cluster.logs())


def add_admin(cluster: Cluster, username: str = "ops", role: str = "admin") -> str:
    """An account made through the admin API; its username."""
    made = cluster.admin("POST", "/api/users",
                         json={"username": username, "password": PASSWORD, "role": role})
    assert made.status_code == 201, made.text
    return username


def send(page: Page, button: Locator) -> None:
    """Press a form's button and wait for the page that answers: the document sent from is
    marked first, so that an answer saying the same again is not mistaken for it."""
    page.evaluate("document.documentElement.dataset.sentFrom = 'yes'")
    button.click()
    expect(page.locator("html[data-sent-from]")).to_have_count(0)


def log_in(page: Page, username: str, password: str = PASSWORD) -> None:
    """Fill the login form the page is on, send it and wait for the answer."""
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(password)
    send(page, page.get_by_role("button", name="Log in"))


def signed_in_state(browser: Browser, cluster: Cluster, username: str) -> dict:
    """The cookies of a session opened through the login form, for ``browse`` to start
    with: one login per module, not one per test."""
    context = browser.new_context(base_url=cluster.base_url)
    context.set_default_timeout(WAIT_MS)
    try:
        page = context.new_page()
        page.goto("/ui/login")
        log_in(page, username)
        expect(page.get_by_role("heading", name="Overview", exact=True)).to_be_visible()
        return context.storage_state()
    finally:
        context.close()
