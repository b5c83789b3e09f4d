"""Golden launches: the exact argv, environment and readiness of every engine, per shape.

Each expected argv is written out literally. When one of these tests fails, the command
llmgw starts an engine with has changed: check it against the engine's own documentation
(and ``llmgw ctl engine-check``) before updating the expected tuple.

Shapes: one GPU, eight GPUs, two nodes of eight GPUs (rank 0 on 10.0.0.5, rank 1 on
10.0.0.6) and CPU only.
"""

from __future__ import annotations

import pytest

from llmgw import engines
from llmgw.core import engine_names
from llmgw.engines import comfyui, llamacpp, sglang, sim, vllm
from llmgw.engines.base import EngineError, Launch, NodeFacts, ShardRequest

PY = "/usr/bin/python3"
LLAMA = "/opt/llama/bin/llama-server"
RPC = "/opt/llama/bin/ggml-rpc-server"
VLLM = "/opt/vllm/bin/vllm"
RAY = "/opt/vllm/bin/ray"
SGLANG = "/opt/sglang/bin/python"
COMFY = "/opt/comfyui/main.py"
COMFY_PY = "/opt/comfyui/venv/bin/python"
BINARIES = {"llama.cpp": LLAMA, "vllm": VLLM, "sglang": SGLANG, "comfyui": COMFY}

LEADER = NodeFacts(bind_address="10.0.0.5", python=PY, binaries=dict(BINARIES))
WORKER = NodeFacts(bind_address="10.0.0.6", python=PY, binaries=dict(BINARIES))
BARE = NodeFacts(bind_address="10.0.0.5", python=PY, binaries={})

GPU1 = (3,)
GPU8 = (0, 1, 2, 3, 4, 5, 6, 7)
CPU: tuple[int, ...] = ()

ENV_CPU = {"CUDA_VISIBLE_DEVICES": ""}  # a shard given no GPU sees none
ENV_GPU1 = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "3"}
ENV_GPU8 = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}


def one(gpus: tuple[int, ...], **kw) -> ShardRequest:
    """The only shard of a one-node replica."""
    fields = dict(replica="r-e7", rank=0, world_size=1, model="org/m", weights="/w/org-m",
                  port=20001, gpus=gpus)
    fields.update(kw)
    return ShardRequest(**fields)


def two(rank: int, gpus: tuple[int, ...] = GPU8, **kw) -> ShardRequest:
    """Rank ``rank`` of a two-node replica led by 10.0.0.5."""
    fields = dict(replica="r-e7", rank=rank, world_size=2, model="org/m", weights="/w/org-m",
                  port=20001, gpus=gpus, leader_address="10.0.0.5", rendezvous_port=20002,
                  peers=("10.0.0.5:20001", "10.0.0.6:20001"))
    fields.update(kw)
    return ShardRequest(**fields)


def launch(engine: str, req: ShardRequest, node: NodeFacts = LEADER) -> Launch:
    return engines.render(engine, req, node)


def assert_serving(got: Launch, env: dict[str, str], health: str = "/health") -> None:
    assert got.env == env
    assert got.port == 20001
    assert got.health_path == health
    assert got.tcp_ready is False
    assert got.wait_for == ()


# --- sim ----------------------------------------------------------------------------------


def test_sim_one_gpu():
    got = launch("sim", one(GPU1, model="m"))
    assert got.argv == (
        PY, "-m", "llmgw.sim", "--model", "m", "--host", "10.0.0.5", "--port", "20001",
    )
    assert_serving(got, ENV_GPU1)


def test_sim_eight_gpus():
    got = launch("sim", one(GPU8, model="m"))
    assert got.argv == (
        PY, "-m", "llmgw.sim", "--model", "m", "--host", "10.0.0.5", "--port", "20001",
    )
    assert_serving(got, ENV_GPU8)


def test_sim_two_nodes_leader():
    got = launch("sim", two(0, model="m"))
    assert got.argv == (
        PY, "-m", "llmgw.sim", "--model", "m",
        "--rank", "0", "--world-size", "2", "--rendezvous", "10.0.0.5:20002",
        "--host", "10.0.0.5", "--port", "20001",
    )
    assert_serving(got, ENV_GPU8)


