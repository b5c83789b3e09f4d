"""``server.yaml`` and ``agent.yaml``: what an operator writes, checked strictly at start.

Every Struct here forbids unknown fields: a misspelt key is an error that names its path
(``models[0].profiles[0].gpus: expected int, got str``), never a silently ignored setting.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec
import yaml


class ConfigError(Exception):
    """A configuration file that cannot be used; the message names the file and key path."""


class _Config(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    pass


PositiveSeconds = Annotated[float, msgspec.Meta(gt=0)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]


# --- server.yaml ---------------------------------------------------------------------------


HTTP_SERVERS = ("uvicorn", "granian")


class Listen(_Config):
    host: str = "127.0.0.1"
    port: Port = 8080
    # Without a tls block the server speaks plain HTTP: passwords, keys and the agent
    # stream in the clear. Allowed on loopback; anywhere else only when set on purpose.
    allow_plain_http: bool = False
    # The HTTP server for /v1 and the admin API (docs/gateway.md, "The HTTP server"):
    # uvicorn costs less CPU per request; granian for those who run it elsewhere.
    server: str = "uvicorn"

    def __post_init__(self) -> None:
        # Checked here rather than typed as a Literal: msgspec's "invalid enum value" would
        # not say which values there are.
        if self.server not in HTTP_SERVERS:
            raise ValueError(f"server: {self.server!r} is not an HTTP server llmgw runs; "
                             f"write {' or '.join(HTTP_SERVERS)} (the default is uvicorn)")


class StoreSettings(_Config):
    """``url`` is a SQLAlchemy URL; empty means a SQLite file in the state directory."""

    url: str = ""


class Auth(_Config):
    # Every /v1 request needs an API key. Off is allowed only on a loopback listener.
    require_api_key: bool = True
    # How long a server trusts what it read of an API key (revoked? limits? owner
    # disabled?) before reading it again; changes made through another server take this
    # long to apply here. 0 reads the store on every request.
    key_cache_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 5.0
    session_ttl_s: PositiveSeconds = 12 * 3600.0
    # A file holding the admin token, so that every server of a cluster takes the same one.
    # Absent: each server makes its own at first start, <state_dir>/secrets/admin-token.
    admin_token_file: str | None = None
    # argon2id: at most this many hashes at once (each takes argon2_memory_kib).
    hash_slots: Annotated[int, msgspec.Meta(ge=1, le=64)] = 2
    argon2_memory_kib: Annotated[int, msgspec.Meta(ge=19 * 1024)] = 65536
    argon2_time_cost: Annotated[int, msgspec.Meta(ge=2)] = 3
    argon2_parallelism: Annotated[int, msgspec.Meta(ge=1)] = 4
    # Per client address: this many login attempts per window, for this many addresses.
    login_attempts: Annotated[int, msgspec.Meta(ge=1)] = 10
    login_window_s: PositiveSeconds = 300.0
    login_throttle_capacity: Annotated[int, msgspec.Meta(ge=1)] = 10_000


class NodeTimeouts(_Config):
    heartbeat_interval_s: PositiveSeconds = 3.0
    unreachable_after_s: PositiveSeconds = 15.0
    lost_after_s: PositiveSeconds = 60.0


class Controller(_Config):
    interval_s: PositiveSeconds = 2.0
    restart_backoff_initial_s: PositiveSeconds = 10.0
    restart_backoff_max_s: PositiveSeconds = 300.0
    restart_backoff_reset_s: PositiveSeconds = 600.0
    # How long adopted shards of one replica may wait for their missing ranks to report.
    adoption_grace_s: PositiveSeconds = 30.0
    # Several servers on one PostgreSQL: the leader's lease runs this long unless renewed
    # (every quarter of it); a paused or cut-off leader is followed after about this long.
    lease_s: Annotated[float, msgspec.Meta(ge=2, le=300)] = 10.0
    # How often a server that does not lead reads the leader's replica table.
    follow_interval_s: PositiveSeconds = 1.0


class Sidecar(_Config):
    """A helper process a shard needs beside its engine (a proxy, an embedding service):
    started first, on the same node, stopped with the engine."""

    name: str
    command: Annotated[list[str], msgspec.Meta(min_length=1)]
    env: dict[str, str] = {}
    # Ready once this port accepts connections on 127.0.0.1; without one, once it runs.
    port: Port | None = None
    startup_timeout_s: PositiveSeconds = 120.0


class Profile(_Config):
    engine: str
    name: str = "default"
    nodes: Annotated[int, msgspec.Meta(ge=1)] = 1
    gpus: Annotated[int, msgspec.Meta(ge=0)] = 0
    gpu_memory_mib: Annotated[int, msgspec.Meta(ge=0)] = 0
    args: list[str] = []
    env: dict[str, str] = {}
    # A path on the node (a GGUF file, a model directory) that wins over ``source``.
    weights: str | None = None
    # Where the weights come from when a node lacks them: hf://ORG/NAME[@REVISION] (the
    # agent's hub or mirror) or https://HOST/ORG/NAME. ``files`` picks some of its files
    # (globs such as "*Q4_K_M.gguf"); empty means all of them.
    source: str | None = None
    files: list[str] = []
    startup_timeout_s: PositiveSeconds = 600.0
    # Serve /v1/embeddings (llama.cpp --embeddings, vLLM --runner pooling, SGLang
    # --is-embedding): an embedding model, not a chat one.
    embeddings: bool = False
    # vLLM across nodes: its own multi-process launch, or Ray on request.
    launch_mode: Literal["mp", "ray"] = "mp"
    # A CPU engine on a CPU without AVX2 runs several times slower: a warning by default,
    # a refusal with this set.
    require_avx2: bool = False
    sidecars: list[Sidecar] = []
    # Requests one replica serves at once (the engine's batch: llama.cpp --parallel, vLLM
    # --max-num-seqs); more wait in the gateway's queue.
    slots: Annotated[int, msgspec.Meta(ge=1)] = 64


class Selector(_Config):
    """Which nodes may run a model: every label must match; ``gpu_class`` is matched
    against the GPU's name ("H100" matches "NVIDIA H100 80GB HBM3")."""

    labels: dict[str, str] = {}
    gpu_class: str | None = None


