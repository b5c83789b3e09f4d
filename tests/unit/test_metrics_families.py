"""The families /metrics gained beside the request counts: tokens, time to first token
and between tokens, requests by owner, the controller's counts, replicas and engine
installs by state, the certificates' expiry. Each against a throwaway registry, fed as
the gateway and the controller feed it, and each bounded whatever it is fed."""

from __future__ import annotations

import datetime as dt
import logging
import re
import secrets
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from prometheus_client.parser import text_string_to_metric_families

from llmgw import wire
from llmgw.config import Model, ServerTls
from llmgw.core.catalog import catalog_from_config
from llmgw.core.inventory import Timeouts
from llmgw.core.placement import REFUSAL_KINDS
from llmgw.core.replicas import ReplicaState
from llmgw.core.usage import Usage
from llmgw.server.agents.sessions import NodeSessions
from llmgw.server.controller_stats import ACTIONS, ControllerStats
from llmgw.server.metrics import (
    INTER_TOKEN_BUCKETS,
    MAX_OWNERS,
    UNKNOWN_MODEL,
    Metrics,
)
from llmgw.server.openai.router import Router
from llmgw.server.openai.timing import StreamClock, timed_sink, timed_write
from llmgw.store import ApiKeyRecord

ROLE = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
NULL = b'data: {"choices":[{"delta":{"role":"assistant","content":null}}]}\n\n'
TOKEN = b'data: {"choices":[{"delta":{"content":"Hel"}}]}\n\n'
TEXT = b'data: {"choices":[{"text":"lo","index":0}]}\n\n'


def _metrics(*names: str, replicas=(), sessions=None, **kwargs) -> Metrics:
    models = [msgspec.convert({"name": n, "profiles": [{"engine": "sim"}]}, Model)
              for n in names]
    controller = SimpleNamespace(catalog=catalog_from_config(models),
                                 replicas={r.id: r for r in replicas},
                                 sessions=sessions or NodeSessions(Timeouts()))
    return Metrics(controller, Router(), process=False, **kwargs)  # type: ignore[arg-type]


