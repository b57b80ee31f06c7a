#!/usr/bin/env bash
# Hardware mode on one GPU. First the GPU tests (kernels on device memory; NIXL/UCX
# transfers between rank processes whose KV pools, staging rings and send buffers are
# GPU memory, every byte verified), then staging vs slice figures on the GPU for a
# P2->D1 scenario, both roles on the one device. Needs a CUDA torch and nixl; PY
# names the interpreter (default: the project's venv). Prints the figures; the run
# directories land in $OUT (default runs/gpu-check).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/gpu-check}
mkdir -p "$OUT"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible'; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
"$PY" -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py
# gather / scatter bandwidth as a share of a device-to-device copy (goal: >= 0.8)
"$PY" benchmarks/gpu_kernels.py --layers 16 --tokens 8192
for path in staging slice; do
    "$PY" -m kvstage.cli hw scenarios/llama3-8b-p4-d2.toml --device cuda --backend "${BACKEND:-nixl}" \
        --set prefill.tp=2 --set decode.tp=1 --set workload.requests=4 --set transfer.path=$path \
        --out "$OUT/$path"
done
"$PY" - "$OUT" <<'PYEOF'
import json, sys
out = sys.argv[1]
st = json.load(open(f"{out}/staging/summary.json")); sl = json.load(open(f"{out}/slice/summary.json"))
def busy(s): return s["payload_bytes"] * 8 / 1e9 / s["throughput_gbps"]
print(f"staging: {st['payload_bytes']/2**20:.1f} MiB in {busy(st):.4f} s = {st['payload_bytes']/busy(st)/1e9:.2f} GB/s, "
      f"{st['transfer_requests']['total']} requests, wrong bytes {st['bytes_wrong']} of {st['bytes_verified']} verified")
print(f"slice:   {busy(sl):.4f} s, slice/staging = {busy(sl)/busy(st):.1f}x, {sl['transfer_requests']['total']} requests, "
      f"wrong bytes {sl['bytes_wrong']} of {sl['bytes_verified']} verified")
PYEOF
