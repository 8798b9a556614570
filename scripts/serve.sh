#!/usr/bin/env bash
# Start, stop or query tritonserver serving an engine dir through triton_model_repo/lookahead_llm.
#
#   scripts/serve.sh start [--engine DIR] [--device cpu|cuda|cuda:N] [--http-port N] [--grpc-port N]
#                          [--metrics-port N] [--mode dense|lookahead|sparse] [--instances N] [--max-queue N]
#                          [--timeout S] [--watch] [--max-body-bytes N] [--run-dir DIR]
#   scripts/serve.sh stop [--run-dir DIR]       # seconds, even when the python stub died
#   scripts/serve.sh status [--run-dir DIR]     # runs a one-token request: 0 serving, 1 not, 3 not running
#   scripts/serve.sh restart [start options]    # stop, then start
#   scripts/serve.sh start --frontend dynamo [--workers N] [--router kv|round-robin|random] [--watch]
#                          [--http-port N] [--engine DIR] [--mode M] [--device D] [--run-dir DIR]
#                          [--discovery file|etcd] [-- any --lookahead-field VALUE]
#   scripts/serve.sh status --run-dir DIR       # finds a Dynamo run dir too: says which workers are up
#
# --prefix-caching true|false (both frontends; default: the engine's, on): full KV blocks outlive
# their request and a prompt that starts with cached blocks prefills only the rest.
# --router (Dynamo; default kv when --workers > 1): kv sends a request to the worker that holds the
# longest prefix of its KV blocks (the workers publish their cache's events), weighed by load.
#
# --device (default auto: cuda when torch has a GPU, else cpu) is where the engine runs: the Triton
# config's instance_group (KIND_GPU on GPU N for cuda:N, KIND_CPU for cpu) or every Dynamo worker's
# --device. A device that is not there (cuda on a machine without one) is refused before anything
# starts, in one line naming `device` and the fix.
#
# --frontend dynamo: the OpenAI API (/v1) from NVIDIA Dynamo's frontend and N engine workers on
# 127.0.0.1 (deploy/dynamo_launch.py; install it with scripts/install_dynamo.sh or
# `make dynamo`); its run dir is build/dynamo unless --run-dir is given. stop and status find it.
#
# The tritonserver is the one bundled in the nvidia-pytriton wheel, run by a supervisor
# (deploy/supervisor.py) that stays in the background: the HTTP port is its front, which
# refuses bodies over --max-body-bytes (413; default 2 MiB: tritonserver 2.51 crashes on bodies over
# ~4 MB) and malformed or deeply nested JSON (400); gRPC and metrics are tritonserver's own ports.
# --watch restarts the server when it or its python stub dies (or stops answering the probe); with
# --frontend dynamo it restarts a worker (or the frontend) that dies.
# Everything lives in --run-dir (default build/serve): the model repository, the PID files, the state
# (tritonserver.env), and the logs, rotated at every start (tritonserver.log.1 is the previous run's).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
# OpenMP's short spin (runtime/threads.py) for the servers and workers started from here: libgomp reads it
# once, when torch loads it. A GOMP_SPINCOUNT or OMP_WAIT_POLICY of your own wins.
[ -n "${GOMP_SPINCOUNT+x}${OMP_WAIT_POLICY+x}" ] || export GOMP_SPINCOUNT=10000

