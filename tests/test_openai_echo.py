"""Completions `echo` and `prompt_logprobs` on the OpenAI API, without a server (issue 41 items 5
and 9): each prompt token's exact piece of the text (`TextTokenizer.token_texts`), and the front's
rewrite of the answer (deploy/openai_front.py). tests/test_dynamo.py runs them on a real deployment."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from runtime.tokenizer import TextTokenizer
from tiny_engine import byte_tokenizer

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TOKENIZER = ROOT / "engines" / "default" / "tokenizer"
SPECIAL = "<|im_start|>"

TRICKY = {
    "ascii": "The history of the Roman Empire",
    "spaces": "  two  spaces\tand a tab\n\nnewlines ",
    "emoji": "ok 👍🏽 then 🇫🇷!",
    "cjk": "東京は日本の首都です。",
    "mixed scripts": "naïve café – Ωμέγα – привет",
    "special tokens": f"{SPECIAL}user\nHi{SPECIAL}",
    "special inside a split character": f"é{SPECIAL}😀",
    "one emoji": "🎉",
}


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory) -> TextTokenizer:
    """The tiny engines' byte tokenizer (every non-ASCII character split over tokens) plus one
    special token."""
    d = tmp_path_factory.mktemp("tok")
    tok = byte_tokenizer()
    tok.add_special_tokens([SPECIAL])
    tok.save(str(d / "tokenizer.json"))
    return TextTokenizer(d)


def tokenizers(byte_level):
    out = [byte_level]
    if (DEFAULT_TOKENIZER / "tokenizer.json").is_file():     # SmolLM2's byte-level BPE, with merges
        out.append(TextTokenizer(DEFAULT_TOKENIZER))
    return out


@pytest.mark.parametrize("name", sorted(TRICKY))
def test_token_texts_join_to_the_text_and_index_it(byte_level, name):
    """Issue 41: the echo's tokens gave special tokens as "" and a split character as "\\ufffd", so
    they did not join to the text and text_offset did not index it."""
    text = TRICKY[name]
    for tok in tokenizers(byte_level):
        ids = tok.encode(text)
        pieces = tok.token_texts(ids)
        assert len(pieces) == len(ids)
        assert "".join(pieces) == text, (name, pieces)
        assert all("\ufffd" not in p for p in pieces)
        at = 0
        for tid, piece in zip(ids, pieces):     # each piece is its token's text at its offset
            assert text[at:at + len(piece)] == piece
            at += len(piece)
        if SPECIAL in text and tok is byte_level:
            assert SPECIAL in pieces


def test_token_texts_give_a_split_character_to_the_token_that_completes_it(byte_level):
    ids = byte_level.encode("a👍b")                 # a, 4 bytes of 👍, b
    assert byte_level.token_texts(ids) == ["a", "", "", "", "👍", "b"]
    # a prompt of ids that ends inside a character: the last token takes what is left
    assert "".join(byte_level.token_texts(ids[:3])) == byte_level.decode(ids[:3])
    assert byte_level.token_texts([]) == []


# ---- the front's rewrite (deploy/openai_front.py) ------------------------------------------------
def _request(body: dict, path: str = "/v1/completions"):
    from deploy.http_front import Request
    req = Request("POST", path, "HTTP/1.1", [("Content-Type", "application/json")])
    req.body = json.dumps(body).encode()
    return req


def _entries(own: int, own_rank: int, k: int) -> dict:
    """A worker's prompt_logprobs entry: the k most likely (ids 100.., ranks 1..k) and the token."""
    out = {str(100 + r): {"logprob": -0.1 * r, "rank": r, "decoded_token": f"<{r}>"} for r in range(1, k + 1)}
    out[str(own)] = {"logprob": -5.0, "rank": own_rank, "decoded_token": "\ufffd"}
    return out


def _answer(ids, pieces, k, choices=1):
    return {"choices": [{"index": i, "text": "!", "logprobs": {"tokens": ["!"], "token_logprobs": [-0.3],
                                                               "top_logprobs": [{"!": -0.3}], "text_offset": []}}
                        for i in range(choices)],
            "usage": {"prompt_tokens": len(ids)},
            "nvext": {"engine_data": {"prompt_token_ids": ids, "prompt_tokens": pieces,
                                      "prompt_logprobs": [None] + [_entries(t, 40, k) for t in ids[1:]]}}}


