# One command per chore, the same locally and in CI (.ci/run calls `make test`).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
PEERS_ARGS ?=
# Every lib's and service's folder: its tests/ and, as doctests (--doctest-modules in pyproject.toml), the examples
# in its src/ docstrings; loadtests/ likewise (its tests/ and its modules' examples); chaos/: the chaos suite's short
# mode (chaos/tests, marked integration: a few minutes, the whole platform on the simulated engine) and its examples.
TEST_DIRS = libs services loadtests tests chaos
# mypy checks the packages by name, found through MYPYPATH (some services are namespace packages).
SRC_DIRS = $(wildcard libs/*/src services/*/src)
empty :=
space := $(empty) $(empty)
PACKAGES = $(notdir $(filter-out %.egg-info,$(wildcard libs/*/src/goodput_* services/*/src/goodput_*)))

.PHONY: install protos docs run images test test-unit lint chaos bench litellm peers clean

install:  ## virtualenv, pinned dependencies, vLLM (CPU), the dev model, editable packages; near-instant when done
	VENV=$(VENV) scripts/install.sh

protos:  ## regenerate libs/protos from protos/
	$(PY) scripts/gen_protos.py

docs:  ## regenerate the README's configuration reference from the settings classes
	$(PY) scripts/gen_config_docs.py --readme README.md

run: install  ## the whole platform on this machine (Ctrl-C stops it)
	$(VENV)/bin/goodput up

images: install  ## every service image (podman; a Debian base made here when no registry answers): .tools/images/
	$(PY) scripts/images.py

test: lint litellm  ## ruff, mypy, then the whole suite, integration and end-to-end tests included (LiteLLM's too)
	$(PY) -m pytest $(TEST_DIRS) $(PYTEST_ARGS)

test-unit: install  ## everything except the tests that start the platform
	$(PY) -m pytest $(TEST_DIRS) --ignore=tests/integration -m "not integration and not e2e" $(PYTEST_ARGS)

lint: install  ## ruff and mypy (part of make test)
	$(VENV)/bin/ruff check libs services scripts tests loadtests chaos
	MYPYPATH=$(subst $(space),:,$(SRC_DIRS)) $(VENV)/bin/mypy $(addprefix -p ,$(PACKAGES))
	MYPYPATH=$(subst $(space),:,$(SRC_DIRS)) $(VENV)/bin/mypy --follow-imports=silent -p chaos -p loadtests

chaos: install  ## the chaos suite in full (vLLM workers): chaos/reports/chaos-full.{json,md}; `make test` runs its short mode
	$(PY) -m chaos --mode full

bench: install  ## gateway/scheduler overhead benchmark (reports numbers, does not assert)
	$(PY) -m loadtests.overhead

litellm:  ## the LiteLLM proxy's own venv (.tools/litellm-venv) for `python -m loadtests.overhead --litellm` and its test
	scripts/install-litellm.sh

peers: install  ## inference-perf, aiperf and guidellm (own venvs, .tools/peers) unchanged against `goodput up`: loadtests/out/peers/peers.{json,md}
	scripts/install-peers.sh
	$(PY) -m loadtests.peers $(PEERS_ARGS)

clean:  ## removes the local platform's state (.goodput/: logs, dev key); stops nothing
	rm -rf .goodput
