#!/usr/bin/env python3
"""Prefix-caching bench, in-process (the Engine API: add_request/step from one thread).

Workloads, each run with prefix caching off and on (one engine per setting, the same requests):
- dqa: D documents x Q questions (Paul Graham essays, each document a different slice of
  --doc-tokens tokens), the D*Q prompts in a seeded shuffle, admitted as they arrive at
  concurrency C (a new request enters when one ends), like a RAG / document-QA service.
- second: one document, a first then a second question (sequential): the second's TTFT / the first's.
- multiturn: T turns of ~--turn-tokens new tokens each; each turn's prompt is the chat template over
  every earlier turn including the model's own replies (their text). It also checks whether turn
  N+1's token ids extend turn N's (the template) and turn N's prompt + generated ids (the reply
  re-tokenized from its text), and reports where they first differ.
- n: n = 4 vs n = 1 on fresh documents of the same length (one prefill for n choices).

Reports TTFT p50/p90, output tokens/s, hit rate and prefill tokens computed (engine.counters
["prompt_tokens"]), as a table, --json and --plot. Timings are wall clock on a shared CPU: the load
average at start and end is recorded beside them.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from runtime.threads import prepare_threads

prepare_threads()  # first: libgomp reads GOMP_SPINCOUNT once, when torch loads it (runtime/threads.py)

from bench.prefix_serve import VLLM_BIND_HELP, dqa_doc, first_and_later, pct

ROOT = Path(__file__).resolve().parent.parent

QUESTIONS = ["What is the main argument of the text above?", "Who is the intended reader of the text above?",
             "List three concrete examples the text above gives.", "What does the author recommend doing?",
             "What is the tone of the text above?", "Which claim in the text above is the most surprising?",
             "Summarize the text above in one sentence.", "What problem does the text above describe?",
             "What would a critic say about the text above?", "Give the text above a title."]


def make_docs(tokenizer, count: int, lengths: list[int], seed: int) -> list[str]:
    """`count` documents, each a different slice of the essays' words, cut to its token length."""
    from bench import longctx_data
    words = " ".join(longctx_data.load_essays()).split()
    rng = random.Random(seed)
    docs = []
    for i in range(count):
        n = lengths[i % len(lengths)]
        start = (i * len(words) // max(count, 1) + rng.randrange(100)) % max(1, len(words) - 2 * n)
        chunk = words[start:start + 2 * n]
        lo, hi = 1, len(chunk)
        while lo < hi:                          # the most words whose tokens fit n
            mid = (lo + hi + 1) // 2
            if len(tokenizer.encode(" ".join(chunk[:mid]))) <= n:
                lo = mid
            else:
                hi = mid - 1
        docs.append(" ".join(chunk[:lo]))
    return docs


def drive(engine, requests: list[tuple[str, list[int], object]], concurrency: int, max_steps: int) -> dict:
    """Admit requests in order at `concurrency` (one enters when one ends), step until all end."""
    pending = list(requests)
    live: dict[str, dict] = {}
    done: dict[str, dict] = {}
    c0 = dict(engine.counters)
    t0 = time.perf_counter()

    def admit() -> None:
        while pending and len(live) < concurrency:
            rid, ids, params = pending.pop(0)
            engine.add_request(ids, params, request_id=rid)
            live[rid] = {"t_add": time.perf_counter(), "ttft_s": None, "out": {}, "cached": None,
                         "prompt_tokens": len(ids), "n": getattr(params, "n", 1)}

    admit()
    steps = 0
    while live and steps < max_steps:
        outs = engine.step()
        steps += 1
        now = time.perf_counter()
        for o in outs:
            r = live.get(o.request_id)
            if r is None:
                continue
            if o.new_token_ids and r["ttft_s"] is None:
                r["ttft_s"] = now - r["t_add"]
            r["out"].setdefault(o.index, []).extend(o.new_token_ids)
            r["cached"] = o.num_cached_tokens if r["cached"] is None else min(r["cached"], o.num_cached_tokens)
            if o.request_finished or (o.finished and r["n"] == 1):
                r["total_s"] = now - r["t_add"]
                done[o.request_id] = live.pop(o.request_id)
        admit()
    if live:
        raise RuntimeError(f"{len(live)} requests unfinished after {max_steps} steps")
    wall = time.perf_counter() - t0
    out_tokens = sum(len(v) for r in done.values() for v in r["out"].values())
    return {"requests": done, "wall_s": wall, "output_tokens": out_tokens,
            "prefill_tokens_computed": engine.counters["prompt_tokens"] - c0["prompt_tokens"],
            "prompt_tokens_total": sum(r["prompt_tokens"] for r in done.values()),
            "cached_tokens_total": sum(r["cached"] or 0 for r in done.values())}


def summarize(res: dict, engine, stats0: dict) -> dict:
    ttfts = [r["ttft_s"] for r in res["requests"].values() if r["ttft_s"] is not None]
    st = engine.stats()
    q = (st.get("prefix_cache_queries") or 0) - (stats0.get("prefix_cache_queries") or 0)
    h = (st.get("prefix_cache_hits") or 0) - (stats0.get("prefix_cache_hits") or 0)
    return {"n_requests": len(res["requests"]), "ttft_p50_s": pct(ttfts, 0.5), "ttft_p90_s": pct(ttfts, 0.9),
            "output_tokens": res["output_tokens"], "wall_s": res["wall_s"],
            "output_tokens_per_s": res["output_tokens"] / res["wall_s"] if res["wall_s"] else None,
            "prefill_tokens_computed": res["prefill_tokens_computed"],
            "prompt_tokens_total": res["prompt_tokens_total"], "cached_tokens_total": res["cached_tokens_total"],
            "hit_rate": (h / q) if q else (0.0 if res["prompt_tokens_total"] else None),
            "cached_blocks": st.get("cached_blocks"), "evictions": st.get("prefix_cache_evictions")}


def chat_prompt(tok, text: str) -> list[int]:
    return tok.encode(tok.apply_chat_template(text))


def dqa_prompts(tok, docs: list[str], questions: int, seed: int) -> list[tuple[str, str]]:
    """(id, chat-templated text) for every document x question, in a seeded shuffle."""
    pairs = [(d, q) for d in range(len(docs)) for q in range(questions)]
    random.Random(seed).shuffle(pairs)
    return [(f"dqa-{d}-{q}", tok.apply_chat_template(f"{docs[d]}\n\n{QUESTIONS[q % len(QUESTIONS)]}"))
            for d, q in pairs]


def run_dqa(engine, args, docs: list[str]) -> dict:
    from runtime.sampling import SamplingParams
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    reqs = [(f"{rid}-{time.monotonic_ns()}", tok.encode(text), params)
            for rid, text in dqa_prompts(tok, docs, args.questions, args.seed)]
    s0 = engine.stats()
    res = drive(engine, reqs, args.concurrency, args.max_steps)
    out = summarize(res, engine, s0)
    out.update(first_and_later([rid for rid, _, _ in reqs], {rid: r["ttft_s"] for rid, r in res["requests"].items()},
                               dqa_doc))
    out["texts"] = {rid.rsplit("-", 1)[0]: tok.decode(r["out"].get(0, [])) for rid, r in res["requests"].items()}
    return out


def run_llama_server(args, tok, docs: list[str]) -> dict:
    """The DQA prompts against llama.cpp's server (prompt cache on), then the first --check-uncached of
    them again with `cache_prompt: false`: do its cached answers equal its uncached ones?"""
    from bench import llama_cpp as llama_cpp_peer
    from bench.prefix_serve import LlamaServer, complete, run_dqa as http_dqa
    binary = llama_cpp_peer.ensure_built(targets=llama_cpp_peer.SERVER_TARGETS)["llama-server"]
    quantize = llama_cpp_peer.ensure_built()["llama-quantize"]
    gguf = llama_cpp_peer.ensure_gguf(args.peer_weights, quantize)
    prompts = dqa_prompts(tok, docs, args.questions, args.seed)
    longest = max(len(tok.encode(t)) for _, t in prompts) + args.max_tokens + 64
    with LlamaServer(binary, gguf, slots=args.concurrency, ctx_per_slot=longest, threads=args.peer_threads) as srv:
        print(f"llama-server: {' '.join(srv.command)}", flush=True)
        res = http_dqa(srv.url, "default", prompts, args.concurrency, args.max_tokens, log=print)
        same, checked = 0, []
        for rid, text in prompts[:args.check_uncached]:
            r = complete(srv.url, "default", text, args.max_tokens, {"cache_prompt": False})
            checked.append({"id": rid, "cached_text": res["texts"][rid], "uncached_text": r.text,
                            "equal": r.text == res["texts"][rid]})
            same += r.text == res["texts"][rid]
    res["uncached_check"] = {"checked": len(checked), "equal": same, "rows": checked}
    res["server"] = {"command": srv.command, "gguf": str(gguf), "weights": args.peer_weights}
    return res


def run_vllm(args, tok, docs: list[str]) -> dict:
    """The DQA prompts against vLLM CPU's OpenAI server (prefix caching on) on the Hugging Face dir
    the engine was built from, in its --vllm-dtype."""
    from bench.prefix_serve import VllmServer, run_dqa as http_dqa
    from bench.speed import reference_hf_dir
    prompts = dqa_prompts(tok, docs, args.questions, args.seed)
    longest = max(len(tok.encode(t)) for _, t in prompts) + args.max_tokens + 64
    with VllmServer(args.vllm_python, reference_hf_dir(args.engine), dtype=args.vllm_dtype,
                    max_model_len=max(longest, 2048), threads=args.peer_threads, bind=args.vllm_bind) as srv:
        print(f"vLLM: {' '.join(srv.command)}", flush=True)
        res = http_dqa(srv.url, "lookahead_llm", prompts, args.concurrency, args.max_tokens, log=print)
    res["server"] = {"command": srv.command, "dtype": args.vllm_dtype, "bind": args.vllm_bind}
    return res


def run_served(args, tok, docs: list[str]) -> dict:
    """The DQA prompts against our own server's OpenAI API (--served-url: Dynamo's frontend), with
    the same client as the peers, so served TTFTs compare with theirs."""
    from bench.prefix_serve import run_dqa as http_dqa
    res = http_dqa(args.served_url.rstrip("/").removesuffix("/v1"), args.served_model,
                   dqa_prompts(tok, docs, args.questions, args.seed), args.concurrency, args.max_tokens, log=print)
    res["server"] = {"url": args.served_url}
    if res.get("first_cached_tokens"):
        print(f"warning: the served documents were already in the server's cache ({res['first_cached_tokens']} "
              "tokens of the first questions were cached): its first-question TTFTs are not cold. Restart the "
              "server, or pass another --seed, for a cold run.", flush=True)
    return res


def same_answers(ours: dict, peer: dict) -> dict:
    """How many of the peer's greedy replies equal ours (a run of our engine: served, or in-process with
    caching on), by prompt."""
    a, b = ours.get("texts") or {}, peer.get("texts") or {}
    common = sorted(set(a) & set(b))
    differ = [k for k in common if a[k].strip() != b[k].strip()]
    return {"compared": len(common), "equal": len(common) - len(differ),
            "first_differences": [{"id": k, "ours": a[k], "peer": b[k]} for k in differ[:3]]}


def run_dynamo_routing(args, tok) -> dict:
    """D documents x Q questions on Dynamo with 2 workers whose host pools hold about --dynamo-pool-docs
    documents each (fewer than D, so a worker that sees every document evicts): kv vs round-robin."""
    from bench.prefix_serve import DynamoDeployment, run_dqa as http_dqa
    docs = make_docs(tok, args.dynamo_docs, [args.dynamo_doc_tokens], args.seed + 404)
    prompts = dqa_prompts(tok, docs, args.dynamo_questions, args.seed)
    blocks = int(args.dynamo_pool_docs * (args.dynamo_doc_tokens + 64) / 16) + 4 * args.dynamo_concurrency
    out: dict = {"workload": {"docs": args.dynamo_docs, "questions": args.dynamo_questions,
                              "doc_tokens": args.dynamo_doc_tokens, "workers": args.dynamo_workers,
                              "pool_docs": args.dynamo_pool_docs, "num_host_blocks": blocks,
                              "concurrency": args.dynamo_concurrency, "max_tokens": args.max_tokens}}
    for router in args.dynamo_routers.split(","):
        with DynamoDeployment(args.engine, args.dynamo_workers, router, blocks) as dep:
            print(f"dynamo {router}: {dep.url} ({args.dynamo_workers} workers, {blocks} host blocks each)", flush=True)
            out[router] = http_dqa(dep.url, "lookahead_llm", prompts, args.dynamo_concurrency, args.max_tokens, log=print)
            print(f"  {router}: {({k: v for k, v in out[router].items() if k != 'texts'})}", flush=True)
    return out


def run_dynamo_long(args, tok) -> dict:
    """--dynamo-long: D documents of --dynamo-long-tokens on Dynamo, one worker whose host pool holds
    them all: a first question on every document at once (cold prefills, side by side), then a
    second question on every document at once (each document from the prefix cache). Per document:
    both TTFTs and second / first; every request's error, where one fails (the run goes on)."""
    from concurrent.futures import ThreadPoolExecutor

    from bench.prefix_serve import DynamoDeployment, complete
    n, length = args.dynamo_long_docs, args.dynamo_long_tokens
    docs = make_docs(tok, n, [length], args.seed + 505)
    blocks = int(n * (length + 256) / 16) + 64
    out: dict = {"workload": {"docs": n, "doc_tokens": length, "workers": 1, "num_host_blocks": blocks,
                              "max_tokens": args.max_tokens, "worker_args": args.dynamo_worker_arg,
                              "request_timeout_s": args.request_timeout}, "rounds": []}

    def ask(prompt: str):
        try:
            return complete(url, "lookahead_llm", prompt, args.max_tokens, timeout=args.request_timeout)
        except Exception as e:      # noqa: BLE001 — recorded with its document, the round goes on
            return f"{type(e).__name__}: {e}"[:300]

    with DynamoDeployment(args.engine, 1, "kv", blocks, extra=list(args.dynamo_worker_arg)) as dep:
        url = dep.url
        print(f"dynamo long documents: {url} ({n} x {length} tokens, {blocks} host blocks)", flush=True)
        for q in (0, 1):
            prompts = [tok.apply_chat_template(f"{d}\n\n{QUESTIONS[q]}") for d in docs]
            t0 = time.perf_counter()
            with ThreadPoolExecutor(n) as pool:
                replies = list(pool.map(ask, prompts))
            rows = [{"error": r} if isinstance(r, str) else
                    {"ttft_s": r.ttft_s, "total_s": r.total_s, "prompt_tokens": r.prompt_tokens,
                     "cached_tokens": r.cached_tokens, "completion_tokens": r.completion_tokens, "text": r.text}
                    for r in replies]
            out["rounds"].append({"question": QUESTIONS[q], "wall_s": time.perf_counter() - t0, "requests": rows})
            print(f"  round {q + 1}: {[row.get('ttft_s', row.get('error')) for row in rows]}", flush=True)
    first, later = out["rounds"]
    ratios = [b["ttft_s"] / a["ttft_s"] for a, b in zip(first["requests"], later["requests"])
              if a.get("ttft_s") and b.get("ttft_s")]
    out["errors"] = sum("error" in r for rnd in out["rounds"] for r in rnd["requests"])
    out["later_over_first"] = ratios
    out["later_over_first_max"] = max(ratios) if ratios else None
    return out


def run_second(engine, args, doc: str) -> dict:
    from runtime.sampling import SamplingParams
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for i, q in enumerate(QUESTIONS[:2]):
        ids = chat_prompt(tok, f"{doc}\n\n{q}")
        r = drive(engine, [(f"second-{i}-{time.monotonic_ns()}", ids, params)], 1, args.max_steps)
        rr = next(iter(r["requests"].values()))
        rows.append({"prompt_tokens": len(ids), "ttft_s": rr["ttft_s"], "cached_tokens": rr["cached"],
                     "prefill_tokens_computed": r["prefill_tokens_computed"]})
    return {"questions": rows, "ttft_ratio_second_over_first": rows[1]["ttft_s"] / rows[0]["ttft_s"]}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run_multiturn(engine, args, parts: list[str]) -> dict:
    from runtime.sampling import SamplingParams
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=args.reply_tokens)
    messages: list[dict] = []
    turns = []
    prev_ids: list[int] | None = None
    prev_gen: list[int] | None = None
    for t, part in enumerate(parts):
        messages.append({"role": "user", "content": f"{part}\n\nIn a sentence, what does this part add?"})
        ids = tok.encode(tok.apply_chat_template(messages))
        r = drive(engine, [(f"turn-{t}-{time.monotonic_ns()}", ids, params)], 1, args.max_steps)
        rr = next(iter(r["requests"].values()))
        gen = rr["out"].get(0, [])
        reply = tok.decode(gen)
        row = {"turn": t + 1, "prompt_tokens": len(ids), "ttft_s": rr["ttft_s"], "cached_tokens": rr["cached"],
               "prefill_tokens_computed": r["prefill_tokens_computed"], "output_tokens": len(gen)}
        if prev_ids is not None:
            # the template: does this prompt extend the last one? with the reply: does it extend the
            # last prompt + the ids the model generated?
            row["prefix_vs_prev_prompt"] = common_prefix(prev_ids, ids)
            row["prev_prompt_tokens"] = len(prev_ids)
            seen = prev_ids + prev_gen
            k = common_prefix(seen, ids)
            row["prefix_vs_prev_prompt_and_reply"] = k
            row["prev_prompt_and_reply_tokens"] = len(seen)
            if k < len(seen):
                row["diverges_at"] = {"pos": k, "position_in": "prompt" if k < len(prev_ids) else "reply",
                                      "seen": tok.decode(seen[max(0, k - 4):k + 6]),
                                      "now": tok.decode(ids[max(0, k - 4):k + 6]),
                                      "seen_ids": seen[k:k + 6], "now_ids": ids[k:k + 6]}
            # the most a block cache can reuse: the common prefix, down to whole blocks
            bs = engine.config.block_size
            row["reusable_tokens"] = (k // bs) * bs
            row["gap_tokens"] = row["reusable_tokens"] - (rr["cached"] or 0)
        turns.append(row)
        messages.append({"role": "assistant", "content": reply})
        prev_ids, prev_gen = ids, gen
    ratio = turns[-1]["ttft_s"] / turns[0]["ttft_s"] if turns and turns[0]["ttft_s"] else None
    return {"turns": turns, "ttft_ratio_last_over_first": ratio}


def run_n(engine, args, docs: list[str]) -> dict:
    from runtime.sampling import SamplingParams
    tok = engine.tokenizer
    rows = {}
    for n, doc in zip((1, 4), docs):
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, n=n, temperature=0.8, seed=1)
        ids = chat_prompt(tok, f"{doc}\n\n{QUESTIONS[0]}")
        r = drive(engine, [(f"n{n}-{time.monotonic_ns()}", ids, params)], 1, args.max_steps)
        rr = next(iter(r["requests"].values()))
        rows[f"n{n}"] = {"prompt_tokens": len(ids), "ttft_s": rr["ttft_s"], "total_s": rr.get("total_s"),
                         "prefill_tokens_computed": r["prefill_tokens_computed"],
                         "choices": len(rr["out"]), "output_tokens": r["output_tokens"]}
    rows["ttft_ratio_n4_over_n1"] = rows["n4"]["ttft_s"] / rows["n1"]["ttft_s"]
    return rows


