# FlowMaker developer targets. `make test` is what CI (.ci/run) and the README run.
PY := .venv/bin/python
export PATH := $(CURDIR)/.venv/bin:$(PATH)
STAMP := .venv/.installed

.PHONY: setup etcd proto proto-check lint typecheck test unit demo bench bench-selector bench-serving clean

setup: $(STAMP) etcd   ## virtualenv with FlowMaker + dev extras, and an etcd server binary

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,bayesopt,otlp]'
	touch $(STAMP)

etcd:                  ## etcd 3.4 from Debian (tests and the local stack run a real one)
	@command -v etcd >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server; \
	  else sudo apt-get update -q && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server; fi; }

proto: $(STAMP)        ## regenerate flowmaker/api from protos/
	$(PY) scripts/gen_protos.py

proto-check: $(STAMP)  ## buf lint + fail when generated code and protos disagree
	$(PY) scripts/gen_protos.py --check
	cd protos && buf lint

lint: $(STAMP)
	ruff check flowmaker services tests scripts

typecheck: $(STAMP)
	mypy flowmaker services

test: setup proto-check lint typecheck   ## everything CI runs: drift, buf lint, ruff, mypy, pytest
	$(PY) -m pytest -q tests

unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

demo: setup            ## the main job: local stack, 11 models, 7 tasks, a burst of requests
	$(PY) -m flowmaker.cli.main demo

bench: bench-selector bench-serving

bench-selector: $(STAMP)
	$(PY) -m flowmaker.cli.main bench selector

bench-serving: $(STAMP)
	$(PY) -m flowmaker.cli.main bench serving

clean:
	rm -rf out .pytest_cache .mypy_cache .ruff_cache .hypothesis
