#!/usr/bin/env bash
# The main job: set up (idempotent), then simulate the flagship scenario
# (Llama-3-70B, prefill TP8 -> decode TP2) and print its summary. Extra
# arguments go to `kvstage sim`, e.g. --set workload.requests=200.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
SCENARIO=${SCENARIO:-scenarios/llama3-70b-p8-d2.toml}
exec .venv/bin/kvstage sim "$SCENARIO" "$@"
