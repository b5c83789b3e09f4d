"""A server restarted under load fails no request and refuses no connection.

The test plays systemd's socket unit (tests/integration/activation.py): it holds the
listening socket, and the server runs on it. Plain and streaming chat requests run
through the official client, one at a time per thread, while the server is stopped
(SIGTERM: it finishes what it has in flight) and started again on the same socket. While
no server runs, the kernel queues new connections; the new server routes at once to the
replica that was ready (from the stored replica table, checked by its own health check)
while the agent dials back and re-registers. The engine is never restarted.
"""

from __future__ import annotations

import signal
import time

from tests.integration.activation import listener, start_activated
from tests.integration.cluster import wait_for
from tests.integration.load import ChatLoad

MODEL = "sim-small"
def test_a_server_restart_under_load_fails_no_request(make_cluster):
    sock = listener()
    c = make_cluster()
    c.port = sock.getsockname()[1]
    config = c.write_server_config()
    c.server_state.mkdir(parents=True)
    c.api_key = c.make_key()
    logs = [c.root / "server.log", c.root / "server-2.log"]
    load = ChatLoad(c.base_url, c.api_key, MODEL, {"plain": 2, "stream": 2})
    try:
        c.server = start_activated(sock, config, logs[0])
        wait_for(lambda: "socket passed by systemd" in logs[0].read_text(), 60,
                 "the server to serve on the passed socket")
        c.admin_token = (c.server_state / "secrets" / "admin-token").read_text().strip()
        agent = c.add_agent("node-a")
        [replica] = c.wait_ready(MODEL)
        engine = agent.engine_pids()
        load.start()
        wait_for(lambda: load.answered_after(0) >= 20, 30, "20 answers before the restart")

        c.server.send_signal(signal.SIGTERM)
        assert c.server.wait(30) == 0, "the server did not stop cleanly on SIGTERM"
        restarted = time.monotonic()
        c.server = start_activated(sock, config, logs[1])
        wait_for(lambda: load.answered_after(restarted) >= 40, 60,
                 "40 answers from the restarted server")
        load.finish()

        failures, spanned = load.failures(), load.spanning(restarted)
        print(f"{len(load.done)} requests, {spanned} waited across the restart, "
              f"{len(failures)} failed")
        assert failures == [], failures[:5]
        assert spanned, "no request waited in the socket's queue across the restart"
        assert "routing from the stored replica table" in logs[1].read_text()
        assert [r["id"] for r in c.ready_replicas(MODEL)] == [replica["id"]]
        assert agent.engine_pids() == engine
    finally:
        load.finish()
        sock.close()
