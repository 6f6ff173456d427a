# The two commands of the README: `make run` runs the product, `make test` runs every test.
# Both create .venv on first use. torch is pinned to the local CPU build (2.13.0); an
# unpinned torch would pull a multi-GB CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test bootstrap demo bench-learn clean chromium bubblewrap sglang sglang-model

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

bootstrap: $(STAMP)

# The dashboard: migrate, ensure the admin user, ASGI server + Celery worker, print the URL.
# Embedded (SQLite + filesystem broker) unless DATABASE_URL / REDIS_URL are set.
run: $(STAMP) bubblewrap
	$(BIN)/python manage.py serve

# The linter, then every test; then the web tests again on PostgreSQL + Redis (DATABASE_URL / REDIS_URL, defaults
# on 127.0.0.1; they fail loudly if the servers are down).
test:
	@# the prerequisites side by side: the two virtualenvs' installs overlap (118 s instead of 175 s fresh)
	@$(MAKE) --no-print-directory bubblewrap
	@$(MAKE) --no-print-directory -j2 $(STAMP) chromium sglang sglang-model
	$(BIN)/ruff check .
	$(BIN)/python -m pytest --durations=25
	RLPILOT_TEST_SETUP=redis $(BIN)/python -m pytest tests/web --durations=25

# Headless Chromium for the browser test (Debian's package; never `playwright install`).
CHROMIUM := /usr/bin/chromium
chromium:
	@test -x $(CHROMIUM) || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	  else echo "$(CHROMIUM) is missing: run 'sudo apt-get install -y chromium'" >&2; exit 1; fi; }

# bubblewrap, the boundary around model-written code (trainer/sandbox/bwrap.py; Debian's package).
BWRAP := /usr/bin/bwrap
bubblewrap:
	@test -x $(BWRAP) || command -v bwrap >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; \
	  else echo "bwrap is missing: run 'sudo apt-get install -y bubblewrap'" >&2; exit 1; fi; }

# A real SGLang server in its own virtualenv (.venv-sglang): SGLang as published where an NVIDIA
# GPU answers, else SGLang's CPU engine with pinned non-CUDA requirements (tools/sglang/).
# The real-server tests (tests/test_sglang_real.py) run when it exists; they serve SmolLM2.
sglang:
	PY=$(PY) tools/sglang/setup.sh

SMOLLM2 := var/models/smollm2-135m-instruct
sglang-model: $(SMOLLM2)/config.json
$(SMOLLM2)/config.json: | $(STAMP)
	$(BIN)/python -m trainer import-gguf smollm2

bench-learn: $(STAMP)
	$(BIN)/python -m trainer bench learn --json

clean:
	rm -rf $(VENV) .venv-sglang runs var .pytest_cache