ACTION="${1:-}"; [ $# -gt 0 ] && shift
ENGINE="engines/default"; HTTP=8000; GRPC=8001; METRICS=8002
MODE=""; INSTANCES=1; MAX_QUEUE=256; TIMEOUT=180; RUN_DIR="$ROOT/build/serve"; WATCH=0
MAX_BODY=$((2 * 1024 * 1024)); LOG_KEEP=5
FRONTEND=triton; WORKERS=1; DISCOVERY=file; RUN_DIR_SET=0; EXTRA=(); DEVICE=auto; ROUTER=""; PREFIX_CACHING=""

usage() { sed -n '2,36p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
die() { echo "serve.sh: error: $*" >&2; exit 1; }
case "$ACTION" in -h|--help|help) usage 0 ;; esac

while [ $# -gt 0 ]; do
  case "$1" in
    --engine) ENGINE="$2"; shift 2 ;;
    --device) DEVICE="$2"; shift 2 ;;
    --http-port) HTTP="$2"; shift 2 ;;
    --grpc-port) GRPC="$2"; shift 2 ;;
    --metrics-port) METRICS="$2"; shift 2 ;;
    --mode) MODE="$2"; shift 2 ;;
    --instances) INSTANCES="$2"; shift 2 ;;
    --max-queue) MAX_QUEUE="$2"; shift 2 ;;
    --timeout) TIMEOUT="$2"; shift 2 ;;
    --run-dir) RUN_DIR="$2"; RUN_DIR_SET=1; shift 2 ;;
    --frontend) FRONTEND="$2"; shift 2 ;;
    --workers) WORKERS="$2"; shift 2 ;;
    --discovery) DISCOVERY="$2"; shift 2 ;;
    --router) ROUTER="$2"; shift 2 ;;
    --prefix-caching) PREFIX_CACHING="$2"; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    --watch) WATCH=1; shift ;;
    --max-body-bytes) MAX_BODY="$2"; shift 2 ;;
    -h|--help) usage 0 ;;
    *) echo "serve.sh: unknown option $1" >&2; usage ;;
  esac
done