def test_sim_two_nodes_worker_serves_nothing():
    got = launch("sim", two(1, model="m"), WORKER)
    assert got.argv == (
        PY, "-m", "llmgw.sim", "--model", "m",
        "--rank", "1", "--world-size", "2", "--rendezvous", "10.0.0.5:20002",
    )
    assert got.env == ENV_GPU8
    assert got.port is None
    assert got.health_path is None
    assert got.tcp_ready is False


def test_sim_cpu():
    got = launch("sim", one(CPU, model="m"))
    assert got.argv == (
        PY, "-m", "llmgw.sim", "--model", "m", "--host", "10.0.0.5", "--port", "20001",
    )
    assert_serving(got, ENV_CPU)


# --- llama.cpp ----------------------------------------------------------------------------


def gguf(gpus: tuple[int, ...]) -> ShardRequest:
    return one(gpus, model="smol", weights="/models/smol.gguf")


def test_llamacpp_one_gpu_offloads_every_layer():
    got = launch("llama.cpp", gguf(GPU1))
    assert got.argv == (
        LLAMA, "--model", "/models/smol.gguf", "--alias", "smol",
        "--host", "10.0.0.5", "--port", "20001", "--n-gpu-layers", "999",
    )
    assert_serving(got, ENV_GPU1)


def test_llamacpp_eight_gpus():
    got = launch("llama.cpp", gguf(GPU8))
    assert got.argv == (
        LLAMA, "--model", "/models/smol.gguf", "--alias", "smol",
        "--host", "10.0.0.5", "--port", "20001", "--n-gpu-layers", "999",
    )
    assert_serving(got, ENV_GPU8)


def test_llamacpp_cpu_offloads_nothing():
    got = launch("llama.cpp", gguf(CPU))
    assert got.argv == (
        LLAMA, "--model", "/models/smol.gguf", "--alias", "smol",
        "--host", "10.0.0.5", "--port", "20001", "--n-gpu-layers", "0",
    )
    assert_serving(got, ENV_CPU)


def test_llamacpp_two_nodes_leader_dials_its_worker_over_rpc():
    got = launch("llama.cpp", two(0, model="smol", weights="/models/smol.gguf"))
    assert got.argv == (
        LLAMA, "--model", "/models/smol.gguf", "--alias", "smol",
        "--host", "10.0.0.5", "--port", "20001", "--n-gpu-layers", "999",
        "--rpc", "10.0.0.6:20001",
    )
    assert got.env == ENV_GPU8
    assert got.port == 20001
    assert got.health_path == "/health"
    assert got.tcp_ready is False
    # llama-server dials its RPC servers once, at load: it must start after they listen.
    assert got.wait_for == ("10.0.0.6:20001",)


def test_llamacpp_two_nodes_worker_is_an_rpc_server_that_keeps_its_port():
    got = launch("llama.cpp", two(1, model="smol", weights="/models/smol.gguf"), WORKER)
    assert got.argv == (RPC, "--host", "10.0.0.6", "--port", "20001")
    assert got.env == ENV_GPU8
    assert got.port == 20001
    assert got.health_path is None
    assert got.tcp_ready is True
    assert got.wait_for == ()


def test_llamacpp_worker_needs_no_weights():
    got = launch("llama.cpp", two(1, weights=None), WORKER)
    assert got.argv == (RPC, "--host", "10.0.0.6", "--port", "20001")


def test_llamacpp_cpu_leader_of_several_nodes_offloads_every_layer_to_its_workers():
    got = launch("llama.cpp", two(0, gpus=CPU, model="smol", weights="/models/smol.gguf"))
    assert got.argv == (
        LLAMA, "--model", "/models/smol.gguf", "--alias", "smol",
        "--host", "10.0.0.5", "--port", "20001", "--n-gpu-layers", "999",
        "--rpc", "10.0.0.6:20001",
    )
    assert got.env == ENV_CPU


