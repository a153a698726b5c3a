# The two commands a newcomer runs: `make run` and `make test`.
PYTHON_BOOT ?= $(shell command -v python3.12 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
CKSUM := $(shell cksum pyproject.toml | cut -d' ' -f1)
RUN_STAMP := $(VENV)/.installed-run-$(CKSUM)
TEST_STAMP := $(VENV)/.installed-test-$(CKSUM)
PORT ?= 8000
export PORT  # settings derive SANDBOX_URL from it

.PHONY: run test install migrate soak

# `make run` installs what running needs; `make test` (and `make install`) adds the test tools
# (Playwright, ruff, OpenTelemetry's SDK…), which a first `make run` need not wait for.
$(RUN_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON_BOOT) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	rm -f $(VENV)/.installed-run-* && touch $(RUN_STAMP)

$(TEST_STAMP): $(RUN_STAMP)
	$(PY) -m pip install --quiet -e '.[test]'
	rm -f $(VENV)/.installed-test-* && touch $(TEST_STAMP)

install: $(TEST_STAMP)

migrate: $(RUN_STAMP)
	$(PY) manage.py migrate --noinput
	$(PY) manage.py migrate --noinput --database sandbox

# Console + embedded executor on SQLite; no servers needed, under one supervisor (manage.py
# run_local): an executor that dies is reported loudly and restarted; Ctrl-C or SIGTERM stops
# both. Their metrics (served at /metrics when RECOVERY_METRICS_TOKEN is set) are added up in
# var/prometheus.
run: export PROMETHEUS_MULTIPROC_DIR ?= $(CURDIR)/var/prometheus
# The /demo page and seed_demo are off unless RECOVERY_DEMO is set (docs/security.md): make run sets it.
run: export RECOVERY_DEMO ?= 1
run: migrate
	mkdir -p "$(PROMETHEUS_MULTIPROC_DIR)" && rm -f "$(PROMETHEUS_MULTIPROC_DIR)"/*.db
	$(PY) manage.py seed_demo
	$(PY) manage.py demo_login
	@echo "Recovery Console on http://127.0.0.1:$(PORT)/ (embedded executor running beside it)"
	@exec $(PY) manage.py run_local --addr 127.0.0.1:$(PORT)

# The whole suite, in TEST_WORKERS processes (pytest-xdist; each has its own test databases). Honours
# DATABASE_URL (e.g. postgres://postgres@127.0.0.1:5432/recovery), SANDBOX_DATABASE_URL and
# CELERY_BROKER_URL; on the embedded default the PostgreSQL-only tests skip with a reason.
# PYTEST_ARGS go to pytest (.ci/run's SQLite pass deselects the storage-agnostic browser tests).
TEST_WORKERS ?= 2
PYTEST_ARGS ?=
test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

# The whole system under real process death (docs/soak.md): the engine's database on a throwaway
# PostgreSQL cluster of its own (restarted once), the sandbox's on the server of DATABASE_URL, its
# own Redis; SOAK_RUNS (500), SOAK_KILL_EVERY, SOAK_TIMEOUT, SOAK_KEEP.
soak: install
	$(PY) bench/soak.py
