"""`llmgw up` run again on the same state directory: the banner comes when the model
serves, and at once, not after the earlier run's replica is failed and backed off."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import openai
import psutil

from tests.integration.cluster import free_port, free_port_block, wait_for


def _up_until_banner(state, port, engine_ports, out_path) -> tuple[subprocess.Popen, float]:
    began = time.monotonic()
    with open(out_path, "wb") as out:
        up = subprocess.Popen(
            [sys.executable, "-m", "llmgw", "up", "--engine", "sim", "--state-dir", str(state),
             "--port", str(port), "--port-range", "-".join(map(str, engine_ports))],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        wait_for(lambda: "Ctrl-C stops everything" in out_path.read_text()
                 or up.poll() is not None, 60, "`llmgw up` to say it is up", every_s=0.02)
    except BaseException:
        _kill(up)
        raise
    assert up.poll() is None, out_path.read_text()
    return up, time.monotonic() - began


def _kill(up: subprocess.Popen) -> None:
    procs = []
    with contextlib.suppress(psutil.Error):
        procs = psutil.Process(up.pid).children(recursive=True)
    if up.poll() is None:
        os.killpg(up.pid, signal.SIGKILL)
        up.wait(5)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()


def test_a_second_up_serves_as_soon_as_it_says_so(tmp_path):
    state, port, engine_ports = tmp_path / "state", free_port(), free_port_block(10)
    first, _ = _up_until_banner(state, port, engine_ports, tmp_path / "first.out")
    first.send_signal(signal.SIGINT)
    assert first.wait(30) == 0

    again, to_banner_s = _up_until_banner(state, port, engine_ports, tmp_path / "again.out")
    try:
        printed = (tmp_path / "again.out").read_text()
        key = re.search(r"API key\s+(\S+)", printed)[1]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key,
                               max_retries=0)
        # The first request after the banner, no retry: the earlier run's replica, still
        # in the stored table, once made the banner come before anything served (503).
        reply = client.chat.completions.create(
            model="sim-small", messages=[{"role": "user", "content": "Hello"}])
        assert reply.choices[0].message.content
        # Its loss, once counted as a failure, held the new placement for the restart
        # backoff (10 s); a start takes about 2.5 s here.
        assert to_banner_s < 9, f"the second `up` took {to_banner_s:.1f} s to its banner"
        server_log = (state / "logs" / "server.log").read_text()
        assert "came back without it" not in server_log
        again.send_signal(signal.SIGINT)
        assert again.wait(30) == 0
    except BaseException:
        print(printed)
        for log in sorted((state / "logs").glob("*.log")):
            print(f"===== {log.name}\n{log.read_text(errors='replace')[-5000:]}")
        raise
    finally:
        _kill(again)
