"""``llmgw server`` on a socket systemd passed it (LISTEN_FDS), as llmgw-server.socket does.

The test plays systemd: it holds the listening socket itself, starts the server with that
socket as fd 3 (through a shell that sets LISTEN_PID to its own pid and execs, as systemd
does), and while a client keeps connecting, stops the server and starts another on the same
socket. No connection may be refused: the kernel queues them while no server runs.
"""

from __future__ import annotations

import http.client
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from llmgw.config import HTTP_SERVERS, Listen
from llmgw.server.listen import (
    ListenError,
    check_matches,
    inherited_listener,
    listening_socket,
)
from tests.integration.activation import listener, start_activated
from tests.integration.cluster import _stop_group, free_port, wait_for


def _write_config(root: Path, port: int, http_server: str = "uvicorn") -> Path:
    path = root / "server.yaml"
    path.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": port, "server": http_server},
        "state_dir": str(root / "state"),
        "log_level": "info",
    }))
    return path


def _healthz(port: int, timeout_s: float) -> int:
    # A new connection each time: each one must be accepted by some server.
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("GET", "/healthz", headers={"connection": "close"})
        return conn.getresponse().status
    finally:
        conn.close()


@dataclass
class _Client:
    """Requests /healthz one after another until told to stop, at most ``max_requests``
    and ``max_s`` seconds; records (start, end, outcome) of each."""

    port: int
    max_requests: int = 3000
    max_s: float = 90.0
    results: list[tuple[float, float, object]] = field(default_factory=list)
    in_flight_since: float | None = None
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        deadline = time.monotonic() + self.max_s
        while (not self.stop.is_set() and len(self.results) < self.max_requests
               and time.monotonic() < deadline):
            began = self.in_flight_since = time.monotonic()
            try:
                outcome: object = _healthz(self.port, timeout_s=30)
            except OSError as err:
                outcome = err
            self.in_flight_since = None
            self.results.append((began, time.monotonic(), outcome))
            if isinstance(outcome, OSError):
                return

    def answered_after(self, t: float) -> int:
        return sum(1 for _, end, outcome in self.results if end > t and outcome == 200)


@pytest.mark.parametrize("http_server", HTTP_SERVERS)
def test_restart_on_the_passed_socket_refuses_no_connection(tmp_path, http_server):
    sock = listener()
    port = sock.getsockname()[1]
    config = _write_config(tmp_path, port, http_server)
    logs = [tmp_path / "server-1.log", tmp_path / "server-2.log"]
    first = second = None
    client = _Client(port)
    thread = threading.Thread(target=client.run, daemon=True)
    try:
        first = start_activated(sock, config, logs[0])
        wait_for(lambda: f"socket passed by systemd) ({http_server})" in logs[0].read_text(),
                 60, f"the first server to serve on the passed socket, on {http_server}")
        # The server set it on the socket systemd (this test) holds: granian closes, as it
        # stops, a connection that has sent nothing yet (listen.DEFER_ACCEPT_S).
        deferred = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT)
        assert (deferred > 0) is (http_server == "granian")
        thread.start()
        wait_for(lambda: client.answered_after(0) >= 10, 30, "10 answers from the first server")

        first.send_signal(signal.SIGTERM)
        first.wait(20)
        # A request pending while no server runs: the kernel must queue it, not refuse it.
        wait_for(lambda: client.in_flight_since is not None, 30,
                 "a request pending while no server runs")
        second_started = time.monotonic()
        second = start_activated(sock, config, logs[1])
        wait_for(lambda: client.answered_after(second_started) >= 10, 60,
                 "10 answers from the second server")
        client.stop.set()
        thread.join(35)

        failures = [(round(end - began, 2), outcome) for began, end, outcome in client.results
                    if outcome != 200]
        assert not failures, f"requests not answered 200: {failures[:5]}"
        spanned = [r for r in client.results if r[0] < second_started < r[1]]
        assert spanned, "no request waited in the socket's queue across the restart"
        assert first.returncode == 0, "the first server did not stop cleanly on SIGTERM"
    except BaseException:
        print(f"last requests (start, end, outcome): {client.results[-3:]}")
        for log in logs:
            if log.exists():
                print(f"===== {log.name}\n{log.read_text(errors='replace')[-4000:]}")
        raise
    finally:
        client.stop.set()
        for proc in (first, second):
            if proc is not None:
                _stop_group(proc)
        sock.close()