def test_llamacpp_cpu_worker_has_no_cuda_variables():
    got = launch("llama.cpp", two(1, gpus=CPU), WORKER)
    assert got.argv == (RPC, "--host", "10.0.0.6", "--port", "20001")
    assert got.env == ENV_CPU


def test_llamacpp_three_nodes_leader_lists_every_worker_in_rank_order():
    peers = ("10.0.0.5:20001", "10.0.0.6:20001", "10.0.0.7:20003")
    got = launch("llama.cpp", two(0, world_size=3, peers=peers, model="smol",
                                  weights="/models/smol.gguf"))
    assert got.argv == (
        LLAMA, "--model", "/models/smol.gguf", "--alias", "smol",
        "--host", "10.0.0.5", "--port", "20001", "--n-gpu-layers", "999",
        "--rpc", "10.0.0.6:20001,10.0.0.7:20003",
    )
    assert got.wait_for == ("10.0.0.6:20001", "10.0.0.7:20003")


def test_llamacpp_embeddings():
    got = launch("llama.cpp", _with(gguf(CPU), embeddings=True))
    assert got.argv == (
        LLAMA, "--model", "/models/smol.gguf", "--alias", "smol",
        "--host", "10.0.0.5", "--port", "20001", "--n-gpu-layers", "0", "--embeddings",
    )


def test_llamacpp_named_rpc_binary_wins():
    node = NodeFacts("10.0.0.6", PY, {"llama.cpp-rpc": "/usr/local/bin/rpc-server"})
    got = launch("llama.cpp", two(1), node)
    assert got.argv == ("/usr/local/bin/rpc-server", "--host", "10.0.0.6", "--port", "20001")


def test_llamacpp_without_weights_names_the_profile_setting():
    with pytest.raises(EngineError) as err:
        launch("llama.cpp", _with(gguf(GPU1), weights=None))
    message = str(err.value)
    assert "smol" in message
    assert "GGUF" in message
    assert "weights" in message


def test_llamacpp_leader_without_every_worker_address_is_refused():
    with pytest.raises(EngineError, match="address of every worker"):
        launch("llama.cpp", two(0, peers=("10.0.0.5:20001",), weights="/models/smol.gguf"))


# --- vLLM ---------------------------------------------------------------------------------


def test_vllm_one_gpu():
    got = launch("vllm", one(GPU1))
    assert got.argv == (
        VLLM, "serve", "/w/org-m", "--served-model-name", "org/m",
        "--tensor-parallel-size", "1", "--host", "10.0.0.5", "--port", "20001",
    )
    assert_serving(got, ENV_GPU1)


def test_vllm_eight_gpus_are_tensor_parallel():
    got = launch("vllm", one(GPU8))
    assert got.argv == (
        VLLM, "serve", "/w/org-m", "--served-model-name", "org/m",
        "--tensor-parallel-size", "8", "--host", "10.0.0.5", "--port", "20001",
    )
    assert_serving(got, ENV_GPU8)


def test_vllm_cpu():
    got = launch("vllm", one(CPU))
    assert got.argv == (
        VLLM, "serve", "/w/org-m", "--served-model-name", "org/m",
        "--tensor-parallel-size", "1", "--host", "10.0.0.5", "--port", "20001",
    )
    assert_serving(got, ENV_CPU)


def test_vllm_serves_the_model_name_when_there_are_no_weights():
    got = launch("vllm", one(GPU1, weights=None))
    assert got.argv == (
        VLLM, "serve", "org/m", "--served-model-name", "org/m",
        "--tensor-parallel-size", "1", "--host", "10.0.0.5", "--port", "20001",
    )


def test_vllm_mp_two_nodes_leader():
    got = launch("vllm", two(0))
    assert got.argv == (
        VLLM, "serve", "/w/org-m", "--served-model-name", "org/m",
        "--tensor-parallel-size", "8",
        "--distributed-executor-backend", "mp",
        "--pipeline-parallel-size", "2",
        "--nnodes", "2", "--node-rank", "0",
        "--master-addr", "10.0.0.5", "--master-port", "20002",
        "--host", "10.0.0.5", "--port", "20001",
    )
    assert_serving(got, ENV_GPU8)


