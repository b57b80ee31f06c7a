#!/usr/bin/env bash
# The main job: set up (idempotent), then simulate the flagship scenario
# (Llama-3-70B, prefill TP8 -> decode TP2) on both transfer paths -- staging and
# the slice baseline -- and write one self-contained HTML report comparing them,
# plus its figures as PNG files. Extra arguments go to both `kvstage sim` runs,
# e.g. --set workload.requests=200. SCENARIO=path picks another scenario,
# OUT=dir another output folder (default runs/main-<time>).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
SCENARIO=${SCENARIO:-scenarios/llama3-70b-p8-d2.toml}
name=$(basename "$SCENARIO" .toml)
OUT=${OUT:-runs/main-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
for path in staging slice; do
    # ours last: the extra arguments may change anything but the run directory and the path
    .venv/bin/kvstage sim "$SCENARIO" "$@" --out "$OUT/$name-$path" --set "transfer.path=$path"
done
.venv/bin/kvstage report "$OUT/$name-staging" "$OUT/$name-slice" --out "$OUT/report.html" --png "$OUT/figures"
echo
echo "open in a browser: $OUT/report.html   (its figures as PNG files: $OUT/figures/)"
