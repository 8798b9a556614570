"""Chat templates: found among a tokenizer's files, rendered sandboxed and under a budget.

The template comes from the engine dir, which anyone who can write the dir controls (the manifest's
checksums are not signed), so it is rendered
- in jinja2's immutable sandbox, set up as transformers sets its own: a template that reaches for
  Python internals (`cycler.__init__.__globals__.os`, `''.__class__.__mro__`) fails with a
  SecurityError instead of running code;
- in a helper process (`serve`, started on the first render and kept for the next ones) that limits
  itself to `RenderBudget`: CPU seconds per render (RLIMIT_CPU), address space (RLIMIT_AS) and
  characters of output. A template that loops for ever or builds a 3 GB string costs that process,
  not the engine's; it is restarted on the next render.
Any failure is an EngineDirError naming the template (`<file>: chat_template` or
`<file>.jinja`) and the limit it ran into, in one line.
"""
from __future__ import annotations

import json
import select
import shutil
import signal
import subprocess
import sys
import threading
import weakref
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from .errors import EngineDirError

TEMPLATE_FILE = "chat_template.jinja"     # transformers 5 keeps the template here, not in the config
# the conversation a template is rendered on at engine load (runtime/tokenizer.py): every chat starts so
PROBE_CONVERSATION = [{"role": "user", "content": "Hello"}]
_ROOT = Path(__file__).resolve().parents[1]
_FIX = "rebuild the engine from a trusted model, or send raw prompts (--raw)"


@dataclass(frozen=True)
class RenderBudget:
    """What one render may take. Real templates take milliseconds and a few MB."""

    cpu_seconds: int = 5               # CPU time per render (the helper's RLIMIT_CPU; whole seconds)
    memory_bytes: int = 1 << 30        # the helper process's address space (RLIMIT_AS)
    max_chars: int = 64 << 20          # characters of rendered prompt


DEFAULT_BUDGET = RenderBudget()


class ChatTemplate:
    """One engine's chat template. `origin` names it in errors (a path, plus ': chat_template' when
    it is a field of tokenizer_config.json). Thread-safe; renders run one at a time."""

    def __init__(self, text: str, origin: str, *, bos_token: Any = "", eos_token: Any = "",
                 budget: RenderBudget | None = None):
        self.text, self.origin, self.budget = text, origin, budget or DEFAULT_BUDGET
        self._tokens = {"bos_token": bos_token, "eos_token": eos_token}
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        request = dict(template=self.text, messages=messages, add_generation_prompt=add_generation_prompt,
                       **self._tokens, budget=asdict(self.budget))     # the template's variables, and the budget
        line = json.dumps(request) + "\n"      # ASCII: any locale, any string
        with self._lock:
            reply = self._ask(line)
        if "text" not in reply:
            raise EngineDirError(f"{self.origin} cannot be rendered ({reply.get('error', '?')}): {_FIX}")
        return reply["text"]

    def check(self) -> None:
        """Render PROBE_CONVERSATION once, then stop the helper: at engine load, so a template that
        cannot render (or finish) is refused at start, naming it, instead of at the first request."""
        try:
            self.render(PROBE_CONVERSATION)
        finally:
            self.close()

    def close(self) -> None:
        with self._lock:
            self._stop()

    # ---- the helper process -------------------------------------------------------------------
    def _ask(self, line: str) -> dict[str, Any]:
        """Send one request line, read one reply line; a helper that died or overran is stopped
        and its reason returned as the error."""
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        proc, wall = self._proc, 10 * self.budget.cpu_seconds + 30   # wall: a backstop; RLIMIT_CPU stops a busy helper
        timed_out, raw = False, b""
        try:
            proc.stdin.write(line.encode("ascii"))
            proc.stdin.flush()
            timed_out = not select.select([proc.stdout], [], [], wall)[0]
            raw = b"" if timed_out else proc.stdout.readline(12 * self.budget.max_chars + 4096)
        except OSError:             # BrokenPipeError: the helper is gone
            pass
        if raw.endswith(b"\n"):
            reply = json.loads(raw)
            if reply.get("fatal"):      # the helper exits after a MemoryError: start a fresh one next time
                self._stop()
            return reply
        self._stop()                # reaps it: its exit status says why it stopped
        if timed_out:
            return {"error": f"no answer within {wall} s"}
        if proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
            return {"error": f"it ran past its CPU budget of {self.budget.cpu_seconds} s"}
        return {"error": f"the render process exited with code {proc.returncode}"}

    def _start(self) -> None:
        code = f"import sys; sys.path.insert(0, {str(_ROOT)!r}); from runtime.chat_template import serve; serve()"
        self._proc = subprocess.Popen([_python(), "-I", "-c", code], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        weakref.finalize(self, _stop_process, self._proc)

    def _stop(self) -> None:
        if self._proc is not None:
            _stop_process(self._proc)
            self._proc = None


def _stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for f in (proc.stdin, proc.stdout):
        try:
            f.close()
        except OSError:
            pass


def _python() -> str:
    """This interpreter, or (inside tritonserver's python stub, whose executable is the stub) the
    python3 on PATH, which triton_env puts the venv's bin first on."""
    exe = Path(sys.executable or "")
    return str(exe) if exe.name.startswith("python") else (shutil.which("python3") or "python3")


def find_chat_template(config: dict[str, Any], config_path: Path | None,
                       locate: Callable[[str], Path | None], **kwargs: Any) -> ChatTemplate | None:
    """The tokenizer's chat template: tokenizer_config.json's `chat_template` (a string, or the
    Hugging Face list form's entry named "default"), else the file TEMPLATE_FILE. `locate(name)`
    gives the path to read a tokenizer file from, or None when there is none (an engine dir's:
    engine_dir.engine_file, which refuses a file its manifest does not list)."""
    value = config.get("chat_template")
    if isinstance(value, list):
        value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None)
    if value is not None and not isinstance(value, str):
        raise EngineDirError(f"{config_path}: chat_template must be a string, got a {type(value).__name__}: "
                             "rebuild the engine")
    if value:
        return ChatTemplate(value, f"{config_path}: chat_template", **kwargs)
    path = locate(TEMPLATE_FILE)
    if path is None:
        return None
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise EngineDirError(f"{path} is not UTF-8 text: rebuild the engine") from None
    return ChatTemplate(text, str(path), **kwargs) if text else None