def test_vllm_mp_two_nodes_worker_is_headless():
    got = launch("vllm", two(1), WORKER)
    assert got.argv == (
        VLLM, "serve", "/w/org-m", "--served-model-name", "org/m",
        "--tensor-parallel-size", "8",
        "--distributed-executor-backend", "mp",
        "--pipeline-parallel-size", "2",
        "--nnodes", "2", "--node-rank", "1",
        "--master-addr", "10.0.0.5", "--master-port", "20002",
        "--headless",
    )
    assert got.env == ENV_GPU8
    assert got.port is None
    assert got.health_path is None
    assert got.tcp_ready is False


def test_vllm_mp_pipeline_is_nodes_and_tensor_is_gpus_per_node():
    got = launch("vllm", two(0, world_size=4, gpus=(4, 5)))
    argv = got.argv
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[argv.index("--pipeline-parallel-size") + 1] == "4"
    assert argv[argv.index("--nnodes") + 1] == "4"
    assert got.env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "4,5"}


def test_vllm_ray_leader_starts_a_ray_head_then_execs_vllm():
    got = launch("vllm", two(0, launch_mode="ray"))
    assert got.argv == (
        "/bin/sh", "-c",
        "/opt/vllm/bin/ray start --head --port=20002 --node-ip-address=10.0.0.5 "
        "--disable-usage-stats"
        " && exec /opt/vllm/bin/vllm serve /w/org-m --served-model-name org/m"
        " --tensor-parallel-size 8 --distributed-executor-backend ray"
        " --pipeline-parallel-size 2 --host 10.0.0.5 --port 20001",
    )
    assert_serving(got, ENV_GPU8)


def test_vllm_ray_worker_joins_the_head_and_blocks():
    got = launch("vllm", two(1, launch_mode="ray"), WORKER)
    assert got.argv == (RAY, "start", "--address=10.0.0.5:20002",
                        "--node-ip-address=10.0.0.6", "--block")
    assert got.env == ENV_GPU8
    assert got.port is None
    assert got.health_path is None
    assert got.tcp_ready is False


def test_vllm_ray_script_quotes_paths_and_profile_args():
    node = NodeFacts("10.0.0.5", PY, {"vllm": "/opt/my vllm/bin/vllm"})
    req = two(0, launch_mode="ray", embeddings=True,
              args=("--chat-template", "/t/a b.jinja", "--max-model-len", "8192"))
    got = launch("vllm", req, node)
    assert got.argv == (
        "/bin/sh", "-c",
        "'/opt/my vllm/bin/ray' start --head --port=20002 --node-ip-address=10.0.0.5 "
        "--disable-usage-stats"
        " && exec '/opt/my vllm/bin/vllm' serve /w/org-m --served-model-name org/m"
        " --tensor-parallel-size 8 --runner pooling --distributed-executor-backend ray"
        " --pipeline-parallel-size 2 --host 10.0.0.5 --port 20001"
        " --chat-template '/t/a b.jinja' --max-model-len 8192",
    )


def test_vllm_ray_is_only_for_several_nodes():
    assert launch("vllm", one(GPU1, launch_mode="ray")).argv == launch("vllm", one(GPU1)).argv


def test_vllm_embeddings_run_the_pooling_runner():
    got = launch("vllm", one(GPU1, embeddings=True))
    assert got.argv == (
        VLLM, "serve", "/w/org-m", "--served-model-name", "org/m",
        "--tensor-parallel-size", "1", "--runner", "pooling",
        "--host", "10.0.0.5", "--port", "20001",
    )


# --- SGLang -------------------------------------------------------------------------------


def test_sglang_one_gpu():
    got = launch("sglang", one(GPU1))
    assert got.argv == (
        SGLANG, "-m", "sglang.launch_server", "--model-path", "/w/org-m",
        "--served-model-name", "org/m", "--tp-size", "1",
        "--host", "10.0.0.5", "--port", "20001",
    )
    assert_serving(got, ENV_GPU1)


