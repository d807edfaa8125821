#!/usr/bin/env bash
# The federation's MLflow tracking server: SQLite store, artifacts served by the server itself.
#
#   cluster/tracking_server.sh [extra mlflow server options ...]
#
# Environment:
#   HOST        interface to bind (default 127.0.0.1: this machine only). On a cluster whose silos
#               run on other machines, bind the head's private address instead: each silo uploads
#               its own model's files to tracking.uri from its own node.
#   PORT        port (default 5000)
#   MLFLOW_DIR  where the store lives (default ./runs/mlflow-server): MLFLOW_DIR/mlflow.db holds
#               runs and the model registry, MLFLOW_DIR/artifacts the files clients upload through
#               the server (--serve-artifacts), so clients need no access to this disk.
#
# Extra arguments go to `mlflow server` unchanged, e.g. `--allowed-hosts mlflow.example:5000`
# (MLflow >= 3.5 answers only Host headers naming localhost or a private IP unless told) or
# `--app-name basic-auth` (user names and passwords; clients set MLFLOW_TRACKING_USERNAME and
# MLFLOW_TRACKING_PASSWORD).
#
# The script execs mlflow, so its pid is the server's: `kill <pid>` stops the server.
set -euo pipefail

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    exit 0
fi

HOST="${HOST:-127.0.0.1}"
PORT="${PORT:-5000}"
MLFLOW_DIR="${MLFLOW_DIR:-runs/mlflow-server}"

if ! command -v mlflow >/dev/null 2>&1; then
    echo "tracking_server.sh: mlflow is not on PATH (pip install mlflow)" >&2
    exit 127
fi

# No network beyond the federation: MLflow's usage telemetry stays off unless asked for.
export MLFLOW_DISABLE_TELEMETRY="${MLFLOW_DISABLE_TELEMETRY:-true}"
# Runs, models and artifacts only: MLflow's job execution (a task queue of seven consumer
# processes beside the server, for its GenAI jobs) stays off unless asked for. A federation never
# submits a job, and idle they took CPU all the same (docs/BENCHMARKS.md, "idle_cluster.py").
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION="${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false}"

mkdir -p "$MLFLOW_DIR/artifacts"
MLFLOW_DIR="$(cd "$MLFLOW_DIR" && pwd)"

echo "tracking_server.sh: MLflow at http://$HOST:$PORT, store $MLFLOW_DIR" >&2
exec mlflow server \
    --backend-store-uri "sqlite:///$MLFLOW_DIR/mlflow.db" \
    --serve-artifacts \
    --artifacts-destination "$MLFLOW_DIR/artifacts" \
    --host "$HOST" \
    --port "$PORT" \
    "$@"
