"""An engine that exits as soon as it starts (a sim engine given a flag it does not know):
the controller places the model again after each failure, waiting as docs/architecture.md
says: ``restart_backoff_initial_s * 2^(n-1)`` after the n-th failure in a row, at most
``restart_backoff_max_s``. The waits are read from the server's log: from each "failed"
line to the next "placed on" line of the model."""

from __future__ import annotations

import time

from tests.chaos.measure import figure, timed_lines
from tests.integration.cluster import wait_for

INITIAL_S, MAX_S = 1.0, 2.0
INTERVAL_S = 0.5  # the controller's pass: a placement comes at the first pass once due
LATE_S = INTERVAL_S + 0.7  # and that pass may run late on a loaded machine
FAILURES = 5  # four waits: 1, 2, 2 and 2 s: doubled once, then at the cap
CRASHING = {"name": "sim-crash", "replicas": 1,
            "profiles": [{"engine": "sim", "args": ["--no-such-flag"]}]}


def expected_wait_s(failures: int) -> float:
    return min(INITIAL_S * 2 ** (failures - 1), MAX_S)


def test_a_crash_looping_engine_is_placed_again_on_the_documented_backoff(
        make_cluster, record_property):
    c = make_cluster([CRASHING], controller={
        "interval_s": INTERVAL_S, "restart_backoff_initial_s": INITIAL_S,
        "restart_backoff_max_s": MAX_S, "adoption_grace_s": 5})
    c.start_server()
    c.add_agent("node-a")
    log = c.root / "server.log"
    began = time.monotonic()
    waiting: set[str] = set()

    def enough_failures() -> bool:
        model = next(m for m in c.status()["models"] if m["name"] == "sim-crash")
        if model["unplaced"] and model["unplaced"].startswith("restarting after"):
            waiting.add(model["unplaced"].split(", next try")[0])
        return len(timed_lines(log, "of sim-crash failed:")) >= FAILURES

    wait_for(enough_failures, 40, f"{FAILURES} failures of sim-crash", every_s=0.2)
    failed = timed_lines(log, "of sim-crash failed:")[:FAILURES]
    placed = [t for t, _ in timed_lines(log, "of sim-crash: placed on")]
    waits = [next(t for t in placed if t > t_failed) - t_failed for t_failed, _ in failed[:-1]]
    expected = [expected_wait_s(n) for n in range(1, FAILURES)]
    figure(record_property, "backoff_waits_s", " ".join(f"{w:.2f}" for w in waits), "s")
    figure(record_property, "backoff_expected_s", " ".join(f"{w:.2f}" for w in expected), "s")
    figure(record_property, "five_failures_s", time.monotonic() - began, "s")

    for n, (wait, want) in enumerate(zip(waits, expected, strict=True), start=1):
        # Not before it is due (log times are to the millisecond), nor much after.
        assert want - 0.01 <= wait <= want + LATE_S, (n, waits, expected)
    # Each failure says why, in the engine's own words, and the model says it waits.
    assert all("exited with code 2" in line for _, line in failed), failed
    assert "unrecognized arguments: --no-such-flag" in log.read_text()
    assert {"restarting after 1 failure", "restarting after 2 failures"} <= waiting, waiting
    # One replica at a time: each placed only after the one before it failed.
    assert len(placed) <= FAILURES + 1
    assert c.node_state("node-a") == "ready"
