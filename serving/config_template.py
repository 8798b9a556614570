"""Fill `config.pbtxt` templates and write a ready Triton model repository.

    python -m serving.config_template --engine engines/default --out build/serve/model_repo \
        --instances 1 --max-queue 256 --device cuda:1 --mode lookahead

`--device` (cpu, cuda, cuda:N; default auto: cuda when torch has a GPU, else cpu) places the
instances: `instance_group [{ kind: KIND_GPU, gpus: [N] }]` for cuda:N, KIND_CPU for cpu, and a
`device` parameter; `1/model.py` hands the instance's device to `Engine.from_dir(device=...)`.
A device that is not there is refused here, before anything is written or started.

Templates use `${name}` placeholders (as tensorrtllm_backend's `fill_template.py` does). `fill` is
strict both ways: a placeholder without a value and a value without a placeholder (a typo) are errors,
so a config never reaches the server half-filled. The template itself is never edited in place.
"""
from __future__ import annotations

import argparse
import functools
import json
import re
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from runtime.errors import LookaheadError

if TYPE_CHECKING:
    import torch

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


@functools.lru_cache(maxsize=4)
def model_inputs(template: str | Path | None = None) -> dict[str, str]:
    """The model's inputs as its config template declares them: name -> data_type (`TYPE_STRING`,
    `TYPE_INT32`, ...); the HTTP front types a /generate body's fields by it, as tritonserver does."""
    path = Path(template) if template is not None else REPO_TEMPLATE / MODEL_NAME / TEMPLATE_FILE
    section = re.search(r"^input \[(.*?)^\]", path.read_text(), re.M | re.S)
    if section is None:
        raise TemplateError(f"{path}: no input [ ... ] section")
    return dict(re.findall(r'name:\s*"(\w+)"\s*data_type:\s*(TYPE_\w+)', section.group(1)))


def pbtxt_string(text: str) -> str:
    """Escape `text` for use inside a double-quoted protobuf text-format string."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def placement(device: str | torch.device) -> dict[str, str]:
    """The template's instance values for `device` (checked for its form only, not for presence):
    cuda:N -> KIND_GPU on GPU N, cpu -> KIND_CPU; `device` as the engine will be given it."""
    import torch

    from runtime.errors import ConfigError

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError("device", f"{device!r} is not a device", "use cpu, cuda, cuda:N or auto") from None
    if dev.type == "cuda":
        index = dev.index or 0
        return {"instance_kind": "KIND_GPU", "instance_gpus": str(index), "device": f"cuda:{index}"}
    if dev.type == "cpu":
        return {"instance_kind": "KIND_CPU", "instance_gpus": "", "device": "cpu"}
    raise ConfigError("device", f"{device!r} is not supported", "use cpu, cuda, cuda:N or auto")


def instance_device(args: Mapping[str, Any], parameters: Mapping[str, str]) -> str:
    """The device of one model instance, from what Triton hands `initialize`: a KIND_GPU instance
    runs on its GPU (`model_instance_device_id`), a KIND_CPU one on the CPU; any other kind
    (KIND_MODEL, a config without instance_group) uses the config's `device` parameter, else auto."""
    kind = str(args.get("model_instance_kind") or "").upper()
    if kind == "GPU":
        return f"cuda:{int(args.get('model_instance_device_id') or 0)}"
    if kind == "CPU":
        return "cpu"
    return parameters.get("device") or "auto"


def config_text(engine_dir: str | Path, *, model_name: str = MODEL_NAME, instance_count: int = 1,
                device: str | torch.device = "cpu", max_queue: int = 256,
                lookahead_overrides: Mapping[str, Any] | None = None,
                template_dir: str | Path = REPO_TEMPLATE / MODEL_NAME) -> str:
    """The filled config.pbtxt (nothing checked but the template's values; `write_model_repo`
    checks the engine dir, the overrides and that `device` is there)."""
    values = {
        "model_name": model_name,
        "engine_dir": pbtxt_string(str(Path(engine_dir).resolve())),
        "instance_count": instance_count,
        **placement(device),
        "max_queue": max_queue,
        "lookahead_overrides": pbtxt_string(json.dumps(dict(lookahead_overrides or {}), sort_keys=True)),
    }
    return fill((Path(template_dir) / TEMPLATE_FILE).read_text(), values)


def write_model_repo(out: str | Path, engine_dir: str | Path, *, model_name: str = MODEL_NAME,
                     instance_count: int = 1, device: str | None = None, max_queue: int = 256,
                     lookahead_overrides: Mapping[str, Any] | None = None,
                     template_dir: str | Path = REPO_TEMPLATE / MODEL_NAME) -> Path:
    """Write `<out>/<model_name>/{config.pbtxt, 1/model.py}` from the template; returns `out`.

    `device`: cpu, cuda, cuda:N, or None/"auto" (cuda when torch has a GPU, else cpu); one that is
    not there is a ConfigError naming `device`. The engine dir and overrides are checked here too
    (manifest only, no checksums), so a bad one fails now with the runtime's message rather than
    later inside the server's log.
    """
    from runtime.device import resolve_device
    from runtime.engine_dir import load_manifest
    from runtime.spec import resolve_spec

    out, template_dir = Path(out).resolve(), Path(template_dir).resolve()
    model_dir = out / model_name
    if model_dir == template_dir:
        raise TemplateError(f"--out {out} would overwrite the template itself; choose another directory")
    if instance_count < 1:
        raise TemplateError(f"instance_count must be >= 1, got {instance_count}")
    if max_queue < 1:
        raise TemplateError(f"max_queue must be >= 1, got {max_queue}")
    dev = resolve_device(device)                     # raises ConfigError naming device
    overrides = dict(lookahead_overrides or {})
    manifest = load_manifest(engine_dir, verify_checksums=False)
    resolve_spec(manifest, dev, overrides)           # raises ConfigError naming a bad field, as the model will
    text = config_text(engine_dir, model_name=model_name, instance_count=instance_count, device=dev,
                       max_queue=max_queue, lookahead_overrides=overrides, template_dir=template_dir)
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
    p.add_argument("--device", default="auto",
                   help="cpu, cuda or cuda:N: KIND_CPU, or KIND_GPU on that GPU (default: auto, cuda when "
                        "torch has a GPU, else cpu)")
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting for admission, per instance")
    p.add_argument("--template-dir", default=str(REPO_TEMPLATE / MODEL_NAME))
    add_lookahead_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    from runtime.cli import lookahead_overrides

    args = build_parser().parse_args(argv)
    try:
        out = write_model_repo(args.out, args.engine, model_name=args.model_name, instance_count=args.instances,
                               device=args.device, max_queue=args.max_queue,
                               lookahead_overrides=lookahead_overrides(args), template_dir=args.template_dir)
    except LookaheadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out / args.model_name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
