"""The way in (``/``, login, logout) and the overview."""

from __future__ import annotations

import time

import msgspec
from litestar import Request, Response, get, post
from litestar.response import Redirect, Template

from llmgw.core.replicas import ReplicaState
from llmgw.server.admin.accounts import Credentials, check_login, session_cookie
from llmgw.server.admin.status import Status, cluster_status
from llmgw.server.auth.sessions import COOKIE, close_session
from llmgw.server.controller import Controller
from llmgw.server.errors import ApiError
from llmgw.server.ui.charts import Column, stacked_bars
from llmgw.server.ui.page import (
    PREFIX,
    GoTo,
    open_form_page,
    open_page,
    posted,
    posted_before_session,
    setup_needed,
    viewer_of,
)


@get("/", include_in_schema=False)
async def root() -> Redirect:
    return Redirect(f"{PREFIX}/", status_code=302)


def _next(raw: str) -> str:
    """Where to go after logging in: a page of this site only, never another host."""
    if raw.startswith(f"{PREFIX}/") and not raw.startswith("//") and "\\" not in raw:
        return raw
    return f"{PREFIX}/"


@get(f"{PREFIX}/login", include_in_schema=False)
async def login_page(request: Request) -> Template:
    if await setup_needed(request):
        raise GoTo(f"{PREFIX}/setup")
    if await viewer_of(request) is not None:
        raise GoTo(_next(request.query_params.get("next", "")))
    return open_form_page(request).render(
        "login.html", title="Log in", problem="", username="",
        next=_next(request.query_params.get("next", "")))


@post(f"{PREFIX}/login", include_in_schema=False, status_code=303)
async def login_post(request: Request) -> Response:
    fields = await posted_before_session(request)
    state = request.app.state
    creds = Credentials(username=fields.get("username", ""),
                        password=fields.get("password", "")[:1024])
    try:
        _, token, expires = await check_login(request, creds, state.store, state.hasher,
                                              state.throttle, state.config)
    except ApiError as err:
        # The throttle's words, or the one answer for a wrong name or password.
        page = open_form_page(request)
        response = page.render("login.html", status_code=err.status, title="Log in",
                               problem=err.message, username=creds.username,
                               next=_next(fields.get("next", "")))
        if err.headers:
            response.headers.update(err.headers)
        return response
    return session_cookie(Redirect(_next(fields.get("next", "")), status_code=303), request,
                          token, expires)


@post(f"{PREFIX}/logout", include_in_schema=False, status_code=303)
async def logout_post(request: Request) -> Response:
    page, _ = await posted(request)
    if page.viewer is not None and page.viewer.session_token:
        await close_session(request.app.state.store, page.viewer.session_token)
    response = Redirect(f"{PREFIX}/login", status_code=303)
    response.delete_cookie(COOKIE, path="/")
    return response


async def status_of(request: Request) -> Status:
    state = request.app.state
    return await cluster_status(state.controller, state.router, state.throttle, state.hasher,
                                state.store, state.leadership)


class Attention(msgspec.Struct):
    """Something an operator should look at, and the page where it is."""

    what: str
    href: str


def _cut(text: str, room: int = 300) -> str:
    return text if len(text) <= room else text[:room - 1] + "…"


def attention(status: Status, controller: Controller) -> list[Attention]:
    found = []
    for node in status.nodes:
        href = f"{PREFIX}/nodes/{node.id}"
        if node.state in ("lost", "unreachable"):
            found.append(Attention(f"node {node.id} is {node.state}", href))
        for engine in node.engines:
            if engine.state == "failed":
                found.append(Attention(f"{engine.name} failed to install on {node.id}: "
                                       f"{_cut(engine.detail)}", href))
        found.extend(Attention(f"{node.id}: {w}", href) for w in node.warnings)
    for replica in status.replicas:
        if replica.state == ReplicaState.FAILED:
            found.append(Attention(f"replica {replica.id} of {replica.model} failed: "
                                   f"{_cut(replica.reason)}",
                                   f"{PREFIX}/models/{replica.model}"))
    for model in status.models:
        if model.unplaced:
            # One reason per node turned down: its page has them all.
            found.append(Attention(f"{model.name} has no place: {_cut(model.unplaced)}",
                                   f"{PREFIX}/models/{model.name}"))
    for model in controller.catalog.models:
        if model.endpoints:
            found.extend(Attention(f"endpoint {e.url} of {model.name} is down: "
                                   f"{_cut(e.reason or 'no answer')}",
                                   f"{PREFIX}/models/{model.name}")
                         for e in controller.endpoints.states(model) if e.health == "down")
    return found


@get(f"{PREFIX}/", include_in_schema=False)
async def overview(request: Request) -> Template:
    page = await open_page(request)
    status = await status_of(request)
    if not page.is_admin:
        # What GET /api/models tells a user; nodes, replicas and traffic are admins'.
        status = Status(nodes=[], replicas=[], models=status.models, logins=status.logins)
    by_state: dict[str, list[str]] = {}
    for node in status.nodes:
        by_state.setdefault(node.state, []).append(node.id)
    minutes = request.app.state.usage.recent.series(time.time())
    columns = [Column("" if i % 10 else f"-{len(minutes) - i}m", (m.requests,),
                      title=f"{len(minutes) - i} min ago")
               for i, m in enumerate(minutes)]
    token_columns = [Column(c.label, (m.tokens,), c.title) for c, m in zip(columns, minutes,
                                                                          strict=True)]
    return page.render(
        "overview.html", title="Overview", status=status, by_state=by_state,
        requests_chart=stacked_bars(columns, ["requests"], "requests per minute, last hour"),
        tokens_chart=stacked_bars(token_columns, ["tokens"], "tokens per minute, last hour"),
        requests_hour=sum(m.requests for m in minutes),
        tokens_hour=sum(m.tokens for m in minutes),
        attention=attention(status, request.app.state.controller) if page.is_admin else [])


@get(f"{PREFIX}/{{rest:path}}", include_in_schema=False)
async def no_such_page(request: Request, rest: str) -> Template:
    await viewer_of(request)
    raise ApiError(404, f"there is no page {request.url.path} here")


ROUTES = [root, login_page, login_post, logout_post, overview, no_such_page]
