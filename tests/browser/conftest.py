"""The cluster page in a real browser: Debian's Chromium (/usr/bin/chromium, which .ci/run
installs) driven by Playwright's sync API, against real servers and agents on loopback
(tests/browser/browsing.py says how, and why the tests are plain functions).

One Chromium for the whole folder, one cluster per module, a fresh browser context (its
own cookies) per page a test opens. ``shot(page, name)`` saves a full-page screenshot at
desktop and phone widths into one folder per run, which the end of the run prints, so a
person can look at every page; the tests assert on what a person reads, never on pixels.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from playwright.sync_api import Browser, BrowserContext, Page, Playwright, expect, sync_playwright

from tests.browser.browsing import (
    CHROMIUM,
    CHROMIUM_ARGS,
    DESKTOP,
    PHONE,
    WAIT_MS,
    print_running_logs,
)
from tests.integration.cluster import Cluster, cannot
from tests.integration.conftest import pytest_runtest_makereport  # noqa: F401 - rep_call

_shots: dict[str, Path] = {}  # "dir": where this run's screenshots went, once one was taken


@pytest.fixture(autouse=True)
def _logs_when_failed(request: pytest.FixtureRequest) -> Iterator[None]:
    """The running cluster's logs, printed with a test that failed."""
    yield
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print_running_logs()


@pytest.fixture(scope="package")
def playwright() -> Iterator[Playwright]:
    if not CHROMIUM.exists():
        cannot(f"Debian's Chromium is not at {CHROMIUM}: apt-get install chromium")
    with sync_playwright() as driver:
        yield driver


@pytest.fixture(scope="package")
def browser(playwright: Playwright) -> Iterator[Browser]:
    chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
    expect.set_options(timeout=WAIT_MS)
    yield chromium
    chromium.close()


@pytest.fixture
def browse(browser: Browser) -> Iterator[Callable[..., Page]]:
    """``browse(cluster)``: a page at desktop size in a new context (no cookies) whose
    relative URLs go to that cluster; ``browse(cluster, storage_state=...)`` starts signed
    in. Closed after the test."""
    contexts: list[BrowserContext] = []

    def open_page(cluster: Cluster, **options) -> Page:
        context = browser.new_context(base_url=cluster.base_url, viewport=DESKTOP, **options)
        context.set_default_timeout(WAIT_MS)
        contexts.append(context)
        return context.new_page()

    yield open_page
    for context in contexts:
        context.close()


@pytest.fixture(scope="session")
def screenshot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = os.environ.get("LLMGW_SCREENSHOTS")
    folder = Path(where) if where else tmp_path_factory.getbasetemp() / "screenshots"
    folder.mkdir(parents=True, exist_ok=True)
    _shots["dir"] = folder
    return folder


@pytest.fixture(scope="package")
def phone_page(browser: Browser) -> Iterator[Page]:
    """A phone-sized, touch, mobile page that the phone screenshots are drawn in."""
    context = browser.new_context(viewport=PHONE, is_mobile=True, has_touch=True)
    context.set_default_timeout(WAIT_MS)
    yield context.new_page()
    context.close()


@pytest.fixture
def shot(request: pytest.FixtureRequest, screenshot_dir: Path,
         phone_page: Page) -> Callable[[Page, str], None]:
    """``shot(page, name)``: the page as it is now, full length, at desktop and at phone
    width: ``<module>--<name>--desktop.png`` and ``--phone.png``.

    The phone picture is of the same document (its HTML drawn again in a phone-sized
    page of the same origin), not of a new request: a flash, a secret shown once or a
    form's refusal is in both."""
    module = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")

    def take(page: Page, name: str) -> None:
        stem = screenshot_dir / f"{module}--{re.sub(r'[^a-z0-9]+', '-', name.lower())}"
        page.screenshot(path=f"{stem}--desktop.png", full_page=True)
        origin = "{0.scheme}://{0.netloc}".format(urlsplit(page.url))
        if not phone_page.url.startswith(origin + "/"):
            # Any page of the origin would do; the stylesheet asks nothing of a session.
            phone_page.goto(f"{origin}/ui/static/llmgw.css")
        phone_page.set_content(page.content())
        phone_page.screenshot(path=f"{stem}--phone.png", full_page=True)

    return take


def pytest_terminal_summary(terminalreporter) -> None:
    if "dir" in _shots:
        terminalreporter.write_line(f"screenshots: {_shots['dir']}")
