"""Serving glue between `runtime.Engine` and the servers that run it: Triton Inference Server's python
backend (triton_model_repo/lookahead_llm/1/model.py) and NVIDIA Dynamo's worker.

Starting, watching and stopping those servers is `deploy/`'s. Nothing here imports
`triton_python_backend_utils`, so every piece is tested without a server:

- `config_template`: fill `config.pbtxt` templates and write a ready model repository (the
  instance_group from `--device`), and `instance_device`, where model.py puts an instance;
- `request`: Triton request tensors -> (prompt, SamplingParams), with typed errors naming the field;
- `fields`: the request's names for the runtime's fields (`prompt` is Triton's `text_input`, the
  OpenAI API's `prompt/messages`), and `client_error`, a core error reported under them;
- `loop`: the one background thread that steps the engine and routes outputs to each request;
- `metrics`: engine stats -> Prometheus families on Triton's metrics endpoint;
- `dynamo_worker`: the process Dynamo runs per engine: OpenAI requests <-> the engine, KV events;
- `grpc_stream` (client side): one request on its own gRPC stream, half-closed once it has finished.
"""