class Endpoint(_Config):
    """An OpenAI-compatible server someone else runs, serving the model beside (or
    instead of) the replicas llmgw runs: routed, limited, metered and health-checked as
    they are (docs/gateway.md, "Static endpoints")."""

    # Its base URL, as an OpenAI client's base_url: http://10.0.0.5:8000/v1.
    url: str
    # A file holding its API key, sent as `Authorization: Bearer`; read at start and at
    # each reload (SIGHUP).
    api_key_file: str | None = None
    # Its name for the model, set as the request body's `model`; absent: the model's own.
    model: str | None = None
    # Requests it takes at once; absent: as many as a replica without slots.
    slots: Annotated[int, msgspec.Meta(ge=1)] | None = None
    # https: CA certificates to check its certificate against instead of the system's.
    ca_file: str | None = None


class Model(_Config):
    name: str
    # Engines llmgw runs for it; a model has profiles, endpoints, or both.
    profiles: list[Profile] = []
    # Servers someone else runs for it (Endpoint).
    endpoints: list[Endpoint] = []
    replicas: Annotated[int, msgspec.Meta(ge=0)] = 1
    description: str = ""
    # A model that fits nowhere may evict replicas of models with a lower priority.
    priority: int = 0
    nodes: Selector = msgspec.field(default_factory=Selector)
    # Other names clients may send as `model` for this one (`gpt-4o-mini` for a local
    # model): listed by /v1/models, served by this model's replicas.
    aliases: list[str] = []
    # Models (names or aliases) that serve this one's requests, tried in order, when it has
    # no ready replica or its queue refuses, before anything was sent to an engine.
    fallbacks: list[str] = []
    # Scale to zero: after idle_unload_s without a request the model keeps min_replicas
    # of its replicas (0: none); the next request places the rest again and waits, up to
    # wake_timeout_s, for one to serve it. Without idle_unload_s, never unloaded.
    idle_unload_s: PositiveSeconds | None = None
    min_replicas: Annotated[int, msgspec.Meta(ge=0)] = 0
    wake_timeout_s: PositiveSeconds = 300.0


class Gateway(_Config):
    """How long ``/v1`` waits on an engine. ``first_byte_timeout_s`` runs from the request
    to the first byte of the answer's body (a stream's first event comes after the
    prefill; a non-streamed answer's first byte when the whole generation is done), so it
    is generous; ``idle_timeout_s`` then bounds each silence between chunks."""

    connect_timeout_s: PositiveSeconds = 5.0
    first_byte_timeout_s: PositiveSeconds = 600.0
    # Between two chunks of a streamed answer: a half-open engine ends the stream with an
    # error event after this long.
    idle_timeout_s: PositiveSeconds = 120.0
    # When every replica of a model is at its slots: at most this many requests wait, each
    # at most queue_wait_s, then 429 with Retry-After.
    queue_max: Annotated[int, msgspec.Meta(ge=0)] = 1024
    queue_wait_s: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    # Same `user` or conversation start to the same replica (its prefix cache), while that
    # replica holds at most (1 + affinity_epsilon) times the average load.
    affinity: bool = True
    affinity_epsilon: Annotated[float, msgspec.Meta(ge=0)] = 0.25


