#!/usr/bin/env bash
# Hardware mode on one GPU: a P2->D1 scenario with --device cuda, both roles on the
# one device, then the same staging/slice/raw figures as benchmarks/hw_transfer.py.
# For the times a GPU machine is available (needs a CUDA torch, nixl and the CUDA
# Mooncake wheel installed; see README). Prints the run summary and the figures.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible'; print(torch.cuda.get_device_name(0))"
OUT=${OUT:-runs/gpu-check}
"$PY" -m kvstage.cli hw scenarios/llama3-8b-p4-d2.toml --device cuda --backend "${BACKEND:-nixl}" \
    --set prefill.tp=2 --set decode.tp=1 --set workload.requests=4 --out "$OUT/staging"
"$PY" -m kvstage.cli hw scenarios/llama3-8b-p4-d2.toml --device cuda --backend "${BACKEND:-nixl}" \
    --set prefill.tp=2 --set decode.tp=1 --set workload.requests=4 --set transfer.path=slice --out "$OUT/slice"
"$PY" - "$OUT" <<'PYEOF'
import json, sys
out = sys.argv[1]
st = json.load(open(f"{out}/staging/summary.json")); sl = json.load(open(f"{out}/slice/summary.json"))
def busy(s): return s["payload_bytes"] * 8 / 1e9 / s["throughput_gbps"]
print(f"staging: {st['payload_bytes']/2**20:.1f} MiB in {busy(st):.4f} s = {st['payload_bytes']/busy(st)/1e9:.2f} GB/s, wrong bytes {st['bytes_wrong']}")
print(f"slice:   {busy(sl):.4f} s, slice/staging = {busy(sl)/busy(st):.1f}x, wrong bytes {sl['bytes_wrong']}")
PYEOF
