"""The gRPC guard on the public gRPC port (deploy/grpc_guard.py).

tritonserver 2.51 dies with SIGSEGV after refusing a stream request sent with `triton_grpc_error: true` (a BYTES
tensor whose length prefix runs past its data was enough, on the 1st-4th try). The unit tests check the request
checks on tables of malformed tensors and fresh random valid ones; the server tests send the crashing request, a
seeded fuzz of malformed messages with and without the header, and the administrative methods through a served
deployment's public port, and check the same server is up and answers afterwards.
"""
from __future__ import annotations

import asyncio
import random
import struct
import time

import grpc
import pytest
from tritonclient.grpc import service_pb2 as pb

from deploy.grpc_guard import (ALLOWED, ITEM_BYTES, SERVICE, STREAM_INFER, bytes_elements, check_infer_request,
                               error_response, parse_request, status_of, upstream_metadata, wants_status)
from triton_fixtures import ServeSh, triton_backend_dir, triton_engine_dir  # noqa: F401

MODEL = "lookahead_llm"


def bytes_raw(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(x)) + x for x in items)


def request(text: bytes = b"Say hi", max_tokens: int = 2, **extra_bytes: bytes) -> pb.ModelInferRequest:
    """A well-formed streaming request with raw tensors: text_input, max_tokens, stream, and BYTES extras."""
    r = pb.ModelInferRequest(model_name=MODEL, id="r1")
    for name, dtype, raw in [("text_input", "BYTES", bytes_raw(text)), ("max_tokens", "INT32",
                             struct.pack("<i", max_tokens)), ("stream", "BOOL", b"\x01"),
                             *[(k, "BYTES", bytes_raw(v)) for k, v in extra_bytes.items()]]:
        r.inputs.add(name=name, datatype=dtype, shape=[1])
        r.raw_input_contents.append(raw)
    return r


def random_valid(rng: random.Random) -> pb.ModelInferRequest:
    """Fresh random tensors of every datatype, raw or as contents, all well-formed."""
    r = pb.ModelInferRequest(model_name=MODEL)
    raw = rng.random() < 0.5
    for i, dtype in enumerate(["BYTES", *ITEM_BYTES]):
        shape = [rng.randint(0, 3), rng.randint(1, 3)]
        n = shape[0] * shape[1]
        t = r.inputs.add(name=f"in{i}", datatype=dtype, shape=shape)
        if dtype == "BYTES":
            items = [rng.randbytes(rng.randint(0, 40)) for _ in range(n)]
            if raw:
                r.raw_input_contents.append(bytes_raw(*items))
            else:
                t.contents.bytes_contents.extend(items)
        elif raw:
            r.raw_input_contents.append(rng.randbytes(n * ITEM_BYTES[dtype]))
        elif dtype in ("FP16", "BF16"):
            t.datatype = "FP32"
            t.contents.fp32_contents.extend(rng.random() for _ in range(n))
        else:
            field = {"BOOL": "bool_contents", "INT64": "int64_contents", "UINT64": "uint64_contents",
                     "FP32": "fp32_contents", "FP64": "fp64_contents"}.get(
                dtype, "uint_contents" if dtype.startswith("U") else "int_contents")
            getattr(t.contents, field).extend([True] * n if dtype == "BOOL" else [1] * n)
    return r


def test_random_valid_requests_pass():
    rng = random.Random(7)
    for _ in range(200):
        r = random_valid(rng)
        assert check_infer_request(r) is None, r
        assert parse_request(r.SerializeToString()) == (r, None)


def _mutate(r: pb.ModelInferRequest, how: str) -> None:
    if how == "prefix past the data":
        r.raw_input_contents[0] = struct.pack("<I", 1000) + b"abc"
    elif how == "bytes after the last element":
        r.raw_input_contents[0] += b"\x00"
    elif how == "a cut length prefix":
        r.raw_input_contents[0] = bytes_raw(b"ok") + b"\x05\x00"
    elif how == "more elements than the shape":
        r.raw_input_contents[0] = bytes_raw(b"a", b"b")
    elif how == "fewer elements than the shape":
        r.inputs[0].shape[:] = [3]
    elif how == "fixed-size data too short":
        r.raw_input_contents[1] = b"\x01\x00"
    elif how == "fixed-size data too long":
        r.raw_input_contents[1] += b"\x00" * 4
    elif how == "a negative dimension":
        r.inputs[1].shape[:] = [-1]
    elif how == "a huge shape":
        r.inputs[1].shape[:] = [1 << 40, 1 << 40]
    elif how == "an unknown datatype":
        r.inputs[1].datatype = "INT128"
    elif how == "a raw tensor missing":
        del r.raw_input_contents[-1]
    elif how == "raw and contents both":
        r.inputs[0].contents.bytes_contents.append(b"x")
    elif how == "a shared-memory input":
        r.inputs[0].parameters["shared_memory_region"].string_param = "region"
    elif how == "a shared-memory output":
        r.outputs.add(name="text_output").parameters["shared_memory_region"].string_param = "region"
    elif how == "no model name":
        r.model_name = ""
    elif how == "a repeated input":
        r.inputs[2].name = r.inputs[0].name
    else:
        raise AssertionError(how)