# ---- the helper's side ----------------------------------------------------------------------------
def serve() -> None:
    """The render helper: one JSON request per line on stdin, one JSON reply per line on stdout
    ({"text": ...} or {"error": ...}); exits at EOF, and after a MemoryError."""
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    compiled: dict[str, Any] = {}
    for line in sys.stdin.buffer:
        request = json.loads(line)
        budget = RenderBudget(**request.pop("budget"))
        _limit(resource, budget)
        try:
            reply = {"text": _render(request, budget, compiled)}
        except MemoryError:
            compiled.clear()
            reply = {"error": f"it ran past its memory budget of {budget.memory_bytes >> 20} MiB", "fatal": True}
        except RecursionError:
            reply = {"error": "it recursed too deep"}
        except _Overrun as e:
            reply = {"error": str(e)}
        except Exception as e:       # jinja2.TemplateError (SecurityError, syntax, raise_exception), TypeError, ...
            reply = {"error": one_line(e)}
        sys.stdout.buffer.write(json.dumps(reply).encode("ascii") + b"\n")
        sys.stdout.buffer.flush()
        if reply.get("fatal"):
            return


def _limit(resource: Any, budget: RenderBudget) -> None:
    """RLIMIT_CPU: what this process has used so far plus the budget (SIGXCPU ends it there);
    RLIMIT_AS: the budget (allocations past it raise MemoryError)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(usage.ru_utime + usage.ru_stime) + 1 + budget.cpu_seconds
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (budget.memory_bytes, hard))


def _render(request: dict[str, Any], budget: RenderBudget, compiled: dict[str, Any]) -> str:
    text = request.pop("template")
    if text not in compiled:
        compiled.clear()
        compiled[text] = _sandbox().from_string(text)
    out, size = [], 0
    for chunk in compiled[text].generate(**request):
        size += len(chunk)
        if size > budget.max_chars:
            raise _Overrun(f"its output ran past its budget of {budget.max_chars} characters")
        out.append(chunk)
    return "".join(out)


class _Overrun(Exception):
    """A render ran past a limit the helper counts itself."""


def one_line(e: BaseException, limit: int = 200) -> str:
    text = " ".join(f"{e.__class__.__name__}: {e}".split())
    return text if len(text) <= limit else text[:limit] + "..."


def _sandbox():
    """An immutable sandboxed environment set up as transformers' apply_chat_template sets its
    own (trim_blocks, lstrip_blocks, loop controls, raise_exception, a tojson that does not
    HTML-escape), so a template renders here as it does there."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