class MetricsSettings(_Config):
    """``/metrics`` for Prometheus: a scrape from loopback (not through a proxy) needs no
    token; any other needs the metrics token (from ``token_file``) or the admin token."""

    enabled: bool = True
    allow_loopback: bool = True
    token_file: str | None = None


class Tracing(_Config):
    """OpenTelemetry traces, sent over OTLP/HTTP (protobuf) to ``endpoint``. Absent
    endpoint: tracing is off, every span is the no-op one and commands carry no trace
    context."""

    # The collector's traces URL, e.g. http://127.0.0.1:4318/v1/traces.
    endpoint: str | None = None
    # A file of `Name: value` lines sent with every export (a collector's API key).
    headers_file: str | None = None
    # The share of /v1 requests traced when the client sent no `traceparent`; a client's
    # sampled `traceparent` is always honoured. The controller's and nodes' traces are
    # rare and always kept.
    sample_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.1
    # service.name of the spans; default llmgw-server or llmgw-agent.
    service_name: str | None = None


class BundleSettings(_Config):
    """Bundles this control plane accepts (`llmgw bundle import`, docs/offline.md) and the
    mirror it serves its nodes from."""

    # Public keys (`llmgw-bundle-ed25519:BASE64`, as `llmgw bundle keygen` prints) whose
    # signature an import accepts; none accepts no bundle.
    trusted_keys: list[str] = []
    # Where imported bundles are kept and served from; "" is <state_dir>/mirror.
    mirror_dir: str = ""


class Logging(_Config):
    """``access: json`` writes one JSON line per /v1 request to the `llmgw.access` logger
    (never prompt or answer text); ``off`` writes none."""

    access: Literal["off", "json"] = "off"


# The engines a node installs, by name: the one list of them (core.engine_names reads it;
# it is written here because server.yaml's keys are checked against it as it is read).
InstallableEngine = Literal["llama.cpp", "vllm", "sglang", "comfyui"]


class EngineRelease(_Config):
    """One engine every node installs (see docs/engines.md). Empty values mean the
    defaults this release was checked against."""

    # "" is the version llmgw was checked against (llama.cpp; vLLM); SGLang and ComfyUI
    # need one named.
    version: str = ""
    # Where archives come from: <release_url>/<version>/<file>. "" is the publisher's
    # (GitHub's releases), or engine_mirror's when that is set.
    release_url: str = ""
    # sha256 per archive file name, pinned by the operator; otherwise the publisher's
    # digest (GitHub's), or the mirror's SHA256SUMS.
    sha256: dict[str, str] = {}
    # Python engines: the package index, and resolve as it stood on this date (or time).
    index_url: str = ""
    exclude_newer: str = ""


class EngineOverride(_Config):
    """Nodes picked by GPU class, id or labels (every one given must match) get their own
    engine versions, builds (auto, a build name, or none) or disabled engines; a later
    override wins over an earlier one."""

    gpu_class: str | None = None
    nodes: list[str] = []
    labels: dict[str, str] = {}
    versions: dict[InstallableEngine, str] = {}
    build: dict[InstallableEngine, str] = {}
    disable: list[InstallableEngine] = []


def _default_engines() -> dict[str, EngineRelease]:
    return {"llama.cpp": EngineRelease()}


class ServerTls(_Config):
    """The cluster's identity: its CA, the server's certificate (``llmgw server init``
    writes all four files), and the agent stream's own mTLS listener."""

    ca_file: str
    # Signs each node's certificate at join and renewal; readable by the server alone.
    ca_key_file: str
    cert_file: str
    key_file: str
    # Node certificates live this long; agents renew them when a third is left.
    node_cert_days: PositiveSeconds = 7.0
    agent_listen: Listen = msgspec.field(default_factory=lambda: Listen(host="0.0.0.0",
                                                                        port=8443))
    # The URLs nodes reach this cluster's API at, every server's (https://cp1:8080, ...):
    # the join command names them, and a joining node is given the same hosts on
    # agent_listen.port as its failover list. Empty: the URL the admin's request came to.
    public_urls: list[str] = []


