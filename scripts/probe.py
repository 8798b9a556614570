#!/usr/bin/env python3
"""Liveness probe of a served lookahead_llm: one real one-token request (serving/probe.py).

    scripts/probe.py --http-port 8000 [--timeout 10]     # exit 0: the model serves; 1: it cannot (why on stderr)
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy.probe import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
