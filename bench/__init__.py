"""The measuring code behind the evidence scripts (scripts/bench_decode.py, eval_accuracy.py, ...)
and the GPU check: libraries, imported as `from bench import longctx_data` (importing this package
loads nothing: each module imports what it needs).

- `speed`: bench_decode.py's prompts, our step-wise decoder, profiling, machine info, table, plot and the
  modeled-link sweep; `floor`: a decode step's bandwidth and compute floors; `hf`: transformers'
  decode paths as rows of bench_decode.py; `llama_cpp`: llama.cpp as a peer (build, GGUFs, run, parse;
  `python -m bench.llama_cpp build` builds it, as `make llama-cpp` does);
- `runs`: what the resumable evaluations share (engines over one loaded model, mode specs, JSONL
  records); `longctx_data`: RULER tasks, essays and scoring;
- `load_workload`, `load_report`: load_test.py's and soak.py's workload, measurements and report;
- `prefix_serve`: bench_prefix.py's workloads over HTTP (llama-server, a Dynamo deployment);
- the GPU check's stages (run by scripts/gpu_check.sh): `python -m bench.gpu_kernels` (kernel
  numerics and bandwidths), `python -m bench.gpu_decode` (decode timing of the real engine) and
  `python -m bench.gpu_results` (the one-line summary of their JSON).
"""
