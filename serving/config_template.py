"""Fill `config.pbtxt` templates and write a ready Triton model repository.

    python -m serving.config_template --engine engines/default --out build/serve/model_repo \
        --instances 1 --max-queue 256 --mode lookahead

Templates use `${name}` placeholders (as tensorrtllm_backend's `fill_template.py` does). `fill` is
strict both ways: a placeholder without a value and a value without a placeholder (a typo) are errors,
so a config never reaches the server half-filled. The template itself is never edited in place.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Mapping

from runtime.errors import LookaheadError

REPO_TEMPLATE = Path(__file__).resolve().parents[1] / "triton_model_repo"
MODEL_NAME = "lookahead_llm"
TEMPLATE_FILE = "config.pbtxt.template"
_TOKEN = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class TemplateError(LookaheadError, ValueError):
    """A template and its values do not match, or the model repository cannot be written."""


def placeholders(template_text: str) -> list[str]:
    """Placeholder names in order of first use; raises on a `$` that starts no valid placeholder."""
    for m in re.finditer(r"\$", template_text):
        if not _TOKEN.match(template_text, m.start()):
            line = template_text.count("\n", 0, m.start()) + 1
            snippet = template_text[m.start():m.start() + 20].split("\n")[0]
            raise TemplateError(f"line {line}: malformed placeholder {snippet!r} (write ${{name}})")
    return list(dict.fromkeys(_TOKEN.findall(template_text)))


def fill(template_text: str, values: Mapping[str, Any]) -> str:
    """Replace every `${name}` with `str(values[name])`.

    Raises TemplateError naming the placeholder when a value is missing, or the key when a value
    has no placeholder (an unknown name is more likely a typo than something to ignore).
    """
    names = placeholders(template_text)
    missing = [n for n in names if n not in values]
    if missing:
        raise TemplateError(f"no value for placeholder ${{{missing[0]}}} "
                            f"(missing: {', '.join(missing)}; the template needs: {', '.join(names)})")
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise TemplateError(f"{unknown[0]!r} is not a placeholder of this template "
                            f"(unknown: {', '.join(unknown)}; the template has: {', '.join(names)})")
    return _TOKEN.sub(lambda m: str(values[m.group(1)]), template_text)


def pbtxt_string(text: str) -> str:
    """Escape `text` for use inside a double-quoted protobuf text-format string."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def write_model_repo(out: str | Path, engine_dir: str | Path, *, model_name: str = MODEL_NAME,
                     instance_count: int = 1, instance_kind: str = "KIND_CPU", max_queue: int = 256,
                     lookahead_overrides: Mapping[str, Any] | None = None,
                     template_dir: str | Path = REPO_TEMPLATE / MODEL_NAME) -> Path:
    """Write `<out>/<model_name>/{config.pbtxt, 1/model.py}` from the template; returns `out`.

    The engine dir and overrides are checked here (manifest only, no checksums), so a bad one fails
    now with the runtime's message rather than later inside the server's log.
    """
    from runtime.engine_dir import load_manifest

    out, template_dir = Path(out).resolve(), Path(template_dir).resolve()
    model_dir = out / model_name
    if model_dir == template_dir:
        raise TemplateError(f"--out {out} would overwrite the template itself; choose another directory")
    if instance_count < 1:
        raise TemplateError(f"instance_count must be >= 1, got {instance_count}")
    if max_queue < 1:
        raise TemplateError(f"max_queue must be >= 1, got {max_queue}")
    overrides = dict(lookahead_overrides or {})
    manifest = load_manifest(engine_dir, verify_checksums=False)
    manifest.lookahead.replace(**overrides)          # raises ConfigError naming a bad field
    values = {
        "model_name": model_name,
        "engine_dir": pbtxt_string(str(Path(engine_dir).resolve())),
        "instance_count": instance_count,
        "instance_kind": instance_kind,
        "max_queue": max_queue,
        "lookahead_overrides": pbtxt_string(json.dumps(overrides, sort_keys=True)),
    }
    text = fill((template_dir / TEMPLATE_FILE).read_text(), values)
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(text)
    shutil.copyfile(template_dir / "1" / "model.py", model_dir / "1" / "model.py")
    return out


def build_parser() -> argparse.ArgumentParser:
    from runtime.cli import add_lookahead_flags

    p = argparse.ArgumentParser(prog="python -m serving.config_template",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", required=True, help="engine dir the server loads")
    p.add_argument("--out", required=True, help="model repository to write (created when missing)")
    p.add_argument("--model-name", default=MODEL_NAME)
    p.add_argument("--instances", type=int, default=1, help="model instances (each loads its own engine)")
    p.add_argument("--instance-kind", default="KIND_CPU", help="KIND_CPU here; KIND_GPU/KIND_MODEL on GPUs")
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting for admission, per instance")
    p.add_argument("--template-dir", default=str(REPO_TEMPLATE / MODEL_NAME))
    add_lookahead_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    from runtime.cli import lookahead_overrides

    args = build_parser().parse_args(argv)
    try:
        out = write_model_repo(args.out, args.engine, model_name=args.model_name, instance_count=args.instances,
                               instance_kind=args.instance_kind, max_queue=args.max_queue,
                               lookahead_overrides=lookahead_overrides(args), template_dir=args.template_dir)
    except LookaheadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out / args.model_name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