MALFORMED = ["prefix past the data", "bytes after the last element", "a cut length prefix",
             "more elements than the shape", "fewer elements than the shape", "fixed-size data too short",
             "fixed-size data too long", "a negative dimension", "a huge shape", "an unknown datatype",
             "a raw tensor missing", "raw and contents both", "a shared-memory input", "a shared-memory output",
             "no model name", "a repeated input"]


@pytest.mark.parametrize("how", MALFORMED)
def test_malformed_requests_are_refused_naming_the_tensor(how):
    r = request(stop=b"x", sampling_parameters=b"{}")
    assert check_infer_request(r) is None
    _mutate(r, how)
    problem = check_infer_request(r)
    assert problem
    if how not in ("no model name", "a raw tensor missing", "a repeated input", "a shared-memory output"):
        assert problem.startswith("input '"), problem


def test_contents_must_match_the_datatype_and_shape():
    r = pb.ModelInferRequest(model_name=MODEL)
    t = r.inputs.add(name="x", datatype="INT32", shape=[2])
    t.contents.int_contents.extend([1, 2])
    assert check_infer_request(r) is None
    t.contents.int_contents.append(3)
    assert "3 elements" in check_infer_request(r)
    del t.contents.int_contents[:]
    t.contents.fp32_contents.extend([1.0, 2.0])
    assert "int_contents" in check_infer_request(r)
    t.datatype, t.shape[:] = "FP16", [0]
    assert "raw_input_contents" in check_infer_request(r)


def test_bytes_elements():
    rng = random.Random(3)
    for _ in range(100):
        items = [rng.randbytes(rng.randint(0, 300)) for _ in range(rng.randint(0, 6))]
        data = bytes_raw(*items)
        assert bytes_elements(data) == len(items)
        if data:
            assert bytes_elements(data[:-1]) is None or bytes_elements(data[:-1]) < len(items)
    assert bytes_elements(struct.pack("<I", 0xFFFFFFFF) + b"x") is None
    assert bytes_elements(b"\x00\x00\x00") is None


def test_a_message_that_is_no_request_is_refused():
    assert parse_request(b"\xff\xff\xff\xff")[1] == "the message is not a ModelInferRequest"


def test_the_models_error_messages_keep_their_codes():
    """The codes triton_model_repo/lookahead_llm/1/model.py sends its messages with (queue full UNAVAILABLE, a
    cancel CANCELLED, a bug INTERNAL, a request error INVALID_ARG)."""
    C = grpc.StatusCode
    assert status_of("the waiting queue is full (2 requests waiting for a batch slot); retry") == C.UNAVAILABLE
    assert status_of("the server is shutting down") == C.UNAVAILABLE
    assert status_of("internal error in the engine step (see the server log)") == C.UNAVAILABLE
    assert status_of("internal error: boom") == C.INTERNAL
    assert status_of("the request was cancelled") == C.CANCELLED
    assert status_of("max_tokens: must be a positive integer, got -5 (e.g. 64)") == C.INVALID_ARGUMENT
    assert status_of("Stub process 'lookahead_llm_0_0' is not healthy.") == C.UNAVAILABLE


def test_the_error_header_never_goes_upstream():
    md = (("triton_grpc_error", "true"), ("user-agent", "x"), ("x-trace", "1"))
    assert wants_status(md) and not wants_status((("triton_grpc_error", "false"),))
    assert upstream_metadata(md) == (("x-trace", "1"),)
    resp = pb.ModelStreamInferResponse.FromString(error_response(request(), "bad"))
    assert resp.error_message == "bad" and resp.infer_response.id == "r1"