class ServerConfig(_Config):
    listen: Listen = msgspec.field(default_factory=Listen)
    gateway: Gateway = msgspec.field(default_factory=Gateway)
    metrics: MetricsSettings = msgspec.field(default_factory=MetricsSettings)
    state_dir: str = "/var/lib/llmgw"
    store: StoreSettings = msgspec.field(default_factory=StoreSettings)
    auth: Auth = msgspec.field(default_factory=Auth)
    nodes: NodeTimeouts = msgspec.field(default_factory=NodeTimeouts)
    controller: Controller = msgspec.field(default_factory=Controller)
    # This server's name among the cluster's servers (`ctl status`, the leader's lease);
    # unique per server. Default: listen's host and port.
    name: str | None = None
    models: list[Model] = []
    # Absent: no CA, no agent-stream mTLS listener, no node onboarding.
    tls: ServerTls | None = None
    # Engines every node installs; an empty mapping installs none.
    engines: dict[InstallableEngine, EngineRelease] = msgspec.field(
        default_factory=_default_engines)
    # An offline mirror: <engine_mirror>/<engine>/<version>/<file>, with SHA256SUMS beside.
    engine_mirror: str | None = None
    engine_overrides: list[EngineOverride] = []
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    logging: Logging = msgspec.field(default_factory=Logging)
    tracing: Tracing = msgspec.field(default_factory=Tracing)
    bundle: BundleSettings = msgspec.field(default_factory=BundleSettings)


# --- agent.yaml ----------------------------------------------------------------------------


class Reconnect(_Config):
    initial_s: PositiveSeconds = 0.5
    max_s: PositiveSeconds = 30.0


class EnginePath(_Config):
    """An engine binary named on purpose; reported as ``configured``."""

    binary: str
    version: str = ""


class WeightsDirectory(_Config):
    path: str
    # A filer other nodes of the fabric see too (NFS, Lustre…). Said, never guessed: local
    # storage taken for shared would make the cluster believe a model is everywhere.
    shared: bool = False


class Weights(_Config):
    # Where the agent looks for weights; fetched weights go to the first one that is not
    # shared. Created at start when missing. Unset: see AgentConfig.weights_directories.
    directories: Annotated[list[WeightsDirectory], msgspec.Meta(min_length=1)] | None = None
    # The Hugging Face-style hub hf:// sources are fetched from. Unset: the mirror of the
    # control plane the agent is connected to, when it serves an imported bundle, else
    # https://huggingface.co.
    hub: str | None = None
    # A file holding the hub token, for gated repositories.
    token_file: str | None = None


class ShardHealth(_Config):
    """How a ready shard's health is watched: checked every ``every_s``; failing for
    ``unhealthy_after_s`` it is reported unhealthy (the gateway stops sending it requests),
    for ``fail_after_s`` it is failed and stopped, and the control plane replaces it."""

    every_s: PositiveSeconds = 1.0
    unhealthy_after_s: PositiveSeconds = 3.0
    fail_after_s: PositiveSeconds = 30.0


class AgentTls(_Config):
    """The node's identity on the agent stream (``https://`` control-plane addresses)."""

    ca_file: str
    cert_file: str
    key_file: str


DEFAULT_AGENT_STATE_DIR = "/var/lib/llmgw-agent"
DEFAULT_WEIGHTS_DIR = "/var/lib/llmgw-weights"


