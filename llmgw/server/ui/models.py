"""The models pages: every model with its replicas ready and wanted and where they run,
and its static endpoints answering; one model's replicas and shards, its endpoints and
their health, why a replica is not placed (placement's reason per node
turned down), and a shard's output. Admins add, scale and remove models here with the
same functions, checks and words as ``/api/models`` (``server.admin.models``). A user
sees what ``GET /api/models`` tells them: names, descriptions, replicas ready and wanted.

A model's name may hold "/", so its page is ``/ui/models/{name:path}`` and nothing may
follow the name: the forms that change a model post to that same address with an
``action``, and a shard's output is asked with ``?log=REPLICA&rank=N``.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import quote

import msgspec
import yaml
from litestar import Request, get, post
from litestar.response import Template

from llmgw.core import engine_names
from llmgw.server.admin.logs import shard_log_tail
from llmgw.server.admin.models import (
    ModelParts,
    ModelView,
    add_to_catalog,
    checked_model,
    model_views,
    remove_from_catalog,
    set_replicas,
)
from llmgw.server.admin.nodes import known_sessions
from llmgw.server.admin.status import ReplicaView, model_status, replica_views
from llmgw.server.catalog import CONFIG
from llmgw.server.errors import ApiError
from llmgw.server.ui.page import PREFIX, GoTo, Page, open_page, posted

MODELS = f"{PREFIX}/models"
# What the page asks a node for, and shows of it: a tail, not the whole file.
LOG_TAIL_BYTES = 32 * 1024
LOG_LINES = 100
# Bounds that keep a page well under 100 KB, however big the catalog or the model.
SHOWN_MODELS = 50
SHOWN_SHARD_ROWS = 120
SHOWN_REFUSALS = 100
# The add form's fields, in its order; the engine preselected.
ADD_FIELDS = ("name", "description", "engine", "weights", "source", "files", "replicas",
              "gpus")
DEFAULT_ENGINE = "llama.cpp"
# "profiles[0].gpus…", "name", "replicas": the form field a refusal's key path names.
_FIELD_OF_PARAM = re.compile(r"^(?:profiles\[0\]\.)?(\w+)")


def _parts(request: Request) -> ModelParts:
    return ModelParts.of(request.app.state)


def model_path(name: str) -> str:
    return f"{MODELS}/{quote(name)}"


# --- the list --------------------------------------------------------------------------------


async def _list_page(request: Request, page: Page, status_code: int = 200,
                     values: dict[str, str] | None = None, problem: str = "",
                     problem_field: str = "") -> Template:
    state = request.app.state
    # A user is told what GET /api/models tells them: no nodes, no placement.
    models = await model_views(state.store, state.config, state.controller, page.is_admin)
    return page.render(
        "models.html", status_code=status_code, title="Models", models=models[:SHOWN_MODELS],
        more_models=max(0, len(models) - SHOWN_MODELS),
        admin=page.is_admin, engines=engine_names.ALL,
        values={"engine": DEFAULT_ENGINE, "replicas": "1", **(values or {})},
        problem=problem, problem_field=problem_field)


@get(MODELS, include_in_schema=False)
async def models_page(request: Request) -> Template:
    return await _list_page(request, await open_page(request))


def _number(text: str) -> int | str:
    """A whole number as typed, or the text itself, for server.yaml's rules to name."""
    try:
        return int(text)
    except ValueError:
        return text


def written_model(fields: dict[str, str]) -> dict[str, Any]:
    """The add form as a server.yaml ``models:`` entry: what ``POST /api/models`` takes."""
    value = {k: fields.get(k, "").strip() for k in ADD_FIELDS}
    profile: dict[str, Any] = {"engine": value["engine"]}
    for key in ("weights", "source"):
        if value[key]:
            profile[key] = value[key]
    files = [f.strip() for f in value["files"].split(",") if f.strip()]
    if files:
        profile["files"] = files
    if value["gpus"]:
        profile["gpus"] = _number(value["gpus"])
    written: dict[str, Any] = {"name": value["name"]}
    if value["description"]:
        written["description"] = value["description"]
    written["replicas"] = _number(value["replicas"] or "1")
    written["profiles"] = [profile]
    return written


def _field_of(param: str | None) -> str:
    found = _FIELD_OF_PARAM.match(param or "")
    return found.group(1) if found and found.group(1) in ADD_FIELDS else ""


@post(MODELS, include_in_schema=False, status_code=303)
async def add_post(request: Request) -> Template:
    page, fields = await posted(request, admin=True)
    kept = {k: fields.get(k, "") for k in ADD_FIELDS}
    try:
        view = await add_to_catalog(_parts(request), checked_model(written_model(fields)))
    except ApiError as err:
        # The form again, as it was filled in, with the API's words: nothing was stored.
        return await _list_page(request, page, err.status, kept, err.message,
                                _field_of(err.param))
    raise GoTo(model_path(view.name), f"model {view.name!r} added; {view.replicas} "
               f"replica{'s' if view.replicas != 1 else ''} wanted")


# --- one model -------------------------------------------------------------------------------


class LogTail(msgspec.Struct):
    """A shard's output as the page shows it: its last lines, or why there are none."""

    replica: str
    rank: int
    lines: list[str] = []
    cut: int = 0  # earlier lines of the tail not shown
    problem: str = ""
    status: int = 200


