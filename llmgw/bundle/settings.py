"""What server.yaml says of a control plane that serves a bundle: its engines at the
bundle's versions and its models fetched from the mirror (`llmgw server init --bundle`,
and the cluster page's setup form)."""

from __future__ import annotations

import contextlib
import re
from typing import Any

from llmgw.bundle.manifest import Manifest, engine_path
from llmgw.config import BundleSettings, EngineRelease, Model, Profile
from llmgw.core.builds import comfyui_archive
from llmgw.core.engine_names import INSTALLABLE
from llmgw.core.names import NameRuleError, check_model_name
from llmgw.core.weights import SourceError, check_patterns

_SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)


def offline_settings(manifest: Manifest, trusted_keys: list[str]
                     ) -> tuple[dict[str, Any], list[str]]:
    """server.yaml's keys for a control plane that serves ``manifest``'s bundle, and notes
    for the operator. Each engine at the bundle's version (the first it lists, when it
    holds several); each model with one replica, fetched from the mirror as the bundle
    pinned it (every file the bundle holds of it), on llama.cpp when it has a .gguf file,
    else on vLLM (which loads a Hugging Face model directory)."""
    notes: list[str] = []
    engines: dict[str, EngineRelease] = {}
    for engine in manifest.engines:
        if engine.name not in INSTALLABLE:
            notes.append(f"the bundle's engine {engine.name} is not one nodes install; left "
                         "out of server.yaml")
        elif engine.name in engines:
            notes.append(f"engines.{engine.name}: {engines[engine.name].version}; the bundle "
                         f"also holds {engine.version}")
        elif engine.name == "comfyui":
            # GitHub publishes no digest for its tag archive: server.yaml pins the bundle's.
            asset = comfyui_archive(engine.version)
            digests = {f.path: f.sha256 for f in manifest.files}
            pinned = digests.get(engine_path(engine.name, engine.version, asset))
            engines[engine.name] = EngineRelease(
                version=engine.version, sha256={asset: pinned} if pinned else {})
        else:
            engines[engine.name] = EngineRelease(version=engine.version)
    if not engines:
        notes.append("the bundle holds no engine nodes install: server.yaml names none, so "
                     "nodes run only the engines their agent.yaml names")
    models: list[Model] = []
    for bundled in manifest.models:
        try:
            check_model_name(bundled.name)
        except NameRuleError as err:
            notes.append(f"the bundle's model {bundled.name!r} left out: {err}")
            continue
        if bundled.name in {m.name for m in models}:
            notes.append(f"the bundle names model {bundled.name} twice; the first is declared")
            continue
        # The layout of bundle.manifest.model_path.
        prefix = f"models/{bundled.repo}/{bundled.revision}/"
        paths = sorted(p.removeprefix(prefix) for p in bundled.files if p.startswith(prefix))
        engine = "llama.cpp" if any(p.lower().endswith(".gguf") for p in paths) else "vllm"
        profile: dict[str, Any] = {"engine": engine,
                                   "source": f"hf://{bundled.repo}@{bundled.revision}"}
        # A name no pattern can say: no files, so every file the bundle holds of it.
        with contextlib.suppress(SourceError):
            profile["files"] = list(check_patterns(paths))
        ggufs = [p for p in paths if p.lower().endswith(".gguf")
                 and not p.rsplit("/", 1)[-1].startswith("mmproj")]
        if len(ggufs) > 1 and not all(_SPLIT_GGUF.search(p) for p in ggufs):
            notes.append(f"model {bundled.name} holds {len(ggufs)} GGUF files and llama.cpp "
                         "loads one: keep that one in its files: in server.yaml")
        if engine not in engines:
            notes.append(f"model {bundled.name} runs on {engine}, which the bundle does not "
                         "hold: nodes need it from elsewhere (engines: in server.yaml)")
        models.append(Model(name=bundled.name, replicas=1, profiles=[Profile(**profile)]))
    settings = {"engines": engines, "models": models,
                "bundle": BundleSettings(trusted_keys=list(trusted_keys))}
    return settings, notes