def test_sglang_eight_gpus():
    got = launch("sglang", one(GPU8))
    assert got.argv == (
        SGLANG, "-m", "sglang.launch_server", "--model-path", "/w/org-m",
        "--served-model-name", "org/m", "--tp-size", "8",
        "--host", "10.0.0.5", "--port", "20001",
    )
    assert_serving(got, ENV_GPU8)


def test_sglang_cpu():
    got = launch("sglang", one(CPU))
    assert got.argv == (
        SGLANG, "-m", "sglang.launch_server", "--model-path", "/w/org-m",
        "--served-model-name", "org/m", "--tp-size", "1",
        "--host", "10.0.0.5", "--port", "20001",
    )
    assert_serving(got, ENV_CPU)


def test_sglang_two_nodes_leader_tensor_parallel_spans_every_gpu():
    got = launch("sglang", two(0))
    assert got.argv == (
        SGLANG, "-m", "sglang.launch_server", "--model-path", "/w/org-m",
        "--served-model-name", "org/m", "--tp-size", "16",
        "--nnodes", "2", "--node-rank", "0", "--dist-init-addr", "10.0.0.5:20002",
        "--host", "10.0.0.5", "--port", "20001",
    )
    assert_serving(got, ENV_GPU8)


def test_sglang_two_nodes_worker_serves_nothing():
    got = launch("sglang", two(1), WORKER)
    assert got.argv == (
        SGLANG, "-m", "sglang.launch_server", "--model-path", "/w/org-m",
        "--served-model-name", "org/m", "--tp-size", "16",
        "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.5:20002",
    )
    assert got.env == ENV_GPU8
    assert got.port is None
    assert got.health_path is None
    assert got.tcp_ready is False


def test_sglang_embeddings():
    got = launch("sglang", two(0, embeddings=True))
    assert got.argv == (
        SGLANG, "-m", "sglang.launch_server", "--model-path", "/w/org-m",
        "--served-model-name", "org/m", "--tp-size", "16",
        "--nnodes", "2", "--node-rank", "0", "--dist-init-addr", "10.0.0.5:20002",
        "--is-embedding", "--host", "10.0.0.5", "--port", "20001",
    )


# --- ComfyUI ------------------------------------------------------------------------------


def test_comfyui_one_gpu():
    got = launch("comfyui", one(GPU1, model="flux"))
    # Which GPU ComfyUI picks is test_comfyui_runs_on_the_gpu_it_was_placed_on's business.
    assert got.argv[:6] == (COMFY_PY, COMFY, "--listen", "10.0.0.5", "--port", "20001")
    assert_serving(got, ENV_GPU1, health="/system_stats")


def visible_to_comfyui(got: Launch) -> str:
    """The CUDA_VISIBLE_DEVICES ComfyUI runs with: its main.py overwrites the variable with
    the value of --cuda-device when that flag is given (``os.environ['CUDA_VISIBLE_DEVICES']
    = str(args.cuda_device)``, before torch is imported)."""
    argv = got.argv
    if "--cuda-device" in argv:
        return argv[argv.index("--cuda-device") + 1]
    return got.env.get("CUDA_VISIBLE_DEVICES", "")


def test_comfyui_runs_on_the_gpu_it_was_placed_on():
    assert visible_to_comfyui(launch("comfyui", one((5,), model="flux"))) == "5"


def test_comfyui_cpu_runs_on_the_cpu():
    assert "--cpu" in launch("comfyui", one(CPU, model="flux")).argv


def test_comfyui_cpu_sees_no_gpu_and_is_told_so():
    got = launch("comfyui", one(CPU, model="flux"))
    assert got.argv[:6] == (COMFY_PY, COMFY, "--listen", "10.0.0.5", "--port", "20001")
    assert "--cuda-device" not in got.argv
    assert_serving(got, ENV_CPU, health="/system_stats")


