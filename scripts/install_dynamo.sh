#!/usr/bin/env bash
# Install NVIDIA Dynamo 1.6.1 (OpenAI frontend + Python worker runtime) and the `openai` client into
# the project's venv, or into the python given as $1 / $PYTHON.
#
#   scripts/install_dynamo.sh                 # .venv/bin/python
#   scripts/install_dynamo.sh /path/to/python
#   scripts/install_dynamo.sh --help          # this text
#
# Why not `pip install ai-dynamo`: it requires `aisimulate`, a stub wheel that downloads from a host
# outside the package registries (only `dynamo.planner` imports it), so the install fails. What works:
# `ai-dynamo-runtime` plus ai-dynamo's other requirements, then `ai-dynamo` itself with --no-deps
# (docs/INSTALL.md).
#
# Idempotent: exits at once when `import dynamo.frontend, dynamo.llm, openai` already works.
# The torch and numpy already installed are pinned through a constraints file, so pip never swaps
# the CPU torch for a multi-GB CUDA build, nor numpy 1.x (Triton's python stub needs it) for 2.x.
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,/^set -euo pipefail/{/^set -euo/d; s/^# \{0,1\}//; p}' "${BASH_SOURCE[0]}"; exit 0 ;; esac

DYNAMO_VERSION=1.6.1
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${1:-${PYTHON:-$ROOT/.venv/bin/python}}

if ! "$PY" -c 'import sys' 2>/dev/null; then
  echo "install_dynamo: no working python at $PY (run 'make venv' first, or pass a python)" >&2
  exit 2
fi
if "$PY" -c 'import dynamo.frontend, dynamo.llm, dynamo.runtime, openai' 2>/dev/null; then
  echo "install_dynamo: dynamo $("$PY" -c 'import importlib.metadata as m; print(m.version("ai-dynamo"))') and openai already installed for $PY"
  exit 0
fi

CONSTRAINTS=$(mktemp "${TMPDIR:-/tmp}/dynamo-constraints.XXXXXX")
trap 'rm -f "$CONSTRAINTS"' EXIT
# Pin what is installed now (its public version: "2.13.0+cpu" is pinned as "torch==2.13.0", which the
# installed CPU build satisfies, so pip keeps it).
"$PY" - "$CONSTRAINTS" <<'EOF'
import importlib.metadata as md, sys
lines = []
for name in ("torch", "numpy"):
    try:
        lines.append(f"{name}=={md.version(name).split('+')[0]}")
    except md.PackageNotFoundError:
        if name == "numpy":
            lines.append("numpy<2")      # the Triton 2.51 python stub crashes on numpy 2
with open(sys.argv[1], "w") as f:
    f.write("\n".join(lines) + "\n")
EOF
echo "install_dynamo: constraints: $(tr '\n' ' ' < "$CONSTRAINTS")"

t0=$(date +%s)
# ai-dynamo 1.6.1's requirements, less aisimulate (the stub above), plus the official OpenAI client.
"$PY" -m pip install -q -c "$CONSTRAINTS" \
  "ai-dynamo-runtime==$DYNAMO_VERSION" \
  "aiohttp>=3.14.3,<4" "certifi>=2026.10.19" "kubernetes>=32.0.1,<33" "msgspec>=0.19" \
  "prometheus-client>=0.23.1,<1" "pyzmq>=26" "redis>=6.2,<9" tqdm "transformers>=4.56" \
  "typing-extensions>=4.10" "zstandard>=0.23,<1" uvloop \
  "openai>=1.40"
"$PY" -m pip install -q --no-deps "ai-dynamo==$DYNAMO_VERSION"

"$PY" -c 'import dynamo.frontend, dynamo.llm, dynamo.runtime, openai, torch; print("install_dynamo: ok: torch", torch.__version__, "openai", openai.__version__)'
echo "install_dynamo: done in $(( $(date +%s) - t0 )) s"
