"""The project's Python modules one engine step runs a function of, in the order it first enters them.

    python tests/step_modules.py engines/default mode=lookahead     # prints them, one a line

`step_modules(engine)` steps the engine once under `sys.setprofile` and records the file of every
Python function called (C calls are not Python frames: a ctypes kernel is not counted, its
wrapper is), keeping the files under the repository. The caller warms the engine first, so the
step is a decode step like any later one. A test asserts the count (tests/test_fused_lookahead.py).
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def step_modules(engine) -> list[str]:
    """Run `engine.step()` once; the repository files whose Python functions it ran, in first-call order."""
    seen: dict[str, None] = {}
    root = str(REPO) + "/"

    def hook(frame, event, arg):
        if event == "call":
            name = frame.f_code.co_filename
            if name not in seen and name.startswith(root) and "/.venv/" not in name:
                seen[name] = None

    sys.setprofile(hook)
    try:
        engine.step()
    finally:
        sys.setprofile(None)
    return [str(Path(n).relative_to(REPO)) for n in seen]


def warm_decode(engine, prompt_len: int = 300, batch: int = 2, steps: int = 4) -> None:
    """Give `engine` `batch` requests and step until every prompt is done and `steps` decode steps ran."""
    from runtime.sampling import SamplingParams

    for i in range(batch):
        engine.add_request([(7 * i + j) % 200 + 3 for j in range(prompt_len)],
                           SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    for _ in range(steps + 4):
        engine.step()


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    import torch

    from runtime.engine import Engine

    overrides = dict(a.split("=", 1) for a in sys.argv[2:])
    eng = Engine.from_dir(sys.argv[1] if len(sys.argv) > 1 else REPO / "engines/default", **overrides)
    with torch.inference_mode():
        warm_decode(eng)
        mods = step_modules(eng)
    print("\n".join(mods))
    print(len(mods), "modules")
    eng.close()
