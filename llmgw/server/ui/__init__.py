"""The cluster page: server-rendered HTML under ``/ui`` (Jinja templates, one stylesheet,
no JavaScript needed), on the same sessions and admin functions as ``/api``.

Every page module lists its handlers in ``ROUTES``; ``router`` mounts them with the
page's own error handling (an HTML page, not the API's JSON envelope) and the static
files, which are served from the package, never a CDN.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape
from litestar import Request, Response, Router
from litestar.datastructures import CacheControlHeader
from litestar.exceptions import HTTPException
from litestar.plugins.jinja import JinjaTemplateEngine
from litestar.static_files import create_static_files_router
from litestar.template import TemplateConfig

from llmgw.server.errors import ApiError
from llmgw.server.ui import keys, models, nodes, pages, setup, usage
from llmgw.server.ui.page import PREFIX, GoTo, Page, go_to, session_csrf

STATIC = Path(__file__).with_name("static")


def template_config() -> TemplateConfig:
    env = Environment(loader=PackageLoader("llmgw.server.ui", "templates"),
                      autoescape=select_autoescape(default=True), undefined=StrictUndefined,
                      trim_blocks=True, lstrip_blocks=True)
    return TemplateConfig(instance=JinjaTemplateEngine.from_environment(env))


def _refused(request: Request, status: int, message: str) -> Response:
    # Exception handlers are not awaited: the viewer is the one the page found, if any.
    viewer = request.state.get("viewer")
    referer = urlsplit(request.headers.get("referer", ""))
    same_site = referer.netloc == request.url.netloc and referer.path.startswith(PREFIX)
    back = referer.path if same_site else f"{PREFIX}/"
    page = Page(request, viewer,
                session_csrf(viewer.session_token or "") if viewer is not None else "")
    return page.render("error.html", status_code=status, title=f"Refused ({status})",
                       message=message, back=back)


def api_error(request: Request, exc: ApiError) -> Response:
    return _refused(request, exc.status, exc.message)


def http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 404:
        return _refused(request, 404, f"there is no page {request.url.path} here")
    return _refused(request, exc.status_code, str(exc.detail))


ROUTES = [*pages.ROUTES, *setup.ROUTES, *nodes.ROUTES, *models.ROUTES, *keys.ROUTES,
          *usage.ROUTES]


def router() -> Router:
    """The pages, with the page's own answers to refusals, and the static files."""
    static = create_static_files_router(
        path=f"{PREFIX}/static", directories=[STATIC], include_in_schema=False,
        name="ui-static", cache_control=CacheControlHeader(max_age=3600))
    return Router(path="/", route_handlers=[*ROUTES, static],
                  exception_handlers={GoTo: go_to, ApiError: api_error,
                                      HTTPException: http_error})
