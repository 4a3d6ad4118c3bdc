# The two commands of the course (see README.md). Each sets itself up on first use:
# a virtual environment in .venv with PyTorch ($(TORCH_SPEC)) and this project's
# dependencies (the CuTe DSL, pytest, mkdocs-material, Jupyter pieces, and transformers for the
# models backend and its capstone notebook).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch
BIN := $(VENV)/bin
READY := $(VENV)/.ready

.PHONY: status test

status: $(READY)
	$(BIN)/python -m course status

test: $(READY)
	$(BIN)/python -m pytest

$(READY): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev,models]"
	touch $(READY)