def test_only_serving_methods_pass():
    served = {m.full_name.rsplit(".", 1)[-1] for m in pb.DESCRIPTOR.services_by_name[
        "GRPCInferenceService"].methods}
    allowed = {m[len(SERVICE):] for m in ALLOWED}
    assert allowed <= served
    assert not allowed & {"SystemSharedMemoryRegister", "CudaSharedMemoryRegister", "RepositoryModelLoad",
                          "RepositoryModelUnload", "LogSettings", "TraceSetting"}


# -- through a served deployment -----------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tmp_path_factory, triton_engine_dir, triton_backend_dir):
    run = ServeSh(tmp_path_factory.mktemp("grpc_guard") / "run", triton_engine_dir)
    try:
        run.sh("start", "--timeout", "60", timeout=90, check=True)
        yield run
    finally:
        run.cleanup()


async def _stream(channel, raws: list[bytes], header: bool) -> tuple[str, list[str]]:
    """Send `raws` on one stream, half-close after the last final response; (status, messages seen)."""
    call = channel.stream_stream(STREAM_INFER)(metadata=(("triton_grpc_error", "true"),) if header else None)
    seen, finals = [], 0
    for raw in raws:
        await call.write(raw)
    if not raws:
        await call.done_writing()
    try:
        async for m in call:
            r = pb.ModelStreamInferResponse.FromString(m)
            seen.append(r.error_message or "token")
            p = r.infer_response.parameters.get("triton_final_response")
            if r.error_message or (p is not None and p.bool_param):
                finals += 1
                if finals == len(raws):
                    await call.done_writing()
        return "OK", seen
    except grpc.aio.AioRpcError as e:
        return e.code().name, [e.details()]


def _alive_and_answering(run: ServeSh, pid: int) -> None:
    assert run.server_pid() == pid and run.state()["STATE"] == "ready", run.state()

    async def ok():
        async with grpc.aio.insecure_channel(run.grpc_url) as ch:
            return await asyncio.wait_for(_stream(ch, [request(max_tokens=2).SerializeToString()], True), 30)
    status, seen = asyncio.run(ok())
    assert status == "OK" and seen.count("token") >= 1, (status, seen)


@pytest.mark.triton
@pytest.mark.timeout(120)
def test_the_crashing_request_is_refused_and_the_server_stays_up(served):
    """The issue's message (length prefix 1000, 3 bytes of data) in each BYTES input, with the header (which
    killed 2.51 on the 1st-4th try) and without: a clean error each time, the same server after."""
    pid = served.server_pid()

    async def main():
        async with grpc.aio.insecure_channel(served.grpc_url) as ch:
            out = []
            for name in ("text_input", "stop", "sampling_parameters", "text_input", "stop", "sampling_parameters"):
                r = request(stop=b"x", sampling_parameters=b"{}")
                r.raw_input_contents[[t.name for t in r.inputs].index(name)] = struct.pack("<I", 1000) + b"abc"
                out.append((name, True, await _stream(ch, [r.SerializeToString()], True)))
                out.append((name, False, await _stream(ch, [r.SerializeToString()], False)))
            return out
    for name, header, (status, seen) in asyncio.run(main()):
        expected = ("INVALID_ARGUMENT", 1) if header else ("OK", 1)
        assert (status, len(seen)) == expected and f"input '{name}'" in seen[0], (name, header, status, seen)
    _alive_and_answering(served, pid)


@pytest.mark.triton
@pytest.mark.timeout(120)
def test_errors_keep_their_status_with_the_header_and_their_message_without(served):
    """A request the model refuses (it reached the server, without the header): with the header the stream ends
    with INVALID_ARGUMENT and the model's message, without it the message comes as an error response."""
    bad = request(max_tokens=-5).SerializeToString()

    async def main():
        async with grpc.aio.insecure_channel(served.grpc_url) as ch:
            return await _stream(ch, [bad], True), await _stream(ch, [bad], False)
    with_header, without = asyncio.run(main())
    assert with_header[0] == "INVALID_ARGUMENT" and with_header[1][0].startswith("max_tokens")
    assert without[0] == "OK" and without[1][0].startswith("max_tokens")