async def _log_tail(request: Request, replica_ids: set[str]) -> LogTail | None:
    """The shard output ``?log=REPLICA&rank=N`` asks for (an admin's page only)."""
    replica = request.query_params.get("log")
    if not replica:
        return None
    raw_rank = request.query_params.get("rank", "0")
    rank = int(raw_rank) if raw_rank.isdigit() else -1
    tail = LogTail(replica, rank)
    if rank < 0:
        tail.problem, tail.status = f"rank must be a whole number, 0 or more, not {raw_rank!r}", 400
    elif replica not in replica_ids:
        tail.problem, tail.status = (f"{replica} is not a replica of this model now; its "
                                     "replicas are listed above"), 404
    else:
        try:
            text = await shard_log_tail(request.app.state.controller, replica, rank,
                                        LOG_TAIL_BYTES)
        except ApiError as err:
            tail.problem, tail.status = err.message, err.status
        else:
            lines = text.splitlines()
            tail.lines = lines[-LOG_LINES:]
            tail.cut = len(lines) - len(tail.lines)
    return tail


def _first_rows(replicas: list[ReplicaView]) -> list[ReplicaView]:
    """The first replicas whose shards fill at most ``SHOWN_SHARD_ROWS`` rows (one row
    each at least)."""
    shown, rows = [], 0
    for replica in replicas:
        rows += max(1, len(replica.shards))
        if rows > SHOWN_SHARD_ROWS:
            break
        shown.append(replica)
    return shown


def _spec_yaml(view: ModelView) -> str:
    spec = view.spec if isinstance(view.spec, dict) else {}
    return yaml.safe_dump(spec, sort_keys=False, allow_unicode=True, width=88)


@get(f"{MODELS}/{{name:path}}", include_in_schema=False)
async def model_page(request: Request, name: str) -> Template:
    page = await open_page(request)
    name = name.lstrip("/")
    if not name:
        raise GoTo(MODELS)
    state = request.app.state
    # A user is told what GET /api/models tells them; replicas and placement are admins'.
    views = await model_views(state.store, state.config, state.controller, page.is_admin)
    view = next((v for v in views if v.name == name), None)
    if view is None:
        raise ApiError(404, f"no model {name!r}: the Models page lists them "
                       f"({MODELS})", code="model_not_found")
    declared = state.controller.catalog.get(name)
    context = {"title": f"Model {name}", "model": view, "admin": page.is_admin,
               "from_config": view.source == CONFIG, "here": model_path(name),
               # Served by its static endpoints alone: no replica to show or scale.
               "endpoint_only": declared is not None and not declared.profiles}
    if not page.is_admin:
        if request.query_params.get("log"):
            raise ApiError(403, "the engines' output is for admins, as on the API; ask one "
                           "to show it to you", code="admin_required")
        return page.render("model.html", **context)
    # This model's part of /api/status only: not a view of every node.
    controller = state.controller
    replicas = replica_views(controller, state.router, name)
    status_model = (model_status(declared, controller,
                                 await known_sessions(controller, state.store))
                    if declared is not None else None)
    shown = _first_rows(replicas)
    log = await _log_tail(request, {r.id for r in replicas})
    refusals = state.controller.refusals_of(name)
    return page.render(
        "model.html", status_code=log.status if log is not None else 200, **context,
        status_model=status_model,
        replicas=shown, more_replicas=len(replicas) - len(shown),
        refusals=refusals[:SHOWN_REFUSALS], more_refusals=max(0, len(refusals) - SHOWN_REFUSALS),
        spec=_spec_yaml(view), log=log, log_lines=LOG_LINES)


def _replicas(text: str) -> int:
    count = _number(text.strip())
    if not isinstance(count, int) or count < 0:
        raise ApiError(400, f"replicas must be a whole number, 0 or more, not {text!r}",
                       param="replicas", code="invalid_value")
    return count


def _plural(count: int) -> str:
    return f"{count} replica{'s' if count != 1 else ''}"


@post(f"{MODELS}/{{name:path}}", include_in_schema=False, status_code=303)
async def change_post(request: Request, name: str) -> None:
    """``action``: ``scale`` (``replicas``), ``reset`` (back to server.yaml's replicas) or
    ``remove`` (with ``confirm=yes``); back to the list or the model's page after."""
    _, fields = await posted(request, admin=True)
    name = name.lstrip("/")
    action = fields.get("action", "")
    back = MODELS if fields.get("back") == "list" else model_path(name)
    if action == "scale":
        view = await set_replicas(_parts(request), name, _replicas(fields.get("replicas", "")))
        raise GoTo(back, f"{name}: scaled to {_plural(view.replicas)}")
    if action == "reset":
        view = await set_replicas(_parts(request), name, None)
        raise GoTo(back, f"{name}: back to server.yaml's {_plural(view.replicas)}")
    if action == "remove":
        if fields.get("confirm") != "yes":
            raise ApiError(400, f"tick “remove {name}” to confirm, then press Remove again",
                           param="confirm", code="not_confirmed")
        await remove_from_catalog(_parts(request), name)
        raise GoTo(MODELS, f"model {name!r} removed; its replicas stop")
    raise ApiError(400, f"this form asks for {action!r}, which the models page does not "
                   "do: reload the page and use its buttons", param="action",
                   code="invalid_value")


ROUTES = [models_page, add_post, model_page, change_post]
