"""What the OpenAI API (Dynamo's frontend) accepts that this engine cannot serve: refused by name, in front.

Dynamo 1.6.1's frontend, in Tokens mode, turns a request into token ids, stop conditions and
sampling/output options for the worker. Some OpenAI fields never reach a worker: `tools`,
`tool_choice`, `functions`, `logit_bias`, `suffix`, ... are accepted by the frontend and either
dropped or rendered into the prompt, and the answer then reads as if they had been honoured. A
worker cannot refuse what it does not see, so `dynamo_launch` puts `deploy.http_front` in front of
the frontend with `check_openai_request` as its check: such a field gets a 400 naming it before
the frontend sees the request. Fields that do reach the worker (penalties, `response_format` as
guided decoding, `n`, `logprobs`, ...) are checked there (serving/dynamo_worker.py); here only
their JSON types are, since the frontend's own message for a wrong type names no field
("invalid type: string "x", expected u8 at line 1 column 92").

Completions `echo` and `prompt_logprobs` answers are written here (`prompt_logprobs_rewrite`):
Dynamo's frontend computes but does not render them.

Every refusal is one line, `<field>: <problem> (<fix>)`, in OpenAI's error shape
{"error": {"message", "type": "invalid_request_error", "param", "code": 400}}.
"""
from __future__ import annotations

import json
from typing import Any

from .http_front import HttpError

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"

