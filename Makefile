# laneflow — the two commands: `make demo` runs the pipeline locally, `make test` runs the tests.
# Both create .venv and install everything on first use (scripts/bootstrap.sh).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.laneflow-installed
DEMO_DIR ?= .laneflow/demo
# tusimple or culane: the format of the demo's synthetic data (`make demo DATASET=culane`).
DATASET ?= tusimple
PORT ?= 4200

.PHONY: demo serve stop-server test test-compile image image-gpu lint bench bench-train-step bench-precision bench-accuracy bench-overhead bench-sweep bench-models bench-server soak install clean clean-work

$(STAMP): pyproject.toml scripts/bootstrap.sh scripts/install_horovod.sh scripts/constraints.txt scripts/versions.env
	VENV=$(VENV) scripts/bootstrap.sh
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py --workdir $(DEMO_DIR) --port $(PORT) --dataset $(DATASET)

serve: $(STAMP)
	$(VENV)/bin/laneflow serve --home $(DEMO_DIR) --port $(PORT)

stop-server: $(STAMP)
	$(VENV)/bin/laneflow stop-server --home $(DEMO_DIR)

# The images deployments/Dockerfile.* build (CPU flavour; cached by content, so an unchanged tree builds
# nothing). The emulated cluster's pods run from them, so the tests build them first where they can.
image: $(STAMP)
	$(PY) scripts/images.py build

# The training image's GPU flavour (localhost/laneflow-train:gpu): CUDA and NCCL from PyPI wheels, Horovod compiled
# for NCCL (docs/getting-started/images.md). Not part of `make test`: GBs of downloads and a Horovod build; its own lock, so the
# tests' CPU builds never wait for it.
image-gpu: $(STAMP)
	$(PY) scripts/images.py build --flavour gpu

test: $(STAMP)
	$(PY) scripts/images.py build --if-possible
	$(PY) -m pytest

# The seeded soak (tests/soak.py): runs side by side on the AKS-shaped emulated cluster, through the real Prefect
# Kubernetes worker, while disruptions drawn from the seed hit them; then the invariants, a table per seed.
# SEED=3 or SEED=1,2,3; RUNS and DISRUPTIONS per seed. `make test` runs one short seed.
SEED ?= 1
RUNS ?= 3
DISRUPTIONS ?= 5
soak: $(STAMP)
	$(PY) scripts/images.py build --if-possible
	LANEFLOW_SOAK_SEEDS=$(SEED) LANEFLOW_SOAK_RUNS=$(RUNS) LANEFLOW_SOAK_DISRUPTIONS=$(DISRUPTIONS) \
		$(PY) -m pytest -n 0 -s -p no:cacheprovider --timeout 3600 tests/test_soak.py -k "not short_seed"

# torch.compile's scenario on SCNN too (its custom autograd op; ~2 minutes of compiling): the suite runs it on ufld.
test-compile: $(STAMP)
	LANEFLOW_TEST_COMPILE_SCNN=1 $(PY) -m pytest -n 0 -p no:cacheprovider tests/test_compile.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) bench/preprocess.py
	$(PY) bench/loader.py
	$(PY) bench/train_step.py
	$(PY) bench/scaling.py
	$(PY) bench/overhead.py

# One training step against this machine's GEMM rate, per precision and memory format (docs/performance.md).
bench-train-step: $(STAMP)
	$(PY) bench/train_step.py

# bf16 + channels-last against fp32 in val accuracy at equal steps, over seeds (docs/performance.md).
bench-precision: $(STAMP)
	$(PY) bench/precision_parity.py

bench-overhead: $(STAMP)
	$(PY) bench/overhead.py

bench-accuracy: $(STAMP)
	$(PY) bench/accuracy.py

bench-sweep: $(STAMP)
	$(PY) bench/sweep.py

# The Prefect server under a sweep of 16 trials, 8 at once: SQLite against PostgreSQL + Redis (docs/performance.md).
bench-server: $(STAMP)
	$(PY) bench/server_load.py

# SCNN against the row-anchor detector: parameters, inference img/s at one input size, steps and seconds to a
# val accuracy (docs/performance.md).
bench-models: $(STAMP)
	$(PY) bench/models.py

# Caches only (Python's, pytest's and ruff's): the demo's volumes, snapshots and Prefect history are kept. `make clean-work` lists the demo's trained work and history; CONFIRM=yes deletes it.
clean:
	python3 scripts/clean.py caches --demo-dir $(DEMO_DIR)

clean-work:
ifeq ($(CONFIRM),yes)
	-$(VENV)/bin/laneflow stop-server --home $(DEMO_DIR)
	python3 scripts/clean.py work --demo-dir $(DEMO_DIR) --yes
else
	python3 scripts/clean.py work --demo-dir $(DEMO_DIR)
endif
