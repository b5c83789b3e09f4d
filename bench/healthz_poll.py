"""Latency of ``GET /healthz`` polled every 50 ms, from a process of its own.

``bench/agents.py`` runs it beside thousands of simulated agents: polled from their busy
process, a request would wait for the client's own loop as much as for the server's.

    python -m bench.healthz_poll http://127.0.0.1:8080 20    # prints a JSON list of ms
"""

from __future__ import annotations

import http.client
import json
import sys
import time
from urllib.parse import urlsplit


def poll(base: str, seconds: float) -> list[float]:
    url = urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    waits = []
    try:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            began = time.perf_counter()
            conn.request("GET", "/healthz")
            conn.getresponse().read()
            waits.append((time.perf_counter() - began) * 1000)
            time.sleep(0.05)
    finally:
        conn.close()
    return waits


if __name__ == "__main__":
    print(json.dumps(poll(sys.argv[1], float(sys.argv[2]))))