@pytest.mark.triton
@pytest.mark.timeout(120)
def test_administration_is_not_served_on_the_public_port(served):
    async def main():
        out = {}
        async with grpc.aio.insecure_channel(served.grpc_url) as ch:
            for method, msg in [("SystemSharedMemoryRegister", pb.SystemSharedMemoryRegisterRequest(
                    name="r", key="/etc", offset=0, byte_size=4)), ("RepositoryModelUnload",
                    pb.RepositoryModelUnloadRequest(model_name=MODEL)), ("LogSettings", pb.LogSettingsRequest()),
                    ("TraceSetting", pb.TraceSettingRequest())]:
                try:
                    await ch.unary_unary(SERVICE + method)(msg.SerializeToString())
                    out[method] = "OK"
                except grpc.aio.AioRpcError as e:
                    out[method] = e.code().name
            ready = pb.ModelReadyResponse.FromString(await ch.unary_unary(SERVICE + "ModelReady")(
                pb.ModelReadyRequest(name=MODEL).SerializeToString()))
        return out, ready.ready
    refused, ready = asyncio.run(main())
    assert set(refused.values()) == {"PERMISSION_DENIED"}, refused
    assert ready


def _fuzzed(rng: random.Random) -> bytes:
    """One malformed message: a mutation from the table, random bytes in a tensor, a random shape or datatype,
    or bytes that are no request."""
    r = request(stop=b"x", sampling_parameters=b"{}")
    pick = rng.random()
    if pick < 0.5:
        _mutate(r, rng.choice(MALFORMED))
    elif pick < 0.7:
        i = rng.choice([0, 3, 4])
        r.raw_input_contents[i] = struct.pack("<I", rng.randint(4, (1 << 32) - 1)) + rng.randbytes(rng.randint(0, 3))
    elif pick < 0.8:
        r.inputs[rng.randrange(len(r.inputs))].shape[:] = [rng.randint(-3, 1 << 20) for _ in range(rng.randint(1, 9))]
    elif pick < 0.9:
        r.inputs[rng.randrange(len(r.inputs))].datatype = rng.choice(["BYTES", "INT8", "FP64", "STRING", ""])
        if check_infer_request(r) is None:       # still well-formed: make it not
            r.raw_input_contents[1] += b"\x00"
    else:
        return rng.randbytes(rng.randint(1, 64))
    raw = r.SerializeToString()
    assert parse_request(raw)[1], "a fuzzed message must be malformed"
    return raw


@pytest.mark.triton
@pytest.mark.timeout(120)
def test_a_fuzz_of_malformed_messages_leaves_the_server_up(served):
    """3,000 seeded malformed messages (bounded: 40 s), half with the header (one stream each, as the header ends
    a stream at its first error), half without (100 to a stream), and ModelInfer: every one answered with an
    error, the same server up and answering after."""
    pid = served.server_pid()
    rng = random.Random(41)
    messages = [_fuzzed(rng) for _ in range(3000)]

    async def main():
        counts = {"status": 0, "responses": 0, "unary": 0}
        deadline = time.monotonic() + 40
        async with grpc.aio.insecure_channel(served.grpc_url) as ch:
            infer = ch.unary_unary(SERVICE + "ModelInfer")
            for i in range(0, 1000):
                status, seen = await _stream(ch, [messages[i]], True)
                assert status == "INVALID_ARGUMENT" and len(seen) == 1, (status, seen)
                counts["status"] += 1
            for i in range(1000, 2000, 100):
                status, seen = await _stream(ch, messages[i:i + 100], False)
                assert status == "OK" and len(seen) == 100 and "token" not in seen, (status, seen[:3])
                counts["responses"] += len(seen)
            for raw in messages[2000:]:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await infer(raw)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                counts["unary"] += 1
            assert time.monotonic() < deadline, "the fuzz outran its 40 s bound"
        return counts
    assert asyncio.run(main()) == {"status": 1000, "responses": 1000, "unary": 1000}
    _alive_and_answering(served, pid)


@pytest.mark.triton
@pytest.mark.timeout(120)
def test_a_client_that_leaves_cancels_through_the_guard(served):
    """A stream cancelled mid-generation: the engine aborts the request (counted), and frees its blocks."""
    before = served.metrics().get("lookahead_aborted_requests_total", 0.0)
    long = request(max_tokens=3000, sampling_parameters=b'{"ignore_eos": true}').SerializeToString()

    async def main():
        async with grpc.aio.insecure_channel(served.grpc_url) as ch:
            call = ch.stream_stream(STREAM_INFER)()
            await call.write(long)
            n = 0
            async for m in call:
                assert not pb.ModelStreamInferResponse.FromString(m).error_message
                n += 1
                if n == 3:
                    call.cancel()
                    break
            return n
    assert asyncio.run(main()) == 3
    deadline = time.monotonic() + 20
    while served.metrics().get("lookahead_aborted_requests_total", 0.0) <= before:
        assert time.monotonic() < deadline, served.metrics()
        time.sleep(0.1)
    m = served.metrics()
    assert not m["lookahead_running_requests"]