def _value(m: Metrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def _series(m: Metrics, family: str) -> list[dict[str, str]]:
    return [s.labels for f in text_string_to_metric_families(m.exposition().decode())
            for s in f.samples if s.name.startswith(family)]


def test_tokens_count_per_catalog_model_and_direction():
    m = _metrics("m1")
    m.request_done("m1", "chat", 200, 0.1, usage=Usage(12, 30))
    m.request_done("m1", "completions", 200, 0.1, usage=Usage(3, 4))
    m.request_done("m1", "chat", 200, 0.1)  # an engine that reported nothing
    for name in ("nope", None, 'x"y', secrets.token_hex(8)):
        m.request_done(name, "other", 200, 0.1, usage=Usage(1, 2))
    assert _value(m, "llmgw_tokens_total", model="m1", direction="input") == 15
    assert _value(m, "llmgw_tokens_total", model="m1", direction="output") == 34
    assert _value(m, "llmgw_tokens_total", model=UNKNOWN_MODEL, direction="input") == 4
    assert {s["model"] for s in _series(m, "llmgw_tokens")} == {"m1", UNKNOWN_MODEL}


def test_the_first_token_is_the_first_read_with_generated_text():
    m = _metrics("m1")
    clock = StreamClock(m.stream_series("m1"), began=0.0)
    clock.read(ROLE)
    clock.read(NULL)
    assert clock.first_token is None  # a role, an empty or null content: no token yet
    clock.read(TOKEN)
    assert clock.first_token is not None and clock.first_token > 0
    clock.reads([TOKEN, TOKEN])  # one read, two events: one gap
    clock.read(b"data: [DONE]\n\n")
    clock.done()
    assert _value(m, "llmgw_time_to_first_token_seconds_count", model="m1") == 1
    assert _value(m, "llmgw_time_to_first_token_seconds_sum",
                  model="m1") == pytest.approx(clock.first_token)
    assert _value(m, "llmgw_inter_token_latency_seconds_count", model="m1") == 2
    assert _value(m, "llmgw_inter_token_latency_seconds_bucket", model="m1",
                  le=str(INTER_TOKEN_BUCKETS[-1])) == 2  # in-process gaps: under 2.5 s
    # The gaps' sum, added once at the end: from the first token to the last read.
    assert _value(m, "llmgw_inter_token_latency_seconds_sum",
                  model="m1") == pytest.approx(clock.last - clock.first_at)
    assert 0 < clock.last - clock.first_at < 2.5
    # A completion's text, split across a read's parts, is a token too.
    other = StreamClock(m.stream_series("m1"), began=0.0)
    other.reads([TEXT[:20], TEXT[20:]])
    assert other.first_token is not None


def test_timed_relays_hand_on_every_read_as_it_came():
    m = _metrics("m1")
    clock = StreamClock(m.stream_series("m1"), began=0.0)
    written: list[bytes] = []
    write = timed_write(lambda data: written.append(data) or "as write says", clock)
    assert write(TOKEN) == "as write says"
    sunk: list[list[bytes]] = []
    sink = timed_sink(lambda chunks: sunk.append(chunks) or False, clock)
    assert sink([TOKEN, ROLE]) is False
    assert sink([TOKEN]) is False
    clock.done()
    assert written == [TOKEN] and sunk == [[TOKEN, ROLE], [TOKEN]]
    # Two gaps after the first token, counted in the same buckets observe would use.
    assert _value(m, "llmgw_inter_token_latency_seconds_count", model="m1") == 2
    assert _value(m, "llmgw_inter_token_latency_seconds_bucket", model="m1",
                  le=str(INTER_TOKEN_BUCKETS[-1])) == 2  # back to back: under 2.5 s
    assert _value(m, "llmgw_inter_token_latency_seconds_sum",
                  model="m1") == pytest.approx(clock.last - clock.first_at)


def _key(account_id: int | None) -> ApiKeyRecord:
    return ApiKeyRecord(prefix=secrets.token_hex(4), secret_hash="00", name="k",
                        created_at=dt.datetime.now(dt.UTC), account_id=account_id)


def test_requests_by_owner_are_bounded_by_the_accounts_counted():
    m = _metrics("m1")
    m._owner_names = {1: "alice", 2: "bob"}  # as name_owners reads them from the store
    m.request_done("m1", "chat", 200, 0.1, _key(1))
    m.request_done("m1", "chat", 429, 0.1, _key(1))
    m.request_done("m1", "chat", 200, 0.1, _key(2))
    m.request_done("m1", "chat", 401, 0.1, None)
    m.request_done("m1", "chat", 200, 0.1, _key(None))
    m.request_done("m1", "chat", 200, 0.1, _key(99))  # an id the store did not name
    assert _value(m, "llmgw_requests_by_owner_total", owner="alice", status="2xx") == 1
    assert _value(m, "llmgw_requests_by_owner_total", owner="alice", status="4xx") == 1
    assert _value(m, "llmgw_requests_by_owner_total", owner="bob", status="2xx") == 1
    assert _value(m, "llmgw_requests_by_owner_total", owner="anonymous", status="4xx") == 1
    assert _value(m, "llmgw_requests_by_owner_total", owner="unowned", status="2xx") == 1
    assert _value(m, "llmgw_requests_by_owner_total", owner="other", status="2xx") == 1

    # However many accounts send requests, the series stop at MAX_OWNERS of them.
    for account in range(100, 100 + 2 * MAX_OWNERS):
        m.request_done("m1", "chat", 200, 0.01, _key(account))
    assert len(m._owners) <= MAX_OWNERS + 3
    m._owner_names |= {a: f"user{a}" for a in range(100, 100 + 2 * MAX_OWNERS)}
    samples = [s for f in text_string_to_metric_families(m.exposition().decode())
               for s in f.samples if s.name == "llmgw_requests_by_owner_total"]
    assert len({s.labels["owner"] for s in samples}) <= MAX_OWNERS + 3
    # Every request counted: those of the accounts past the cap (the first 3 counted
    # were 1, 2 and 99) as "other", with account 99's, which has no name.
    assert sum(s.value for s in samples) == 6 + 2 * MAX_OWNERS
    past_cap = 2 * MAX_OWNERS - (MAX_OWNERS - 3)
    assert sum(s.value for s in samples if s.labels["owner"] == "other") == 1 + past_cap


def test_the_controllers_counts():
    stats = ControllerStats()
    m = _metrics("m1", stats=stats)
    stats.pass_done(0.003)
    stats.pass_done(0.2)
    for action in ("place", "place", "reap", "evict"):
        stats.action(action)
    stats.refused("gpus")
    stats.refused("gpus")
    stats.refused("something new")  # not a kind placement names: counted as other
    stats.failed("m1")
    stats.failed("since-removed")
    stats.stream_connects.n += 3
    stats.stream_disconnects.n += 1
    assert _value(m, "llmgw_controller_pass_seconds_count") == 2
    assert _value(m, "llmgw_controller_pass_seconds_bucket", le="0.005") == 1
    assert _value(m, "llmgw_controller_actions_total", action="place") == 2
    assert _value(m, "llmgw_controller_actions_total", action="stop") == 0
    assert {s["action"] for s in _series(m, "llmgw_controller_actions")} == set(ACTIONS)
    assert _value(m, "llmgw_placement_refusals_total", reason="gpus") == 2
    assert _value(m, "llmgw_placement_refusals_total", reason="other") == 1
    assert {s["reason"] for s in _series(m, "llmgw_placement_refusals")} == set(REFUSAL_KINDS)
    assert _value(m, "llmgw_replica_failures_total", model="m1") == 1
    assert _value(m, "llmgw_replica_failures_total", model=UNKNOWN_MODEL) == 1
    assert _value(m, "llmgw_agent_stream_connects_total") == 3
    assert _value(m, "llmgw_agent_stream_disconnects_total") == 1


def _register(node: str, *engines: tuple[str, str]) -> wire.Register:
    return wire.Register(node_id=node, address="127.0.0.1", inventory=wire.Inventory(
        hostname=node, engines=[wire.Engine(name=n, state=s) for n, s in engines]))


def test_replicas_and_engine_installs_by_state():
    replicas = [SimpleNamespace(id=f"r{i}", model=model, state=state) for i, (model, state)
                in enumerate([("m1", ReplicaState.READY), ("m1", ReplicaState.STARTING),
                              ("m1", ReplicaState.FAILED), ("gone", ReplicaState.READY)])]
    sessions = NodeSessions(Timeouts())
    sessions.attach(_register("a", ("llama.cpp", "installed"), ("vllm", "installing"),
                              ("sim", "installed")), 0.0)
    sessions.attach(_register("b", ("llama.cpp", "failed"), ("made-up", "installed"),
                              ("vllm", "half-done")), 0.0)
    m = _metrics("m1", "m2", replicas=replicas, sessions=sessions)
    assert _value(m, "llmgw_replicas", model="m1", state="ready") == 1
    assert _value(m, "llmgw_replicas", model="m1", state="failed") == 1
    assert _value(m, "llmgw_replicas", model="m2", state="starting") == 0
    assert _value(m, "llmgw_replicas", model=UNKNOWN_MODEL, state="ready") == 1
    assert _value(m, "llmgw_engine_installs", engine="llama.cpp", state="installed") == 1
    assert _value(m, "llmgw_engine_installs", engine="llama.cpp", state="failed") == 1
    assert _value(m, "llmgw_engine_installs", engine="vllm", state="installing") == 1
    assert _value(m, "llmgw_engine_installs", engine="vllm", state="other") == 1
    assert _value(m, "llmgw_engine_installs", engine="other", state="installed") == 1
    assert _value(m, "llmgw_engine_installs", engine="sglang", state="installed") == 0
    engines = {s["engine"] for s in _series(m, "llmgw_engine_installs")}
    assert "made-up" not in engines


def _certificate(path: Path, days: int) -> float:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test")])
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(now + dt.timedelta(days=days))
            .sign(key, hashes.SHA256()))
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return (now + dt.timedelta(days=days)).timestamp()


