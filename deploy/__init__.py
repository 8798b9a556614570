"""Process management for serving an engine: what `scripts/serve.sh` runs, apart from the glue.

`serving/` is what runs inside a server (the Triton python backend's model.py, the Dynamo worker);
this package starts, watches, probes and stops those servers:

- `supervisor`: the background process behind `serve.sh start` (Triton): owns tritonserver, its HTTP
  front and the run dir's state, restarts a dead server with `--watch`, and `stop`/`status`;
- `http_front`: the public HTTP port in front of a server (body-size cap, JSON check, streamed relay,
  cancel on disconnect); `request_target`: its one parser of the request target;
- `generate_front`: Triton's /generate and /generate_stream served by the front over gRPC (cancellable);
- `openai_front`: the front's checks on the OpenAI routes (fields no Dynamo worker sees);
- `dynamo_launch`: a Dynamo deployment (frontend, N `serving.dynamo_worker`s, optional etcd/NATS, the
  front process), its watch, `stop` and `status`;
- `triton_env`: find the tritonserver shipped in `nvidia-pytriton`, build its backend dir and environment;
- `probe`: one real one-token request, the liveness check `status` runs.
"""
