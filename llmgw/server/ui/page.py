"""What every page of the cluster page shares: who is looking, the CSRF token of their
forms, the one-line message a form leaves for the page it lands on, and the template.

A page is read with the session cookie the login form set (the same sessions as
``/api/auth/login``). A form that changes something is posted as a browser posts forms
(urlencoded), so the JSON rule that guards ``/api`` from other sites' forms cannot apply;
each such form carries a CSRF token instead, on top of the cookie's SameSite=Strict:

- signed in, the token is derived from the session token (an HMAC of it), which no other
  site can read (the cookie is HttpOnly), so it needs no storage and holds on every server
  of the cluster;
- before a session exists (the login and setup forms), a random token is set as a cookie
  of its own and must come back in the form (double submit).

A form without the right token is refused with 403 and changes nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

from litestar import MediaType, Request, Response
from litestar.response import Redirect, Template

from llmgw.server.auth.sessions import COOKIE, Principal, session_principal
from llmgw.server.errors import ApiError
from llmgw.store import Store

PREFIX = "/ui"
FORM_COOKIE = "llmgw_form"  # the double-submit token of the login and setup forms
FLASH_COOKIE = "llmgw_flash"  # what the last form did, shown once by the next page
CSRF_FIELD = "csrf"
_CSRF_LABEL = b"llmgw page form"
FLASH_MAX = 300  # characters: a message, not a store
SETUP_SETTING = "setup_done"  # set once the setup form is sent


class GoTo(Exception):
    """Leave this page for another (303): the login form, the setup form, or the page a
    form was posted from; ``flash`` is said there once."""

    def __init__(self, path: str, flash: str = "") -> None:
        super().__init__(path)
        self.path = path
        self.flash = flash


def go_to(_: Request, exc: GoTo) -> Response:
    response = Redirect(exc.path, status_code=303)
    if exc.flash:
        response.set_cookie(FLASH_COOKIE, quote(exc.flash[:FLASH_MAX]), max_age=60,
                            httponly=True, samesite="strict", path=PREFIX)
    return response


def session_csrf(session_token: str) -> str:
    return hmac.new(session_token.encode(), _CSRF_LABEL, hashlib.sha256).hexdigest()


def _same(given: str, expected: str) -> bool:
    return bool(given) and hmac.compare_digest(given.encode(), expected.encode())


@dataclass
class Page:
    """One page being served: its request, the viewer (None on the login and setup
    pages), its forms' CSRF token and the message left for it."""

    request: Request
    viewer: Principal | None
    csrf: str
    flash: str = ""
    # A new double-submit token to set with this page (login and setup forms).
    form_cookie: str = ""

    @property
    def is_admin(self) -> bool:
        return self.viewer is not None and self.viewer.is_admin

    def render(self, template: str, status_code: int = 200, **context: Any) -> Template:
        # Always HTML: a handler whose return type is not a Template (a form's POST that
        # may redirect or re-render) would otherwise send it as its default, JSON.
        page = Template(template_name=template, status_code=status_code,
                        media_type=MediaType.HTML, context={
            "viewer": self.viewer, "csrf": self.csrf, "csrf_field": CSRF_FIELD,
            "flash": self.flash, "path": self.request.url.path, **context})
        # No page is cached, and none may be framed by another site (clickjacking).
        page.headers.update({"cache-control": "no-store", "x-frame-options": "DENY",
                             "content-security-policy": CSP,
                             "referrer-policy": "same-origin"})
        if self.flash:
            page.delete_cookie(FLASH_COOKIE, path=PREFIX)
        if self.form_cookie:
            page.set_cookie(FORM_COOKIE, self.form_cookie, httponly=True, samesite="strict",
                            secure=self.request.url.scheme == "https", path=PREFIX)
        return page


# Scripts and styles only from this server; forms post only here; nothing framed.
CSP = ("default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
       "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")


def _flash(request: Request) -> str:
    return unquote(request.cookies.get(FLASH_COOKIE, ""))[:FLASH_MAX]


async def viewer_of(request: Request) -> Principal | None:
    """Who is looking; kept in the request's state for an error page to find."""
    token = request.cookies.get(COOKIE)
    viewer = await session_principal(request.app.state.store, token) if token else None
    request.state.viewer = viewer
    return viewer


async def setup_done(store: Store) -> bool:
    """Whether the setup form was sent, or an admin account exists some other way."""
    if await store.get_setting(SETUP_SETTING, False):
        return True
    return any(a.role == "admin" for a in await store.list_accounts())


async def setup_needed(request: Request) -> bool:
    """True until the setup form (or an admin account made some other way) is done;
    once False it is remembered, so pages ask the store no more."""
    state = request.app.state
    if state.get("setup_done"):
        return False
    done = await setup_done(state.store)
    if done:
        state.setup_done = True
    return not done


async def open_page(request: Request, *, admin: bool = False) -> Page:
    """The page for a signed-in viewer; otherwise off to setup (on a fresh install) or
    to the login form, coming back here after."""
    if await setup_needed(request):
        raise GoTo(f"{PREFIX}/setup")
    viewer = await viewer_of(request)
    if viewer is None:
        here = request.url.path if request.url.path != PREFIX else f"{PREFIX}/"
        raise GoTo(f"{PREFIX}/login?next={quote(here)}")
    if admin and not viewer.is_admin:
        raise ApiError(403, "this page is for admins; ask one to give you the admin role",
                       code="admin_required")
    return Page(request, viewer, session_csrf(viewer.session_token or ""),
                flash=_flash(request))


def open_form_page(request: Request) -> Page:
    """A page whose form is posted before any session (login, setup): it carries a fresh
    double-submit token, or the browser's current one."""
    token = request.cookies.get(FORM_COOKIE) or secrets.token_urlsafe(32)
    return Page(request, None, token, flash=_flash(request),
                form_cookie=token if token != request.cookies.get(FORM_COOKIE) else "")


async def form_of(request: Request) -> dict[str, str]:
    """The posted form's fields (the last of a repeated name)."""
    form = await request.form()
    return {k: v for k, v in form.items() if isinstance(v, str)}


def _refuse_csrf() -> ApiError:
    return ApiError(403, "this form was not sent from this cluster's page (its CSRF token "
                    "is missing or wrong); reload the page and send it again",
                    code="csrf_failed")


async def posted(request: Request, *, admin: bool = False) -> tuple[Page, dict[str, str]]:
    """A signed-in viewer's form, its CSRF token checked; the page it came from and its
    fields."""
    viewer = await viewer_of(request)
    fields = await form_of(request)
    if viewer is None:
        raise GoTo(f"{PREFIX}/login", "your session has ended; log in again")
    if not _same(fields.get(CSRF_FIELD, ""), session_csrf(viewer.session_token or "")):
        raise _refuse_csrf()
    if admin and not viewer.is_admin:
        raise ApiError(403, "this needs an admin", code="admin_required")
    return Page(request, viewer, session_csrf(viewer.session_token or "")), fields


async def posted_before_session(request: Request) -> dict[str, str]:
    """A login or setup form's fields, its double-submit token checked."""
    fields = await form_of(request)
    if not _same(fields.get(CSRF_FIELD, ""), request.cookies.get(FORM_COOKIE, "")):
        raise _refuse_csrf()
    return fields
