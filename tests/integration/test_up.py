"""`llmgw up` as a newcomer runs it: it serves, it says how to call it, Ctrl-C stops it all."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import httpx
import openai
import psutil
import pytest

from tests.integration.cluster import free_port, free_port_block, wait_for


@pytest.mark.parametrize(("engine_args", "model"), [
    ([], "smollm2-135m"),  # the default a newcomer gets: SmolLM2 on llama.cpp
    (["--engine", "sim"], "sim-small"),
], ids=["llama.cpp", "sim"])
def test_up_serves_the_demo_model_and_ctrl_c_stops_everything(tmp_path, llama_cpp,
                                                              engine_args, model):
    # llama_cpp: the build `llmgw up` would start is done (and timed) by the fixture.
    port = free_port()
    state = tmp_path / "state"
    engine_ports = None
    if model == "sim-small":  # and its engine on the ports it is given
        engine_ports = free_port_block(10)
        engine_args = [*engine_args, "--port-range", "-".join(map(str, engine_ports))]
    out_path = tmp_path / "up.out"
    with open(out_path, "wb") as out:
        up = subprocess.Popen(
            [sys.executable, "-m", "llmgw", "up", "--state-dir", str(state), "--port", str(port),
             *engine_args],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    watched: list[psutil.Process] = []
    try:
        # The banner's last line: read before it, the banner may be half written.
        wait_for(lambda: "Ctrl-C stops everything" in out_path.read_text(), 60,
                 "`llmgw up` to say it is up")
        assert "llmgw is up" in out_path.read_text()
        printed = out_path.read_text()
        key = (state / "server" / "secrets" / "up-api-key").read_text().strip()
        assert key in printed and f"http://127.0.0.1:{port}/v1" in printed
        assert oct((state / "server" / "secrets" / "up-api-key").stat().st_mode & 0o777) == "0o600"
        # The cluster page it names leads a first visit to the setup form.
        assert f"cluster page     http://127.0.0.1:{port}/" in printed
        setup = httpx.get(f"http://127.0.0.1:{port}/", follow_redirects=True)
        assert setup.url.path == "/ui/setup" and "Set up llmgw" in setup.text

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key,
                               max_retries=0)
        reply = client.chat.completions.create(
            model=model, max_tokens=24, temperature=0,
            messages=[{"role": "user", "content": "What is 2+2? Answer with the number."}])
        assert reply.choices[0].message.content
        if model == "smollm2-135m":
            assert "4" in reply.choices[0].message.content

        records = [json.loads(p.read_text())
                   for p in (state / "agent" / "shards").glob("*.json")]
        assert len(records) == 1
        if engine_ports:
            assert engine_ports[0] <= records[0]["port"] <= engine_ports[1]
        children = psutil.Process(up.pid).children()
        watched = [*children, psutil.Process(records[0]["pid"])]
        assert len(children) == 2, "up runs a server and an agent"

        up.send_signal(signal.SIGINT)  # what Ctrl-C delivers
        assert up.wait(30) == 0
        _, alive = psutil.wait_procs(watched, timeout=10)
        assert not alive, f"still running after Ctrl-C: {alive}"
    except BaseException:
        print(out_path.read_text(errors="replace"))
        for log in sorted((state / "logs").glob("*.log")):
            print(f"===== {log.name}\n{log.read_text(errors='replace')[-5000:]}")
        raise
    finally:
        # On failure, stop what this test started, by PID: up, its server and agent (each
        # in its own session) and the engines, all of them up's descendants.
        with contextlib.suppress(psutil.Error):
            watched += psutil.Process(up.pid).children(recursive=True)
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait(5)
        for proc in watched:
            with contextlib.suppress(psutil.Error):
                proc.kill()
