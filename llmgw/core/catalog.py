"""The catalog: declared models and the profiles they can run with."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmgw import config
from llmgw.core import engine_names
from llmgw.core.endpoints import EndpointError, StaticEndpoint, static_endpoints
from llmgw.core.names import NameRuleError, check_element, check_model_name
from llmgw.core.weights import SourceError, check_patterns, parse_source, weights_key


class CatalogError(ValueError):
    """A model declaration that cannot be served; the message says what to change."""


@dataclass(frozen=True, slots=True)
class Sidecar:
    name: str
    command: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    port: int | None = None
    startup_timeout_s: float = 120.0


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    engine: str
    nodes: int = 1
    gpus: int = 0  # per shard (one shard per node)
    gpu_memory_mib: int = 0  # free memory needed on each of those GPUs
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    weights: str | None = None
    source: str | None = None
    files: tuple[str, ...] = ()
    # What a node holding these weights reports (see core.weights); "" for a profile
    # without a source, whose weights are keyed by the model's name.
    weights_key: str = ""
    startup_timeout_s: float = 600.0
    embeddings: bool = False
    launch_mode: str = "mp"
    require_avx2: bool = False
    sidecars: tuple[Sidecar, ...] = ()
    slots: int = 64


@dataclass(frozen=True, slots=True)
class Selector:
    labels: tuple[tuple[str, str], ...] = ()
    gpu_class: str | None = None


@dataclass(frozen=True, slots=True)
class Model:
    name: str
    profiles: tuple[Profile, ...]
    replicas: int = 1
    description: str = ""
    priority: int = 0
    selector: Selector = Selector()
    # Servers someone else runs for it (core.endpoints), routed beside its replicas. A
    # model without profiles runs no replica (replicas 0): its endpoints serve it alone.
    endpoints: tuple[StaticEndpoint, ...] = ()
    # Other names clients may send as `model` for this one (core.catalog.Catalog.resolve).
    aliases: tuple[str, ...] = ()
    # Names (or aliases) of models that serve its requests when it cannot
    # (Catalog.fallbacks_of), as written.
    fallbacks: tuple[str, ...] = ()
    # Scale to zero (core.idle): None, never unloaded; else after that long without a
    # request only min_replicas stay, and a request waits up to wake_timeout_s for the
    # others to be placed again.
    idle_unload_s: float | None = None
    min_replicas: int = 0
    wake_timeout_s: float = 300.0

    def profile(self, name: str) -> Profile | None:
        return next((p for p in self.profiles if p.name == name), None)

    def weights_key(self, profile: Profile) -> str:
        return profile.weights_key or self.name


@dataclass(frozen=True, slots=True)
class Catalog:
    models: tuple[Model, ...] = field(default=())
    # By name only: what the controller, placement and metrics look models up by.
    _by_name: dict[str, Model] = field(init=False, repr=False, compare=False, hash=False)
    # By every name a client may send (names and aliases): looked up on every /v1
    # request, so one dict lookup, not a scan of the models.
    _served: dict[str, Model] = field(init=False, repr=False, compare=False, hash=False)
    # Each model that names fallbacks, by name: its whole chain, worked out once.
    _chains: dict[str, tuple[Name, ...]] = field(init=False, repr=False, compare=False,
                                                  hash=False)

    def __post_init__(self) -> None:
        # reversed: where two models share a name, the first is the one found.
        object.__setattr__(self, "_by_name", {m.name: m for m in reversed(self.models)})
        served = {alias: m for m in reversed(self.models) for alias in m.aliases}
        # A model's own name wins over another's alias (catalog_from_config and
        # name_taken refuse both; a merged catalog may still hold one, see server.catalog).
        served.update(self._by_name)
        object.__setattr__(self, "_served", served)
        object.__setattr__(self, "_chains", {m.name: self._chain(m) for m in self.models
                                             if m.fallbacks})

    def get(self, name: str) -> Model | None:
        """The model called ``name``; an alias is not a name (``resolve`` takes both)."""
        return self._by_name.get(name)

    def resolve(self, requested: str) -> Model | None:
        """The model a client's ``model`` names: by its name or by one of its aliases."""
        return self._served.get(requested)

    def names(self) -> list[str]:
        return [m.name for m in self.models]

    def fallbacks_of(self, model: Model) -> tuple[Name, ...]:
        """The models that serve ``model``'s requests when it cannot, in the order they are
        tried: its own fallbacks as listed, then theirs, and so on (breadth first), each
        once, never ``model`` itself; each as its fallback list names it."""
        return self._chains.get(model.name, ()) if model.fallbacks else ()

    def _chain(self, model: Model) -> tuple[Name, ...]:
        # A name that resolves to nothing, or a cycle, is skipped: catalog_from_config and
        # server.catalog refuse both, but a merged catalog may still hold one (a model
        # removed over the API that another names).
        chain: list[Name] = []
        seen = {model.name}
        level = [model]
        while level:
            following = []
            for current in level:
                for name in current.fallbacks:
                    fallback = self.resolve(name)
                    if fallback is not None and fallback.name not in seen:
                        seen.add(fallback.name)
                        chain.append(Name(name, fallback))
                        following.append(fallback)
            level = following
        return tuple(chain)

    def served_names(self) -> list[Name]:
        """Every name a client may send, each model's own then its aliases, in catalog
        order: what GET /v1/models lists."""
        return [Name(n, m) for m in self.models for n in (m.name, *m.aliases)
                if self._served.get(n) is m]


