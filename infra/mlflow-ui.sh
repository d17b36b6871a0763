#!/usr/bin/env bash
# Start the MLflow UI on 127.0.0.1 over the project's tracking store: infra/mlflow-ui.sh [PORT]
# One worker and no background job runners, in its own process group so Ctrl-C (or one
# `kill -- -PGID`) stops everything it started.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT="${1:-5000}"
URI="${MLFLOW_TRACKING_URI:-sqlite:///$PWD/mlflow.db}"
BIN="${VENV:-.venv}/bin"
echo "MLflow UI for $URI on http://127.0.0.1:$PORT (Ctrl-C to stop)"
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false
exec setsid "$BIN/mlflow" ui --backend-store-uri "$URI" --host 127.0.0.1 --port "$PORT" --workers 1
