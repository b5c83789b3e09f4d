"""The control plane's mirror, served to its nodes: the files of the bundle imported last
(``llmgw bundle import``; bundle/mirror.py keeps it) and a Hugging Face-shaped hub of the
bundle's models, which is what the agent's weights fetcher reads.

    GET /mirror/files/<path>                                  a file the manifest lists
    GET /mirror/hub/api/models/<org>/<name>/tree/<revision>   a model's files, recursively
    GET /mirror/hub/<org>/<name>/resolve/<revision>/<path>    one of them

Every path is checked as plain elements (bundle.manifest.check_path) before anything is
built from it, and only files the current manifest lists are served, streamed with their
length: no listings of folders, nothing beside the bundle's files. A model's revision is
the commit the bundle pinned it to, or ``main``, which names that commit too while the
bundle holds one revision of the repository. Every file of a listing carries its sha256
(an ``lfs`` block), so the node checks each file it fetches against the signed manifest;
an engine's files are pinned in the EngineWanted the controller sends (core.
desired_engines), never read from the mirror.

Who may read: the peers that may open the agent stream. With ``tls``, the agents' mTLS
listener serves it to a node whose certificate it admits (``mtls.admit``: the CA, the
dates, the store, revocations); without, the main listener serves it as the plain agent
stream is served (``stream.plain_refusal``: loopback, or ``listen.allow_plain_http``).
``answer`` is the one logic; ``mirror_route`` (Litestar) and ``aiohttp_response`` adapt it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from litestar import Request, Response, get
from litestar.di import NamedDependency
from litestar.params import Parameter
from litestar.response import File

from llmgw import wire
from llmgw.bundle import manifest as mf
from llmgw.bundle.manifest import BundleError, BundleFile, LlmgwRelease, Manifest
from llmgw.bundle.mirror import configured_dir, current_dir, current_manifest, file_path
from llmgw.config import ServerConfig
from llmgw.core.desired_engines import MirrorEngines
from llmgw.server.dependencies import from_states
from llmgw.server.errors import error_body, error_response, refusals

if TYPE_CHECKING:
    from aiohttp import web  # the mTLS listener's; a server without tls never loads it

log = logging.getLogger(__name__)

PREFIX = "/mirror/"
ROUTE = "/mirror/{path:path}"  # Litestar's
AIOHTTP_ROUTE = "/mirror/{path:.*}"
_DEFAULT_REVISION = "main"
_CHUNK = 2**20
_HUB = wire.MIRROR_HUB.removeprefix(PREFIX) + "/"  # "hub/"
_FILES = wire.MIRROR_FILES.removeprefix(PREFIX) + "/"  # "files/"
_NO_BUNDLE = ("this control plane serves no bundle: import one with `llmgw bundle import "
              "BUNDLE --config server.yaml` (docs/offline.md)")


# --- what the current bundle holds ---------------------------------------------------------


@dataclass(frozen=True)
class Held:
    """The current bundle, indexed for serving: its folder (which names it), its files by
    path, its models by repository and revision ({path in the repository: file}), and
    its engines as core.desired_engines takes them."""

    folder: Path
    files: dict[str, BundleFile]
    models: dict[str, dict[str, dict[str, BundleFile]]]
    engines: MirrorEngines
    llmgw: LlmgwRelease | None = None

    @classmethod
    def of(cls, folder: Path, manifest: Manifest) -> Held:
        files = {f.path: f for f in manifest.files}
        # The layout of bundle.manifest's engine_path and model_path.
        engines: dict[str, dict[str, dict[str, str]]] = {}
        for engine in manifest.engines:
            prefix = f"engines/{engine.name}/{engine.version}/"
            pins = engines.setdefault(engine.name, {}).setdefault(engine.version, {})
            pins.update({p.removeprefix(prefix): files[p].sha256 for p in engine.files
                         if p.startswith(prefix)})
        models: dict[str, dict[str, dict[str, BundleFile]]] = {}
        for model in manifest.models:
            prefix = f"models/{model.repo}/{model.revision}/"
            held = models.setdefault(model.repo, {}).setdefault(model.revision, {})
            held.update({p.removeprefix(prefix): files[p] for p in model.files
                         if p.startswith(prefix)})
        return cls(folder, files, models, engines, manifest.llmgw)

    def upgrade_wheels(self) -> list[wire.UpgradeWheel]:
        """llmgw's wheels, as UpgradeAgent sends them (none when it holds a Nix closure)."""
        release = self.llmgw
        if release is None or release.kind != "wheels":
            return []
        return [wire.UpgradeWheel(url=f"{wire.MIRROR_SCHEME}{wire.MIRROR_FILES}/{path}",
                                  sha256=self.files[path].sha256, size=self.files[path].size)
                for path in release.files if path.endswith(".whl")]


