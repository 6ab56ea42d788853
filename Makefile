# distlab — make help lists the targets.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# Where there is no GPU, torch comes from PyTorch's CPU index (a ~200 MB build instead
# of the multi-GB CUDA one); NVIDIA machines take PyPI's CUDA build and cupy (extra
# [gpu]). torch itself is installed first, without its dependencies, so that only that
# one look-up goes to PyTorch's index; everything else comes from PyPI. On ROCm:
#   make setup TORCH_INDEX="--index-url https://download.pytorch.org/whl/rocm6.4" \
#              DEPS_INDEX="--extra-index-url https://download.pytorch.org/whl/rocm6.4"
HAS_NVIDIA := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
ifeq ($(HAS_NVIDIA),yes)
TORCH_INDEX ?=
EXTRAS ?= [dev,gpu]
else
TORCH_INDEX ?= --extra-index-url https://download.pytorch.org/whl/cpu
EXTRAS ?= [dev]
endif
DEPS_INDEX ?=
LAB ?=
# make lab: the notebooks' folder, and further options for JupyterLab (LAB_ARGS="--port 9999")
LAB_DIR ?= labs
LAB_ARGS ?=
PYTEST_ARGS ?=
# make acceptance: which checks (comma-separated; default all) and where their JSON goes
CHECKS ?=
RESULTS ?= results
# make test spreads its units of work over this many worker processes (pytest-xdist; a
# unit, a file or a case of the grading files (tests/durations.py), stays on one worker,
# heaviest first (tests/conftest.py): a notebook's cells share a kernel, a module's
# fixtures are built once).
# TEST_WORKERS=0 runs everything in one process.
# Three on a 2-core machine: much of the suite waits (kernels and ranks starting, time
# limits and deadlocks reached on purpose), and a third worker fills that time.
TEST_WORKERS ?= 3
# One thread per process for the tests, as the ranks already have (runtime/pool.py): with
# three workers, their notebooks' kernels and their ranks on two cores, torch's thread
# pools only wait on each other.
TEST_THREADS ?= 1
STAMP := $(VENV)/.distlab-installed
EXTRAS_SPEC := .$(EXTRAS)

.PHONY: help setup lab test test-mutants test-browser grade nbval labs edition bench acceptance clean

help: ## list the targets
	@echo "distlab — make targets"
	@echo "For students (LAB=03 grades one lab):"
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | awk -F'\t' '{printf "  make %-14s %s\n", $$1, $$2}'
	@echo "For instructors and developers:"
	@grep -E '^[a-z-]+:.*##! ' $(MAKEFILE_LIST) | sed -E 's/:.*##! /\t/' | awk -F'\t' '{printf "  make %-14s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# --retries 0: where PyTorch's index cannot be reached, fall back to the others at once
	$(PY) -m pip install --quiet --no-deps --retries 0 --timeout 10 "torch==$(TORCH_VERSION)" $(TORCH_INDEX)
	@# the kit and its ~150 dependencies through uv (seconds; pip takes about a minute to
	@# resolve and install them), through pip where uv cannot be had
	($(PY) -m pip install --quiet uv && $(VENV)/bin/uv pip install --quiet --compile-bytecode --python $(PY) \
	  -e "$(EXTRAS_SPEC)" $(DEPS_INDEX)) || $(PY) -m pip install --quiet -e "$(EXTRAS_SPEC)" $(DEPS_INDEX)
	@# nbgrader ([dev], for the instructors' tests) stays out of the students' JupyterLab
	-$(PY) tools/quiet-nbgrader.py >/dev/null 2>&1
	@# the kit's bytecode, once: where PYTHONDONTWRITEBYTECODE is set (as on some CI
	@# machines) every interpreter would otherwise compile what it imports of lib/distlab
	-$(PY) -m compileall -q lib/distlab >/dev/null
	touch $(STAMP)

setup: $(STAMP) ## create .venv and install the kit (CPU torch where there is no GPU)

lab: $(STAMP) ## open JupyterLab on the student notebooks in labs/ (as root too; on a remote machine it prints the SSH tunnel to open)
	$(PY) -m distlab.jupyter $(LAB_DIR) $(LAB_ARGS)

test: $(STAMP) ##! the tests that gate a change: library, autograder, notebooks (nbval), browser when available (not the held-back mutants: make test-mutants)
	OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest -q -rs -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --nbval --nbval-current-env --ignore-glob='tests/test_mutants_*' tests solutions $(PYTEST_ARGS)

test-mutants: $(STAMP) ##! every held-back wrong answer graded: each exercise's checks name its mistake (CI runs it after make test)
	OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest -q -rs -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests/test_mutants_*.py $(PYTEST_ARGS)

test-browser: $(STAMP) ##! only the browser test: JupyterLab in headless Chromium
	$(PY) -m pytest -q -rsx tests/test_browser.py tests/test_browser_widgets.py $(PYTEST_ARGS)

grade: $(STAMP) ## grade your labs (all, or LAB=03) and write grade-report.json
	$(PY) -m distlab.grading labs $(if $(LAB),--lab $(LAB)) --json grade-report.json

nbval: $(STAMP) ##! check that the solution notebooks reproduce their outputs
	$(PY) -m pytest -q --nbval --nbval-current-env solutions $(PYTEST_ARGS)

labs: $(STAMP) ##! regenerate labs/ from solutions/; refuses to overwrite a lab someone edited (FORCE=1: overwrite, keeping a copy)
	$(PY) -m distlab.grading.labs render solutions --readme README.md
	$(PY) -m distlab.grading.notebook release solutions labs $(if $(FORCE),--force)

edition: $(STAMP) ##! write the student edition through lab THROUGH (none, 00, 01 ...) to OUT (default ../distlab-through-THROUGH)
	$(if $(THROUGH),,$(error name the last lab whose answers it holds: make edition THROUGH=04, or THROUGH=none))
	$(PY) -m distlab.grading.course release $(or $(OUT),../distlab-through-$(THROUGH)) --through $(THROUGH)

bench: $(STAMP) ## launch cost, bandwidth sweeps of the collectives and the ring (CPU-sized; GPU goals: make acceptance)
	$(PY) -m distlab.bench.launch
	$(PY) -m distlab.bench.collectives
	$(PY) -m distlab.bench.ring

acceptance: $(STAMP) ##! the GPU acceptance suite into results/ (CHECKS=ring,zero to select; python -m distlab.acceptance --list)
	$(PY) -m distlab.acceptance $(if $(CHECKS),--only $(CHECKS)) --out $(RESULTS)

clean: ## remove the virtual environment and caches
	rm -rf $(VENV) build lib/*.egg-info grade-report.json
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