@dataclass(frozen=True, slots=True)
class Name:
    """A name clients may send as ``model`` and the model it is served by (the model's
    own name, or one of its aliases)."""

    name: str
    model: Model


def may_use(allowed: list[str] | None, requested: str, model: Model) -> bool:
    """Whether an API key whose model list is ``allowed`` (None: every model) may send
    ``requested`` for ``model``: its list names the model, or the very name sent (an alias
    of it). A key limited to an alias may use the model by that alias only."""
    return allowed is None or requested in allowed or model.name in allowed


def name_taken(name: str, catalog: Catalog) -> str | None:
    """What already answers to ``name`` in ``catalog`` ("model 'x'", "an alias of model
    'x'"), None when nothing does."""
    model = catalog.resolve(name)
    if model is None:
        return None
    return f"model {model.name!r}" if model.name == name else f"an alias of model {model.name!r}"


def clashes(model: Model, catalog: Catalog) -> tuple[str, str] | None:
    """Why ``model`` cannot join ``catalog``: one of its names is already answered to
    there. The key at fault (``name``, ``aliases[1]``) and words naming both models; None
    when it can join."""
    for k, name in enumerate((model.name, *model.aliases)):
        taken = name_taken(name, catalog)
        if taken is not None:
            key, what = ("name", "name") if k == 0 else (f"aliases[{k - 1}]", "alias")
            return key, (f"{what} {name!r} of model {model.name!r} is already {taken}; each "
                         "name a client may send must name one model: rename or drop one")
    return None


def fallback_problems(catalog: Catalog) -> list[tuple[str, str, str]]:
    """Fallbacks that cannot be followed, as (model, key, why): a name no model or alias
    answers to, one that names the model itself, or one that leads back to the model
    (``a → b → a``). Empty when every chain ends."""
    problems = []
    for model in catalog.models:
        for k, name in enumerate(model.fallbacks):
            key = f"fallbacks[{k}]"
            target = catalog.resolve(name)
            if target is None:
                problems.append((model.name, key, f"{name!r} is not a model or an alias of "
                                 "one; declare it, or drop it from the fallbacks"))
            elif target is model:
                problems.append((model.name, key, f"{name!r} is this model itself; drop it"))
            else:
                loop = _path_back(catalog, target, model)
                if loop is not None:
                    problems.append((model.name, key, f"{name!r} leads back to {model.name!r} "
                                     f"({' → '.join([model.name, *loop])}): a model's "
                                     "fallbacks must not fall back to it; drop one link"))
    return problems


def _path_back(catalog: Catalog, start: Model, goal: Model) -> list[str] | None:
    """The names from ``start`` along fallbacks to ``goal`` (depth first), None when no
    chain of fallbacks leads there."""
    stack: list[tuple[Model, list[str]]] = [(start, [start.name])]
    seen = {start.name}
    while stack:
        current, path = stack.pop()
        for name in current.fallbacks:
            target = catalog.resolve(name)
            if target is goal:
                return [*path, goal.name]
            if target is not None and target.name not in seen:
                seen.add(target.name)
                stack.append((target, [*path, target.name]))
    return None



def _other_names(where: str, key: str, names: list[str], itself: set[str],
                 itself_words: str) -> list[str]:
    """A model's ``aliases`` or ``fallbacks`` (``key``), checked: each a model name, not a
    name of ``itself``, none twice."""
    kept: list[str] = []
    for k, name in enumerate(names):
        try:
            check_model_name(name)
        except NameRuleError as err:
            raise CatalogError(f"{where}.{key}[{k}]: {err}") from None
        if name in kept or name in itself:
            why = "listed twice" if name in kept else itself_words
            raise CatalogError(f"{where}.{key}[{k}]: {name!r} is {why}; drop it")
        kept.append(name)
    return kept