def test_echo_asks_the_worker_for_k_alternatives_and_lists_k_per_prompt_token():
    """Issue 41 item 5: Dynamo's frontend asks the worker for 1 alternative per prompt token on any
    echo, so `logprobs: 5` listed at most one. The front now asks for k and lists k + the token."""
    from deploy.openai_front import prompt_logprobs_rewrite

    req = _request({"prompt": "ab", "echo": True, "logprobs": 5, "max_tokens": 1})
    transform = prompt_logprobs_rewrite(req)
    assert json.loads(req.body)["prompt_logprobs"] == 5
    out = json.loads(transform(200, json.dumps(_answer([1, 2, 3], ["a", "b", "c"], 5)).encode()))
    tops = out["choices"][0]["logprobs"]["top_logprobs"]
    assert tops[0] is None and [len(t) for t in tops[1:3]] == [6, 6] and tops[3] == {"!": -0.3}
    assert list(tops[1])[:5] == ["<1>", "<2>", "<3>", "<4>", "<5>"] and tops[1]["b"] == -5.0


def test_prompt_logprobs_are_answered_in_the_choice_as_vllm_does():
    """Issue 41 item 9: `prompt_logprobs: k` was computed and dropped. It is answered as vLLM's
    completions answer it: the choice's `prompt_logprobs`, per prompt token None for the first,
    else {token id: {logprob, rank, decoded_token}} for the k most likely and the token. With echo
    too the worker computes the larger k; each field lists its own."""
    from deploy.openai_front import prompt_logprobs_rewrite

    req = _request({"prompt": "ab", "prompt_logprobs": 2, "max_tokens": 1})
    transform = prompt_logprobs_rewrite(req)
    assert json.loads(req.body)["prompt_logprobs"] == 2
    out = json.loads(transform(200, json.dumps(_answer([1, 2], ["a", "b"], 2, choices=2)).encode()))
    for choice in out["choices"]:
        assert choice["text"] == "!" and choice["logprobs"]["tokens"] == ["!"]        # no echo: untouched
        assert choice["prompt_logprobs"][0] is None
        assert sorted(choice["prompt_logprobs"][1]) == ["101", "102", "2"]
        assert choice["prompt_logprobs"][1]["2"] == {"logprob": -5.0, "rank": 40, "decoded_token": "\ufffd"}
    assert "nvext" not in out
    req = _request({"prompt": "ab", "prompt_logprobs": 1, "echo": True, "logprobs": 3})
    transform = prompt_logprobs_rewrite(req)
    assert json.loads(req.body)["prompt_logprobs"] == 3
    choice = json.loads(transform(200, json.dumps(_answer([1, 2], ["a", "b"], 3)).encode()))["choices"][0]
    assert len(choice["logprobs"]["top_logprobs"][1]) == 4 and len(choice["prompt_logprobs"][1]) == 2


@pytest.mark.parametrize("cut", ["prompt_logprobs", "prompt_tokens", "prompt_token_ids"])
def test_a_worker_payload_cut_short_is_an_error_never_a_short_answer(cut):
    from deploy.openai_front import prompt_logprobs_rewrite

    transform = prompt_logprobs_rewrite(_request({"prompt": "abc", "echo": True, "logprobs": 1}))
    answer = _answer([1, 2, 3], ["a", "b", "c"], 1)
    answer["nvext"]["engine_data"][cut].pop()
    with pytest.raises(ValueError, match="incomplete"):
        transform(200, json.dumps(answer).encode())
    answer = _answer([1, 2, 3], ["a", "b", "c"], 1)
    answer["usage"]["prompt_tokens"] = 4
    with pytest.raises(ValueError, match="for 4 prompt tokens"):
        transform(200, json.dumps(answer).encode())


