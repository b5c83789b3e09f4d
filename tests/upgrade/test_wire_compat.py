"""llmgw/wire.py against the protocols of older peers, in all four directions.

An older peer's protocol is a frozen copy of its wire.py: wire_v<N>.py for every version
the server still accepts (MIN_PROTOCOL_VERSION..PROTOCOL_VERSION), and the previous
release's, from git (release.py). Every message type either side has is built with every
field set away from its default (omit_defaults would leave a default off the wire), so a
field added here later is crossed too without a change to this file:

- an older agent's Up decodes here, and an older server's Down too (no field became
  required, no type changed);
- this side's Up and Down decode there (what it does not know is ignored, a message type
  it does not know is skipped, not a broken peer);
- a field both sides know arrives with the value sent.
"""

from __future__ import annotations

import importlib
import typing
from pathlib import Path
from types import ModuleType

import msgspec
import msgspec.inspect as mi
import pytest

from llmgw import wire
from tests.upgrade import release

HERE = Path(__file__).resolve().parent


def _frozen(version: int) -> ModuleType:
    return importlib.import_module(f"tests.upgrade.wire_v{version}")


@pytest.fixture(params=[*(f"wire_v{v}" for v in range(wire.MIN_PROTOCOL_VERSION,
                                                     wire.PROTOCOL_VERSION + 1)),
                        "previous-release"])
def older(request) -> ModuleType:
    """An older peer's wire module."""
    if request.param == "previous-release":
        return release.previous_wire()
    return _frozen(int(request.param.removeprefix("wire_v")))


def test_every_accepted_protocol_version_is_frozen():
    for version in range(wire.MIN_PROTOCOL_VERSION, wire.PROTOCOL_VERSION + 1):
        assert (HERE / f"wire_v{version}.py").is_file(), (
            f"protocol {version} is accepted (MIN_PROTOCOL_VERSION..PROTOCOL_VERSION) but "
            f"not frozen: copy llmgw/wire.py as it is at protocol {version} to "
            f"tests/upgrade/wire_v{version}.py")
        assert version == _frozen(version).PROTOCOL_VERSION


def _value(t: mi.Type):
    """A value of type ``t`` that is no field's default."""
    match t:
        case mi.BoolType():
            return True
        case mi.IntType():
            return 7
        case mi.FloatType():
            return 0.5
        case mi.StrType():
            return "text"
        case mi.ListType(item_type=item):
            return [_value(item)]
        case mi.DictType(key_type=key, value_type=value):
            return {_value(key): _value(value)}
        case mi.TupleType(item_types=items):
            return tuple(_value(item) for item in items)
        case mi.UnionType(types=types):
            return _value(next(u for u in types if not isinstance(u, mi.NoneType)))
        case mi.StructType(cls=cls, fields=fields):
            return cls(**{f.name: _value(f.type) for f in fields})
    raise TypeError(f"no sample value for {t}: teach _value this type")


def _samples(union) -> dict[str, msgspec.Struct]:
    """One message of every type in ``union`` (wire.Up or Down), by tag."""
    return {cls.__struct_config__.tag: _value(mi.type_info(cls))
            for cls in typing.get_args(union)}


def _differences(sent, got, where: str) -> list[str]:
    """Where a field both sides know did not arrive as sent."""
    if isinstance(sent, msgspec.Struct):
        if not isinstance(got, msgspec.Struct):
            return [f"{where}: sent a {type(sent).__name__}, got {got!r}"]
        shared = [f for f in sent.__struct_fields__ if f in got.__struct_fields__]
        return [d for f in shared
                for d in _differences(getattr(sent, f), getattr(got, f), f"{where}.{f}")]
    if isinstance(sent, list | tuple) and isinstance(got, list | tuple) \
            and len(sent) == len(got):
        return [d for i, (a, b) in enumerate(zip(sent, got, strict=True))
                for d in _differences(a, b, f"{where}[{i}]")]
    if isinstance(sent, dict) and isinstance(got, dict) and sent.keys() == got.keys():
        return [d for k in sent for d in _differences(sent[k], got[k], f"{where}[{k!r}]")]
    return [] if sent == got else [f"{where}: sent {sent!r}, got {got!r}"]


def _cross(samples: dict[str, msgspec.Struct], encode, decode, known: set[str]) -> list[str]:
    """Send every sample with ``encode``, read it with ``decode``: what went wrong."""
    wrong = []
    for tag, message in samples.items():
        try:
            got = decode(encode(message))
        except Exception as exc:  # WireError, or worse: either is the finding
            wrong.append(f"{tag}: {exc}")
            continue
        if tag not in known:
            if got is not None:
                wrong.append(f"{tag}: unknown to the receiver, yet read as {got!r}")
        elif got is None:
            wrong.append(f"{tag}: skipped as unknown")
        else:
            wrong.extend(_differences(message, got, tag))
    return wrong


def _tags(union) -> set[str]:
    return {cls.__struct_config__.tag for cls in typing.get_args(union)}


def _assert_crosses(sender: ModuleType, receiver: ModuleType, direction: str) -> None:
    decode = receiver.decode_up if direction == "Up" else receiver.decode_down
    wrong = _cross(_samples(getattr(sender, direction)), sender.encode, decode,
                   _tags(getattr(receiver, direction)))
    assert not wrong, (f"{direction} messages from {sender.__name__} do not read on "
                       f"{receiver.__name__}:\n" + "\n".join(wrong))


def test_an_older_agent_s_messages_read_here(older):
    _assert_crosses(older, wire, "Up")


def test_this_server_s_messages_read_on_an_older_agent(older):
    _assert_crosses(wire, older, "Down")


def test_an_older_server_s_messages_read_here(older):
    _assert_crosses(older, wire, "Down")


def test_this_agent_s_messages_read_on_an_older_server(older):
    _assert_crosses(wire, older, "Up")


def test_the_crossing_finds_what_would_break_an_older_peer():
    """A field made required, a field's type changed, a known message skipped: each is
    reported. (A field renamed with a default is not: to the receiver it is a field the
    sender dropped, which the rules allow.)"""

    class Old(msgspec.Struct, tag="welcome", tag_field="type", kw_only=True,
              omit_defaults=True):
        node_id: str
        heartbeat_interval_s: float = 3.0

    class NewRequired(msgspec.Struct, tag="welcome", tag_field="type", kw_only=True):
        node_id: str
        term: int

    class NewType(msgspec.Struct, tag="welcome", tag_field="type", kw_only=True):
        node_id: str
        heartbeat_interval_s: int = 3

    old = {"welcome": _value(mi.type_info(Old))}
    encode = msgspec.msgpack.encode
    assert _cross(old, encode, msgspec.msgpack.Decoder(Old).decode, {"welcome"}) == []
    for new in (NewRequired, NewType):
        [finding] = _cross(old, encode, msgspec.msgpack.Decoder(new).decode, {"welcome"})
        assert finding.startswith("welcome: ")
    assert _cross(old, encode, lambda frame: None, {"welcome"}) == [
        "welcome: skipped as unknown"]