def model_from_config(raw: config.Model, where: str = "model") -> Model:
    try:
        check_model_name(raw.name)
    except NameRuleError as err:
        raise CatalogError(f"{where}.name: {err}") from None
    profiles = []
    for i, p in enumerate(raw.profiles):
        at = f"{where}.profiles[{i}]"
        try:
            check_element(p.name, "profile name")
        except NameRuleError as err:
            raise CatalogError(f"{at}.name: {err}") from None
        if p.engine not in engine_names.ALL:
            raise CatalogError(
                f"{at}.engine: unknown engine {p.engine!r}; use one of "
                + ", ".join(sorted(engine_names.ALL))
            )
        if p.engine in engine_names.SINGLE_GPU and (p.nodes > 1 or p.gpus > 1):
            raise CatalogError(f"{at}: {p.engine} runs on one GPU of one node; "
                               "set nodes: 1 and gpus: 0 or 1")
        if p.gpu_memory_mib and not p.gpus:
            raise CatalogError(f"{at}.gpu_memory_mib is set but gpus is 0; set gpus too")
        try:
            files = check_patterns(p.files)
            key = weights_key(parse_source(p.source), files) if p.source else ""
        except SourceError as err:
            raise CatalogError(f"{at}: {err}") from None
        if files and not p.source:
            raise CatalogError(f"{at}.files is set but source is not; name the repository")
        sidecars = []
        for k, sc in enumerate(p.sidecars):
            try:
                check_element(sc.name, "sidecar name")
            except NameRuleError as err:
                raise CatalogError(f"{at}.sidecars[{k}].name: {err}") from None
            if sc.name in {s.name for s in sidecars}:
                raise CatalogError(f"{at}.sidecars[{k}].name: {sc.name!r} is used twice")
            sidecars.append(Sidecar(sc.name, tuple(sc.command), tuple(sorted(sc.env.items())),
                                    sc.port, sc.startup_timeout_s))
        profiles.append(
            Profile(
                name=p.name,
                engine=p.engine,
                nodes=p.nodes,
                gpus=p.gpus,
                gpu_memory_mib=p.gpu_memory_mib,
                args=tuple(p.args),
                env=tuple(sorted(p.env.items())),
                weights=p.weights,
                source=p.source,
                files=files,
                weights_key=key,
                startup_timeout_s=p.startup_timeout_s,
                embeddings=p.embeddings,
                launch_mode=p.launch_mode,
                require_avx2=p.require_avx2,
                sidecars=tuple(sidecars),
                slots=p.slots,
            )
        )
    if raw.idle_unload_s is None and raw.min_replicas:
        raise CatalogError(f"{where}.min_replicas is set but idle_unload_s is not; "
                           "min_replicas is what an idle model keeps, so name how long "
                           "without a request makes it idle (idle_unload_s: 600)")
    if raw.min_replicas > raw.replicas:
        raise CatalogError(f"{where}.min_replicas ({raw.min_replicas}) is over replicas "
                           f"({raw.replicas}); an idle model keeps at most what it runs")
    try:
        endpoints = static_endpoints(raw.endpoints, where)
    except EndpointError as err:
        raise CatalogError(str(err)) from None
    if not profiles and not endpoints:
        raise CatalogError(f"{where}: the model has neither profiles (engines llmgw runs) "
                           "nor endpoints (servers someone else runs, by URL); give one or "
                           "both")
    if not profiles and raw.replicas > 1:
        raise CatalogError(f"{where}.replicas is {raw.replicas} but the model has no "
                           "profiles: llmgw runs no replica of it, its endpoints serve it; "
                           "drop replicas, or add a profile")
    aliases = _other_names(where, "aliases", raw.aliases, {raw.name}, "the model's own name")
    fallbacks = _other_names(where, "fallbacks", raw.fallbacks, {raw.name, *aliases},
                             "this model itself")
    return Model(
        name=raw.name,
        profiles=tuple(profiles),
        replicas=raw.replicas if profiles else 0,
        description=raw.description,
        priority=raw.priority,
        selector=Selector(tuple(sorted(raw.nodes.labels.items())), raw.nodes.gpu_class),
        endpoints=endpoints,
        aliases=tuple(aliases),
        fallbacks=tuple(fallbacks),
        idle_unload_s=raw.idle_unload_s,
        min_replicas=raw.min_replicas,
        wake_timeout_s=raw.wake_timeout_s,
    )


def catalog_from_config(models: list[config.Model]) -> Catalog:
    """server.yaml's models as a catalog; a CatalogError naming the entry when one is not
    servable, when one of its names or aliases is another's, or when one of its fallbacks
    names no model of the file or leads back to it."""
    catalog = Catalog()
    for i, raw in enumerate(models):
        model = model_from_config(raw, f"models[{i}]")
        clash = clashes(model, catalog)
        # The same name twice is config._check's to say (it reads the file first).
        if clash is not None and catalog.get(model.name) is None:
            key, why = clash
            raise CatalogError(f"models[{i}].{key}: {why}")
        catalog = Catalog((*catalog.models, model))
    index = {m.name: i for i, m in reversed(list(enumerate(models)))}
    for name, key, why in fallback_problems(catalog)[:1]:
        raise CatalogError(f"models[{index[name]}].{key}: {why}")
    return catalog
