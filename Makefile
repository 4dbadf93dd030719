# Developer commands. `make test` is what CI runs (.ci/run). Targets are .PHONY because
# folders named proto/ and tests/ exist.
.PHONY: help dev lock proto proto-check lint typecheck test fast demo bench soak wheel clean

# Byte code is cached (our modules', and pytest's rewritten test modules' in tests/__pycache__)
# even where the shell sets PYTHONDONTWRITEBYTECODE, as this machine's does: without the cache
# every pytest process (each xdist worker) compiles and rewrites all 117 test modules afresh
# (what that costs the fast tier: README).
unexport PYTHONDONTWRITEBYTECODE

# Every tool runs from .venv, which `make dev` (or any target needing it) creates on first use.
VENV_BIN := $(CURDIR)/.venv/bin
export PATH := $(VENV_BIN):$(PATH)
PY := $(VENV_BIN)/python
DEV := .venv/.installed
VERL_VENV := build/verl-venv
VERL := $(VERL_VENV)/.installed
# The test venvs install with the lock files of tests/locks/ as pip constraints
# (tests/support/locks.py); `make lock` writes them anew. LOCKED=no builds without them.
LOCKED ?= yes
DEV_LOCK := tests/locks/dev.txt
VERL_LOCK := tests/locks/verl.txt
constrain = $(if $(filter yes,$(LOCKED)),-c $(1))
OPENRLHF_PKG := build/openrlhf-pkg
# `make demo` installs only the package (its runtime dependencies; no dev tools, no torch/TRL),
# marked by its own file, so a later `make dev`/`make test` still installs everything.
DEMO_DEPS := .venv/.demo
# How the demo runs: from the repository root, so that it imports the harness as `tests.support`.
DEMO_RUN = $(PY) -m tests.demo
# Include roots for protoc: our protos, googleapis-common-protos (google/rpc/status.proto) and
# grpcio-tools' bundled well-known types.
GAPI = $(shell $(PY) -c "import google.rpc, os; print(os.path.dirname(os.path.dirname(list(google.rpc.__path__)[0])))")
GTOOLS = $(shell $(PY) -c "import grpc_tools, os; print(os.path.join(os.path.dirname(grpc_tools.__file__), '_proto'))")
PROTOS = proto/nemo_gym_grpc/v1/verify.proto proto/nemo_gym_grpc/v1/rollout.proto \
  proto/nemo_gym_grpc/v1/session.proto
OUT ?= proto

help:
	@echo "make dev          create .venv with the package and its dev tools, and"
	@echo "                  build/verl-venv with verl 0.9.1 (tests/test_verl.py), both"
	@echo "                  from tests/locks/ (pip constraints)"
	@echo "make lock         rebuild the test venvs from the newest releases, write"
	@echo "                  tests/locks/ anew, then run make test on them"
	@echo "make demo         score NeMo Gym example rows through the bridge (real servers);"
	@echo "                  installs only the package, no dev tools or torch"
	@echo "make test         the whole test suite on real NeMo Gym 0.7.0 servers, then its"
	@echo "                  compat subset on 0.4.0; installs everything"
	@echo "make fast         the fast tier (no NeMo Gym servers, no trainer venvs) on one"
	@echo "                  worker more than the cores, with its time"
	@echo "make bench        benchmarks into benchmarks/results/ (docs/performance.md)"
	@echo "make soak         10-minute chaos soak (not part of make test; its 60 s variant is)"
	@echo "make proto        regenerate Python code from $(PROTOS)"
	@echo "make proto-check  fail if the committed generated code is stale"
	@echo "make lint         ruff, buf lint and mypy (make typecheck: mypy alone)"
	@echo "make wheel        build the wheel into dist/"
	@echo "make clean        remove build/ (verl's venv too), dist/, *.egg-info, .pytest_cache"

dev: $(DEV) $(VERL)

$(DEV): pyproject.toml $(DEV_LOCK)
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,ray,verifiers,skyrl]' --group test-trl $(call constrain,$(DEV_LOCK))
	touch $@

# tests/test_verl.py runs verl 0.9.1 in a venv of its own (pyproject group test-verl, torch
# pinned): verl requires transformers<5.11, the TRL tests >=5.14, so they cannot share .venv.
# tests/test_openrlhf.py runs OpenRLHF's reward caller there too, from openrlhf installed
# without its dependencies into $(OPENRLHF_PKG) (openrlhf needs flash-attn, which builds only
# with CUDA; the reward caller needs only what verl brings).
$(VERL): pyproject.toml $(VERL_LOCK)
	test -x $(VERL_VENV)/bin/python || python3 -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/python -m pip install -q --upgrade pip
	$(VERL_VENV)/bin/python -m pip install -q -e . --group test-verl $(call constrain,$(VERL_LOCK))
	$(VERL_VENV)/bin/python -m pip install -q --no-deps --target $(OPENRLHF_PKG) openrlhf==0.11.2
	touch $@