def test_comfyui_named_python_wins():
    node = NodeFacts("10.0.0.5", PY, {"comfyui": COMFY, "comfyui-python": "/env/bin/python"})
    got = launch("comfyui", one(GPU1, model="flux"), node)
    assert got.argv[:2] == ("/env/bin/python", COMFY)


def test_comfyui_refuses_eight_gpus():
    with pytest.raises(EngineError) as err:
        launch("comfyui", one(GPU8, model="flux"))
    message = str(err.value)
    assert "flux" in message
    assert "one GPU" in message
    assert "gpus: 1" in message


def test_comfyui_refuses_two_nodes():
    for rank in (0, 1):
        with pytest.raises(EngineError) as err:
            launch("comfyui", two(rank, gpus=GPU1, model="flux"))
        assert "nodes: 1" in str(err.value)


# --- every engine -------------------------------------------------------------------------

ALL = engine_names.ALL
SHAPES = {
    "one-gpu": (one(GPU1, weights="/models/m.gguf"), LEADER),
    "eight-gpus": (one(GPU8, weights="/models/m.gguf"), LEADER),
    "two-nodes-rank0": (two(0, weights="/models/m.gguf"), LEADER),
    "two-nodes-rank1": (two(1, weights="/models/m.gguf"), WORKER),
    "cpu": (one(CPU, weights="/models/m.gguf"), LEADER),
}
REFUSED = {("comfyui", s) for s in ("eight-gpus", "two-nodes-rank0", "two-nodes-rank1")}
RUNNABLE = [(e, s) for e in ALL for s in SHAPES if (e, s) not in REFUSED]


def _fields(req: ShardRequest) -> dict:
    return {name: getattr(req, name) for name in ShardRequest.__slots__}


def _with(req: ShardRequest, **kw) -> ShardRequest:
    return ShardRequest(**{**_fields(req), **kw})