class ServedMirror:
    """One mirror directory as the server serves it. The manifest is read again only when
    an import has swapped ``current``; reads from worker threads see one whole index."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._held: Held | None = None
        self._warned = ""

    def held(self) -> Held | None:
        """The current bundle, or None before the first import; BundleError when the
        mirror cannot be read."""
        folder = current_dir(self.directory)
        if folder is None:
            return None
        held = self._held
        if held is None or held.folder != folder:
            manifest = current_manifest(self.directory)
            if manifest is None:
                return None
            # Named by the folder it was asked for: an import racing this read is seen at
            # the next one.
            held = self._held = Held.of(folder, manifest)
        return held

    def held_or_none(self) -> Held | None:
        """held(), or None (logged once) when the mirror cannot be read."""
        try:
            held = self.held()
        except (BundleError, OSError) as err:
            # Said once per problem: this is asked at every node's registration.
            if str(err) != self._warned:
                self._warned = str(err)
                log.warning("the mirror in %s cannot be read, so nodes are not sent to it: "
                            "%s", self.directory, err)
            return None
        self._warned = ""
        return held

    def engines(self) -> MirrorEngines:
        """The current bundle's engines for core.desired_engines ({} when none)."""
        held = self.held_or_none()
        return held.engines if held is not None else {}


_SERVED: dict[Path, ServedMirror] = {}


def served_mirror(config: ServerConfig) -> ServedMirror:
    """The server's mirror (one per directory, so its index is shared by every caller)."""
    directory = configured_dir(config)
    return _SERVED.setdefault(directory, ServedMirror(directory))


def mirror_engines(config: ServerConfig) -> MirrorEngines:
    """What the server's mirror holds of each engine, for core.desired_engines."""
    return served_mirror(config).engines()


def welcome_mirror(config: ServerConfig) -> str:
    """Welcome.mirror: the hub's path when this control plane takes bundles (it trusts a
    key) or serves one, so that its nodes fetch weights from it, also after an import
    made while they are connected; "" when not."""
    if config.bundle.trusted_keys or served_mirror(config).held_or_none() is not None:
        return wire.MIRROR_HUB
    return ""


# --- answering a request -------------------------------------------------------------------


@dataclass(frozen=True)
class Refusal:
    status: int
    message: str


@dataclass(frozen=True)
class Listing:
    body: bytes  # a JSON list, as the hub's tree API answers


@dataclass(frozen=True)
class Found:
    path: Path
    size: int


Answer = Refusal | Listing | Found


def answer(mirror: ServedMirror, rest: str) -> Answer:
    """What to send for GET /mirror/<rest> (the path without its query). Blocking: it may
    read the manifest and stats the file, so callers run it in a thread."""
    try:
        mf.check_path(rest)
    except BundleError as err:
        return Refusal(400, f"not a path of the mirror: {err}")
    try:
        held = mirror.held()
    except (BundleError, OSError) as err:
        return Refusal(503, f"the mirror in {mirror.directory} cannot be read: {err}")
    if held is None:
        return Refusal(404, _NO_BUNDLE)
    bundle = held.folder.name
    if rest.startswith(_FILES):
        path = rest.removeprefix(_FILES)
        entry = held.files.get(path)
        if entry is None:
            return Refusal(404, f"the mirror's bundle {bundle} has no file {path}")
        return _found(mirror, entry)
    parts = rest.removeprefix(_HUB).split("/") if rest.startswith(_HUB) else []
    if len(parts) == 6 and parts[:2] == ["api", "models"] and parts[4] == "tree":
        org, name, revision = parts[2], parts[3], parts[5]
        files = _model_files(held, f"{org}/{name}", revision)
        return files if isinstance(files, Refusal) else Listing(_tree(files))
    if len(parts) >= 5 and parts[2] == "resolve":
        repo, revision, path = f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:])
        files = _model_files(held, repo, revision)
        if isinstance(files, Refusal):
            return files
        if path not in files:
            return Refusal(404, f"the mirror's bundle {bundle} holds no {path} in {repo} at "
                                f"{revision}")
        return _found(mirror, files[path])
    return Refusal(404, f"there is no GET {PREFIX}{rest} here: the mirror serves "
                        f"{wire.MIRROR_FILES}/PATH and a Hugging Face-style hub at "
                        f"{wire.MIRROR_HUB}")


def _model_files(held: Held, repo: str, revision: str) -> dict[str, BundleFile] | Refusal:
    revisions = held.models.get(repo)
    if not revisions:
        return Refusal(404, f"the mirror's bundle {held.folder.name} holds no model {repo}: "
                            "make a bundle with it (llmgw bundle create --model), or set "
                            "weights.hub in the node's agent.yaml to a hub that has it")
    if revision in revisions:
        return revisions[revision]
    if revision == _DEFAULT_REVISION and len(revisions) == 1:
        return next(iter(revisions.values()))
    return Refusal(404, f"the mirror's bundle {held.folder.name} holds {repo} at "
                        f"{', '.join(sorted(revisions))}, not at {revision}: name one of "
                        "those in the profile's source (hf://ORG/NAME@REVISION)")