def test_echo_text_is_the_tokens_pieces_so_offsets_index_it(byte_level):
    """The echoed text is the prompt tokens' pieces joined: every text_offset indexes the text."""
    from deploy.openai_front import prompt_logprobs_rewrite

    text = f"{SPECIAL}é 👍"
    ids = byte_level.encode(text)
    transform = prompt_logprobs_rewrite(_request({"prompt": text, "echo": True, "logprobs": 0}))
    choice = json.loads(transform(200, json.dumps(_answer(ids, byte_level.token_texts(ids), 0)).encode()))["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == text + "!" and "".join(lp["tokens"]) == choice["text"]
    assert all(choice["text"][at:at + len(t)] == t for at, t in zip(lp["text_offset"], lp["tokens"]))


# ---- the response limit (deploy/http_front.py) ---------------------------------------------------
def _serve_once(front_kwargs: dict, body: dict, response: bytes, chunked: bool = True) -> tuple[int, dict, int]:
    """POST `body` to /v1/completions through a Front with the OpenAI checks and rewrite, over a
    fake upstream answering `response` (chunked, 64 KiB chunks); then a second plain request on a
    new connection -> (status, JSON answer, the second request's status)."""
    from deploy.http_front import Front
    from deploy.openai_front import check_openai_request, openai_error_body, prompt_logprobs_rewrite

    async def upstream(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                if not chunked:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(response), response))
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
                    for i in range(0, len(response), 65536):
                        part = response[i:i + 65536]
                        writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                        await writer.drain()
                    writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def post(port, doc):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        data = json.dumps(doc).encode()
        w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(data), data))
        await w.drain()
        raw = await r.read()
        w.close()
        head, _, payload = raw.partition(b"\r\n\r\n")
        return int(head.split(b" ")[1]), payload

    async def main():
        up = await asyncio.start_server(upstream, "127.0.0.1", 0)
        front = Front("127.0.0.1", 0, "127.0.0.1", up.sockets[0].getsockname()[1], check=check_openai_request,
                      error_body=openai_error_body, upstream_name="the Dynamo frontend",
                      rewrite=prompt_logprobs_rewrite, **front_kwargs)
        await front.start()
        port = front.server.sockets[0].getsockname()[1]
        serve = asyncio.ensure_future(front.serve())
        try:
            status, payload = await post(port, body)
            again, _ = await post(port, {"model": "m", "prompt": "x"})       # relayed as it comes (chunked)
            return status, json.loads(payload), again
        finally:
            front.close()
            serve.cancel()
            up.close()
    return asyncio.run(main())


def _big_answer(n_tokens: int, k: int) -> bytes:
    ids = [7] * n_tokens
    return json.dumps(_answer(ids, ["a"] * n_tokens, k)).encode()


def test_an_answer_over_the_request_cap_comes_back_whole():
    """k = 5 over a long prompt is MBs of engine_data: over the front's 2 MiB request-body cap,
    which the front applied to the response too (a 502 "retry" that could never succeed)."""
    from deploy.http_front import DEFAULT_MAX_BODY_BYTES

    response = _big_answer(6000, 5)
    assert len(response) > DEFAULT_MAX_BODY_BYTES
    status, doc, _ = _serve_once({}, {"model": "m", "prompt": "a", "echo": True, "logprobs": 5}, response)
    assert status == 200, doc
    lp = doc["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 6001 and all(len(t) == 6 for t in lp["top_logprobs"][1:6000])


@pytest.mark.parametrize("body, field", [
    ({"echo": True, "logprobs": 5}, "logprobs"),
    ({"prompt_logprobs": 5}, "prompt_logprobs"),
    ({"echo": True, "logprobs": 1, "prompt_logprobs": 5}, "prompt_logprobs"),
])
@pytest.mark.parametrize("chunked", [True, False])
def test_an_answer_over_the_response_limit_is_a_400_naming_the_field(body, field, chunked):
    """Over the front's own response limit: a 400 naming what sized the answer, with the limit;
    the front stays up for the next request."""
    limit = 200_000
    status, doc, again = _serve_once({"max_response_bytes": limit}, {"model": "m", "prompt": "a", **body},
                                     _big_answer(1000, 5), chunked=chunked)
    assert status == 400 and doc["error"]["param"] == field, doc
    assert doc["error"]["message"].startswith(f"{field}: the answer, 6 log-probabilities for each prompt token")
    assert f"limit of {limit} bytes" in doc["error"]["message"] and again == 200
