# FlowMaker developer targets. `make test` is what CI (.ci/run) and the README run.
PY := .venv/bin/python
export PATH := $(CURDIR)/.venv/bin:$(PATH)
STAMP := .venv/.installed

.PHONY: setup etcd native proto proto-check lint typecheck test unit demo bench bench-selector bench-serving clean

setup: $(STAMP) etcd native   ## virtualenv with FlowMaker + dev extras, an etcd server binary, the compiled class search

# The selector's class search, pattern route and sharing searches compiled with mypyc (flowmaker/native.py): about 3x faster, the
# same results bit for bit. Rebuilt when its source changes; without a C compiler it is skipped and the selector runs as pure Python.
NATIVE_SRC := flowmaker/selection/binpack.py flowmaker/selection/patterns.py flowmaker/selection/order_search.py \
              flowmaker/selection/sharing_bound.py flowmaker/native.py
native: build/native/manifest.json
build/native/manifest.json: $(STAMP) $(NATIVE_SRC)
	@echo "==> native: compiling the selector's class search, pattern route and sharing searches with mypyc (about 30 s)"
	$(PY) -m flowmaker.native build

$(STAMP): pyproject.toml
	@echo "==> .venv: installing FlowMaker with its dev extras (pip shows its progress; a few minutes the first time)"
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install --progress-bar on --upgrade pip
	$(PY) -m pip install --progress-bar on -e '.[dev,bayesopt,otlp]'
	touch $(STAMP)
	@echo "==> .venv ready"

# Another apt (unattended-upgrades, a second shell) may hold the dpkg/apt locks: wait for them instead of
# failing. DPkg::Lock::Timeout covers dpkg's lock; the loop covers apt-get update's lists lock on older apt.
APT_WAIT := -o DPkg::Lock::Timeout=600
APT_RETRY_S := 10
etcd:                  ## etcd 3.4 from Debian (tests and the local stack run a real one)
	@command -v etcd >/dev/null || { \
	  echo "==> etcd: installing Debian's etcd-server with apt (waits for the apt lock if another apt runs)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  for i in $$(seq 60); do $$SUDO apt-get $(APT_WAIT) update -q && break; \
	    echo "apt is busy (lock held?); retrying in $(APT_RETRY_S)s ($$i/60)"; sleep $(APT_RETRY_S); done; \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get $(APT_WAIT) install -y -q etcd-server; }

proto: $(STAMP)        ## regenerate flowmaker/api from protos/
	$(PY) scripts/gen_protos.py

proto-check: $(STAMP)  ## buf lint + fail when generated code and protos disagree
	$(PY) scripts/gen_protos.py --check
	cd protos && buf lint

lint: $(STAMP)
	ruff check flowmaker services tests scripts

typecheck: $(STAMP)
	mypy flowmaker services

test: setup proto-check lint typecheck   ## everything CI runs: drift, buf lint, ruff, mypy, pytest (scripts/run_tests.sh)
	PY=$(PY) scripts/run_tests.sh

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
