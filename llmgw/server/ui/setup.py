"""The setup form: a fresh install's first admin account, its store and a first model.

It shows while the store holds no admin account and setup was never finished; after
that, never again. Until then every page leads here, and the form takes effect only with
the server's admin token (the file the server made in its state directory, which
`llmgw up` also prints): whoever reaches the port first cannot claim the cluster.

Choosing PostgreSQL checks the URL first (a login, and no llmgw store already there),
and server.yaml must be editable; then the account and model are made, the store is
copied there, server.yaml is pointed at it (its old copy kept beside it) and the server
starts again in the same process, on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from litestar import Request, get, post
from litestar.response import Template

from llmgw.bundle.manifest import BundleError, Manifest
from llmgw.bundle.mirror import configured_dir, import_bundle
from llmgw.bundle.settings import offline_settings
from llmgw.core.names import NameRuleError, check_username
from llmgw.server.admin.accounts import session_cookie
from llmgw.server.admin.common import client_address
from llmgw.server.auth.admin_token import admin_token_ok
from llmgw.server.auth.sessions import open_session
from llmgw.server.catalog import API, ModelError, catalog_of, entries, parse_model, stored_spec
from llmgw.server.ui.page import (
    PREFIX,
    SETUP_SETTING,
    GoTo,
    go_to,
    open_form_page,
    posted_before_session,
    setup_needed,
)
from llmgw.store import AccountRecord, Store, StoreError, ops
from llmgw.store.config_edit import check_editable, point_config_at
from llmgw.store.urls import asyncpg_url, mask, parse, store_url

log = logging.getLogger(__name__)

MIN_PASSWORD = 10
# The first model the form offers: small enough for any CPU, fetched by the node from
# its hub (Hugging Face, or the control plane's mirror of an imported bundle).
FIRST_MODEL = {
    "name": "smollm2-135m",
    "description": "SmolLM2-135M-Instruct on llama.cpp, on the CPU",
    "source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct-GGUF",
    "files": "*q8_0.gguf",
}


def _token_place(request: Request) -> str:
    config = request.app.state.config
    return config.auth.admin_token_file or f"{config.state_dir}/secrets/admin-token"


async def _form(request: Request, values: dict[str, str], problems: dict[str, str],
                status: int = 200, problem: str = "") -> Template:
    state = request.app.state
    config = state.config
    models = [e.model.name for e in await entries(state.store, config)]
    page = open_form_page(request)
    defaults = {"store": "sqlite", "model": "skip" if models else "add",
                **{f"model_{k}": v for k, v in FIRST_MODEL.items()}}
    return page.render(
        "setup.html", status_code=status, title="Set up llmgw",
        values={**defaults, **values}, problems=problems, problem=problem,
        token_place=_token_place(request), models=models,
        store_now=mask(store_url(config)), store_named=bool(config.store.url),
        config_path=str(state.get("config_path") or ""))


@get(f"{PREFIX}/setup", include_in_schema=False)
async def setup_page(request: Request) -> Template:
    if not await setup_needed(request):
        raise GoTo(f"{PREFIX}/", "setup is done; it is not shown again")
    return await _form(request, {}, {})


def _model_spec(fields: dict[str, str], problems: dict[str, str]) -> dict[str, Any] | None:
    if fields.get("model") == "bundle" and not fields.get("bundle", "").strip():
        problems["bundle"] = ("to declare the bundle's models, give the bundle's path; or "
                              "choose another first model")
    if fields.get("model") != "add":
        return None
    files = [f.strip() for f in fields.get("model_files", "").split(",") if f.strip()]
    written: dict[str, Any] = {
        "name": fields.get("model_name", "").strip(),
        "description": fields.get("model_description", "").strip(),
        "profiles": [{"engine": "llama.cpp", "source": fields.get("model_source", "").strip(),
                      **({"files": files} if files else {})}],
    }
    try:
        parse_model(written)
    except ModelError as err:
        problems["model_name" if err.param == "name" else "model_source"] = str(err)
        return None
    return written


async def _import_bundle(request: Request, fields: dict[str, str],
                         problems: dict[str, str]) -> Manifest | None:
    """The bundle named in the form, checked and imported into the mirror (every file
    against its signed manifest, before anything enters it); None when none is named."""
    path = fields.get("bundle", "").strip()
    if not path:
        return None
    key = fields.get("bundle_key", "").strip()
    if not key:
        problems["bundle_key"] = ("give the public key of whoever made the bundle "
                                  "(llmgw-bundle-ed25519:…, as `llmgw bundle keygen` printed "
                                  "it); the bundle's signature is checked against it")
        return None
    mirror = configured_dir(request.app.state.config)
    sha256 = fields.get("bundle_sha256", "").strip() or None
    try:
        imported = await asyncio.to_thread(import_bundle, Path(path), mirror, [key],
                                           sha256=sha256)
    except BundleError as err:
        problems["bundle"] = f"the bundle {path} was not imported: {err}"
        return None
    return imported.manifest


async def _check_store(request: Request, fields: dict[str, str],
                       problems: dict[str, str]) -> str | None:
    """The PostgreSQL URL to move to, checked; None to stay on SQLite."""
    if fields.get("store") != "postgresql":
        return None
    state = request.app.state
    url = asyncpg_url(fields.get("store_url", "").strip())
    if state.config.store.url:
        problems["store_url"] = ("server.yaml names the store already "
                                 f"({mask(state.config.store.url)}); change it there")
        return None
    config_path = state.get("config_path")
    try:
        parse(url, "postgresql")
        if config_path is None:
            raise StoreError("this server was not started from a server.yaml it can edit; "
                             "set store.url there and restart it")
        check_editable(Path(config_path), password=parse(url).password is not None)
        await ops.check_move(store_url(state.config), url)
    except StoreError as err:
        problems["store_url"] = str(err)
        return None
    return url


@post(f"{PREFIX}/setup", include_in_schema=False, status_code=303)
async def setup_post(request: Request) -> Any:
    fields = await posted_before_session(request)
    if not await setup_needed(request):
        raise GoTo(f"{PREFIX}/", "setup is done; it is not shown again")
    state = request.app.state
    kept = {k: v for k, v in fields.items() if k not in ("admin_token", "password",
                                                          "password_again", "csrf")}
    verdict = state.throttle.attempt(client_address(request), time.monotonic())
    if not verdict.allowed:
        return await _form(request, kept, {}, 429, verdict.reason)
    problems: dict[str, str] = {}
    if not admin_token_ok(state.admin_token, fields.get("admin_token", "").strip()):
        problems["admin_token"] = ("that is not this server's admin token; it is in "
                                   f"{_token_place(request)}")
    try:
        username = check_username(fields.get("username", "").strip().lower())
    except NameRuleError as err:
        problems["username"] = str(err)
    password = fields.get("password", "")
    if len(password) < MIN_PASSWORD:
        problems["password"] = f"choose a password of at least {MIN_PASSWORD} characters"
    elif password != fields.get("password_again", ""):
        problems["password_again"] = "the two passwords differ; type the same one twice"
    model = _model_spec(fields, problems)
    if problems:  # the store is checked last: it may take a few seconds
        return await _form(request, kept, problems, 400)
    move_to = await _check_store(request, fields, problems)
    if problems:
        return await _form(request, kept, problems, 400)
    manifest = await _import_bundle(request, fields, problems)
    if problems:
        return await _form(request, kept, problems, 400)
    store: Store = state.store
    account = await store.add_account(AccountRecord(
        username=username, password_hash=await state.hasher.hash(password), role="admin",
        created_at=datetime.now(UTC)))
    said = [f"admin account {username!r} made"]
    if manifest is not None:
        said.append(f"bundle of {manifest.created_at:%Y-%m-%d} imported into the mirror")
    models = [model] if model is not None else []
    if manifest is not None and fields.get("model") == "bundle":
        settings, notes = offline_settings(manifest, [])
        models = [{"name": m.name, "replicas": m.replicas, "profiles": [
            {k: v for k, v in (("engine", p.engine), ("source", p.source),
                               ("files", list(p.files))) if v} for p in m.profiles]}
            for m in settings["models"]]
        for note in notes:
            log.info("setup from the bundle: %s", note)
    declared = await _declare(request, models)
    if declared:
        said.append(f"model{'s' if len(declared) > 1 else ''} "
                    + ", ".join(repr(n) for n in declared) + " declared")
    await store.put_setting(SETUP_SETTING, True)
    state.setup_done = True
    log.info("setup done from the page: %s", "; ".join(said))
    token, expires = await open_session(store, account.id, state.config.auth.session_ttl_s)
    if move_to is not None:
        said.append(await _move(request, move_to))
    done = GoTo(f"{PREFIX}/", "Set up: " + "; ".join(said) + ".")
    return session_cookie(go_to(request, done), request, token, expires)


async def _declare(request: Request, models: list[dict[str, Any]]) -> list[str]:
    """Declare ``models`` as the API would (a name already taken is left as it is)."""
    state = request.app.state
    store: Store = state.store
    declared = []
    async with state.models_lock:
        for model in models:
            if await store.get_model(model["name"]) is None and not any(
                    m.name == model["name"] for m in state.config.models):
                await store.put_model(model["name"], stored_spec(API, model))
                declared.append(model["name"])
        if declared:
            await state.controller.set_catalog(catalog_of(await entries(store, state.config)))
    return declared


async def _move(request: Request, url: str) -> str:
    """Copy the store to PostgreSQL, point server.yaml at it and ask for a restart."""
    state = request.app.state
    counts = await ops.migrate_to_postgres(store_url(state.config), url)
    kept = await asyncio.to_thread(point_config_at, Path(state.config_path), url)
    log.info("setup: the store was copied to %s (%d rows); server.yaml points there (the "
             "old one is %s); starting again on it", mask(url), sum(counts.values()), kept)
    asyncio.get_running_loop().call_later(0.2, state.restart)
    return (f"the store moves to PostgreSQL ({mask(url)}): the server starts again on it "
            "now; reload in a few seconds")


ROUTES = [setup_page, setup_post]
