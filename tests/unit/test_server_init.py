"""`llmgw server init`: where the server it sets up listens. Told one IP address, there and
nowhere else; every interface only when the addresses need it, or when asked."""

from __future__ import annotations

import pytest

from llmgw.cli.main import main
from llmgw.cli.server_init import InitError, check_listen, init, listen_host
from llmgw.config import ServerConfig, load


@pytest.mark.parametrize(("addresses", "host"), [
    (["127.0.0.1"], "127.0.0.1"),
    (["10.1.2.3"], "10.1.2.3"),
    (["::1"], "::1"),
    (["2001:db8::7"], "2001:db8::7"),
    (["localhost"], "127.0.0.1"),
    (["127.0.0.1", "localhost"], "127.0.0.1"),   # one address, named twice
    (["::1", "localhost"], "::1"),
    (["10.1.2.3", "localhost"], "0.0.0.0"),       # and loopback too
    (["10.1.2.3", "10.1.2.3"], "10.1.2.3"),
    (["10.1.2.3", "cp.example.org"], "0.0.0.0"),  # a name may resolve to any address
    (["cp.example.org"], "0.0.0.0"),
    (["10.1.2.3", "10.1.2.4"], "0.0.0.0"),        # one socket: one address, or all
    (["10.1.2.3", "2001:db8::7"], "0.0.0.0"),
    (["2001:db8::7", "2001:db8::8"], "::"),
])
def test_the_listener_goes_where_the_addresses_say(addresses, host) -> None:
    assert listen_host(addresses) == host


def test_listen_takes_an_ip_address_only() -> None:
    assert [check_listen(h) for h in ("0.0.0.0", "::", "[::1]", "10.0.0.5")] == [
        "0.0.0.0", "::", "::1", "10.0.0.5"]
    with pytest.raises(InitError, match="give an IP address"):
        check_listen("cp.example.org")


def _hosts(path) -> tuple[str, str]:
    config = load(path, ServerConfig)
    return config.listen.host, config.tls.agent_listen.host


def test_init_writes_both_listeners_on_the_one_address(tmp_path) -> None:
    path, _ = init(tmp_path / "a", ["127.0.0.1"], port=9001, agent_port=9002)
    assert _hosts(path) == ("127.0.0.1", "127.0.0.1")
    config = load(path, ServerConfig)
    assert (config.listen.port, config.tls.agent_listen.port) == (9001, 9002)
    path, _ = init(tmp_path / "b", ["10.1.2.3", "cp.example.org"])
    assert _hosts(path) == ("0.0.0.0", "0.0.0.0")
    path, _ = init(tmp_path / "c", ["10.1.2.3", "cp.example.org"], listen="10.1.2.3")
    assert _hosts(path) == ("10.1.2.3", "10.1.2.3")


def test_the_command_says_where_and_takes_listen(tmp_path, capsys) -> None:
    assert main(["server", "init", "--dir", str(tmp_path / "a"), "--address", "127.0.0.1"]) == 0
    out = capsys.readouterr().out
    assert "it listens on 127.0.0.1:8080 (API) and 127.0.0.1:8443 (agent stream)" in out
    assert _hosts(tmp_path / "a" / "server.yaml") == ("127.0.0.1", "127.0.0.1")

    assert main(["server", "init", "--dir", str(tmp_path / "b"), "--address",
                 "cp.example.org"]) == 0
    assert "every IPv4 interface" in capsys.readouterr().out
    assert main(["server", "init", "--dir", str(tmp_path / "c"), "--address",
                 "cp.example.org", "--listen", "[::1]"]) == 0
    assert _hosts(tmp_path / "c" / "server.yaml") == ("::1", "::1")

    assert main(["server", "init", "--dir", str(tmp_path / "d"), "--address", "127.0.0.1",
                 "--listen", "cp.example.org"]) == 2
    assert "--listen cp.example.org: give an IP address" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()  # refused before anything is written


def test_an_address_the_machine_does_not_have_is_warned_of(tmp_path, capsys) -> None:
    # 203.0.113.0/24 is TEST-NET-3: no machine has it.
    assert main(["server", "init", "--dir", str(tmp_path / "a"), "--address",
                 "203.0.113.9"]) == 0
    err = capsys.readouterr().err
    assert "203.0.113.9 is not an address of this machine" in err
    assert _hosts(tmp_path / "a" / "server.yaml") == ("203.0.113.9", "203.0.113.9")
