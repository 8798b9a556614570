#!/usr/bin/env python3
"""Build an engine dir: `python scripts/build_engine.py --model default --output engines/default`.

Thin wrapper over `builder.cli` (options derived from `builder.BuildConfig`); see `--help`.
"""
import sys

from runtime.threads import prepare_threads

prepare_threads()  # first: libgomp reads GOMP_SPINCOUNT once, when torch loads it (runtime/threads.py)

from builder.cli import main

if __name__ == "__main__":
    sys.exit(main())
