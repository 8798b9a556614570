#!/usr/bin/env bash
# Start, stop or query tritonserver serving an engine dir through triton_model_repo/lookahead_llm.
#
#   scripts/serve.sh start [--engine DIR] [--http-port N] [--grpc-port N] [--metrics-port N]
#                          [--mode dense|lookahead] [--instances N] [--max-queue N] [--timeout S]
#   scripts/serve.sh stop
#   scripts/serve.sh status
#
# The tritonserver is the one bundled in the nvidia-pytriton wheel (RECIPES.md); the model repository
# and backend dir are generated under --run-dir (default build/serve), with the PID file and the log.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"

ACTION="${1:-}"; [ $# -gt 0 ] && shift
ENGINE="engines/default"; HTTP=8000; GRPC=8001; METRICS=8002
MODE=""; INSTANCES=1; MAX_QUEUE=256; TIMEOUT=180; RUN_DIR="$ROOT/build/serve"

usage() { sed -n '2,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
die() { echo "serve.sh: error: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --engine) ENGINE="$2"; shift 2 ;;
    --http-port) HTTP="$2"; shift 2 ;;
    --grpc-port) GRPC="$2"; shift 2 ;;
    --metrics-port) METRICS="$2"; shift 2 ;;
    --mode) MODE="$2"; shift 2 ;;
    --instances) INSTANCES="$2"; shift 2 ;;
    --max-queue) MAX_QUEUE="$2"; shift 2 ;;
    --timeout) TIMEOUT="$2"; shift 2 ;;
    --run-dir) RUN_DIR="$2"; shift 2 ;;
    -h|--help) usage 0 ;;
    *) echo "serve.sh: unknown option $1" >&2; usage ;;
  esac
done

PID_FILE="$RUN_DIR/tritonserver.pid"
LOG="$RUN_DIR/tritonserver.log"
STATE="$RUN_DIR/tritonserver.env"

running_pid() {   # prints the PID when the server of our PID file is alive
  [ -f "$PID_FILE" ] || return 1
  local pid; pid="$(cat "$PID_FILE")"
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

log_tail() { echo "---- last lines of $LOG ----" >&2; grep -v '^[|+]' "$LOG" | tail -n "${1:-25}" >&2 || true; }

port_free() {
  "$PY" - "$1" <<'EOF'
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    sys.exit(1)
EOF
}

start() {
  if pid="$(running_pid)"; then die "already running (pid $pid, see $STATE); run: scripts/serve.sh stop"; fi
  case "$MODE" in ""|dense|lookahead) ;; *) die "--mode must be dense or lookahead, got '$MODE'" ;; esac
  for port in "$HTTP" "$GRPC" "$METRICS"; do
    if ! port_free "$port"; then
      who="$(ss -ltnpH "sport = :$port" 2>/dev/null | sed -n 's/.*users:((\("[^"]*",pid=[0-9]*\).*/\1/p' | head -1)"
      die "port $port on 127.0.0.1 is taken${who:+ by $who}; stop that server or pass --http-port/--grpc-port/--metrics-port"
    fi
  done
  # The engine dir is checked first, with the runtime's own message (fast: no checksums here;
  # the server verifies them when it loads the engine).
  "$PY" -c "import sys; from runtime.engine_dir import load_manifest; from runtime.errors import LookaheadError
try:
    load_manifest(sys.argv[1], verify_checksums=False)
except LookaheadError as e:
    sys.exit(f'serve.sh: error: bad engine dir: {e}')" "$ENGINE"

  mkdir -p "$RUN_DIR"
  local mode_flag=(); [ -n "$MODE" ] && mode_flag=(--mode "$MODE")
  "$PY" -m runtime.serving.config_template --engine "$ENGINE" --out "$RUN_DIR/model_repo" \
      --instances "$INSTANCES" --max-queue "$MAX_QUEUE" "${mode_flag[@]}" >/dev/null \
      || die "could not write the model repository (see above)"

  local prefix="lookahead_${HTTP}_$$_"
  : > "$LOG"
  # triton_env builds the backend dir, sets LD_LIBRARY_PATH/PATH (RECIPES.md) and execs tritonserver,
  # so $! is the server's PID. setsid: the server outlives this shell and its terminal signals.
  setsid "$PY" -m runtime.serving.triton_env exec --repo "$RUN_DIR/model_repo" --backend-dir "$RUN_DIR/backends" \
      --http-port "$HTTP" --grpc-port "$GRPC" --metrics-port "$METRICS" --shm-prefix "$prefix" \
      >>"$LOG" 2>&1 < /dev/null &
  local pid=$!
  echo "$pid" > "$PID_FILE"
  printf 'PID=%s\nHTTP_PORT=%s\nGRPC_PORT=%s\nMETRICS_PORT=%s\nENGINE=%s\nMODE=%s\nSHM_PREFIX=%s\n' \
      "$pid" "$HTTP" "$GRPC" "$METRICS" "$ENGINE" "${MODE:-engine default}" "$prefix" > "$STATE"

  echo "serve.sh: starting tritonserver (pid $pid, engine $ENGINE${MODE:+, mode $MODE}); log: $LOG"
  local deadline=$((SECONDS + TIMEOUT))
  until curl -sf -o /dev/null "http://127.0.0.1:$HTTP/v2/health/ready"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      rm -f "$PID_FILE"; log_tail 40; die "tritonserver exited during start-up (log above)"
    fi
    if [ $SECONDS -ge $deadline ]; then
      log_tail 40; kill -TERM "$pid" 2>/dev/null || true; rm -f "$PID_FILE"
      die "tritonserver not ready after ${TIMEOUT}s (log above); stopped it"
    fi
    sleep 0.5
  done
  echo "serve.sh: ready: http://127.0.0.1:$HTTP  grpc 127.0.0.1:$GRPC  metrics http://127.0.0.1:$METRICS/metrics"
}

stop() {
  local pid
  if ! pid="$(running_pid)"; then echo "serve.sh: not running"; rm -f "$PID_FILE"; return 0; fi
  kill -TERM "$pid"
  # The server exits once the model has unloaded (~3 s), at most --exit-timeout-secs (15 s) after TERM.
  for _ in $(seq 1 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  if kill -0 "$pid" 2>/dev/null; then
    log_tail 20; kill -KILL "$pid" 2>/dev/null || true; echo "serve.sh: warning: killed pid $pid after 30 s" >&2
  fi
  rm -f "$PID_FILE"
  local prefix; prefix="$(sed -n 's/^SHM_PREFIX=//p' "$STATE" 2>/dev/null)"
  if [ -n "$prefix" ] && compgen -G "/dev/shm/${prefix}*" >/dev/null; then
    echo "serve.sh: warning: removing leftover shared memory /dev/shm/${prefix}*" >&2
    rm -f /dev/shm/"${prefix}"*
  fi
  echo "serve.sh: stopped (pid $pid)"
}

status() {
  local pid
  if pid="$(running_pid)"; then
    local http; http="$(sed -n 's/^HTTP_PORT=//p' "$STATE")"
    if curl -sf -o /dev/null "http://127.0.0.1:$http/v2/health/ready"; then
      echo "running (pid $pid), ready on http://127.0.0.1:$http"
    else
      echo "running (pid $pid), not ready yet"
    fi
    sed 's/^/  /' "$STATE"
  else
    echo "not running"; return 3
  fi
}

case "$ACTION" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) usage ;;
esac