# Refresh the lock files: .venv and build/verl-venv rebuilt without constraints, their pip
# freeze and each NeMo Gym venv's (built afresh in build/locks/) written to tests/locks/, then
# the suite on them. Commit tests/locks/ when it passes.
lock:
	rm -rf .venv $(VERL_VENV)
	$(MAKE) dev LOCKED=no
	$(PY) -m tests.support refresh-locks
	touch $(DEV) $(VERL)
	$(MAKE) test

proto: $(DEV)
	$(PY) -m grpc_tools.protoc -I proto -I $(GAPI) -I $(GTOOLS) \
	  --python_out=$(OUT) --grpc_python_out=$(OUT) --mypy_out=$(OUT) --mypy_grpc_out=$(OUT) $(PROTOS)

proto-check: $(DEV)
	@tmp=$$(mktemp -d) && $(MAKE) -s proto OUT=$$tmp >/dev/null && \
	  for f in $$(cd $$tmp && find . -type f); do \
	    cmp -s $$tmp/$$f proto/$$f || { echo "stale: proto/$$f (run make proto)"; rc=1; }; done; \
	  rm -rf $$tmp; test -z "$$rc" && echo "generated code is up to date"; exit $${rc:-0}

# buf resolves google/rpc/status.proto from a copy of the installed googleapis-common-protos
# file (build/buf-deps, not committed), so lint runs offline.
lint: $(DEV)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	mkdir -p build/buf-deps/google/rpc && cp $(GAPI)/google/rpc/status.proto build/buf-deps/google/rpc/
	buf lint
	buf format -d --exit-code proto
	$(MAKE) -s typecheck

# mypy checks the installed names: build/typecheck lays the package out as it installs, from
# pyproject.toml's package-dir (tests/support/layout.py).
typecheck: $(DEV)
	$(PY) -c "from pathlib import Path; from tests.support.layout import lay_out; lay_out(Path('build/typecheck'))"
	MYPYPATH=build/typecheck $(PY) -m mypy --config-file pyproject.toml \
	  -p nemo_gym_grpc.bridge -p nemo_gym_grpc.rewards -p nemo_gym_grpc.shared -p nemo_gym_grpc.cli

# The whole suite on NeMo Gym 0.7.0, then the `compat` subset on 0.4.0 (the test modules marked
# `compat`); each phase prints its time. PYTEST_ARGS passes options to both. A NeMo Gym venv
# that is not cached yet is built first (minutes), its progress shown as it goes.
test: $(DEV) $(VERL)
	@t=$$(date +%s); NEMO_GYM_VERSION=0.7.0 $(PY) -m pytest $(PYTEST_ARGS) && \
	  echo "make test: NeMo Gym 0.7.0, whole suite: $$(( $$(date +%s) - t )) s"
	@t=$$(date +%s); NEMO_GYM_VERSION=0.4.0 $(PY) -m pytest -m compat $(PYTEST_ARGS) && \
	  echo "make test: NeMo Gym 0.4.0, compat subset: $$(( $$(date +%s) - t )) s"

# The fast tier: every test that needs no NeMo Gym stack (tests/conftest.py's `nemo_gym` marker)
# and runs nothing in a trainer's venv (`trainer_venv`), for every change, on one pytest-xdist
# worker more than the cores: many fast tests mostly wait (for a deadline, a socket, a child
# process) and the spare worker runs others meanwhile (on 2 cores a fifth less time than
# `-n auto`'s one worker per core); prints its time. PYTEST_ARGS passes options.
FAST_WORKERS ?= $(shell echo $$(( $$(getconf _NPROCESSORS_ONLN) + 1 )))
fast: $(DEV)
	@t=$$(date +%s); $(PY) -m pytest -m "not nemo_gym and not trainer_venv" -n $(FAST_WORKERS) \
	  $(PYTEST_ARGS) && \
	  echo "make fast: $$(( $$(date +%s) - t )) s"

$(DEMO_DEPS): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

demo: $(DEMO_DEPS)
	$(DEMO_RUN)

# Benchmarks (how long each takes: docs/performance.md): JSON, markdown table and PNG plots in
# benchmarks/results/. BENCH_ARGS passes options, e.g. BENCH_ARGS="--only 3,4 --rounds 1".
bench: $(DEV)
	$(PY) -c "import matplotlib, psutil" 2>/dev/null || $(PY) -m pip install -q -e '.[bench]'
	$(PY) -m benchmarks.run $(BENCH_ARGS)

# `make soak`: the 10-minute chaos soak of tests/support/soak.py (real mcqa replicas killed and
# restarted, the bridge restarted, cancels, bad items); writes benchmarks/results/soak.json,
# soak.png and restarted_servers.log (the restarted servers' output) and fails if a check
# fails. SOAK_SECONDS changes its length only: the checks stay the 10-minute run's (200,000
# items, 60 s warm-up), so a shorter run fails them. The 60 s variant, with checks for its
# length, runs in `make test` (tests/test_soak.py).
SOAK_SECONDS ?= 600
soak: $(DEV)
	$(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install -q -e '.[bench]'
	$(PY) -m tests.support.soak --duration $(SOAK_SECONDS) --plot --out benchmarks/results

wheel: $(DEV)
	$(PY) -m build --wheel --outdir dist .

clean:
	rm -rf build dist *.egg-info .pytest_cache
