"""The agent stream protocol: the one contract between the control plane and its agents.

One WebSocket per node carries msgpack frames, each a tagged msgspec Struct (the tag is
the ``type`` field). ``Up`` messages go from agent to server, ``Down`` from server to
agent.

Compatibility rules, so that a half-upgraded cluster keeps working:
- fields a newer peer added are ignored (msgspec's default for Structs);
- a new field here always has a default, so an older peer may omit it;
- a message type this side does not know is skipped with a log line, not a disconnect;
- ``PROTOCOL_VERSION`` goes up only for a change an older peer cannot ignore, and the
  server accepts every version from ``MIN_PROTOCOL_VERSION``.
"""

from __future__ import annotations

import msgspec

PROTOCOL_VERSION = 1
MIN_PROTOCOL_VERSION = 1

# fetching | starting | ready | unhealthy | failed | stopped. Plain text, not a closed
# set, so that a newer agent's new state is read as "not ready" here rather than as a
# broken peer.
ShardState = str


class WireError(Exception):
    """A frame that is not a message of this protocol (garbage, or a malformed message)."""


class _Struct(msgspec.Struct, kw_only=True, omit_defaults=True):
    pass


# --- inventory: what a node says about itself ---------------------------------------------


class Gpu(_Struct):
    index: int
    name: str
    memory_total_mib: int
    memory_free_mib: int
    uuid: str = ""
    pci_bus_id: str = ""


class Engine(_Struct):
    """An engine the node can run. ``state`` is ``installed`` (seen to run), ``configured``
    (named on purpose in agent.yaml), ``installing`` or ``failed``; ``detail`` is the node's
    own words about it."""

    name: str
    version: str = ""
    state: str = "installed"
    detail: str = ""


class WeightsDir(_Struct):
    """One directory the agent looks in for weights, and the complete weights in it (by
    key, see core.weights). ``note`` says what could not be read or what was skipped as
    incomplete."""

    path: str
    shared: bool = False
    total_mib: int = 0
    free_mib: int = 0
    held: list[str] = []
    note: str = ""


class RdmaPort(_Struct):
    """An InfiniBand (or RoCE) port from sysfs."""

    adapter: str
    port: int
    state: str = ""
    rate_gbps: float = 0.0
    link_layer: str = ""
    guid: str = ""


class Inventory(_Struct):
    hostname: str
    os: str = ""  # "ubuntu 24.04"
    os_like: str = ""  # ID_LIKE: "debian", "rhel fedora"
    kernel: str = ""
    arch: str = ""
    cpu_model: str = ""
    cpu_count: int = 0
    cpu_flags: list[str] = []
    ram_total_mib: int = 0
    ram_available_mib: int = 0
    gpus: list[Gpu] = []
    gpu_driver: str = ""
    cuda: str = ""  # the CUDA version the driver supports
    engines: list[Engine] = []
    fabric: str | None = None
    labels: dict[str, str] = {}
    disabled_engines: list[str] = []
    # Keys of the weights complete on this node (or on a filer it sees): every
    # directory's ``held``, once each.
    weights: list[str] = []
    weights_dirs: list[WeightsDir] = []
    rdma: list[RdmaPort] = []


class RunningShard(_Struct):
    """A shard the node is running, reported at registration so the control plane can adopt
    it instead of restarting it."""

    replica: str
    rank: int
    world_size: int
    epoch: int
    model: str
    profile: str
    engine: str
    port: int | None = None
    state: ShardState = "starting"


# --- up: agent -> server ------------------------------------------------------------------


class Register(_Struct, tag="register", tag_field="type"):
    node_id: str
    address: str
    inventory: Inventory
    running: list[RunningShard] = []
    port_range: tuple[int, int] = (20000, 20999)
    # Ports in that range something else on the node listens on: never to be assigned.
    ports_busy: list[int] = []
    protocol: int = PROTOCOL_VERSION
    agent_version: str = ""
    # Engines this agent knows how to install; None (an older agent) means llama.cpp only.
    installable_engines: list[str] | None = None
    # What this agent does beyond protocol 1 (FEATURE_*): the server sends a request only
    # to an agent that named it, as an older one would skip it unanswered.
    features: list[str] = []
    # How this node's llmgw is installed: INSTALL_NIX (the system owns it; upgraded with
    # nixos-rebuild), INSTALL_PYTHON (a Python environment the agent may replace itself,
    # with FEATURE_SELF_UPGRADE); "" from an older agent.
    installation: str = ""


class Heartbeat(_Struct, tag="heartbeat", tag_field="type"):
    ram_available_mib: int = 0
    gpu_memory_free_mib: list[int] = []
    # Free space of each weights directory, in the inventory's order.
    weights_free_mib: list[int] = []
    ports_busy: list[int] = []
    sent_at: float = 0.0


