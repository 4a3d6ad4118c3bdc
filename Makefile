# The course's commands (see README.md; `make help` lists them). Each sets itself up on first use:
# a virtual environment in .venv with PyTorch ($(TORCH_SPEC), from $(TORCH_INDEX) when set) and this
# project's dependencies at the versions of constraints.txt (the CuTe DSL, pytest, mkdocs-material,
# JupyterLab, and transformers for the models backend and its capstone notebook). Changing
# TORCH_SPEC or TORCH_INDEX, pyproject.toml or constraints.txt installs again.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch
# A package index for PyTorch alone. Without an NVIDIA driver on this machine, PyTorch's CPU index (plain
# `torch` from PyPI is a CUDA build of several GB); set TORCH_INDEX (empty: the default index) to choose.
CPU_INDEX := https://download.pytorch.org/whl/cpu
NVIDIA_DRIVER := $(shell { test -e /proc/driver/nvidia/version || command -v nvidia-smi; } >/dev/null 2>&1 && echo yes)
TORCH_INDEX ?= $(if $(NVIDIA_DRIVER),,$(CPU_INDEX))
CPU_NOTE := No NVIDIA driver here: PyTorch's CPU build, from $(CPU_INDEX) (TORCH_INDEX chooses another index)
BIN := $(VENV)/bin
READY := $(VENV)/.ready
TORCH_CHOICE := $(VENV)/.torch-choice
CONSTRAINTS := constraints.txt

.PHONY: help status test quick docs site constraints FORCE

help:  ## this list
	@grep -E '^[a-z]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z]+):.*## /  make \1\t/' | expand -t 20
	@echo "  variables: TORCH_SPEC=$(TORCH_SPEC) TORCH_INDEX=$(TORCH_INDEX) (see README.md)"

status: $(READY)  ## the table of stages: TODOs left, sm_90a cross-compile, CPU numerics; on a Hopper GPU numerics and speed
	$(BIN)/python -m course status

test: $(READY)  ## lint (ruff), then the whole test suite on every core (GPU tests run on Hopper, skipped with the reason elsewhere)
	$(BIN)/ruff check course solutions tests docs/hooks
	$(BIN)/python -m pytest -n auto --dist worksteal

quick: $(READY)  ## lint, then the tests without cross-compiles, docs or notebooks (the edit loop; make test runs all)
	$(BIN)/ruff check course solutions tests docs/hooks
	$(BIN)/python -m pytest -n auto --dist worksteal -m "not compiles" --ignore=tests/test_docs.py \
	  --ignore=tests/test_site.py

docs: $(READY)  ## serve the docs site at http://127.0.0.1:8000, rebuilt on every change
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

site: $(READY)  ## build the docs site into site/ (strict: a broken include or link fails)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d site

constraints: $(READY)  ## pin every dependency but PyTorch to the versions in .venv now (writes constraints.txt)
	$(BIN)/python -m course.tools.constraints > $(CONSTRAINTS)
	touch $(READY)  # .venv is what the new pins describe: no need to install again

# The PyTorch choice as a file that changes only when the choice does: `.ready` depends on it.
$(TORCH_CHOICE): FORCE
	@mkdir -p $(VENV)
	@echo '$(TORCH_SPEC) $(TORCH_INDEX)' | cmp -s - $@ || echo '$(TORCH_SPEC) $(TORCH_INDEX)' > $@

# A changed PyTorch choice gets a fresh environment: one build's libraries (CUDA's are GBs) never stay behind.
$(READY): pyproject.toml $(CONSTRAINTS) $(TORCH_CHOICE)
	@if [ -f $(VENV)/.torch-installed ] && ! cmp -s $(TORCH_CHOICE) $(VENV)/.torch-installed; then \
	  echo "PyTorch choice changed from '$$(cat $(VENV)/.torch-installed)': a fresh $(VENV)"; \
	  rm -rf $(VENV); mkdir -p $(VENV); echo '$(TORCH_SPEC) $(TORCH_INDEX)' > $(TORCH_CHOICE); fi
	$(PYTHON) -m venv $(VENV)
	@$(if $(NVIDIA_DRIVER),,$(if $(filter $(CPU_INDEX),$(TORCH_INDEX)),echo "$(CPU_NOTE)"))
	$(BIN)/python -m pip install --quiet $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX) --retries 1) "$(TORCH_SPEC)" \
	  $(if $(TORCH_INDEX),|| { echo "$(TORCH_INDEX) did not serve $(TORCH_SPEC): from the default index instead"; \
	  $(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"; })
	$(BIN)/python -m pip install --quiet --constraint $(CONSTRAINTS) -e ".[dev,models]"
	cp $(TORCH_CHOICE) $(VENV)/.torch-installed
	touch $(READY)