class AgentConfig(_Config):
    servers: Annotated[list[str], msgspec.Meta(min_length=1)]
    node_id: str | None = None
    address: str | None = None
    state_dir: str = DEFAULT_AGENT_STATE_DIR
    # systemd: transient units on the manager at systemd_bus; process: plain children;
    # auto: systemd where a manager answers there, else processes (logged).
    runtime: Literal["auto", "process", "systemd"] = "auto"
    systemd_bus: str = "unix:path=/run/systemd/private"
    port_range: tuple[Port, Port] = (20000, 20999)
    fabric: str | None = None
    labels: dict[str, str] = {}
    engines: dict[str, EnginePath] = {}
    # Where the agent installs engines; "" is <state_dir>/engines.
    engines_dir: str = ""
    # Install the OS packages an engine build needs (libgomp…) with the machine's package
    # manager; false leaves that to the operator (ldd then names what is missing).
    install_os_packages: bool = True
    # Engines this node must never run, even if installed (`--disable-engine` at join).
    disable_engines: list[str] = []
    weights: Weights = msgspec.field(default_factory=Weights)
    tls: AgentTls | None = None
    # A plain http:// control plane off loopback: refused unless set on purpose.
    allow_plain_http: bool = False
    shard_health: ShardHealth = msgspec.field(default_factory=ShardHealth)
    # NVML's library, loaded by path where the dynamic loader would not find it (NixOS:
    # /run/opengl-driver/lib/libnvidia-ml.so.1). Absent: looked up by name.
    nvml_library: str | None = None
    # How often the agent looks at the node again (engines, RAM, GPUs, weights) and
    # sends its inventory if something changed.
    probe_interval_s: PositiveSeconds = 60.0
    reconnect: Reconnect = msgspec.field(default_factory=Reconnect)
    # `llmgw up` stops its engines with itself; a real node keeps them serving.
    stop_shards_on_exit: bool = False
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    tracing: Tracing = msgspec.field(default_factory=Tracing)

    def weights_directories(self) -> list[WeightsDirectory]:
        """The weights directories agent.yaml names, else one that follows state_dir:
        ``<state_dir>/weights``, so that an agent run from elsewhere never writes to
        /var/lib. With the default state_dir it stays /var/lib/llmgw-weights, where nodes
        set up before kept their weights."""
        if self.weights.directories is not None:
            return self.weights.directories
        if self.state_dir == DEFAULT_AGENT_STATE_DIR:
            return [WeightsDirectory(path=DEFAULT_WEIGHTS_DIR)]
        return [WeightsDirectory(path=str(Path(self.state_dir) / "weights"))]


# --- loading -------------------------------------------------------------------------------

C = TypeVar("C", ServerConfig, AgentConfig)

_LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})

_PATH_RE = re.compile(r" - at (?P<key>`key` in )?`\$(?P<path>[^`]*)`$")


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice in one mapping, which plain YAML
    loading resolves silently by keeping the last."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"the key {key!r} is written twice", key_node.start_mark)
            seen[key] = True
        return super().construct_mapping(node, deep=deep)


def _readable(err: msgspec.ValidationError) -> str:
    """``Expected `int`, got `str` - at `$.models[0].gpus``` -> ``models[0].gpus: expected
    int, got str``."""
    text = str(err)
    match = _PATH_RE.search(text)
    message = text[: match.start()] if match else text
    message = message.replace("`", "")
    message = message[:1].lower() + message[1:]
    if not match:
        return message
    path = match.group("path").lstrip(".")
    if match.group("key"):
        message = f"a key here is not text: {message}"
    return f"{path}: {message}" if path else message


def parse(data: Any, kind: type[C], source: str = "<config>") -> C:
    """Check already-parsed YAML/JSON data against ``kind``."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}: expected a mapping at the top level, got {type(data).__name__}"
        )
    try:
        config = msgspec.convert(data, kind, strict=True)
    except msgspec.ValidationError as err:
        raise ConfigError(f"{source}: {_readable(err)}") from None
    _check(config, source)
    return config


def load(path: str | Path, kind: type[C]) -> C:
    """Read a YAML file into ``kind``; every problem is a ConfigError naming file and key."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (not UTF-8); is it the right file?") from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    return parse(data, kind, str(path))


def dump(config: ServerConfig | AgentConfig) -> str:
    return yaml.safe_dump(msgspec.to_builtins(config), sort_keys=False)


def _check(config: ServerConfig | AgentConfig, source: str) -> None:
    """Rules that span fields, which a type alone cannot say."""
    if isinstance(config, ServerConfig):
        seen: set[str] = set()
        for i, model in enumerate(config.models):
            if model.name in seen:
                raise ConfigError(f"{source}: models[{i}].name: {model.name!r} is declared twice")
            seen.add(model.name)
            names = [p.name for p in model.profiles]
            for j, name in enumerate(names):
                if names.index(name) != j:
                    raise ConfigError(
                        f"{source}: models[{i}].profiles[{j}].name: {name!r} is used twice "
                        "in this model; give each profile its own name"
                    )
        if not config.auth.require_api_key and config.listen.host not in _LOOPBACK:
            raise ConfigError(
                f"{source}: auth.require_api_key: false is allowed only when listen.host is "
                f"a loopback address, not {config.listen.host!r}: anyone who can reach the "
                "port could use every model"
            )
        timeouts = config.nodes
        if not timeouts.heartbeat_interval_s < timeouts.unreachable_after_s < timeouts.lost_after_s:
            raise ConfigError(
                f"{source}: nodes: need heartbeat_interval_s < unreachable_after_s < lost_after_s"
            )
    else:
        low, high = config.port_range
        if low > high:
            raise ConfigError(f"{source}: port_range: {low} is above {high}; write it low, high")
