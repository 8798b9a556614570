"""Lookahead-KV on Triton's python backend (decoupled): a thin adapter over `serving`.

initialize  loads `runtime.Engine` from the config's engine_dir on the instance's device (KIND_GPU:
            the GPU Triton gives it, KIND_CPU: the CPU) and starts one step-loop thread;
execute     parses each request (a bad one gets an error response naming the field as the request
            sent it, `text_input` for the runtime's `prompt`: serving/fields.py; the others go on)
            and hands it to the loop, which streams its outputs back through the response sender;
finalize    stops the loop.

Error codes: a full queue is UNAVAILABLE (retry later), any other request error INVALID_ARG, a bug
INTERNAL. gRPC streaming clients see the code as the stream's status when they send the header
`triton_grpc_error: true` (without it tritonserver passes only the message). Over HTTP /generate,
tritonserver 2.51 reads the code after freeing the error (http_server.cc, GenerateRequestClass::
InferResponseComplete: AddErrorJson deletes it before HttpCodeFromError), so the status is whatever
the freed memory holds: 400 in every run here, for UNAVAILABLE, INVALID_ARG and INTERNAL alike. A
python model cannot set HTTP headers (no Retry-After); the message of a full queue starts with
"the waiting queue is full", for a front proxy or a client to key on.
"""
import gc
import json

import triton_python_backend_utils as pb_utils

from runtime.threads import off_main_thread, prepare_threads

prepare_threads()  # the python stub's process: before runtime.engine loads torch (runtime/threads.py)

from runtime.engine import Engine
from runtime.errors import LookaheadError
from runtime.scheduler import QueueFullError
from serving.config_template import instance_device
from serving.fields import TRITON_FIELDS, client_error
from serving.loop import EngineLoop, request_finished
from serving.metrics import MetricExporter
from serving.request import RequestLimits, ResponseStream, parse_request

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("lookahead_llm streams: set model_transaction_policy "
                                                "{ decoupled: true } in config.pbtxt")
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        overrides = json.loads(params.get("lookahead_overrides") or "{}")
        device = instance_device(args, params)
        try:
            # built off the stub's main thread, so the loop thread's OpenMP team is the only one
            # (runtime/threads.py off_main_thread: a pool left on this thread slowed every step 1.6x)
            self.engine = off_main_thread(lambda: Engine.from_dir(
                params["engine_dir"], device=device, max_queue=int(params.get("max_queue", 256)), **overrides))
        except LookaheadError as e:         # one line in the server log, naming the field and the fix
            raise pb_utils.TritonModelException(f"lookahead_llm: {e}") from None
        self.limits = RequestLimits.for_engine(self.engine)
        labels = {"model": args["model_name"], "instance": args["model_instance_name"]}
        self.metrics = MetricExporter(_metric_family, labels)
        self.loop = EngineLoop(self.engine, on_stats=self.metrics.update, name=args["model_instance_name"])
        self.loop.start()
        pb_utils.Logger.log_info(f"lookahead_llm: engine {params['engine_dir']} loaded on {self.engine.device} "
                                 f"(mode {self.engine.config.mode}, overrides {overrides}; a token covers at "
                                 f"most {self.limits.max_token_bytes} bytes of prompt)")
        # torch and the engine leave ~190k long-lived objects, which every full collection walks
        # (~100 ms, a hiccup in a decode step) and the stub's exit walks again (~0.5 s of the
        # unload, twice that on a loaded machine). Nothing made so far is garbage: freeze it.
        gc.freeze()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            req = None
            try:
                req = parse_request(lambda name: _input(request, name), request.parameters(), self.limits)
                self.loop.submit(req.prompt, req.params, _Sink(sender, req, self.engine.tokenizer.decode))
            except LookaheadError as e:     # the engine's errors name its fields: this request's names
                e = req.error(e) if req is not None else client_error(e, TRITON_FIELDS)
                _send_error(sender, str(e), _error_code(e))
            except Exception as e:      # a bug: answer this request, keep the model up
                pb_utils.Logger.log_error(f"lookahead_llm: request failed: {e!r}"[:2000])
                _send_error(sender, f"internal error: {' '.join(str(e).split())}"[:300], pb_utils.TritonError.INTERNAL)
        return None

    def finalize(self):
        # well inside tritonserver's --exit-timeout-secs (15 s): a loop thread still in a step or a
        # metric update after 2 s is left behind (a daemon thread), not waited for
        self.loop.stop(timeout=2.0)
        self.engine.close()
        self.metrics.close()


class _Sink:
    """One request's response sender, seen from the step loop (serving.loop.RequestSink)."""

    def __init__(self, sender, request, decode=None):
        self.sender, self.request, self.stream = sender, request, ResponseStream(request, decode)

    def on_output(self, out):
        done = request_finished(out)        # with n > 1, `finished` ends one choice only
        if out.finish_reason == "abort":
            if done:
                _send_error(self.sender, "the request was cancelled", pb_utils.TritonError.CANCELLED)
            return
        tensors = self.stream.on_output(out)
        if tensors is not None:
            response = pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in tensors.items()])
            self.sender.send(response, flags=FINAL if done else 0)

    def on_error(self, message):
        _send_error(self.sender, message, pb_utils.TritonError.UNAVAILABLE)

    def on_reject(self, error):
        """A long prompt refused after tokenizing (too long, queue full): the typed error, under
        the request's field names."""
        error = self.request.error(error)
        _send_error(self.sender, str(error), _error_code(error))

    def is_cancelled(self):
        return self.sender.is_cancelled()


def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _error_code(error):
    """A full queue is retryable (UNAVAILABLE); every other LookaheadError is the request's fault."""
    return pb_utils.TritonError.UNAVAILABLE if isinstance(error, QueueFullError) \
        else pb_utils.TritonError.INVALID_ARG


def _send_error(sender, message, code):
    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)), flags=FINAL)


def _metric_family(name, description, kind):
    kinds = {"gauge": pb_utils.MetricFamily.GAUGE, "counter": pb_utils.MetricFamily.COUNTER}
    return pb_utils.MetricFamily(name=name, description=description, kind=kinds[kind])
