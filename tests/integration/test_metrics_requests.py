"""What one request leaves behind, on a real server, agent and sim engine: its tokens and
timing in /metrics, and, with ``logging.access: json``, one JSON line in the server's log
that says how it went and nothing of what was asked or answered."""

from __future__ import annotations

import json
import secrets

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.cluster import wait_for
from tests.integration.conftest import SIM_SMALL, one_node_cluster

MODEL = "sim-small"
LINE_FIELDS = {"ts", "request_id", "method", "path", "model", "status", "duration_s",
               "ttft_s", "input_tokens", "output_tokens", "replica", "retries", "key_id",
               "account_id", "client", "stream"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    with one_node_cluster(tmp_path_factory.mktemp("requests"), request, [SIM_SMALL],
                          {"logging": {"access": "json"}}) as c:
        yield c


def _scrape(cluster) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{cluster.base_url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def _chat(cluster, prompt: str, *, stream: bool, request_id: str | None = None,
          key: str | None = None, model: str = MODEL) -> tuple[int, str]:
    headers = {"authorization": f"Bearer {key or cluster.api_key}"}
    if request_id:
        headers["x-request-id"] = request_id
    body = {"model": model, "max_tokens": 5, "stream": stream,
            "messages": [{"role": "user", "content": prompt}]}
    if stream:
        body["stream_options"] = {"include_usage": True}
    answer = httpx.post(f"{cluster.base_url}/v1/chat/completions", json=body,
                        headers=headers, timeout=30)
    return answer.status_code, answer.text


def test_a_streamed_chat_counts_its_tokens_and_times_them(cluster):
    model = (("model", MODEL),)
    before = _scrape(cluster)
    prompt = "four words of prompt"
    status, text = _chat(cluster, prompt, stream=True)
    assert status == 200
    usage = [json.loads(line[6:])["usage"] for line in text.splitlines()
             if line.startswith("data: {") and '"usage"' in line]
    assert usage == [{"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}]
    status, _ = _chat(cluster, prompt, stream=False)
    assert status == 200
    after = _scrape(cluster)

    def added(name: str, labels: tuple = model) -> float:
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert added("llmgw_tokens_total", (("direction", "input"), *model)) == 8
    assert added("llmgw_tokens_total", (("direction", "output"), *model)) == 10
    assert added("llmgw_time_to_first_token_seconds_count") == 1
    assert 0 < added("llmgw_time_to_first_token_seconds_sum") < 10
    # Five tokens, each in its own event, paced by the engine: a read after each.
    assert added("llmgw_inter_token_latency_seconds_count") >= 4
    assert added("llmgw_time_to_first_byte_seconds_count") == 1
    assert after[("llmgw_store_up", ())] == 1
    assert after[("llmgw_agent_stream_connects_total", ())] >= 1
    assert after[("llmgw_controller_actions_total", (("action", "place"),))] >= 1
    assert after[("llmgw_replicas", (*model, ("state", "ready")))] == 1
    assert after[("llmgw_engine_installs", (("engine", "sim"), ("state", "installed")))] == 1


def _access_lines(cluster) -> list[dict]:
    lines = []
    for line in (cluster.root / "server.log").read_text().splitlines():
        if line.startswith("{"):
            lines.append(json.loads(line))
    return lines


def test_the_access_log_has_one_line_per_request_and_no_text(cluster):
    run = secrets.token_hex(4)
    secret = f"the secret prompt {secrets.token_hex(6)}"
    asked = {
        f"{run}-whole": _chat(cluster, secret, stream=False, request_id=f"{run}-whole"),
        f"{run}-stream": _chat(cluster, secret, stream=True, request_id=f"{run}-stream"),
        f"{run}-missing": _chat(cluster, secret, stream=False, request_id=f"{run}-missing",
                                model="no-such-" + "m" * 100),
        f"{run}-badkey": _chat(cluster, secret, stream=False, request_id=f"{run}-badkey",
                               key="llmgw_not-a-key"),
    }
    assert [status for status, _ in asked.values()] == [200, 200, 404, 401]
    answer_text = json.loads(asked[f"{run}-whole"][1])["choices"][0]["message"]["content"]

    def mine() -> list[dict] | None:
        found = [line for line in _access_lines(cluster)
                 if str(line.get("request_id", "")).startswith(run)]
        return found if len(found) >= len(asked) else None

    lines = wait_for(mine, 10, "the requests' access-log lines")
    assert sorted(line["request_id"] for line in lines) == sorted(asked)  # one each
    by_id = {line["request_id"]: line for line in lines}
    for line in lines:
        assert set(line) == LINE_FIELDS
        assert line["method"] == "POST" and line["path"] == "/v1/chat/completions"
        assert line["client"] == "127.0.0.1"
        assert line["ts"].endswith("Z") and line["duration_s"] >= 0
        assert secret not in json.dumps(line) and answer_text not in json.dumps(line)
    whole, stream = by_id[f"{run}-whole"], by_id[f"{run}-stream"]
    assert (whole["status"], whole["stream"], whole["model"]) == (200, False, MODEL)
    assert (whole["input_tokens"], whole["output_tokens"]) == (4, 5)
    assert whole["replica"] and whole["retries"] == 0 and whole["ttft_s"] is None
    assert whole["key_id"] and cluster.api_key.startswith(whole["key_id"])
    assert whole["account_id"] is None  # the test's key belongs to no account
    assert (stream["status"], stream["stream"]) == (200, True)
    assert 0 < stream["ttft_s"] <= stream["duration_s"]
    assert (stream["input_tokens"], stream["output_tokens"]) == (4, 5)
    missing = by_id[f"{run}-missing"]
    assert missing["status"] == 404 and len(missing["model"]) == 64  # cut short
    assert missing["replica"] is None and missing["input_tokens"] is None
    badkey = by_id[f"{run}-badkey"]
    assert badkey["status"] == 401 and badkey["key_id"] is None
    # No line of the server's log, access or not, carries the prompt.
    assert secret not in (cluster.root / "server.log").read_text()
