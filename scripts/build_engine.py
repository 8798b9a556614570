#!/usr/bin/env python3
"""Build an engine dir: `python scripts/build_engine.py --model default --output engines/default`.

Thin wrapper over `builder.cli` (options derived from `builder.BuildConfig`); see `--help`.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without pip install

from builder.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
