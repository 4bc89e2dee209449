# Entry points for a new machine: `make gate` and `make test`. Both build the stack's venv first.
# STACK picks one of the stacks declared in requirements/stack-*.txt (docs/stacks.md):
#   make test                 the default stack (torchrec 1.8) in .venv
#   make gate STACK=1.9       torchrec 1.9.2 in .venv-1.9
PYTHON ?= python3
STACK ?= 1.8
DEFAULT_STACK := 1.8
VENV ?= $(if $(filter $(DEFAULT_STACK),$(STACK)),.venv,.venv-$(STACK))
BIN := $(VENV)/bin
STAMP := $(VENV)/.paritykit-installed
STACK_DEPS := requirements/stack-$(STACK).txt
STACK_TORCHREC := requirements/stack-$(STACK).torchrec.txt

.PHONY: env gate test selftest bench coverage mutate clean stacks

ifeq ($(wildcard $(STACK_DEPS)),)
$(error STACK=$(STACK) is not declared: no $(STACK_DEPS) (declared: $(patsubst requirements/stack-%.txt,%,$(filter-out %.torchrec.txt,$(wildcard requirements/stack-*.txt)))))
endif

# torchrec goes in with --no-deps (its metadata names the CUDA fbgemm-gpu wheel); everything else
# is pinned in the stack's file.
$(STAMP): $(STACK_DEPS) $(STACK_TORCHREC) requirements/tools.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -r $(STACK_DEPS)
	$(BIN)/python -m pip install -q --no-deps -r $(STACK_TORCHREC)
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $@

env: $(STAMP)

gate: env
	$(BIN)/paritykit gate $(ARGS)

test: env
	$(BIN)/python -m pytest -n 4 $(ARGS)

selftest: env
	$(BIN)/paritykit selftest $(ARGS)

bench: env
	$(BIN)/paritykit bench $(ARGS)

# The instruments that measure the checks (docs/coverage.md): coverage of torchrec under the gate's
# oracles, then a uniform sample of 200 mutants of covered lines (a release task: about two hours on
# 2 cores).
coverage: env
	$(BIN)/paritykit coverage --report coverage-$(STACK) $(ARGS)

mutate: env
	$(BIN)/paritykit mutate --sample 200 --seed 0 --jobs 2 --report mutants-$(STACK) $(ARGS)

stacks:
	@echo $(patsubst requirements/stack-%.txt,%,$(filter-out %.torchrec.txt,$(wildcard requirements/stack-*.txt)))

clean:
	rm -rf $(VENV)
