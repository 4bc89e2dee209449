# Two entry points for a new machine: `make gate` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.paritykit-installed

.PHONY: env gate test bench clean

# torchrec goes in with --no-deps (requirements/torchrec.txt says why); everything else is pinned
# in requirements/cpu.txt.
$(STAMP): requirements/cpu.txt requirements/torchrec.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -r requirements/cpu.txt
	$(BIN)/python -m pip install -q --no-deps -r requirements/torchrec.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $@

env: $(STAMP)

gate: env
	$(BIN)/paritykit gate $(ARGS)

test: env
	$(BIN)/python -m pytest -n 4 $(ARGS)

bench: env
	$(BIN)/paritykit bench $(ARGS)

clean:
	rm -rf $(VENV)
