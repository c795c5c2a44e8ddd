# Every target installs what it needs on first use into a local virtual environment.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# What `pip install` gets when the environment has no torch yet. By default the pinned
# version from the configured index: on Linux x86-64 PyPI serves the CUDA build, while a
# local wheel cache or mirror that holds the CPU build gives that one. Choose on purpose,
# e.g. make TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
TORCH_SPEC ?= torch==2.13.0
# Ray for placement="ray", its tests and the bench's Ray rows, likewise installed first
# when absent, and only by the targets that use it (test, test-slow, bench, bench-quick):
# the base venv (demo, lint, stress, the other benches) stays without it.
RAY_SPEC ?= ray==2.60.0
# Ray, in every target: simulated nodes on 127.0.0.1, no usage reports.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER = 0
export RAY_USAGE_STATS_ENABLED = 0

.PHONY: venv venv-ray venv-models docs docs-check chromium docs-serve test test-slow prometheus metrics-dashboard stress chaos demo bench bench-quick bench-per-call bench-pipelined bench-recovery bench-joined bench-sessions gpu-check gpu-check-venv gpu-check-here compiled-here lint clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml reactor_dist/wire/_framing.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# A torch already in the environment is kept; else TORCH_SPEC (see above).
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e ".[dev,metrics]"
	touch $@

venv-ray: $(VENV)/.ray-installed

$(VENV)/.ray-installed: $(VENV)/.installed
	$(PY) -c "import ray" 2>/dev/null || $(PY) -m pip install -q $(RAY_SPEC)
	$(PY) -m pip install -q -e ".[ray]"
	touch $@

# The third-party models of workers/ (transformers, diffusers; the `models` extra), for
# make test-slow and gpu-check only: installed on first use.
venv-models: $(VENV)/.models-installed

$(VENV)/.models-installed: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[models]"
	touch $@

# The tests run side by side in TEST_JOBS processes (pytest-xdist): most of a test's time
# is spent waiting on its ranks, not computing, so more processes than cores pay.  The
# tests marked `alone` (they need the machine to themselves: the Ray clusters, what
# measures a stall, benchmarks) run after, one at a time.
# One file while you work: .venv/bin/python -m pytest -q tests/test_stream.py
TEST_JOBS ?= 4
PYTEST_SIDE_BY_SIDE = $(PY) -m pytest -q -p xdist -n $(TEST_JOBS) --dist load

test: venv-ray
	$(PYTEST_SIDE_BY_SIDE) -m "not slow and not alone"
	$(PY) -m pytest -q -m "alone and not slow"

test-slow: venv-ray venv-models prometheus
	$(PYTEST_SIDE_BY_SIDE) -m "slow and not alone"
	$(PY) -m pytest -q -m "slow and alone"

# Debian's Prometheus server, for tests/test_prometheus_server.py (slow), installed when
# absent (as root, with services kept from starting: the tests run it on 127.0.0.1 alone).
# Without it that test skips and says why.
prometheus:
	@command -v prometheus >/dev/null || { \
	  if [ ! -e /usr/sbin/policy-rc.d ]; then \
	    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d \
	    && trap 'rm -f /usr/sbin/policy-rc.d' EXIT; fi; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    --no-install-recommends prometheus >/dev/null; } \
	  || echo "prometheus could not be installed: tests/test_prometheus_server.py will skip"

# Runner lifetimes (start, one call, shutdown) over world_size 2-4, with and without a
# CPU hog: zero hangs or it fails (issue 19). Not part of `make test`; N=300 for a quick run.
N ?= 3000
stress: venv
	$(PY) -m benchmarks.stress $(N)

# A chaos soak (issue 30): faults every 1-4 s (SIGKILL, SIGSTOP, raises, a hang, a desync,
# os._exit) under pipelined calls, streams and asyncio tasks at world_size 2 and 3, every
# answer checked exactly; fails on a wrong answer, a stuck call or anything left behind.
# Not part of `make test`. Replay a run's plan with SEED=<the seed it printed>;
# CHAOS_FLAGS=--strict also fails on an error type the contract does not allow.
SECONDS ?= 300
SEED ?=
CHAOS_FLAGS ?=
chaos: venv
	$(PY) -m benchmarks.chaos --seconds $(SECONDS) $(if $(SEED),--seed $(SEED)) $(CHAOS_FLAGS)

# make demo DEMO_FLAGS=--fault: rank 1 SIGKILLed mid-step, the session goes on unseen
DEMO_FLAGS ?=
demo: venv
	$(PY) examples/demo.py --world-size 2 --device auto$(if $(DEMO_FLAGS), $(DEMO_FLAGS))

