"""The build command line, derived from `BuildConfig`'s fields (names, defaults, help)."""
from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import NoReturn, Sequence

from runtime.errors import LookaheadError

from .config import BuildConfig
from .errors import BuildError
from .pipeline import build

EXIT_USER_ERROR = 2


class _OneLineParser(argparse.ArgumentParser):
    """argparse prints usage + message on a bad flag; we print one `error:` line like every other error."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)


def make_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="build_engine.py",
                            description="Build a Lookahead-KV engine dir from a checkpoint and verify it "
                                        "against the source model (transformers).")
    for f in dataclasses.fields(BuildConfig):
        flag = _flag(f)
        help_text = f.metadata.get("help", "")
        required = f.default is dataclasses.MISSING
        if f.type in (bool, "bool"):
            # A bool defaulting to True is switched off by its flag (`--no-verify`), and vice versa.
            action = "store_false" if f.default else "store_true"
            parser.add_argument(flag, dest=f.name, action=action, help=help_text)
        else:
            default_note = "" if required or f.default is None else f" (default: {f.default})"
            parser.add_argument(flag, dest=f.name, required=required, default=None if required else f.default,
                                type=int if f.type in (int, "int") else None,
                                metavar=f.metadata.get("metavar", f.name.upper()), help=help_text + default_note)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, build, and turn any user error into one `error: ...` line on stderr; return the exit code."""
    try:
        args = make_parser().parse_args(argv)
    except SystemExit as e:   # --help (0) or a bad flag (2, already reported in one line)
        return int(e.code or 0)
    try:
        build(BuildConfig(**vars(args)))
    except BuildError as e:
        print(f"error: {e.format(_FLAGS.get(e.field, e.field)) if e.field else e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except LookaheadError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written", file=sys.stderr)
        return 130
    return 0


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


_FLAGS = {f.name: _flag(f) for f in dataclasses.fields(BuildConfig)}   # field -> flag, for error lines