# field -> (the values that mean "off", why it is refused). A field absent or "off" passes.
_UNSERVED_CHAT = {
    "tools": ((None, []), "this engine has no tool calling; the model would answer as if no tools were sent"),
    "tool_choice": ((None, "none"), "this engine has no tool calling"),
    "parallel_tool_calls": ((None,), "this engine has no tool calling"),
    "functions": ((None, []), "this engine has no function calling"),
    "function_call": ((None, "none"), "this engine has no function calling"),
    "logit_bias": ((None, {}), "logit biases are not applied by this engine"),
    "audio": ((None,), "this engine produces text only"),
    "modalities": ((None, ["text"]), "this engine produces text only"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "web_search_options": ((None,), "web search is not supported"),
}
_UNSERVED_COMPLETIONS = {
    "suffix": ((None, ""), "insertion (a suffix) is not supported"),
    "logit_bias": ((None, {}), "logit biases are not applied by this engine"),
}


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_openai_body(path: str, doc: Any) -> None:
    """Raise HttpError(400, naming the field) for a /v1/chat/completions or /v1/completions body
    asking for what this engine cannot serve, or with `n` / `logprobs` / `top_logprobs` of the
    wrong JSON type. Other paths and bodies pass."""
    if path not in (CHAT, COMPLETIONS) or not isinstance(doc, dict):
        return
    unserved = _UNSERVED_CHAT if path == CHAT else _UNSERVED_COMPLETIONS
    for field, (off, why) in unserved.items():
        if field in doc and doc[field] not in off:
            raise HttpError(400, f"{field}: is not supported ({why}) (omit {field})", field)
    n = doc.get("n")
    if n is not None and not _int(n):
        raise HttpError(400, f"n: must be an integer, got {_short(n)} (send 1..16, or omit it)", "n")
    _check_prompt_logprobs(path, doc)
    if path == CHAT:
        if doc.get("logprobs") is not None and not isinstance(doc["logprobs"], bool):
            raise HttpError(400, f"logprobs: must be true or false, got {_short(doc['logprobs'])} "
                                 f"(send top_logprobs: k for k alternatives)", "logprobs")
        top = doc.get("top_logprobs")
        if top is not None and not _int(top):
            raise HttpError(400, f"top_logprobs: must be an integer, got {_short(top)} (send 0..20)",
                            "top_logprobs")
    else:
        lp = doc.get("logprobs")
        if lp is not None and not _int(lp):
            raise HttpError(400, f"logprobs: must be an integer, got {_short(lp)} (send 0..5)", "logprobs")
        echo = doc.get("echo")
        if echo not in (None, False, True):
            raise HttpError(400, f"echo: must be true or false, got {_short(echo)} (omit it, or send true)", "echo")
        if echo and doc.get("stream"):
            raise HttpError(400, "echo: is served on non-streaming requests only (send stream: false, or omit echo)",
                            "echo")
        if echo and _num_prompts(doc.get("prompt")) != 1:
            raise HttpError(400, "echo: is served for one prompt a request (send the prompts one at a time)", "echo")


def _check_prompt_logprobs(path: str, doc: dict) -> None:
    """`prompt_logprobs` (vLLM's extension, both routes): an integer (the worker checks 0..20), on
    a non-streaming request (vLLM refuses it with stream: true too) and, on completions, one prompt."""
    plp = doc.get("prompt_logprobs")
    if plp is None:
        return
    if not _int(plp):
        raise HttpError(400, f"prompt_logprobs: must be an integer, got {_short(plp)} (send 0..20, or omit it)",
                        "prompt_logprobs")
    if doc.get("stream"):
        raise HttpError(400, "prompt_logprobs: are not available when stream is true (send stream: false, or "
                             "omit prompt_logprobs)", "prompt_logprobs")
    if path == COMPLETIONS and _num_prompts(doc.get("prompt")) != 1:
        raise HttpError(400, "prompt_logprobs: are served for one prompt a request (send the prompts one at "
                             "a time)", "prompt_logprobs")


def _num_prompts(prompt: Any) -> int:
    """How many prompts a completions `prompt` holds: a string or a list of token ids is one; a
    list of strings or of id lists is one each."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_int(t) for t in prompt)):
        return 1
    return len(prompt) if isinstance(prompt, list) else 0


def prompt_logprobs_rewrite(req):
    """deploy.http_front's rewrite of a completions request with `echo` or `prompt_logprobs`
    (lm-eval's loglikelihood requests send echo: true, logprobs: k, max_tokens: 1). Dynamo 1.6.1's
    frontend asks the worker for the prompt's log-probabilities (`prompt_logprobs`, else 1 for
    echo) but puts neither them nor the prompt into a completions answer; it passes the worker's
    `engine_data` on under `nvext` when asked. So the request asks for it, and for as many
    alternatives as the answer lists (`_worker_k`), and `PromptLogprobsAnswer` writes the answer.
    Returns that transform, or None for any other request (which passes untouched). A chat
    answer needs none: the frontend writes its `prompt_logprobs` itself."""
    if req.method != "POST" or not req.body or req.path != COMPLETIONS:
        return None
    doc = json.loads(req.body)
    if not isinstance(doc, dict) or (doc.get("echo") is not True and doc.get("prompt_logprobs") is None):
        return None
    nvext = doc.get("nvext") if isinstance(doc.get("nvext"), dict) else {}
    fields = nvext.get("extra_fields") if isinstance(nvext.get("extra_fields"), list) else []
    answer = PromptLogprobsAnswer(echo=doc.get("echo") is True, logprobs=doc.get("logprobs"),
                                  prompt_logprobs=doc.get("prompt_logprobs"), keep_engine_data="engine_data" in fields)
    doc["nvext"] = {**nvext, "extra_fields": fields + ([] if answer.keep_engine_data else ["engine_data"])}
    doc["prompt_logprobs"] = answer.worker_k()
    req.body = json.dumps(doc).encode()
    return answer


class PromptLogprobsAnswer:
    """The transform of a completions answer (see `prompt_logprobs_rewrite`): each choice gets,
    with `echo`, the prompt's text in front of its own and, with `logprobs` k, the prompt's tokens,
    their log-probabilities (None for the first), k alternatives each and text offsets in front of
    the output's, as OpenAI's and vLLM's completions return them; with `prompt_logprobs` k, vLLM's
    `prompt_logprobs` field (per prompt token None for the first, else {token id: {logprob, rank,
    decoded_token}} for the token and the k most likely). The prompt's text is its tokens' pieces
    joined (the worker's `prompt_tokens`, runtime.tokenizer.TextTokenizer.token_texts), so the tokens
    join to the text and every offset indexes it."""

    def __init__(self, *, echo: bool, logprobs: int | None, prompt_logprobs: int | None, keep_engine_data: bool):
        self.echo, self.logprobs, self.prompt_logprobs = echo, logprobs, prompt_logprobs
        self.keep_engine_data = keep_engine_data

    def worker_k(self) -> int:
        """The alternatives the worker computes per prompt token: what the echo lists and what
        `prompt_logprobs` asks, the larger (an echo without logprobs only needs the tokens)."""
        echo_k = (self.logprobs or 0) if self.echo else 0
        return max(echo_k, self.prompt_logprobs or 0)

    def too_large(self, limit: int) -> HttpError:
        """The answer when it would exceed the front's response limit: a 400 naming the field that
        sized it, the one the client can lower."""
        if self.prompt_logprobs:
            field, fix = "prompt_logprobs", "send a smaller prompt_logprobs, or a shorter prompt"
        elif self.echo and self.logprobs:
            field, fix = "logprobs", "send a smaller logprobs, or a shorter prompt, or omit echo"
        else:
            field, fix = "echo", "send a shorter prompt, or omit echo"
        return HttpError(400, f"{field}: the answer, {self.worker_k() + 1} log-probabilities for each prompt token, "
                              f"is over the server's limit of {limit} bytes on an answer ({fix})", field)

    def __call__(self, status: int, body: bytes) -> bytes:
        if status != 200:
            return body
        resp = json.loads(body)
        data = (resp.get("nvext") or {}).get("engine_data") or {}
        if not self.keep_engine_data and isinstance(resp.get("nvext"), dict):
            resp["nvext"].pop("engine_data", None)
            if not resp["nvext"]:
                resp.pop("nvext")
        ids, tokens, plp = _prompt_data(data, (resp.get("usage") or {}).get("prompt_tokens"))
        for choice in resp.get("choices") or []:
            if self.echo:
                choice["text"] = "".join(tokens) + (choice.get("text") or "")
                if self.logprobs is not None:
                    choice["logprobs"] = echo_logprobs(ids, tokens, plp, self.logprobs, choice.get("logprobs"))
            if self.prompt_logprobs is not None:
                choice["prompt_logprobs"] = [None if e is None else _top_k(e, self.prompt_logprobs, str(t))
                                             for e, t in zip(plp, ids)]
        return json.dumps(resp).encode()


def _prompt_data(data: dict, prompt_tokens: int | None) -> tuple[list[int], list[str], list]:
    """(ids, token pieces, prompt_logprobs) of the worker's engine_data, checked whole: one entry
    of each per prompt token, so an answer is never built from a payload cut short."""
    ids, tokens, plp = data.get("prompt_token_ids"), data.get("prompt_tokens"), data.get("prompt_logprobs")
    if not ids or tokens is None or plp is None:
        raise ValueError("the worker sent no prompt log-probabilities for an echo / prompt_logprobs request")
    n = prompt_tokens if isinstance(prompt_tokens, int) else len(ids)
    if not len(ids) == len(tokens) == len(plp) == n:
        raise ValueError(f"the worker's prompt data is incomplete: {len(ids)} ids, {len(tokens)} token texts and "
                         f"{len(plp)} log-probability entries for {n} prompt tokens")
    return ids, tokens, plp


def _top_k(entries: dict, k: int, own: str) -> dict:
    """One position's {token id: {logprob, rank, decoded_token}}: the k most likely and `own`."""
    return {tid: e for tid, e in entries.items() if tid == own or (e.get("rank") or 1 << 30) <= k}


def echo_logprobs(ids: list[int], tokens: list[str], plp: list, k: int, out: dict | None) -> dict:
    """OpenAI completions `logprobs` for prompt + output: the prompt's entries from the worker's
    prompt_logprobs (per position None or {token id: {logprob, rank, decoded_token}}; a prompt
    token's own alternative is keyed by its piece of the text), then the output's as the frontend
    rendered them; text offsets over the whole."""
    out = out or {}
    lps: list = [None]
    tops: list = [None]
    for i in range(1, len(ids)):
        own = str(ids[i])
        entries = _top_k(plp[i] or {}, k, own)
        lps.append((entries.get(own) or {}).get("logprob"))
        best = sorted(entries.items(), key=lambda e: e[1].get("rank") or 1 << 30)
        tops.append({tokens[i] if tid == own else e.get("decoded_token", tid): e["logprob"] for tid, e in best})
    all_tokens = list(tokens) + list(out.get("tokens") or [])
    offsets, at = [], 0
    for t in all_tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": all_tokens, "token_logprobs": lps + list(out.get("token_logprobs") or []),
            "top_logprobs": tops + list(out.get("top_logprobs") or []), "text_offset": offsets}


def check_openai_request(req) -> None:
    """deploy.http_front's check: the JSON body of a POST to the OpenAI completion routes."""
    if req.method != "POST" or not req.body:
        return
    if req.path not in (CHAT, COMPLETIONS):         # the normalised path (deploy/request_target.py)
        return
    check_openai_body(req.path, json.loads(req.body))      # http_front parsed it once already: it parses


def openai_error_body(status: int, message: str, field: str | None) -> bytes:
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": field, "code": status}}).encode()


def _short(value: Any, limit: int = 40) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