@pytest.mark.parametrize(("engine", "shape"), RUNNABLE)
def test_profile_env_is_merged_with_the_gpu_env(engine, shape):
    req, node = SHAPES[shape]
    req = _with(req, env=(("HF_HOME", "/data/hf"), ("VLLM_LOGGING_LEVEL", "DEBUG")))
    got = launch(engine, req, node)
    expected = {"HF_HOME": "/data/hf", "VLLM_LOGGING_LEVEL": "DEBUG"}
    if req.gpus:
        expected |= {"CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                     "CUDA_VISIBLE_DEVICES": ",".join(map(str, req.gpus))}
    else:
        expected |= ENV_CPU
    assert got.env == expected


@pytest.mark.parametrize("engine", ALL)
def test_placement_gpus_win_over_a_profile_cuda_visible_devices(engine):
    gpus = (5,) if engine == "comfyui" else (5, 3)  # ComfyUI takes one GPU only
    req = one(gpus, weights="/models/m.gguf", env=(("CUDA_VISIBLE_DEVICES", "0"),))
    got = launch(engine, req)
    # In placement order, not sorted: CUDA numbers them as placement listed them.
    assert got.env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                       "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}


@pytest.mark.parametrize(("engine", "shape"), RUNNABLE)
def test_adapter_render_alone_sets_no_profile_env_beyond_what_render_merges(engine, shape):
    req, node = SHAPES[shape]
    req = _with(req, env=(("HF_HOME", "/data/hf"),))
    direct = engines.adapter(engine).render(req, node)
    merged = launch(engine, req, node)
    assert merged.env == {"HF_HOME": "/data/hf", **direct.env}
    assert merged.argv == direct.argv


@pytest.mark.parametrize(("engine", "shape"), [
    (e, s) for e, s in RUNNABLE
    # A llama.cpp RPC worker is not llama-server: the profile's args are not its flags.
    if (e, s) != ("llama.cpp", "two-nodes-rank1")
])
def test_profile_args_come_last(engine, shape):
    req, node = SHAPES[shape]
    args = ("--extra-flag", "x y", "--other=1")
    got = launch(engine, _with(req, args=args), node)
    assert got.argv[-3:] == args
    assert got.argv[:-3] == launch(engine, req, node).argv


def test_profile_args_come_last_in_the_ray_script():
    req = two(0, launch_mode="ray")
    got = launch("vllm", _with(req, args=("--max-model-len", "8192")))
    assert got.argv[2].endswith(" --port 20001 --max-model-len 8192")


def test_llamacpp_rpc_worker_ignores_profile_args():
    got = launch("llama.cpp", two(1, args=("--ctx-size", "4096")), WORKER)
    assert got.argv == (RPC, "--host", "10.0.0.6", "--port", "20001")


@pytest.mark.parametrize(("engine", "shape"), [
    ("llama.cpp", "one-gpu"), ("llama.cpp", "two-nodes-rank1"), ("vllm", "one-gpu"),
    ("vllm", "two-nodes-rank1"), ("sglang", "one-gpu"), ("sglang", "two-nodes-rank1"),
    ("comfyui", "one-gpu"),
])
def test_missing_binary_says_to_name_it_in_agent_yaml(engine, shape):
    req, _ = SHAPES[shape]
    with pytest.raises(EngineError) as err:
        launch(engine, req, BARE)
    message = str(err.value)
    assert f"no {engine} binary" in message
    assert "agent.yaml" in message
    assert f"engines.{engine}.binary" in message


def test_vllm_ray_worker_without_a_binary_is_refused_too():
    with pytest.raises(EngineError, match=r"agent\.yaml"):
        launch("vllm", two(1, launch_mode="ray"), BARE)


def test_sim_needs_no_binary():
    assert launch("sim", one(GPU1), BARE).argv[0] == PY


def test_unknown_engine_lists_the_known_ones():
    with pytest.raises(EngineError) as err:
        engines.adapter("tgi")
    message = str(err.value)
    assert "'tgi'" in message
    assert "comfyui, llama.cpp, sglang, sim, vllm" in message
    with pytest.raises(EngineError, match="'tgi'"):
        engines.render("tgi", one(GPU1), LEADER)


def test_there_is_one_adapter_for_each_engine_name_and_no_other():
    """core.engine_names is the list; the adapters each carry their NAME, and must agree."""
    modules = (sim, llamacpp, vllm, sglang, comfyui)
    assert sorted(m.NAME for m in modules) == sorted(engine_names.ALL)
    assert dict(engines.ADAPTERS) == {m.NAME: m for m in modules}


@pytest.mark.parametrize("engine", ALL)
def test_a_serving_rank_without_a_port_is_refused(engine):
    with pytest.raises(EngineError, match="rank 0 of r-e7 needs a port"):
        launch(engine, one(GPU1, port=None, weights="/models/m.gguf"))


@pytest.mark.parametrize("engine", ["sim", "vllm", "sglang"])
def test_non_serving_ranks_need_no_port(engine):
    got = launch(engine, two(1, port=None), WORKER)
    assert got.port is None


@pytest.mark.parametrize("engine", ["sim", "vllm", "sglang"])
@pytest.mark.parametrize("missing", [{"leader_address": ""}, {"rendezvous_port": None}])
def test_several_nodes_without_a_rendezvous_are_refused(engine, missing):
    for rank in (0, 1):
        with pytest.raises(EngineError, match="no leader address and rendezvous port"):
            launch(engine, two(rank, **missing))


def test_vllm_ray_without_a_rendezvous_is_refused():
    with pytest.raises(EngineError, match="rendezvous port"):
        launch("vllm", two(1, launch_mode="ray", rendezvous_port=None), WORKER)


@pytest.mark.parametrize(("engine", "shape"), RUNNABLE)
def test_every_launch_describes_itself(engine, shape):
    req, node = SHAPES[shape]
    assert launch(engine, req, node).description


def test_llamacpp_rpc_worker_takes_the_profiles_thread_count():
    # A CPU worker computes its layers with as many threads as the leader was given.
    got = launch("llama.cpp", _with(two(1, gpus=CPU), args=("--threads", "3", "--metrics")),
                 WORKER)
    assert got.argv == (RPC, "--host", "10.0.0.6", "--port", "20001", "--threads", "3")
