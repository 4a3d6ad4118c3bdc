# The course's commands (see README.md; `make help` lists them). Each sets itself up on first use:
# a virtual environment in .venv with PyTorch ($(TORCH_SPEC), from $(TORCH_INDEX) when set) and this
# project's dependencies at the versions of constraints.txt (the CuTe DSL, pytest, mkdocs-material,
# JupyterLab, and transformers for the models backend and its capstone notebook). Changing
# TORCH_SPEC or TORCH_INDEX, pyproject.toml or constraints.txt installs again.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch
# A package index for PyTorch alone, e.g. https://download.pytorch.org/whl/cpu for a CPU build anywhere.
TORCH_INDEX ?=
BIN := $(VENV)/bin
READY := $(VENV)/.ready
TORCH_CHOICE := $(VENV)/.torch-choice
CONSTRAINTS := constraints.txt

.PHONY: help status test docs site constraints FORCE

help:  ## this list
	@grep -E '^[a-z]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z]+):.*## /  make \1\t/' | expand -t 20
	@echo "  variables: TORCH_SPEC=$(TORCH_SPEC) TORCH_INDEX=$(TORCH_INDEX) (see README.md)"

status: $(READY)  ## the table of stages: TODOs left, sm_90a cross-compile; on a Hopper GPU numerics and speed
	$(BIN)/python -m course status

test: $(READY)  ## lint (ruff), then the whole test suite (GPU tests run on Hopper, skipped with the reason elsewhere)
	$(BIN)/ruff check course solutions tests docs/hooks
	$(BIN)/python -m pytest

docs: $(READY)  ## serve the docs site at http://127.0.0.1:8000, rebuilt on every change
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

site: $(READY)  ## build the docs site into site/ (strict: a broken include or link fails)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d site

constraints: $(READY)  ## pin every dependency but PyTorch to the versions in .venv now (writes constraints.txt)
	$(BIN)/python -m course.constraints > $(CONSTRAINTS)
	touch $(READY)  # .venv is what the new pins describe: no need to install again

# The PyTorch choice as a file that changes only when the choice does: `.ready` depends on it.
$(TORCH_CHOICE): FORCE
	@mkdir -p $(VENV)
	@echo '$(TORCH_SPEC) $(TORCH_INDEX)' | cmp -s - $@ || echo '$(TORCH_SPEC) $(TORCH_INDEX)' > $@

$(READY): pyproject.toml $(CONSTRAINTS) $(TORCH_CHOICE)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet --constraint $(CONSTRAINTS) -e ".[dev,models]"
	touch $(READY)
