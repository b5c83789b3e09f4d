"""An agent leaves a server that takes its connection but never answers, for the next one.

A paused server (SIGSTOP, a frozen VM) still has its kernel accept connections into the
listening socket's queue: the TCP handshake succeeds, and then nothing. Here a socket that
listens and is never accepted from plays that server, first in the agent's list; a real
server is second. The agent must give up the silent one (it waits at most 10 s for the
upgrade's answer) and register with the real one.
"""

from __future__ import annotations

import socket
import time

from tests.integration.cluster import wait_for


def test_a_server_that_never_answers_is_left_for_the_next(make_cluster):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # never accepted from: connections wait in the queue
    silent_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    try:
        c = make_cluster()
        c.start_server()
        began = time.monotonic()
        agent = c.add_agent("node-a", servers=[silent_url, c.base_url])
        wait_for(lambda: c.node_state("node-a") == "ready", 30,
                 "node-a to register with the server that answers")
        took = time.monotonic() - began
    finally:
        silent.close()
    print(f"FIGURE registered past a silent server after {took:.1f} s")
    log = agent.log.read_text()
    assert f"stream to {silent_url} ended (SocketTimeoutError" in log
    assert f"registered with {c.base_url}" in log
    assert took < 25
