"""The agent's engine installer: converges this node on the engines the control plane
asks for (``wire.InstallEngines``), and says how far it got in the node's own words.

Each pass takes every engine asked for, works out its builds for this node
(core.builds, best first), and keeps the first that is already installed or that installs
and runs: an archive (llama.cpp) through ``archives``, a Python environment (vLLM,
SGLang) through ``pyenv``, a source archive beside its environment (ComfyUI) through
``comfyui``, with the OS packages the build needs through ``ospkg``. An
engine named in agent.yaml is the operator's on purpose: it is never replaced, and is
reported by the agent as ``configured``. Nothing found on PATH is ever reported. A file
asked for on the control plane's mirror (``wire.MIRROR_SCHEME``) is downloaded from the
server the agent dialled, with the node's TLS (``control_plane``), and checked against the
sha256 the request pins from the bundle's signed manifest.

What the control plane sees, per engine, in ``Inventory.engines``: ``installing`` ("installing:
downloading llama-b11434-bin-ubuntu-x64.tar.gz (16 MB)"), ``installed``, ``failed``
("failed: libgomp.so.1 is missing") or ``skipped`` (nothing to install here, and nothing
wrong: vLLM on a node without a GPU). Every change calls ``changed``, which makes the agent
send its inventory. A failed pass is retried after a minute, backing off to ten
(``core.backoff.INSTALL_RETRY``); installed archives are checked again every ten minutes
(an upgrade can remove a library).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import platform
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import msgspec
from opentelemetry.context import Context

from llmgw import wire
from llmgw.agent.client_errors import describe
from llmgw.agent.control_plane import ControlPlane, TlsFilesUnusable, is_mirrored
from llmgw.agent.discovery import gpus, host
from llmgw.agent.install import ospkg
from llmgw.agent.install.pypi import InstallError
from llmgw.config import AgentConfig
from llmgw.core import engine_names
from llmgw.core.backoff import INSTALL_RETRY, Retry, RetryPolicy, after_failure
from llmgw.core.builds import (
    ENVIRONMENT_PYTHON,
    Build,
    NodeFacts,
    Refusal,
    candidate_builds,
)
from llmgw.core.digests import parse_digests
from llmgw.tracing import OFF, Tracing, end

log = logging.getLogger(__name__)

RECHECK_S = 600.0
_DIGESTS_MAX_BYTES = 4 * 2**20
_CHECK_TIMEOUT_S = 60.0
_WANTED_FILE = "wanted.json"

SetBinary = Callable[[str, str | None], None]


def node_facts() -> NodeFacts:
    """This node, as core.builds reads it (NVML for the GPUs)."""
    report = gpus.discover_gpus()
    return NodeFacts(
        arch=platform.machine(), gpus=len(report.gpus), gpu_driver=report.driver,
        compute_capabilities=tuple(report.compute_capability[g.uuid] for g in report.gpus
                                   if g.uuid in report.compute_capability),
        gpu_names=tuple(g.name for g in report.gpus))


class EngineInstaller:
    """Owned by the agent: ``async with`` it to run passes in the background."""

    def __init__(self, config: AgentConfig, *, set_binary: SetBinary,
                 changed: Callable[[], None],
                 facts: Callable[[], NodeFacts] = node_facts,
                 retry_policy: RetryPolicy = INSTALL_RETRY,
                 python: str = ENVIRONMENT_PYTHON, tracing: Tracing = OFF):
        """``facts``, ``retry_policy`` and ``python`` (the Python environments are built
        with) are the node's own unless a test says otherwise."""
        self.root = Path(config.engines_dir or Path(config.state_dir) / "engines")
        self._configured = set(config.engines)
        self._disabled = set(config.disable_engines)
        self._os_packages = config.install_os_packages
        self._set_binary = set_binary
        self._changed = changed
        self._facts = facts
        self._wanted: list[wire.EngineWanted] | None = None
        self._reports: dict[str, wire.Engine] = {}
        self._snapshot: tuple[wire.Engine, ...] = ()
        # engine -> (installed directory, build): what shards of it run.
        self._installed: dict[str, tuple[Path, Build]] = {}
        self._wake = asyncio.Event()
        self._retry_policy = retry_policy
        self._retry = Retry()
        self._python = python
        self._task: asyncio.Task | None = None
        self._tracing = tracing
        # The control plane's trace of the last list it sent: installs continue it.
        self._asked_in: Context | None = None
        # The server of the agent's stream, whose mirror serves what is asked for at a
        # wire.MIRROR_SCHEME URL (set by the agent at each connection).
        self.control_plane: ControlPlane | None = None

    # --- what the agent asks -------------------------------------------------------------

    def installable(self) -> list[str]:
        return sorted(engine_names.INSTALLABLE)

    def reported(self) -> list[wire.Engine]:
        # Read from the agent's probe thread: a tuple replaced whole, never mutated.
        return list(self._snapshot)

    def want(self, msg: wire.InstallEngines) -> None:
        """The control plane's list; a pass starts at once."""
        self._wanted = list(msg.engines)
        self._asked_in = self._tracing.context_of(msg.trace)
        try:
            self._save_wanted()
        except OSError as err:
            log.warning("cannot keep the engine list in %s: %s", self.root, err)
        self._wake.set()

    async def __aenter__(self) -> EngineInstaller:
        # What an earlier agent installed serves at once, before the control plane has
        # said anything on this run.
        self._wanted = self._load_wanted()
        if self._wanted:
            facts = await asyncio.to_thread(self._facts)
            for want in self._wanted:
                await self._adopt(want, facts)
            self._wake.set()  # and converge without waiting for the control plane
        self._task = asyncio.create_task(self._loop(), name="engine-installer")
        return self

    async def __aexit__(self, *exc) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # --- state ---------------------------------------------------------------------------

    def _report(self, name: str, version: str, state: str, detail: str) -> None:
        new = wire.Engine(name=name, version=version, state=state, detail=detail)
        if self._reports.get(name) != new:
            self._reports[name] = new
            self._snapshot = tuple(self._reports[n] for n in sorted(self._reports))
            log.info("engine %s %s: %s", name, version, detail or state)
            self._changed()

    def _forget(self, name: str) -> None:
        if self._reports.pop(name, None) is not None:
            self._snapshot = tuple(self._reports[n] for n in sorted(self._reports))
            self._changed()
        if self._installed.pop(name, None) is not None:
            self._set_binary(name, None)

    def _mark_installed(self, want: wire.EngineWanted, path: Path, build: Build) -> None:
        binary = _binary_in(path, build)
        self._installed[want.name] = (path, build)
        self._set_binary(want.name, str(binary))
        self._report(want.name, want.version, "installed", f"{build.name} build")

    def _save_wanted(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        scratch = self.root / f".{_WANTED_FILE}.tmp"
        scratch.write_bytes(msgspec.json.encode(self._wanted or []))
        scratch.replace(self.root / _WANTED_FILE)

    def _load_wanted(self) -> list[wire.EngineWanted] | None:
        try:
            return msgspec.json.decode((self.root / _WANTED_FILE).read_bytes(),
                                       type=list[wire.EngineWanted])
        except (OSError, msgspec.DecodeError):
            return None

    async def _adopt(self, want: wire.EngineWanted, facts: NodeFacts) -> bool:
        """Take an install an earlier agent left in place, if it still runs."""
        from llmgw.agent.install import archives

        if want.name in self._configured or want.name in self._disabled:
            return False
        builds = candidate_builds(want.name, want.version, facts, want.build)
        if isinstance(builds, Refusal):
            return False
        for build in builds:
            found = _installed_dir(self.root, build)
            if found is None:
                continue
            if build.kind == "archive":
                problems = await asyncio.to_thread(archives.recheck, found, build.binary)
                if problems:
                    log.info("%s %s no longer runs: %s", want.name, build.directory,
                             "; ".join(problems))
                    continue
            try:
                self._mark_installed(want, found, build)
            except InstallError as err:
                log.warning("%s %s: %s", want.name, build.directory, err)
                continue
            return True
        return False

    # --- passes --------------------------------------------------------------------------

    async def _loop(self) -> None:
        next_recheck = time.monotonic() + RECHECK_S
        timeout = aiohttp.ClientTimeout(total=None, connect=30, sock_read=60)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while True:
                now = time.monotonic()
                # The next thing due: the ten-minute recheck, or the retry of a failed pass.
                due = next_recheck if not self._retry.failures else min(
                    next_recheck, self._retry.not_before)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), max(0.0, due - now))
                # Woken: a new list, or an install the recheck found broken; both now.
                asked = self._wake.is_set()
                self._wake.clear()
                if time.monotonic() >= next_recheck:
                    next_recheck = time.monotonic() + RECHECK_S
                    await self._recheck()
                if self._wanted is None or not (asked or self._retry.due(time.monotonic())):
                    continue
                try:
                    ok = await self.converge(http)
                except Exception:
                    # A bug in one pass must not stop the installer for good.
                    log.exception("an engine install pass failed")
                    ok = False
                if ok:
                    self._retry = Retry()
                else:
                    self._retry = after_failure(self._retry, time.monotonic(),
                                                self._retry_policy)
                    log.info("an engine install failed; trying again in %.0f s",
                             self._retry.not_before - time.monotonic())

    async def _recheck(self) -> None:
        """Installed archives still find every library and still run; any that does not is
        reported failed, and the next pass installs it again."""
        for name, (path, build) in list(self._installed.items()):
            if build.kind != "archive":
                continue
            from llmgw.agent.install import archives

            problems = await asyncio.to_thread(archives.recheck, path, build.binary)
            if problems:
                del self._installed[name]
                self._set_binary(name, None)
                version = self._reports[name].version if name in self._reports else ""
                self._report(name, version, "failed", "failed: " + "; ".join(problems))
                self._wake.set()

    async def converge(self, http: aiohttp.ClientSession) -> bool:
        """One pass over the wanted list; False when an engine failed to install."""
        wanted = {w.name: w for w in self._wanted or []}
        for name in list(self._reports):
            if name not in wanted:
                self._forget(name)
        facts = await asyncio.to_thread(self._facts)
        ok = True
        for want in wanted.values():
            if want.name in self._configured or want.name in self._disabled:
                self._forget(want.name)  # the agent reports it as configured or disabled
                continue
            ok = await self._converge_one(http, want, facts) and ok
        return ok

    async def _converge_one(self, http: aiohttp.ClientSession, want: wire.EngineWanted,
                            facts: NodeFacts) -> bool:
        builds = candidate_builds(want.name, want.version, facts, want.build)
        if isinstance(builds, Refusal):
            self._forget(want.name)
            state = "failed" if builds.fault else "skipped"
            words = builds.reason if builds.reason.startswith("skipped") else (
                f"failed: {builds.reason}")
            self._report(want.name, want.version, state, words)
            return not builds.fault
        current = self._installed.get(want.name)
        if current is not None and current[1] in builds:
            return True
        unpinned = next((b for b in builds if b.kind == "source" and b.asset not in want.sha256),
                        None)
        if unpinned is not None:
            from llmgw.agent.install import comfyui

            # Said once, not once per build: no build of it can be checked.
            self._forget(want.name)
            self._report(want.name, want.version, "failed",
                         f"failed: {comfyui.no_sha256(want.version, unpinned.asset)}")
            return False
        span = (self._tracing.start(f"install {want.name} {want.version}",
                                    parent=self._asked_in,
                                    attributes={"llmgw.engine": want.name,
                                                "llmgw.version": want.version,
                                                "llmgw.build_choice": want.build})
                if self._tracing.enabled else None)
        failures = []
        for build in builds:
            try:
                with self._tracing.step(f"build {build.name}", span,
                                        **{"llmgw.kind": build.kind}):
                    path = await self._install(http, want, build)
                    self._mark_installed(want, path, build)
            except InstallError as err:
                log.warning("%s %s (%s build) did not install: %s", want.name, want.version,
                            build.name, err)
                failures.append(f"{build.name} build: {err}" if len(builds) > 1 else str(err))
                continue
            if span is not None:
                end(span, **{"llmgw.build": build.name})
            return True
        self._forget(want.name)
        self._report(want.name, want.version, "failed", "failed: " + "; ".join(failures))
        if span is not None:
            end(span, error="; ".join(failures))
        return False

    async def _install(self, http: aiohttp.ClientSession, want: wire.EngineWanted,
                       build: Build) -> Path:
        def status(words: str) -> None:
            self._report(want.name, want.version, "installing", f"installing: {words}")

        if self._os_packages and build.needs:
            release = host.os_release()
            manager = ospkg.package_manager(release)
            if manager is None:
                log.info("%s", ospkg.unsupported(release, list(build.needs)))
            else:
                await ospkg.ensure_packages(manager, list(build.needs), status=status)
        # The installers load when a pass needs one (they pull in unpacking, uv…).
        from llmgw.agent.install import archives, comfyui, pyenv

        extra_indexes = (build.torch_index,) if build.torch_index else ()
        if build.kind == "source":
            async with self._reaching(http, want, f"{want.release_url}/{build.asset}") as (
                    session, url):
                return await comfyui.install_comfyui(
                    session, root=self.root, version=want.version, directory=build.directory,
                    url=url, sha256=want.sha256.get(build.asset, ""),
                    index_url=want.index_url, extra_index_urls=extra_indexes,
                    exclude_newer=want.exclude_newer, python=self._python,
                    import_check=_IMPORT_CHECKS[want.name], status=status,
                    min_free_bytes=build.min_free_mib * 2**20,
                    # On the mirror, the bundle's wheel set beside the archive: no index.
                    wheel_set=want.sha256 if is_mirrored(want.release_url) else None)
        if build.kind == "python":
            found = pyenv.installed_environment(self.root, want.name, build.directory)
            if found is not None:
                return found
            if is_mirrored(want.release_url):
                # The bundle's wheel set, pinned by its manifest: no index is read.
                async with self._reaching(http, want, f"{want.release_url}/{want.version}") as (
                        session, url):
                    return await pyenv.build_from_bundle(
                        session, base_url=url, pins=want.sha256, root=self.root,
                        name=want.name, version=build.directory, python=self._python,
                        import_check=_IMPORT_CHECKS[want.name], status=status,
                        min_free_bytes=build.min_free_mib * 2**20)
        if build.kind == "archive":
            sha256 = await self._digest(http, want, build)
            async with self._reaching(
                    http, want, f"{want.release_url}/{want.version}/{build.asset}") as (
                    session, url):
                path = await archives.install_archive(
                    session, url=url, sha256=sha256, root=self.root,
                    name=want.name, version=build.directory, binary=build.binary,
                    status=status, min_free_bytes=build.min_free_mib * 2**20)
            if build.gpu:
                await _lists_a_gpu(_binary_in(path, build))
            return path
        # The engine resolved as its indexes stood at exclude_newer, pinned with hashes;
        # torch from PyTorch's own index where the build says (trusted: core.builds).
        status(f"resolving {want.name} {want.version}")
        requirements = await pyenv.compile_requirements(
            f"{want.name}=={want.version}\n", index_url=want.index_url,
            extra_index_urls=extra_indexes, exclude_newer=want.exclude_newer or None,
            python=self._python, cache_dir=self.root / ".uv-cache",
            what=f"{want.name}=={want.version}")
        return await pyenv.build_environment(
            root=self.root, name=want.name, version=build.directory,
            requirements=requirements, index_url=want.index_url,
            extra_index_urls=extra_indexes, python=self._python,
            exclude_newer=want.exclude_newer or None,
            import_check=_IMPORT_CHECKS[want.name], status=status,
            min_free_bytes=build.min_free_mib * 2**20)

    @contextlib.asynccontextmanager
    async def _reaching(self, http: aiohttp.ClientSession, want: wire.EngineWanted, url: str
                        ) -> AsyncIterator[tuple[aiohttp.ClientSession, str]]:
        """The session and URL to download ``url`` with: as it is, or, on the control
        plane's mirror, on the server the agent dialled and with the node's TLS."""
        if not is_mirrored(url):
            yield http, url
            return
        plane = self.control_plane
        if plane is None:
            raise InstallError(f"{want.name} {want.version} comes from the control plane's "
                               "mirror, and this agent has not reached a control plane yet")
        try:
            context = plane.ssl_context()
        except TlsFilesUnusable as err:
            raise InstallError(str(err)) from None
        async with aiohttp.ClientSession(timeout=http.timeout,
                                         connector=aiohttp.TCPConnector(ssl=context)) as session:
            yield session, plane.resolve(url)

    async def _digest(self, http: aiohttp.ClientSession, want: wire.EngineWanted,
                      build: Build) -> str:
        """The sha256 the archive must have: pinned (in server.yaml, or by the bundle the
        control plane's mirror serves), else the publisher's (or the mirror's) list."""
        asset = build.asset
        if asset in want.sha256:
            return want.sha256[asset]
        if is_mirrored(want.release_url):
            raise InstallError(f"the control plane's bundle holds no {asset} ({want.name} "
                               f"{want.version}, {build.name} build): make the bundle with "
                               "the builds this node needs")
        if not want.digests_url:
            raise InstallError(f"no sha256 is known for {asset}: its publisher gives none; "
                               f"pin it in server.yaml under engines.{want.name}.sha256")
        try:
            async with http.get(want.digests_url) as resp:
                if resp.status != 200:
                    raise InstallError(f"{want.digests_url} answered {resp.status}; the "
                                       f"sha256 of {asset} cannot be checked")
                text = (await resp.content.read(_DIGESTS_MAX_BYTES)).decode(errors="replace")
        except (aiohttp.ClientError, TimeoutError) as err:
            raise InstallError(f"cannot read the sha256 list {want.digests_url}: "
                               f"{describe(err)}") from None
        digest = parse_digests(text, asset)
        if digest is None:
            raise InstallError(f"{want.digests_url} gives no sha256 for {asset}")
        return digest


