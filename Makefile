# laneflow — the two commands: `make demo` runs the pipeline locally, `make test` runs the tests.
# Both create .venv and install everything on first use (scripts/bootstrap.sh).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.laneflow-installed
DEMO_DIR ?= .laneflow/demo

.PHONY: demo test lint bench bench-accuracy install clean

$(STAMP): pyproject.toml scripts/bootstrap.sh scripts/install_horovod.sh scripts/constraints.txt
	VENV=$(VENV) scripts/bootstrap.sh
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py --workdir $(DEMO_DIR)

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) bench/preprocess.py
	$(PY) bench/loader.py
	$(PY) bench/train_step.py
	$(PY) bench/scaling.py

bench-accuracy: $(STAMP)
	$(PY) bench/accuracy.py

clean:
	rm -rf $(DEMO_DIR) .pytest_cache