case "$RUN_DIR" in /*) ;; *) RUN_DIR="$PWD/$RUN_DIR" ;; esac
case "$FRONTEND" in triton|dynamo) ;; *) die "--frontend must be triton or dynamo, got '$FRONTEND'" ;; esac
case "$ROUTER" in ""|kv|round-robin|random) ;; *) die "--router must be kv, round-robin or random, got '$ROUTER'" ;; esac
case "$PREFIX_CACHING" in ""|true|false) ;; *) die "--prefix-caching must be true or false, got '$PREFIX_CACHING'" ;; esac
PC_FLAG=(); [ -n "$PREFIX_CACHING" ] && PC_FLAG=(--prefix-caching "$PREFIX_CACHING")
DYN_RUN_DIR="$ROOT/build/dynamo"; [ "$RUN_DIR_SET" = 1 ] && DYN_RUN_DIR="$RUN_DIR"
SUP_PID_FILE="$RUN_DIR/supervisor.pid"
PID_FILE="$RUN_DIR/tritonserver.pid"
LOG="$RUN_DIR/tritonserver.log"
SUP_LOG="$RUN_DIR/supervisor.log"
STATE="$RUN_DIR/tritonserver.env"

alive_pid() {     # prints the PID in file $1 when it is alive (not a zombie) and its command has $2
  [ -f "$1" ] || return 1
  local pid; pid="$(cat "$1" 2>/dev/null)"
  pid_alive "$pid" && grep -qaF -- "$2" "/proc/$pid/cmdline" 2>/dev/null && echo "$pid"
}

pid_alive() { [ -n "$1" ] && kill -0 "$1" 2>/dev/null && case "$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1)" in Z|X|'') false ;; esac; }

state_of() { sed -n "s/^$1=//p" "$STATE" 2>/dev/null | head -1 || true; }

log_tail() {
  local f
  for f in "$SUP_LOG" "$LOG"; do
    [ -s "$f" ] || continue
    echo "---- last lines of $f ----" >&2
    grep -v '^[|+]' "$f" | tail -n "${1:-25}" >&2 || true
  done
}

rotate() {        # $1 -> $1.1 -> ... -> $1.$LOG_KEEP; the previous run's log is never truncated
  [ -s "$1" ] || return 0
  local i
  for ((i = LOG_KEEP - 1; i >= 1; i--)); do [ -e "$1.$i" ] && mv -f "$1.$i" "$1.$((i + 1))"; done
  mv -f "$1" "$1.1"
}

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
  local pid
  if pid="$(alive_pid "$SUP_PID_FILE" deploy.supervisor)"; then die "already running (supervisor pid $pid, see $STATE); run: scripts/serve.sh stop${RUN_DIR:+ --run-dir \"$RUN_DIR\"}"; fi
  if pid="$(alive_pid "$PID_FILE" tritonserver)"; then die "a tritonserver of $RUN_DIR still runs (pid $pid) without its supervisor; run: scripts/serve.sh stop --run-dir \"$RUN_DIR\""; fi
  case "$MODE" in ""|dense|lookahead|sparse) ;; *) die "--mode must be dense, lookahead or sparse, got '$MODE'" ;; esac
  case "$MAX_BODY" in ''|*[!0-9]*) die "--max-body-bytes must be a number of bytes, got '$MAX_BODY'" ;; esac
  [ "$MAX_BODY" -ge 1 ] && [ "$MAX_BODY" -le 3900000 ] \
    || die "--max-body-bytes must be in 1..3900000 (tritonserver 2.51 crashes on HTTP bodies over ~4 MB), got $MAX_BODY"
  # The device and the engine dir are checked first, with the runtime's own messages (fast: no
  # checksums here; the server verifies them when it loads the engine; the tokenizer and its chat
  # template, rendered once, as the engine loads them). Prints the device.
  local device
  device="$("$PY" -c "import sys; from runtime.errors import LookaheadError
from runtime.device import resolve_device
from runtime.engine_dir import load_manifest
from runtime.tokenizer import TextTokenizer
try:
    dev = resolve_device(sys.argv[1])
except LookaheadError as e:
    sys.exit(f'serve.sh: error: {e}')
try:
    TextTokenizer.from_engine(load_manifest(sys.argv[2], verify_checksums=False))
except LookaheadError as e:
    sys.exit(f'serve.sh: error: bad engine dir: {e}')
print(dev)" "$DEVICE" "$ENGINE")" || exit 1
  for port in "$HTTP" "$GRPC" "$METRICS"; do
    if ! port_free "$port"; then
      who="$(ss -ltnpH "sport = :$port" 2>/dev/null | sed -n 's/.*users:((\("[^"]*",pid=[0-9]*\).*/\1/p' | head -1)"
      die "port $port on 127.0.0.1 is taken${who:+ by $who}; stop that server or pass --http-port/--grpc-port/--metrics-port"
    fi
  done

  mkdir -p "$RUN_DIR"
  local mode_flag=(); [ -n "$MODE" ] && mode_flag=(--mode "$MODE")
  "$PY" -m serving.config_template --engine "$ENGINE" --out "$RUN_DIR/model_repo" \
      --instances "$INSTANCES" --max-queue "$MAX_QUEUE" --device "$device" "${mode_flag[@]}" "${PC_FLAG[@]}" >/dev/null \
      || die "could not write the model repository (see above)"

  rotate "$SUP_LOG"
  rm -f "$STATE"
  local watch_flag=(); [ "$WATCH" = 1 ] && watch_flag=(--watch)
  # The supervisor rotates tritonserver.log before each server start, cleans up what a killed run
  # left, and runs the HTTP front. setsid: it outlives this shell and its terminal's signals.
  setsid "$PY" -m deploy.supervisor run --run-dir "$RUN_DIR" --http-port "$HTTP" \
      --grpc-port "$GRPC" --metrics-port "$METRICS" --instances "$INSTANCES" --timeout "$TIMEOUT" \
      --max-body-bytes "$MAX_BODY" "${watch_flag[@]}" --info "ENGINE=$ENGINE" --info "MODE=${MODE:-engine default}" --info "DEVICE=$device" \
      --info "PREFIX_CACHING=${PREFIX_CACHING:-engine default}" \
      >>"$SUP_LOG" 2>&1 < /dev/null &
  pid=$!
  echo "serve.sh: starting (supervisor pid $pid, engine $ENGINE on $device${MODE:+, mode $MODE}$([ "$WATCH" = 1 ] && echo ', --watch')); logs: $LOG, $SUP_LOG"
  local deadline=$((SECONDS + TIMEOUT + 30)) st
  while :; do
    st="$(state_of STATE)"
    [ "$st" = ready ] && [ "$(state_of SUPERVISOR_PID)" = "$pid" ] && break
    if ! pid_alive "$pid" || [ "$st" = failed ]; then
      for _ in $(seq 1 100); do pid_alive "$pid" || break; sleep 0.1; done   # its clean-up
      log_tail 30
      die "start failed: $(state_of LAST_DEATH | grep . || echo "the supervisor exited (log above)")"
    fi
    if [ $SECONDS -ge $deadline ]; then
      log_tail 30; "$PY" -m deploy.supervisor stop --run-dir "$RUN_DIR" >&2 || true
      die "not ready after ${TIMEOUT}s (log above); stopped it"
    fi
    sleep 0.25
  done
  echo "serve.sh: ready: http://127.0.0.1:$HTTP (bodies up to $MAX_BODY bytes)  grpc 127.0.0.1:$GRPC  metrics http://127.0.0.1:$METRICS/metrics  (tritonserver pid $(state_of PID))"
}

