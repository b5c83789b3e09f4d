# The two commands a newcomer needs: `make up` and `make test`.
# Both bootstrap uv into .tools/ (pip only, nothing system-wide) and the project's
# locked dependencies into .venv/, then run.

PYTHON ?= python3
UV_VERSION := 0.13.8
UV := .tools/bin/uv
export UV_PYTHON_DOWNLOADS := never
# Every llmgw process the tests start (servers, agents, the CLI) imports Litestar,
# SQLAlchemy and the rest: from source that costs about 3 s of CPU a process on 2 cores,
# from cached bytecode a tenth of it. Some machines set PYTHONDONTWRITEBYTECODE, which
# left every start compiling from source: the suite ran twice as long.
export UV_COMPILE_BYTECODE := 1
unexport PYTHONDONTWRITEBYTECODE

.PHONY: up test lint sync

$(UV):
	$(PYTHON) -m venv .tools
	.tools/bin/pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)

sync: $(UV)
	$(UV) sync --frozen --quiet

up: sync
	.venv/bin/llmgw up $(ARGS)

test: sync
	.venv/bin/ruff check .
	.venv/bin/pytest $(ARGS)

lint: sync
	.venv/bin/ruff check .
	.venv/bin/lint-imports
