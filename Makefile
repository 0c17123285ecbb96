# Every target bootstraps .venv if it is missing, so `make test` alone works on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-real real-setup demo-real bench-real bench-slow lint fmt check demo demo-picture bench bench-scrape clean

install: $(STAMP)

# Reinstall when the dependency declarations change; constraints.txt pins what CI resolves.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# Everything under sglang-router 0.3.2, then the router-facing suites again under its successor
# smg (PDSIM_ROUTER picks the router pdsim.stack and the sandbox units run), less the tests
# marked router_agnostic. The unit tests run alone (they use the CPU); the suites that mostly wait
# on real processes run four modules side by side (pytest-xdist, one module per worker: modules
# share their stacks). --durations names the slow tests, to keep the suite under 15 minutes.
ROUTER_SUITES := tests/integration tests/sandbox tests/e2e
PROCESS_SUITES := tests/pdsim $(ROUTER_SUITES)
XDIST := -n 4 --dist loadfile
# Each run ends with the tests it skipped for a missing system tool and the apt-get line that
# enables them (tests/conftest.py); the runs record them here, and make test ends with their sum,
# whether the runs passed or not (a failed run stops the ones after it, as before).
SKIPS := $(VENV)/test-skips.jsonl
PYTEST := SGLANG_WATCHDOG_SKIPS=$(SKIPS) $(BIN)/pytest -q --durations=10

test: $(STAMP)
	rm -f $(SKIPS)
	status=0; \
	{ PDSIM_ROUTER=sglang-router $(PYTEST) tests/unit \
	  && PDSIM_ROUTER=sglang-router $(PYTEST) $(XDIST) $(PROCESS_SUITES) \
	  && PDSIM_ROUTER=smg $(PYTEST) $(XDIST) -m "not router_agnostic" $(ROUTER_SUITES); } || status=$$?; \
	$(BIN)/python -m tests.skipped_tools $(SKIPS); exit $$status

# The released sglang 0.5.23 as a CPU prefill-decode pair (realsglang/): installed once into
# $(REAL_SGLANG_HOME) (~5 minutes, ~7 GiB; idempotent), then the real-SGLang tier (~18 minutes:
# the conformance checks on one real pair, then one behind both routers with the watchdog at its
# shipped defaults as a unit beside it).
REAL_SGLANG_HOME ?= $(HOME)/.cache/sglang-watchdog/real-sglang
export REAL_SGLANG_HOME

real-setup:
	bash realsglang/setup.sh

test-real: $(STAMP) real-setup
	$(BIN)/pytest -q --durations=10 tests/real

# Dead code in the package: 60 is vulture's lowest confidence, so every unused function, method,
# attribute and field counts; what it cannot see used (protocols, pydantic hooks, fields read by
# name or only serialized, hooks for the suites) is listed in vulture_whitelist.py.
VULTURE := --min-confidence 60 --ignore-decorators "@field_validator,@model_validator,@field_serializer"

lint: $(STAMP)
	$(BIN)/ruff format --check watchdog tests bench demo pdsim sandbox realsglang
	$(BIN)/ruff check watchdog tests bench demo pdsim sandbox realsglang
	$(BIN)/mypy --strict watchdog demo pdsim sandbox realsglang tests bench
	$(BIN)/vulture watchdog vulture_whitelist.py $(VULTURE)

fmt: $(STAMP)
	$(BIN)/ruff format watchdog tests bench demo pdsim sandbox realsglang
	$(BIN)/ruff check --fix watchdog tests bench demo pdsim sandbox realsglang

check: lint test

# The simulated PD stack behind the real router, a transfer stall, detection, evidence, the
# co-restart and its verification, in ~1 minute (systemd sandbox as root, else --dry-run).
# Writes only under demo-output/ (git-ignored); works from a checkout anywhere, /tmp included.
demo: $(STAMP)
	$(BIN)/python -m demo

# The same story on the released sglang 0.5.23 (CPU) behind the real router: the silent transfer
# stall, detection at the shipped defaults, the real co-restart and verification (~5 minutes, as
# root; writes demo-output/real/).
demo-real: $(STAMP) real-setup
	$(BIN)/python -m demo.real

# The demo, then its picture copied over the README's docs/demo-timeline.png (a tracked file:
# commit it). Needs the systemd sandbox; fails rather than publish a dry run's picture.
demo-picture: $(STAMP)
	$(BIN)/python -m demo --docs-image docs/demo-timeline.png

# The chaos benchmark: 12 scenarios x 5 against the anchors' baselines, recovery in the systemd
# sandbox (as root), overhead and scale; writes bench/results.{md,json,png} (~16 minutes), then the
# slow-decode rows at the shipped defaults (bench/slow_decode.py, ~5 minutes) and the real rows on
# sglang 0.5.23 (bench/real.py, ~12 minutes).
bench: $(STAMP) real-setup
	$(BIN)/python -m bench.run
	$(BIN)/python -m bench.slow_decode
	$(BIN)/python -m bench.real

# The slow-decode rows alone (the lowest decode rate read as progress, and a stall's
# detection under that load; results-slow.json and their section of results.md; ~5 minutes).
bench-slow: $(STAMP)
	$(BIN)/python -m bench.slow_decode

# The real rows alone (results-real.json and their section of results.md; ~12 minutes).
bench-real: $(STAMP) real-setup
	$(BIN)/python -m bench.real

# Parser benchmark only (fast): ours vs prometheus_client's full parser on a 3000-line payload.
bench-scrape: $(STAMP)
	$(BIN)/python -m bench.bench_scrape

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