def _tree(files: dict[str, BundleFile]) -> bytes:
    """A recursive tree listing shaped as huggingface.co's: folders, and files with their
    size and the content's sha256 in an ``lfs`` block (what the fetcher checks)."""
    folders = {"/".join(p.split("/")[:i]) for p in files for i in range(1, p.count("/") + 1)}
    entries = [{"type": "directory", "path": f, "size": 0} for f in folders]
    entries += [{"type": "file", "path": p, "size": f.size,
                 "lfs": {"oid": f.sha256, "size": f.size}} for p, f in files.items()]
    return json.dumps(sorted(entries, key=lambda e: e["path"])).encode()


def _found(mirror: ServedMirror, entry: BundleFile) -> Answer:
    try:
        path = file_path(mirror.directory, entry.path)
        size = path.stat().st_size
    except (BundleError, OSError) as err:
        return Refusal(503, f"the mirror cannot read {entry.path}: "
                            f"{getattr(err, 'strerror', None) or err}; import the bundle "
                            "again")
    if size != entry.size:
        # Imported files are not written again; one that changed is not the manifest's.
        return Refusal(503, f"the mirror's {entry.path} is {size} bytes, the manifest says "
                            f"{entry.size}: import the bundle again")
    return Found(path, size)


# --- the two listeners ---------------------------------------------------------------------


def _rest(path: str) -> str:
    return path.removeprefix(PREFIX) if path.startswith(PREFIX) else ""


def _logged(peer: str, rest: str, result: Answer) -> Answer:
    # The path quoted: it may hold anything until answer() has checked it.
    if isinstance(result, Refusal):
        log.info("mirror: GET %r from %s: %d %s", PREFIX + rest, peer, result.status,
                 result.message)
    else:
        log.debug("mirror: GET %r from %s", PREFIX + rest, peer)
    return result


# bundle.manifest.check_path's rule, as the document states it; the handler checks it
# itself and names the element that breaks it.
_ELEMENT = r"[A-Za-z0-9_][A-Za-z0-9._+=@-]{0,254}"
PathParam = Parameter(
    description="files/PATH (a file the bundle's manifest lists), hub/api/models/ORG/NAME/"
                "tree/REVISION or hub/ORG/NAME/resolve/REVISION/PATH",
    schema_extra={"pattern": f"^{_ELEMENT}(/{_ELEMENT}){{0,{mf.MAX_DEPTH - 1}}}$",
                  "maxLength": mf.MAX_PATH})


@get(ROUTE, dependencies=from_states("config"), media_type="application/octet-stream",
     responses=refusals(400, 403, 404, 503))
async def mirror_route(request: Request, config: NamedDependency[ServerConfig],
                       path: Annotated[str, PathParam]) -> Response:
    """The control plane's mirror of its imported bundle, for its nodes (docs/offline.md):
    a file, or a model's listing (JSON) or file in a Hugging Face-shaped hub. Served on
    this listener to the peers that may open the plain agent stream (loopback, or any with
    `listen.allow_plain_http`); with `tls`, only on the agents' mTLS listener."""
    # Here, not at the top: the stream's module imports the controller, which uses this one.
    from llmgw.server.agents.stream import plain_refusal

    peer = request.client.host if request.client else "?"
    why_not = plain_refusal(config, peer)
    if why_not is not None:
        return error_response(403, f"the mirror is served to the peers that may open the "
                                   f"agent stream: {why_not}")
    # The path as routed (repeated slashes merged), every element checked by answer().
    rest = path.removeprefix("/")
    result = _logged(peer, rest, await asyncio.to_thread(answer, served_mirror(config), rest))
    if isinstance(result, Refusal):
        return error_response(result.status, result.message)
    if isinstance(result, Listing):
        return Response(result.body, media_type="application/json")
    return File(result.path, filename=result.path.name, content_disposition_type="attachment",
                media_type="application/octet-stream")


async def aiohttp_response(config: ServerConfig, request: web.Request, peer: str
                           ) -> web.StreamResponse:
    """The mirror on the agents' mTLS listener, for a peer it has admitted."""
    from aiohttp import web
    rest = _rest(request.path)
    result = _logged(peer, rest, await asyncio.to_thread(answer, served_mirror(config), rest))
    if isinstance(result, Refusal):
        return web.Response(status=result.status, body=error_body(result.status, result.message),
                            content_type="application/json")
    if isinstance(result, Listing):
        return web.Response(body=result.body, content_type="application/json")
    # Not web.FileResponse: it would send a "<file>.gz" beside the file instead, to a
    # client that takes gzip, and a bundle may hold both.
    response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    response.content_length = result.size
    source = await asyncio.to_thread(open, result.path, "rb")
    try:
        await response.prepare(request)
        left = result.size
        while left > 0:
            chunk = await asyncio.to_thread(source.read, min(_CHUNK, left))
            if not chunk:
                break  # shorter than it was: the client sees the body cut off
            left -= len(chunk)
            await response.write(chunk)
    finally:
        await asyncio.to_thread(source.close)
    await response.write_eof()
    return response
