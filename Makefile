# FlowMaker developer targets. `make test` is what CI (.ci/run) and the README run.
PY ?= .venv/bin/python
export PATH := $(CURDIR)/.venv/bin:$(PATH)

.PHONY: setup proto proto-check lint typecheck test unit demo bench

setup:            ## create .venv and install FlowMaker with dev extras
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,bayesopt]'

proto:            ## regenerate flowmaker/api from protos/
	$(PY) scripts/gen_protos.py

proto-check:      ## buf lint + fail when generated code and protos disagree
	$(PY) scripts/gen_protos.py --check
	cd protos && buf lint

lint:
	ruff check flowmaker services tests scripts

typecheck:
	mypy flowmaker services

test: proto-check lint typecheck   ## everything CI runs
	$(PY) -m pytest -q -x tests

unit:
	$(PY) -m pytest -q tests/unit

demo:             ## the main job: local stack, 7 tasks, a burst of requests
	$(PY) -m flowmaker.cli.main demo

bench:
	$(PY) -m flowmaker.cli.main bench selector
	$(PY) -m flowmaker.cli.main bench serving
