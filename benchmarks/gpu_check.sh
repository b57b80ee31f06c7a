#!/usr/bin/env bash
# Hardware mode on one GPU. First the GPU tests (kernels on device memory; NIXL/UCX
# transfers between rank processes whose KV pools, staging rings and send buffers are
# GPU memory, every byte verified), then one table on the GPU: the engine's raw ceiling
# (one large write VRAM -> VRAM between two processes, benchmarks/transport_raw.py) beside
# the staging and slice paths of a P2->D1 scenario, both roles on the one device, for
# each backend of BACKENDS (default: nixl, and mooncake where its CUDA wheel,
# mooncake-transfer-engine, is installed). Needs a CUDA torch and nixl; PY names the
# interpreter (default: the project's venv). The run directories and raw.json land in
# $OUT (default runs/gpu-check).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/gpu-check}
mkdir -p "$OUT"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible'; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
if [[ -z ${BACKENDS:-} ]]; then
    BACKENDS=nixl
    "$PY" -c "import importlib.metadata as m; m.version('mooncake-transfer-engine')" 2>/dev/null \
        && BACKENDS="nixl mooncake" || echo "mooncake: no CUDA wheel (mooncake-transfer-engine): NIXL only"
fi
"$PY" -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py
# gather / scatter bandwidth as a share of a device-to-device copy (goal: >= 0.8)
"$PY" benchmarks/gpu_kernels.py --layers 16 --tokens 8192
for backend in $BACKENDS; do
    # the ceiling: one 256 MiB write GPU -> GPU through the engine, no protocol (its last write checked byte for byte)
    "$PY" benchmarks/transport_raw.py --backends "$backend" --device cuda --size-mib 256 --reps 5 \
        --json "$OUT/raw-$backend.json"
    for path in staging slice; do
        "$PY" -m kvstage.cli hw scenarios/llama3-8b-p4-d2.toml --device cuda --backend "$backend" \
            --set prefill.tp=2 --set decode.tp=1 --set workload.requests=4 --set transfer.path=$path \
            --out "$OUT/$backend-$path"
    done
done
# One table: GB/s = payload bytes / transfer busy time (summary.json), against the raw write's median.
"$PY" - "$OUT" $BACKENDS <<'PYEOF'
import json, sys
out, backends = sys.argv[1], sys.argv[2:]
rows = []
for backend in backends:
    raw = json.load(open(f"{out}/raw-{backend}.json"))[backend]
    rows.append((f"raw {backend}, 1 write", raw["large"], raw["bytes"], raw["bytes"] / (raw["large"] * 1e9), 1,
                 0 if raw["ok"] else "not ok", raw["bytes"]))  # transport_raw.py exits 1 on a wrong byte
    for path in ("staging", "slice"):
        s = json.load(open(f"{out}/{backend}-{path}/summary.json"))
        busy = s["payload_bytes"] * 8 / 1e9 / s["throughput_gbps"]
        rows.append((f"{backend} {path}, P2->D1", raw["large"], s["payload_bytes"], busy,
                     s["transfer_requests"]["total"], s["bytes_wrong"], s["bytes_verified"]))
print(f"{'VRAM -> VRAM':26} {'MiB':>8} {'seconds':>9} {'GB/s':>8} {'of raw':>7} {'requests':>9} {'wrong':>10} / verified bytes")
for name, raw_gbs, nbytes, secs, requests, wrong, verified in rows:
    gbps = nbytes / secs / 1e9
    print(f"{name:26} {nbytes / 2**20:8.1f} {secs:9.4f} {gbps:8.2f} {gbps / raw_gbs:7.2f} {requests:9d} "
          f"{wrong:>10} / {verified:<12}")
sys.exit(0 if all(r[5] == 0 for r in rows) else 1)
PYEOF