def test_certificate_expiry_is_read_again_when_the_file_changes(tmp_path, caplog):
    ca, server = tmp_path / "ca.pem", tmp_path / "server.pem"
    ca_expiry, server_expiry = _certificate(ca, 3650), _certificate(server, 30)
    tls = ServerTls(ca_file=str(ca), ca_key_file=str(tmp_path / "ca.key"),
                    cert_file=str(server), key_file=str(tmp_path / "server.key"))
    m = _metrics("m1", tls=tls)
    name = "llmgw_certificate_expiry_timestamp_seconds"
    assert _value(m, name, certificate="ca") == ca_expiry
    assert _value(m, name, certificate="server") == server_expiry
    renewed = _certificate(server, 60)  # a renewal writes a new file in its place
    assert _value(m, name, certificate="server") == renewed
    caplog.set_level(logging.WARNING, logger="llmgw.server.metrics")
    server.write_text("not a certificate\n")
    for _ in range(3):
        assert _value(m, name, certificate="server") is None
        assert _value(m, name, certificate="ca") == ca_expiry
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "holds no PEM certificate" in warned[0]


def test_docs_observability_lists_every_family_the_server_exposes(tmp_path):
    """docs/observability.md names each llmgw_ family /metrics can hold, and no other."""
    ca, cert = tmp_path / "ca.pem", tmp_path / "server.pem"
    _certificate(ca, 365)
    _certificate(cert, 30)
    tls = SimpleNamespace(ca_file=str(ca), cert_file=str(cert))
    store = SimpleNamespace(outage=None)
    m = _metrics("m1", stats=ControllerStats(), store=store, tls=tls)
    # Counters are exposed as NAME_total; the docs write the name a query uses.
    exposed = {f.name + ("_total" if f.type == "counter" else "")
               for f in m.registry.collect() if f.name.startswith("llmgw_")}
    docs = (Path(__file__).parents[2] / "docs" / "observability.md").read_text()
    documented = set(re.findall(r"`(llmgw_[a-z_]+)(?:\{[^`]*\})?`", docs))
    documented = {name for name in documented if not name.endswith(("_bucket", "_count",
                                                                     "_sum"))}
    assert exposed - documented == set(), "exposed, not in docs/observability.md"
    assert documented - exposed == set(), "in docs/observability.md, not exposed"