def loadavg() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def fmt(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def print_report(rep: dict) -> None:
    print(f"\nengine {rep['engine']}  commit {rep['commit']}  load avg start {rep['loadavg_start']} "
          f"end {rep['loadavg_end']}  (2-core box shared with other work: timings are wall clock)")
    if "dqa" in rep:
        w = rep["workload"]["dqa"]
        print(f"\ndocument QA: {w['docs']} docs x {w['questions']} questions, {w['doc_tokens']} tokens, "
              f"concurrency {w['concurrency']}, {w['max_tokens']} output tokens each")
        hdr = ("run", "TTFT p50 s", "TTFT p90 s", "first/doc p50 s", "later p50 s", "later p90 s", "out tok/s",
               "hit rate", "prefill computed", "prompt tokens", "wall s")
        print(" | ".join(hdr))
        names = {"off": "in-process, caching off", "on": "in-process, caching on", "served": "served (ours)"}
        for k in ("off", "on", "served", "llama-server", "vllm"):
            s = rep["dqa"].get(k)
            if s:
                label = names.get(k) or (f"vLLM CPU {s['server']['dtype']}" if k == "vllm" else k)
                print(" | ".join([label, fmt(s["ttft_p50_s"]), fmt(s["ttft_p90_s"]), fmt(s.get("ttft_first_p50_s")),
                                  fmt(s.get("ttft_later_p50_s")), fmt(s.get("ttft_later_p90_s")),
                                  fmt(s["output_tokens_per_s"], ".2f"), fmt(s["hit_rate"], ".3f"),
                                  str(s["prefill_tokens_computed"]), str(s["prompt_tokens_total"]),
                                  fmt(s["wall_s"], ".1f")]))
        if rep["dqa"].get("off") and rep["dqa"].get("on"):
            off, on = rep["dqa"]["off"], rep["dqa"]["on"]
            print(f"TTFT p50 off/on {fmt(off['ttft_p50_s'] / on['ttft_p50_s'], '.1f')}x, "
                  f"output tok/s on/off {fmt(on['output_tokens_per_s'] / off['output_tokens_per_s'], '.2f')}x")
        peer = rep["dqa"].get("llama-server")
        if peer and rep["dqa"].get("on"):
            on = rep["dqa"]["on"]
            print(f"ours (caching on) vs llama-server: TTFT p50 {fmt(peer['ttft_p50_s'] / on['ttft_p50_s'], '.2f')}x "
                  f"better, output tok/s {fmt(on['output_tokens_per_s'] / peer['output_tokens_per_s'], '.2f')}x")
        vl, sv = rep["dqa"].get("vllm"), rep["dqa"].get("served")
        if sv and sv.get("same_answers", {}).get("compared"):
            print(f"served greedy answers equal the in-process ones: {sv['same_answers']['equal']} of "
                  f"{sv['same_answers']['compared']}")
        if vl and sv:
            print(f"served (ours) vs vLLM CPU {vl['server']['dtype']}: later questions' TTFT p50 "
                  f"{fmt(sv.get('ttft_later_p50_s'))} s vs {fmt(vl.get('ttft_later_p50_s'))} s, first question per "
                  f"document {fmt(sv.get('ttft_first_p50_s'))} s vs {fmt(vl.get('ttft_first_p50_s'))} s, output tok/s "
                  f"{fmt(sv['output_tokens_per_s'] / vl['output_tokens_per_s'], '.2f')}x; greedy answers equal "
                  f"{vl['same_answers']['equal']} of {vl['same_answers']['compared']}")
        elif vl and rep["dqa"].get("on"):
            on = rep["dqa"]["on"]
            print(f"ours (caching on) vs vLLM CPU {vl['server']['dtype']}: TTFT p50 "
                  f"{fmt(vl['ttft_p50_s'] / on['ttft_p50_s'], '.2f')}x better, output tok/s "
                  f"{fmt(on['output_tokens_per_s'] / vl['output_tokens_per_s'], '.2f')}x; greedy answers equal "
                  f"{vl['same_answers']['equal']} of {vl['same_answers']['compared']}")
        if peer:
            u = peer["uncached_check"]
            print(f"llama-server: {u['equal']} of {u['checked']} cached replies equal the same prompt's uncached reply"
                  f" ({peer['server']['weights']} GGUF)")
    if "dynamo" in rep:
        d = rep["dynamo"]
        w = d["workload"]
        print(f"\nDynamo routing: {w['workers']} workers, {w['docs']} docs x {w['questions']} questions of "
              f"{w['doc_tokens']} tokens, each worker's pool {w['num_host_blocks']} blocks (~{w['pool_docs']} docs), "
              f"concurrency {w['concurrency']}")
        print("router | TTFT p50 s | TTFT p90 s | out tok/s | hit rate | prefill computed | prompt tokens | wall s")
        for k, s in d.items():
            if k == "workload":
                continue
            print(" | ".join([k, fmt(s["ttft_p50_s"]), fmt(s["ttft_p90_s"]), fmt(s["output_tokens_per_s"], ".2f"),
                              fmt(s["hit_rate"], ".3f"), str(s["prefill_tokens_computed"]),
                              str(s["prompt_tokens_total"]), fmt(s["wall_s"], ".1f")]))
        if d.get("kv") and d.get("round-robin") and d["round-robin"]["prefill_tokens_computed"]:
            kv, rr = d["kv"], d["round-robin"]
            print(f"kv / round-robin: prefill computed {kv['prefill_tokens_computed'] / rr['prefill_tokens_computed']:.2f}, "
                  f"TTFT p50 {fmt(kv['ttft_p50_s'] / rr['ttft_p50_s'], '.2f')}")
    if "dynamo_long" in rep:
        d = rep["dynamo_long"]
        w = d["workload"]
        print(f"\nDynamo, long documents: {w['docs']} x {w['doc_tokens']} tokens, one worker "
              f"({' '.join(w['worker_args']) or 'engine defaults'}), {w['max_tokens']} output tokens; errors {d['errors']}")
        print("doc | prompt tokens | first TTFT s | later TTFT s | later cached tokens | later / first")
        first, later = d["rounds"]
        for i, (a, b) in enumerate(zip(first["requests"], later["requests"])):
            ratio = b["ttft_s"] / a["ttft_s"] if a.get("ttft_s") and b.get("ttft_s") else None
            print(" | ".join([str(i), str(a.get("prompt_tokens", "-")), fmt(a.get("ttft_s"), ".1f"),
                              fmt(b.get("ttft_s"), ".2f"), str(b.get("cached_tokens", "-")), fmt(ratio, ".4f")]))
            for r in (a, b):
                if "error" in r:
                    print(f"    error: {r['error']}")
    if "second" in rep:
        for k, s in rep["second"].items():
            q1, q2 = s["questions"]
            print(f"\nsecond question ({k}): first TTFT {fmt(q1['ttft_s'])} s ({q1['prompt_tokens']} tokens, "
                  f"{q1['cached_tokens']} cached), second {fmt(q2['ttft_s'])} s ({q2['cached_tokens']} cached): "
                  f"ratio 1/{fmt(1 / s['ttft_ratio_second_over_first'], '.1f')}")
    if "multiturn" in rep:
        for k, s in rep["multiturn"].items():
            print(f"\nmulti-turn ({k}): turn | prompt tokens | cached | computed | TTFT s | extends prev prompt | "
                  f"extends prev prompt+reply | block-reusable | gap")
            for r in s["turns"]:
                print(f"{r['turn']} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['prefill_tokens_computed']} | "
                      f"{fmt(r['ttft_s'])} | {r.get('prefix_vs_prev_prompt', '-')}/{r.get('prev_prompt_tokens', '-')} | "
                      f"{r.get('prefix_vs_prev_prompt_and_reply', '-')}/{r.get('prev_prompt_and_reply_tokens', '-')} | "
                      f"{r.get('reusable_tokens', '-')} | {r.get('gap_tokens', '-')}")
                if "diverges_at" in r:
                    d = r["diverges_at"]
                    print(f"    diverges at {d['pos']} (in the {d['position_in']}): was {d['seen']!r} {d['seen_ids']}, "
                          f"now {d['now']!r} {d['now_ids']}")
            print(f"turn {len(s['turns'])} TTFT / turn 1: {fmt(s['ttft_ratio_last_over_first'], '.2f')}")
    if "n" in rep:
        for k, s in rep["n"].items():
            print(f"\nn ({k}): n=1 TTFT {fmt(s['n1']['ttft_s'])} s, n=4 TTFT {fmt(s['n4']['ttft_s'])} s "
                  f"(prefill computed {s['n1']['prefill_tokens_computed']} / {s['n4']['prefill_tokens_computed']}, "
                  f"{s['n4']['choices']} choices): ratio {fmt(s['ttft_ratio_n4_over_n1'], '.2f')}")


def plot(rep: dict, path: str) -> None:
    """One panel per measured thing: DQA TTFT and output tokens/s (caching off, on, llama-server),
    multi-turn TTFT per turn, Dynamo routing (prefill computed and TTFT p50 per router)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no plot")
        return
    panels = []
    if "dqa" in rep:
        ks = [k for k in ("off", "on", "served", "llama-server", "vllm") if rep["dqa"].get(k)]

        def dqa_ttft(ax):
            x = range(len(ks))
            ax.bar([i - 0.2 for i in x], [rep["dqa"][k]["ttft_p50_s"] for k in ks], 0.4, label="p50")
            ax.bar([i + 0.2 for i in x], [rep["dqa"][k]["ttft_p90_s"] for k in ks], 0.4, label="p90")
            ax.set_xticks(list(x), ks); ax.set_yscale("log"); ax.set_ylabel("TTFT s (log)")
            ax.set_title("document QA: TTFT"); ax.legend()

        def dqa_tps(ax):
            ax.bar(ks, [rep["dqa"][k]["output_tokens_per_s"] for k in ks])
            ax.set_ylabel("output tokens/s"); ax.set_title("document QA: throughput")
        panels += [dqa_ttft, dqa_tps]
    if rep.get("multiturn"):
        def turns(ax):
            for k, s in rep["multiturn"].items():
                ax.plot([r["turn"] for r in s["turns"]], [r["ttft_s"] for r in s["turns"]], marker="o", label=k)
            ax.set_xlabel("turn"); ax.set_ylabel("TTFT s"); ax.set_title("multi-turn TTFT"); ax.legend()
        panels.append(turns)
    if rep.get("dynamo"):
        routers = [k for k in rep["dynamo"] if k != "workload"]

        def routing(ax):
            ax.bar(routers, [rep["dynamo"][k]["prefill_tokens_computed"] for k in routers])
            ax.set_ylabel("prefill tokens computed"); ax.set_title("Dynamo, 2 workers: prefill")

        def routing_ttft(ax):
            ax.bar(routers, [rep["dynamo"][k]["ttft_p50_s"] for k in routers])
            ax.set_ylabel("TTFT p50 s"); ax.set_title("Dynamo, 2 workers: TTFT p50")
        panels += [routing, routing_ttft]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.3 * len(panels), 4), squeeze=False)
    for fn, ax in zip(panels, axes[0]):
        fn(ax)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default=str(ROOT / "engines/default"))
    p.add_argument("--workloads", default="dqa,second,multiturn,n", help="comma list of dqa,second,multiturn,n")
    p.add_argument("--settings", default="off,on", help="prefix caching settings to run: off,on (dqa runs both; "
                   "second/multiturn/n run each listed)")
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--doc-tokens", default="4096,8000", help="document lengths in tokens, cycled over documents")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per DQA request (ignore_eos)")
    p.add_argument("--second-doc-tokens", type=int, default=8000)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--turn-tokens", type=int, default=300)
    p.add_argument("--reply-tokens", type=int, default=48)
    p.add_argument("--n-doc-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=200000, help="bound on engine steps per run")
    p.add_argument("--num-host-blocks", type=int, default=None)
    p.add_argument("--engine-arg", action="append", default=[], metavar="FIELD=VALUE",
                   help="a LookaheadConfig override (e.g. mode=lookahead); int/float/bool parsed")
    p.add_argument("--peer", choices=("none", "llama-server", "vllm"), default="none",
                   help="also run the DQA workload against llama.cpp's server (prompt cache on; built once, "
                        "~10 min: python -m bench.llama_cpp build --server) or vLLM CPU's OpenAI server "
                        "(prefix caching on; its own venv: docs/INSTALL.md), and compare the answers")
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"),
                   help="the python of vLLM CPU's venv (default: %(default)s)")
    p.add_argument("--vllm-dtype", default="bfloat16", help="vLLM's --dtype (default: %(default)s)")
    p.add_argument("--vllm-bind", default="nobind",
                   help=VLLM_BIND_HELP)
    p.add_argument("--served-url", default=None,
                   help="also run the DQA workload against our server's OpenAI API here (e.g. http://127.0.0.1:8010, "
                        "Dynamo's frontend started on the same --engine), through the peers' client")
    p.add_argument("--served-model", default="lookahead_llm", help="the model name --served-url serves")
    p.add_argument("--peer-weights", default="Q8_0", help="the peer's GGUF weights (default: %(default)s)")
    p.add_argument("--peer-threads", type=int, default=2)
    p.add_argument("--check-uncached", type=int, default=4,
                   help="peer replies re-asked with its cache off, to compare (default: %(default)s)")
    p.add_argument("--dynamo", action="store_true", help="also run DQA on Dynamo, 2 workers, kv vs round-robin")
    p.add_argument("--dynamo-routers", default="kv,round-robin")
    p.add_argument("--dynamo-workers", type=int, default=2)
    p.add_argument("--dynamo-docs", type=int, default=8)
    p.add_argument("--dynamo-questions", type=int, default=10)
    p.add_argument("--dynamo-doc-tokens", type=int, default=1024)
    p.add_argument("--dynamo-concurrency", type=int, default=2, help="requests in flight on Dynamo (one a worker)")
    p.add_argument("--dynamo-pool-docs", type=float, default=5.0,
                   help="each worker's host pool holds about this many documents (default: %(default)s)")
    p.add_argument("--dynamo-long", action="store_true",
                   help="also run long documents on Dynamo: a first question on each of --dynamo-long-docs documents "
                        "at once, then a second on each (from the prefix cache); one worker")
    p.add_argument("--dynamo-long-docs", type=int, default=4)
    p.add_argument("--dynamo-long-tokens", type=int, default=30000)
    p.add_argument("--dynamo-worker-arg", action="append", default=[], metavar="ARG",
                   help="an argument for the Dynamo workers (python -m serving.dynamo_worker's), e.g. "
                        "--dynamo-worker-arg=--mode --dynamo-worker-arg=lookahead; repeat")
    p.add_argument("--request-timeout", type=float, default=900.0, metavar="S",
                   help="the HTTP client's limit per request (--dynamo-long: four cold 30K prefills side by side "
                        "take ~20 min on 2 cores; default %(default)s)")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--from-json", default=None, metavar="JSON",
                   help="run nothing: print the table of an earlier --json file (and --plot it)")
    args = p.parse_args(argv)
    if args.from_json:
        rep = json.loads(Path(args.from_json).read_text())
        print_report(rep)
        if args.plot:
            plot(rep, args.plot)
        return 0

    from runtime.engine import Engine
    overrides = {}
    for kv in args.engine_arg:
        k, v = kv.split("=", 1)
        for conv in (int, float):
            try:
                v = conv(v)
                break
            except ValueError:
                pass
        if v in ("true", "false"):
            v = v == "true"
        overrides[k] = v
    workloads = [w for w in args.workloads.split(",") if w]
    settings = [s for s in args.settings.split(",") if s]
    lengths = [int(x) for x in args.doc_tokens.split(",")]
    rep: dict = {"engine": args.engine, "commit": commit(), "loadavg_start": loadavg(), "argv": sys.argv[1:],
                 "workload": {}}
    t_start = time.perf_counter()
    for setting in settings:
        engine = Engine.from_dir(args.engine, num_host_blocks=args.num_host_blocks,
                                 prefix_caching=(setting == "on"), **overrides)
        try:
            tok = engine.tokenizer
            # each workload gets its own documents (never a prefix another workload left cached)
            if "dqa" in workloads:
                docs = make_docs(tok, args.docs, lengths, args.seed)
                rep["workload"]["dqa"] = {"docs": args.docs, "questions": args.questions, "doc_tokens": lengths,
                                          "concurrency": args.concurrency, "max_tokens": args.max_tokens}
                rep.setdefault("dqa", {})[setting] = run_dqa(engine, args, docs)
                print(f"[{time.perf_counter() - t_start:.0f}s] dqa {setting}: "
                      f"{({k: v for k, v in rep['dqa'][setting].items() if k != 'texts'})}", flush=True)
            if "second" in workloads:
                doc = make_docs(tok, 1, [args.second_doc_tokens], args.seed + 101)[0]
                rep.setdefault("second", {})[setting] = run_second(engine, args, doc)
                print(f"[{time.perf_counter() - t_start:.0f}s] second {setting} done", flush=True)
            if "multiturn" in workloads:
                parts = make_docs(tok, args.turns, [args.turn_tokens], args.seed + 202)
                rep.setdefault("multiturn", {})[setting] = run_multiturn(engine, args, parts)
                print(f"[{time.perf_counter() - t_start:.0f}s] multiturn {setting} done", flush=True)
            if "n" in workloads:
                docs = make_docs(tok, 2, [args.n_doc_tokens], args.seed + 303)
                rep.setdefault("n", {})[setting] = run_n(engine, args, docs)
                print(f"[{time.perf_counter() - t_start:.0f}s] n {setting} done", flush=True)
        finally:
            engine.close() if hasattr(engine, "close") else None
    if args.peer in ("llama-server", "vllm") or args.dynamo or args.dynamo_long or args.served_url:
        from runtime.engine import Engine as _E   # the tokenizer only (the engines above are closed)
        tok = _E.from_dir(args.engine, num_host_blocks=64).tokenizer
        if args.served_url:
            docs = make_docs(tok, args.docs, lengths, args.seed)     # the in-process DQA's documents
            sv = rep.setdefault("dqa", {})["served"] = run_served(args, tok, docs)
            sv["same_answers"] = same_answers(rep["dqa"].get("on") or {}, sv)
            rep["workload"].setdefault("dqa", {"docs": args.docs, "questions": args.questions, "doc_tokens": lengths,
                                               "concurrency": args.concurrency, "max_tokens": args.max_tokens})
            print(f"[{time.perf_counter() - t_start:.0f}s] dqa served done", flush=True)
        if args.peer == "llama-server":
            docs = make_docs(tok, args.docs, lengths, args.seed)     # the in-process DQA's documents
            rep.setdefault("dqa", {})["llama-server"] = run_llama_server(args, tok, docs)
            rep["workload"].setdefault("dqa", {"docs": args.docs, "questions": args.questions, "doc_tokens": lengths,
                                               "concurrency": args.concurrency, "max_tokens": args.max_tokens})
            print(f"[{time.perf_counter() - t_start:.0f}s] dqa llama-server done", flush=True)
        if args.peer == "vllm":
            docs = make_docs(tok, args.docs, lengths, args.seed)     # the in-process DQA's documents
            vl = rep.setdefault("dqa", {})["vllm"] = run_vllm(args, tok, docs)
            vl["same_answers"] = same_answers(rep["dqa"].get("served") or rep["dqa"].get("on") or {}, vl)
            rep["workload"].setdefault("dqa", {"docs": args.docs, "questions": args.questions, "doc_tokens": lengths,
                                               "concurrency": args.concurrency, "max_tokens": args.max_tokens})
            print(f"[{time.perf_counter() - t_start:.0f}s] dqa vLLM done", flush=True)
        if args.dynamo:
            rep["dynamo"] = run_dynamo_routing(args, tok)
            print(f"[{time.perf_counter() - t_start:.0f}s] dynamo routing done", flush=True)
        if args.dynamo_long:
            rep["dynamo_long"] = run_dynamo_long(args, tok)
            print(f"[{time.perf_counter() - t_start:.0f}s] dynamo long documents done", flush=True)
    rep["loadavg_end"] = loadavg()
    print_report(rep)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rep, indent=1, default=str))
        print(f"json: {args.json}")
    if args.plot:
        plot(rep, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