# The Grafana dashboard's queries against a real Prometheus, drawn: docs/metrics_dashboard.png.
metrics-dashboard: venv prometheus
	$(PY) -m benchmarks.metrics_dashboard

# A full run also rewrites docs/performance.md's tables (between its bench markers).
bench: venv-ray
	$(PY) -m benchmarks.run

# Results under benchmarks/results/ only; docs/performance.md is left alone.
bench-quick: venv-ray
	$(PY) -m benchmarks.run --quick

# The per-call row alone: runner.generate(1) in a plain loop against bare pyzmq echo peers.
bench-per-call: venv
	$(PY) -m benchmarks.per_call

# The pipelined-steps rows alone: steps/s with the next step submitted ahead (C, W in ms).
bench-pipelined: venv
	$(PY) -m benchmarks.pipelined

# The recovery rows alone (issues 21, 31): a new runner, restart(), restart() with rejoin()
# (also with the victim inside a collective), restart() with a spare (2 s and 10 s load()).
bench-recovery: venv
	$(PY) -m benchmarks.recovery

# The joined ranks' fault rows alone (placement="external"): a rank, its joiner killed
# or stopped -> the runner knows; the application killed -> every joined rank gone.
bench-joined: venv
	$(PY) -m benchmarks.joined

# Its session rows alone: a snapshot's cost, a fault the caller never sees.
bench-sessions: venv
	$(PY) -m benchmarks.sessions

# First contact with this machine's GPUs (all of them, up to 8): the GPU-marked tests at
# world_size N with NCCL, the README Quickstart, the demo on CUDA, frame timings; one table,
# under 8 minutes. A driver without CUDA in torch fails (see TORCH_SPEC); no GPU: exit 0.
# Where the environment you are in has a CUDA build of torch (an offline GPU machine with
# its own torch), gpu-check runs there, as gpu-check-here does; else in .venv.
gpu-check:
	@if $(PYTHON) -c "import sys, torch; sys.exit(torch.version.cuda is None)" 2>/dev/null; \
	then $(MAKE) --no-print-directory gpu-check-here; \
	else $(MAKE) --no-print-directory gpu-check-venv; fi

gpu-check-venv: venv-models
	$(PY) -m benchmarks.gpu_check

# The same in the environment you are in, installing nothing and making no venv: for
# offline GPU containers that have torch, transformers and diffusers already.  PYTHON
# picks the interpreter (make gpu-check-here PYTHON=/opt/conda/bin/python); the checkout
# goes on PYTHONPATH.  It first names each package it lacks and what that skips.
gpu-check-here: compiled-here
	PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" $(PYTHON) -m benchmarks.gpu_check --current-env

# framing's compiled half (reactor_dist/wire/_framing.c) built in place for PYTHON with the
# C compiler alone: offline, no pip, no venv (the install builds it everywhere else).
# Where it cannot be built it says so, and the pure-Python path runs.
compiled-here:
	@suffix=$$($(PYTHON) -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))") \
	&& include=$$($(PYTHON) -c "import sysconfig; print(sysconfig.get_paths()['include'])") \
	&& $(CC) -O2 -shared -fPIC -I"$$include" reactor_dist/wire/_framing.c \
	  -o "reactor_dist/wire/_framing$$suffix" \
	&& echo "framing's compiled half: built, reactor_dist/wire/_framing$$suffix" \
	|| echo "framing's compiled half: not built (no C compiler or no Python headers for" \
	  "$(PYTHON)): the pure-Python path runs"

# The documentation site (mkdocs.yml, docs/): the `docs` extra into the same .venv on first
# use, without torch or ray (mkdocstrings reads the source, it imports nothing), then a
# --strict build into site/: a broken link or an API reference that does not resolve fails.
DOCS_STAMP := $(VENV)/.docs-installed

$(DOCS_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e ".[docs]"
	touch $@

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# Every page of the built site in headless Chromium at 1280 px (tests/docs_layout.py): a
# screenshot of each into out/docs-screenshots/, and a failure for a page wider than the
# window or a code block or table that hides part of its content.  Installs Chromium
# (Debian's package) on first use.
docs-check: docs chromium
	$(PY) tests/docs_layout.py site out/docs-screenshots

chromium:
	@command -v chromium >/dev/null || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

# The site while you edit it, on 127.0.0.1 only.
docs-serve: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve -a 127.0.0.1:8000

lint: venv
	$(VENV)/bin/ruff check reactor_dist workers tests benchmarks examples

clean:
	rm -rf $(VENV) out build site *.egg-info
