# Two entry points for a fresh machine:
#   make demo   set up .venv, warm-start the default model (cached) and run a short RL job
#   make test   set up .venv and run the test suite plus the architecture contracts
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test venv clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/tailrace train

test: $(STAMP)
	$(BIN)/lint-imports
	$(BIN)/pytest

clean:
	rm -rf $(VENV)