class InventoryUpdate(_Struct, tag="inventory", tag_field="type"):
    """The node's inventory changed (more RAM, an engine installed, weights fetched):
    the whole new inventory, sent only when it differs from the last one sent."""

    inventory: Inventory


class ShardStatus(_Struct, tag="shard_status", tag_field="type"):
    """A shard's transition. On failure ``output_tail`` holds the engine's last lines."""

    replica: str
    rank: int
    epoch: int
    state: ShardState
    port: int | None = None
    detail: str = ""
    exit_code: int | None = None
    output_tail: list[str] = []


class RenewCertificate(_Struct, tag="renew_certificate", tag_field="type"):
    """The node's certificate has less than a third of its lifetime left: a CSR (PEM),
    signed by the node's key, for the server to sign on the mTLS stream. The new
    certificate names the stream's node, whatever the CSR says."""

    csr: str


# --- down: server -> agent ----------------------------------------------------------------


class Welcome(_Struct, tag="welcome", tag_field="type"):
    node_id: str
    heartbeat_interval_s: float = 3.0
    protocol: int = PROTOCOL_VERSION
    # The leader's term (0: a server that does not elect one). The agent refuses
    # commands from an older term: they come from a server that no longer leads.
    term: int = 0
    # MIRROR_HUB when the server serves an imported bundle: the path, on the address the
    # agent dialled, of a Hugging Face-shaped hub of the bundle's models; "" when not.
    mirror: str = ""


class Sidecar(_Struct):
    name: str
    command: list[str]
    env: dict[str, str] = {}
    port: int | None = None
    startup_timeout_s: float = 120.0


class ShardProfile(_Struct):
    """What an engine needs to know of the model's profile to launch one shard."""

    name: str
    engine: str
    args: list[str] = []
    env: dict[str, str] = {}
    weights: str | None = None
    source: str | None = None
    files: list[str] = []
    weights_key: str = ""
    startup_timeout_s: float = 600.0
    embeddings: bool = False
    launch_mode: str = "mp"
    sidecars: list[Sidecar] = []


class StartShard(_Struct, tag="start_shard", tag_field="type"):
    replica: str
    rank: int
    world_size: int
    epoch: int
    model: str
    profile: ShardProfile
    port: int | None = None
    gpus: list[int] = []
    leader_address: str = ""
    rendezvous_port: int | None = None
    # "address:port" of every rank, by rank.
    peers: list[str] = []
    term: int = 0  # the leader's term that sent it; see Welcome
    # W3C trace context (traceparent, tracestate) of the span this command continues;
    # empty when the server does not trace.
    trace: dict[str, str] = {}


class StopShard(_Struct, tag="stop_shard", tag_field="type"):
    replica: str
    rank: int
    epoch: int
    reason: str = ""
    term: int = 0  # the leader's term that sent it; see Welcome
    # W3C trace context (traceparent, tracestate) of the span this command continues;
    # empty when the server does not trace.
    trace: dict[str, str] = {}


# The control plane's mirror of an imported bundle (server/mirror.py), on the address
# the agent dialled. A URL that starts with MIRROR_SCHEME is relative to that server:
# "llmgw-mirror:/mirror/files/engines/llama.cpp" is <server>/mirror/files/engines/llama.cpp.
MIRROR_SCHEME = "llmgw-mirror:"
MIRROR_FILES = "/mirror/files"
MIRROR_HUB = "/mirror/hub"
MIRROR_ENGINES_URL = f"{MIRROR_SCHEME}{MIRROR_FILES}/engines"
# Register.features: the agent resolves MIRROR_SCHEME URLs; an older one is sent the
# publisher's (or engine_mirror's) URLs instead.
FEATURE_MIRROR = "mirror"


class EngineWanted(_Struct):
    """One engine the control plane wants on this node (see core.desired_engines).
    Archives are at ``<release_url>/<version>/<file>``; ``digests_url`` is where their
    sha256 come from (a SHA256SUMS file, or GitHub's release JSON), unless ``sha256`` pins
    a file's. A source archive (ComfyUI's tag archive) is at ``<release_url>/<file>``, and
    only a pinned ``sha256`` is taken for it: GitHub publishes none. A ``release_url`` on
    the control plane's mirror (MIRROR_SCHEME) comes with every file pinned, from the
    bundle's signed manifest, and no ``digests_url``."""

    name: str
    version: str
    build: str = "auto"  # auto, or the name of one build
    release_url: str = ""
    digests_url: str = ""
    sha256: dict[str, str] = {}
    index_url: str = ""
    exclude_newer: str = ""


class InstallEngines(_Struct, tag="install_engines", tag_field="type"):
    """The whole list of engines the node should have; engines it installed that are not
    on it are no longer reported."""

    engines: list[EngineWanted] = []
    # W3C trace context (traceparent, tracestate) of the span this command continues;
    # empty when the server does not trace.
    trace: dict[str, str] = {}