# a Dynamo run dir: its PID files, or the deployment record `start` wrote
dynamo_running() { [ -f "$DYN_RUN_DIR/frontend.pid" ] || [ -f "$DYN_RUN_DIR/front.pid" ] || compgen -G "$DYN_RUN_DIR/worker-*.pid" >/dev/null; }
dynamo_dir() { dynamo_running || [ -f "$DYN_RUN_DIR/deployment.json" ]; }

dynamo_start() {   # the launcher checks the port, the engine dir and the settings: one-line errors
  local mode_flag=(); [ -n "$MODE" ] && mode_flag=(--mode "$MODE")
  local router_flag=(); [ -n "$ROUTER" ] && router_flag=(--router "$ROUTER")
  local watch_flag=(); [ "$WATCH" = 1 ] && watch_flag=(--watch)
  "$PY" -m deploy.dynamo_launch start --engine "$ENGINE" --device "$DEVICE" --workers "$WORKERS" --http-port "$HTTP" \
      --run-dir "$DYN_RUN_DIR" --discovery "$DISCOVERY" --max-queue "$MAX_QUEUE" --timeout "$TIMEOUT" \
      "${router_flag[@]}" "${watch_flag[@]}" "${mode_flag[@]}" "${PC_FLAG[@]}" "${EXTRA[@]}"
}

stop() {
  local rc=0 dyn=0
  if [ "$FRONTEND" = dynamo ] || dynamo_running; then
    dyn=1; "$PY" -m deploy.dynamo_launch stop --run-dir "$DYN_RUN_DIR" || rc=$?
  fi
  # a Triton server too, unless this was a Dynamo run dir with no Triton supervisor in it
  if [ "$FRONTEND" = triton ] && { [ "$dyn" = 0 ] || [ -f "$SUP_PID_FILE" ]; }; then
    "$PY" -m deploy.supervisor stop --run-dir "$RUN_DIR" || rc=$?
  fi
  return "$rc"
}

status() {
  local rc=0
  # a Dynamo deployment's run dir (named, or the default one while no Triton supervisor runs here)
  if [ "$FRONTEND" = dynamo ] || { [ "$RUN_DIR_SET" = 1 ] && dynamo_dir; } \
      || { ! alive_pid "$SUP_PID_FILE" deploy.supervisor >/dev/null && dynamo_running; }; then
    "$PY" -m deploy.dynamo_launch status --run-dir "$DYN_RUN_DIR" || rc=$?
    return "$rc"
  fi
  "$PY" -m deploy.supervisor status --run-dir "$RUN_DIR" || rc=$?
  [ -f "$STATE" ] && [ "$rc" != 3 ] && sed 's/^/  /' "$STATE"
  return "$rc"
}

case "$ACTION" in
  start) if [ "$FRONTEND" = dynamo ]; then dynamo_start; else start; fi ;;
  stop) stop ;;
  status) status ;;
  restart) stop; if [ "$FRONTEND" = dynamo ]; then dynamo_start; else start; fi ;;
  *) usage ;;
esac
