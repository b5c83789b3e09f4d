"""The agent stream's frames: every message round-trips, a newer peer is tolerated, a broken
one is refused."""

from __future__ import annotations

import msgspec
import pytest

from llmgw import wire
from llmgw.wire import WireError, decode_down, decode_up, encode

INVENTORY = wire.Inventory(
    hostname="node03",
    os="NixOS 25.11",
    arch="x86_64",
    cpu_model="AMD EPYC 9654",
    cpu_count=192,
    cpu_flags=["avx2", "avx512f"],
    ram_total_mib=2_063_731,
    ram_available_mib=1_900_000,
    gpus=[
        wire.Gpu(
            index=i,
            name="NVIDIA H100 80GB HBM3",
            memory_total_mib=81559,
            memory_free_mib=81000,
            uuid=f"GPU-{i:08x}",
            pci_bus_id=f"00000000:{i + 0x18:02X}:00.0",
        )
        for i in range(8)
    ],
    engines=[
        wire.Engine(name="vllm", version="0.11.0"),
        wire.Engine(
            name="llama.cpp",
            state="installing",
            detail="installing: downloading llama-b10991-bin-ubuntu-x64.tar.gz (16 MB)",
        ),
    ],
    fabric="ib-b",
    labels={"rack": "r12"},
)

UP = [
    wire.Register(
        node_id="node03",
        address="10.0.0.3",
        inventory=INVENTORY,
        running=[
            wire.RunningShard(
                replica="qwen-qwen2.5-72b-e7", rank=1, world_size=2, epoch=7,
                model="Qwen/Qwen2.5-72B", profile="tp8x2", engine="vllm", port=20000,
                state="ready",
            )
        ],
        port_range=(21000, 21999),
        agent_version="0.1.0",
    ),
    wire.Heartbeat(ram_available_mib=1024, gpu_memory_free_mib=[81000, 512], sent_at=12.5),
    wire.Heartbeat(),
    wire.ShardStatus(
        replica="m-e3", rank=0, epoch=3, state="failed", port=20004, detail="exit 1",
        exit_code=1, output_tail=["Traceback (most recent call last):", "OOM"],
    ),
]

DOWN = [
    wire.Welcome(node_id="node03", heartbeat_interval_s=2.0),
    wire.StartShard(
        replica="qwen-qwen2.5-72b-e7", rank=0, world_size=2, epoch=7, model="Qwen/Qwen2.5-72B",
        profile=wire.ShardProfile(
            name="tp8x2", engine="vllm", args=["--tensor-parallel-size", "8"],
            env={"NCCL_IB_HCA": "mlx5"}, weights="/models/qwen", startup_timeout_s=1200.0,
        ),
        port=20000, gpus=list(range(8)), leader_address="10.0.0.3", rendezvous_port=20001,
    ),
    wire.StopShard(replica="m-e3", rank=0, epoch=3, reason="scaled down to 0"),
]


def raw(**fields) -> bytes:
    return msgspec.msgpack.encode(fields)


@pytest.mark.parametrize("message", UP, ids=lambda m: type(m).__name__)
def test_up_messages_round_trip(message: wire.Up) -> None:
    assert decode_up(encode(message)) == message


@pytest.mark.parametrize("message", DOWN, ids=lambda m: type(m).__name__)
def test_down_messages_round_trip(message: wire.Down) -> None:
    assert decode_down(encode(message)) == message


def test_frames_carry_their_type_tag() -> None:
    assert msgspec.msgpack.decode(encode(wire.Heartbeat())) == {"type": "heartbeat"}
    assert msgspec.msgpack.decode(encode(DOWN[2]))["type"] == "stop_shard"


# --- a newer peer ----------------------------------------------------------------------------


def test_unknown_fields_from_a_newer_peer_are_tolerated() -> None:
    frame = raw(type="heartbeat", ram_available_mib=5, gpu_temperature_c=[41, 43])

    assert decode_up(frame) == wire.Heartbeat(ram_available_mib=5)


def test_unknown_nested_fields_are_tolerated() -> None:
    frame = raw(
        type="register",
        node_id="n1",
        address="10.0.0.1",
        inventory={"hostname": "n1", "nvlink_topology": "NV18", "gpus": [
            {"index": 0, "name": "g", "memory_total_mib": 1, "memory_free_mib": 1, "mig": True}
        ]},
        attestation="...",
    )

    message = decode_up(frame)

    assert isinstance(message, wire.Register)
    assert message.inventory.gpus == [wire.Gpu(0, "g", 1, 1)]


@pytest.mark.parametrize(
    ("decode", "frame"),
    [
        (decode_up, raw(type="log_lines", lines=["hello"])),
        (decode_down, raw(type="drain", node_id="node03")),
        (decode_down, raw(type="upgrade", version="0.2.0")),
    ],
    ids=["up-log_lines", "down-drain", "down-upgrade"],
)
def test_an_unknown_message_type_decodes_to_none(decode, frame: bytes) -> None:
    assert decode(frame) is None


def test_register_from_an_older_agent_takes_the_defaults() -> None:
    frame = raw(type="register", node_id="n1", address="10.0.0.1", inventory={"hostname": "n1"})

    message = decode_up(frame)

    assert message == wire.Register(
        node_id="n1", address="10.0.0.1", inventory=wire.Inventory(hostname="n1")
    )
    assert message.running == []
    assert message.port_range == (20000, 20999)
    assert message.protocol == wire.PROTOCOL_VERSION
    assert message.agent_version == ""


# --- a broken peer ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "frame",
    [b"", b"\xc1", b"\x92\x01", b"GET / HTTP/1.1\r\n\r\n", raw(type="heartbeat") + b"\x00"],
    ids=["empty", "reserved-byte", "truncated-array", "http", "trailing-bytes"],
)
@pytest.mark.parametrize("decode", [decode_up, decode_down], ids=["up", "down"])
def test_garbage_is_a_wire_error(decode, frame: bytes) -> None:
    with pytest.raises(WireError, match="not a msgpack frame"):
        decode(frame)


def test_a_shard_state_from_a_newer_agent_is_read_not_refused() -> None:
    frame = raw(type="shard_status", replica="r", rank=0, epoch=1, state="warming-up")
    assert decode_up(frame).state == "warming-up"


@pytest.mark.parametrize(
    "frame",
    [
        raw(type="heartbeat", sent_at="now"),
        raw(type="shard_status", replica="r", rank="zero", epoch=1, state="ready"),
        raw(type="register", node_id="n1", address="a"),  # no inventory
        raw(node_id="n1"),  # no type at all
        raw(type=7),
        msgspec.msgpack.encode([1, 2, 3]),
        msgspec.msgpack.encode("register"),
    ],
    ids=[
        "heartbeat-sent_at-str", "rank-str", "register-missing-field",
        "no-type", "int-type", "array", "string",
    ],
)
def test_a_malformed_message_is_a_wire_error(frame: bytes) -> None:
    with pytest.raises(WireError, match="malformed message"):
        decode_up(frame)


def test_a_malformed_down_message_is_a_wire_error() -> None:
    with pytest.raises(WireError, match="malformed message"):
        decode_down(raw(type="stop_shard", replica="r"))
