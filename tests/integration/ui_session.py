"""The cluster page as a browser without JavaScript uses it (httpx, cookies kept): a form's
CSRF token, and a session logged in through the login form."""

from __future__ import annotations

import re

import httpx

from tests.integration.cluster import Cluster


def csrf_of(page: str) -> str:
    """The CSRF token a page's forms carry."""
    return re.search(r'name="csrf" value="([^"]+)"', page).group(1)


def logged_in(cluster: Cluster, username: str, password: str, timeout_s: float = 30
              ) -> httpx.Client:
    """A client holding ``username``'s session, logged in through ``/ui/login``."""
    browser = httpx.Client(base_url=cluster.base_url, timeout=timeout_s)
    form = browser.get("/ui/login")
    done = browser.post("/ui/login", data={"csrf": csrf_of(form.text), "username": username,
                                           "password": password})
    assert done.status_code == 303, done.text
    return browser
