# Two commands on a fresh clone (README, "Quick start"):
#   make demo    set up .venv, then run the main job
#   make test    set up .venv, then build the C++ kernels and run the test suite (CI: .ci/run)
# Both create the virtual environment .venv on first use and reuse it afterwards; the package is
# reinstalled when pyproject.toml changes. PYTHON picks the interpreter that creates .venv
# (make test PYTHON=python3.11; delete .venv to switch). AFTLAB_KERNELS=0 skips the kernels.
#   make check-wheel   build the sdist and the wheel; install the wheel into a fresh venv; train

PYTHON ?= python3
VENV ?= .venv
# the CPU wheel; an unpinned torch pulls a multi-GB CUDA build
TORCH ?= torch==2.13.0
# the main job (one line to change: the mixers, the budget, the sample's length; docs/results.md)
DEMO ?= aftlab compare --mixers attention,aft-local,aft-decay --set lr=4e-3 --steps 500 --sample 300 --decode-positions 4096,65536

BIN := $(abspath $(VENV))/bin
RUN := PATH="$(BIN):$$PATH"

.PHONY: demo test check-wheel clean

demo: $(VENV)/.demo-installed
	$(RUN) $(DEMO)

test: $(VENV)/.test-installed
	@if [ "$(AFTLAB_KERNELS)" != 0 ]; then echo '$(RUN) aftlab kernels'; $(RUN) aftlab kernels; fi
	$(RUN) python -m pytest -q

check-wheel: $(VENV)/.test-installed
	PYTHON=$(PYTHON) BUILD_PYTHON=$(BIN)/python TORCH=$(TORCH) bash .ci/check-wheel

$(VENV)/.torch-installed:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install $(TORCH)
	touch $@

$(VENV)/.test-installed: pyproject.toml $(VENV)/.torch-installed
	$(BIN)/python -m pip install -e ".[test]"
	touch $@

$(VENV)/.demo-installed: pyproject.toml $(VENV)/.torch-installed
	$(BIN)/python -m pip install -e ".[plot,progress]"
	touch $@

clean:
	rm -rf $(VENV) build dist