class Certificate(_Struct, tag="certificate", tag_field="type"):
    """The answer to a RenewCertificate: the node's new certificate and the CA (PEM), for
    the agent's next connection."""

    cert: str
    ca: str


class CertificateRefused(_Struct, tag="certificate_refused", tag_field="type"):
    """A RenewCertificate the server would not sign, and why; the agent asks again later."""

    reason: str


# --- a shard's output, for `llmgw ctl logs` -------------------------------------------------

# Register.features: the agent answers ShardLogRequest.
FEATURE_SHARD_LOGS = "shard_logs"


class ShardLogRequest(_Struct, tag="shard_log_request", tag_field="type"):
    """Down: send the last ``tail_bytes`` of the shard's output (the agent sends at most
    1 MiB), then, with ``follow``, what it writes next, until a ShardLogCancel for
    ``request``, the shard stops, or the stream closes. Answered by ShardLog messages that
    carry ``request``."""

    request: str
    replica: str
    rank: int
    tail_bytes: int = 65536
    follow: bool = False


class ShardLogCancel(_Struct, tag="shard_log_cancel", tag_field="type"):
    """Down: stop sending the output asked for by ``request``."""

    request: str


class ShardLog(_Struct, tag="shard_log", tag_field="type"):
    """Up: a piece of a shard's output (at most 64 KiB of it), for ``request``. The last
    piece has ``done``; its ``error`` says why the output ends there, or, before any
    output, why there is none."""

    request: str
    data: str = ""
    done: bool = False
    error: str = ""


# --- the agent replacing its own llmgw, for `llmgw ctl upgrade` -----------------------------

# Register.features: the agent answers UpgradeAgent.
FEATURE_SELF_UPGRADE = "self_upgrade"
INSTALL_NIX = "nix"
INSTALL_PYTHON = "python"


class UpgradeWheel(_Struct):
    """One wheel of llmgw's release, on the control plane's mirror (a MIRROR_SCHEME URL),
    pinned by the bundle's signed manifest."""

    url: str
    sha256: str
    size: int


class UpgradeAgent(_Struct, tag="upgrade_agent", tag_field="type"):
    """Down: install llmgw ``version`` from ``wheels`` (every platform's: the agent takes
    those that can suit it, and the installer picks), check it, and restart into it with
    the shards left running. Answered by UpgradeStatus messages that carry ``request``."""

    request: str
    version: str
    wheels: list[UpgradeWheel] = []


# UpgradeStatus.state: working (a step; ``detail`` says which), failed (``detail`` says
# why; the agent runs on as it was), restarting (installed and checked: the agent is
# about to run the new llmgw, which registers with its version).
UPGRADE_WORKING = "working"
UPGRADE_FAILED = "failed"
UPGRADE_RESTARTING = "restarting"


class UpgradeStatus(_Struct, tag="upgrade_status", tag_field="type"):
    """Up: how an UpgradeAgent is going."""

    request: str
    state: str
    detail: str = ""


Up = (Register | Heartbeat | InventoryUpdate | ShardStatus | RenewCertificate
      | ShardLog | UpgradeStatus)
Down = (Welcome | StartShard | StopShard | Certificate | CertificateRefused
        | InstallEngines | ShardLogRequest | ShardLogCancel | UpgradeAgent)

_UP_TAGS = frozenset({"register", "heartbeat", "inventory", "shard_status",
                      "renew_certificate", "shard_log", "upgrade_status"})
_DOWN_TAGS = frozenset({"welcome", "start_shard", "stop_shard", "certificate",
                        "certificate_refused", "install_engines", "shard_log_request",
                        "shard_log_cancel", "upgrade_agent"})

_encoder = msgspec.msgpack.Encoder()
_up_decoder = msgspec.msgpack.Decoder(Up)
_down_decoder = msgspec.msgpack.Decoder(Down)
_any_decoder = msgspec.msgpack.Decoder()


def encode(message: Up | Down) -> bytes:
    return _encoder.encode(message)


def _decode(frame: bytes, decoder: msgspec.msgpack.Decoder, known: frozenset[str]):
    try:
        return decoder.decode(frame)
    except msgspec.DecodeError as exc:
        # A message type from a newer peer is skipped; anything else is a broken peer.
        try:
            raw = _any_decoder.decode(frame)
        except msgspec.DecodeError:
            raise WireError(f"not a msgpack frame: {exc}") from None
        tag = raw.get("type") if isinstance(raw, dict) else None
        if isinstance(tag, str) and tag not in known:
            return None
        raise WireError(f"malformed message: {exc}") from None


def decode_up(frame: bytes) -> Up | None:
    """Decode an agent's frame; ``None`` for a message type this version does not know."""
    return _decode(frame, _up_decoder, _UP_TAGS)


def decode_down(frame: bytes) -> Down | None:
    """Decode a server's frame; ``None`` for a message type this version does not know."""
    return _decode(frame, _down_decoder, _DOWN_TAGS)