def test_a_socket_for_another_address_is_refused_at_start(tmp_path):
    """The server refuses, exit 2 and one line, a passed socket server.yaml does not
    describe: its checks (API keys off only on loopback) read listen, not the socket."""
    sock = listener()
    config = _write_config(tmp_path, free_port())
    log = tmp_path / "server.log"
    proc = start_activated(sock, config, log)
    try:
        assert proc.wait(30) == 2
    finally:
        _stop_group(proc)
        sock.close()
    text = log.read_text()
    assert "llmgw server: the socket systemd passed listens on 127.0.0.1:" in text
    assert "make llmgw-server.socket's ListenStream= and listen agree" in text


# --- reading the environment (sd_listen_fds semantics), on real sockets ---------------------


def _env(pid: int, fds: str = "1") -> dict[str, str]:
    return {"LISTEN_PID": str(pid), "LISTEN_FDS": fds, "LISTEN_FDNAMES": "llmgw"}


def test_no_listen_pid_means_bind_yourself():
    env = {"PATH": "/bin"}
    assert inherited_listener(env, pid=1) is None
    assert env == {"PATH": "/bin"}


def test_the_passed_listener_is_returned_and_the_variables_removed():
    sock = listener()
    env = _env(4242)
    got = inherited_listener(env, pid=4242, fd_start=sock.fileno())
    try:
        assert got.getsockname() == sock.getsockname()
        assert not got.get_inheritable()
        assert env == {}
    finally:
        got.detach()
        sock.close()


@pytest.mark.parametrize(("env", "words"), [
    (_env(1), "LISTEN_PID=1 names another process, not this one (4242)"),
    (_env(4242, "2"), "LISTEN_FDS=2: llmgw server takes exactly one listening socket"),
    (_env(4242, "0"), "LISTEN_FDS=0"),
    (_env(4242, "two"), "LISTEN_FDS='two' is not a number"),
    ({"LISTEN_FDS": "1"}, "LISTEN_FDS is set without LISTEN_PID"),
])
def test_environment_refusals(env, words):
    with pytest.raises(ListenError) as err:
        inherited_listener(env, pid=4242)
    assert words in str(err.value)


def test_a_udp_socket_is_refused():
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        with pytest.raises(ListenError, match="not TCP"):
            inherited_listener(_env(7), pid=7, fd_start=udp.fileno())
        udp.getsockname()  # still open: a refused socket is left to its owner
    finally:
        udp.close()


def test_a_tcp_socket_that_does_not_listen_is_refused():
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    try:
        with pytest.raises(ListenError, match="is not listening"):
            inherited_listener(_env(7), pid=7, fd_start=tcp.fileno())
    finally:
        tcp.close()


def test_a_file_is_refused(tmp_path):
    with open(tmp_path / "f", "w") as f, pytest.raises(ListenError, match="is not a socket"):
        inherited_listener(_env(7), pid=7, fd_start=f.fileno())


def test_listen_must_describe_the_socket():
    sock = listener()
    port = sock.getsockname()[1]
    try:
        check_matches(sock, Listen(host="127.0.0.1", port=port))
        check_matches(sock, Listen(host="localhost", port=port))
        with pytest.raises(ListenError, match=r"listens on 127\.0\.0\.1"):
            check_matches(sock, Listen(host="0.0.0.0", port=port))
        with pytest.raises(ListenError, match="port"):
            check_matches(sock, Listen(host="127.0.0.1", port=port % 65535 + 1))
    finally:
        sock.close()



@pytest.mark.parametrize(("http_server", "deferred"), [("granian", True), ("uvicorn", False)])
def test_granian_s_own_socket_hands_over_a_connection_once_its_request_has_begun(
        http_server, deferred):
    """TCP_DEFER_ACCEPT on the socket llmgw binds for granian (on a passed one, the restart
    test above checks it): a connection that has sent nothing stays in the kernel's queue,
    where a stopping server cannot close it unanswered."""
    sock, _ = listening_socket(Listen(host="127.0.0.1", port=free_port(), server=http_server))
    with sock:
        assert (sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT) > 0) is deferred