def _installed_dir(root: Path, build: Build) -> Path | None:
    from llmgw.agent.install import archives, pyenv

    if build.kind == "python":
        return pyenv.installed_environment(root, build.engine, build.directory)
    return archives.installed_archive(root, build.engine, build.directory)


def _binary_in(path: Path, build: Build) -> Path:
    if build.kind == "python":
        return path / "bin" / build.binary
    if build.kind == "source":
        return path / build.binary  # main.py; engines/comfyui.py finds venv/ beside it
    from llmgw.agent.install import archives

    return archives.find_binary(path, build.binary)


async def _lists_a_gpu(binary: Path) -> None:
    """A llama.cpp GPU build whose backend cannot load runs on the CPU without an error:
    it counts only once it lists a GPU device."""
    proc = await asyncio.create_subprocess_exec(
        str(binary), "--list-devices", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), _CHECK_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise InstallError(f"{binary.name} --list-devices did not finish within "
                           f"{_CHECK_TIMEOUT_S:.0f} s") from None
    text = out.decode(errors="replace")
    if not any(word in text for word in ("CUDA", "Vulkan")):
        raise InstallError(f"{binary.name} --list-devices lists no GPU: this build cannot "
                           "use the GPUs here")


_IMPORT_CHECKS = {
    # Imports torch's CUDA runtime and asks it to compute on the first GPU.
    "vllm": "import vllm, torch; torch.ones(1, device='cuda').add_(1)",
    "sglang": "import sglang, torch; torch.ones(1, device='cuda').add_(1)",
    "comfyui": "import torch; torch.ones(1, device='cuda').add_(1)",
}
