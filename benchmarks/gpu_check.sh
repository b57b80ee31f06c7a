#!/usr/bin/env bash
# Hardware mode on one GPU. First the GPU tests (kernels on device memory; NIXL/UCX
# transfers between rank processes whose KV pools, staging rings and send buffers are
# GPU memory, every byte verified), the descriptor probe (NIXL's per-descriptor costs and
# the GIL, host then GPU memory), then one table on the GPU: the engine's raw ceiling
# (one large write VRAM -> VRAM between two processes, benchmarks/transport_raw.py) beside
# the staging and slice paths of a P2->D1 scenario, both roles on the one device, for
# each backend of BACKENDS (default: nixl, and mooncake where its CUDA wheel,
# mooncake-transfer-engine, is installed). Needs a CUDA torch and nixl; PY names the
# interpreter (default: the project's venv). The run directories and raw.json land in
# $OUT (default runs/gpu-check). A lent machine with only a CUDA torch: carry .whl and
# .nx, made here by benchmarks/gpu_wheels.sh (the wheels, and NIXL's CUDA build cut to
# 13 MB), install them with `pip install --no-index --no-deps --target /tmp/site
# .whl/*.whl` and `tar xJf .nx/nixl-min.tar.xz -C /tmp/site`, then run with
# PY=python3 PYTHONPATH=/tmp/site:$PWD. Where nixl is not importable it stops after the
# kernels and the write tag.
#
# Before that (and on a machine without a GPU: CPU_ONLY=1 stops after it), what the
# runs will use: the affinity table (each local rank's GPU, NUMA node and rail NIC,
# and whether they share a PCIe switch: hw/transport/affinity.py), the RDMA devices and their
# ports, the GPU topology, and the engines' transports. After the runs: the transports
# each rank's engine chose (summary.json transport_used) and the bandwidth verdict of
# the staging run on GPU memory (--target, each pair against its own ceiling), with
# the NIC-or-engine limit line. About 5 minutes on one H200 machine with 16 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/gpu-check}
TARGET=${TARGET:-0.5}
mkdir -p "$OUT"
echo "== affinity (local ranks 0..N-1 on cuda:i, N = the GPUs torch sees, at least 1)"
"$PY" - <<'PYEOF'
import torch
from kvstage.hw.transport.affinity import host_topology, rank_affinity, table_lines
from kvstage.hw.transport.placement import default_host, route_source
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
host = route_source("192.0.2.1") or default_host()  # this host's address on its default route
rows = {f"local{i}": rank_affinity(f"local{i}", host, f"cuda:{i}" if n else "cpu", i).to_wire()
        for i in range(max(n, 1))}
print("\n".join(table_lines(rows)))
topo = host_topology()
print("GPU -> NICs on its PCIe switch:", topo["same_switch"] or "none (no GPU, or no NIC shares a switch)")
PYEOF
echo "== transports"
if [[ -d /sys/class/infiniband ]] && compgen -G "/sys/class/infiniband/*" >/dev/null; then
    for port in /sys/class/infiniband/*/ports/*; do
        echo "rdma $(basename "$(dirname "$(dirname "$port")")") port $(basename "$port"): $(cat "$port/state" 2>/dev/null) $(cat "$port/rate" 2>/dev/null) $(cat "$port/link_layer" 2>/dev/null)"
    done
else
    echo "rdma: no RDMA device (/sys/class/infiniband empty or absent): NIXL and Mooncake use TCP between hosts"
fi
command -v nvidia-smi >/dev/null && nvidia-smi topo -m || echo "nvidia-smi: absent (no GPU topology)"
HAVE_NIXL=1
"$PY" -c 'import nixl' 2>/dev/null || HAVE_NIXL=
if [[ -n $HAVE_NIXL ]]; then
    UCX_INFO=$(find "$("$PY" -c 'import nixl, os; print(os.path.dirname(os.path.dirname(nixl.__file__)))')" -name ucx_info -type f 2>/dev/null | head -1)
    if [[ -n $UCX_INFO ]]; then "$UCX_INFO" -d | grep -E "Transport|Device" | paste - - | sort -u | head -20; else echo "ucx_info: not bundled with nixl (UCX's choice per rank: summary.json transport_used)"; fi
else
    echo "nixl: not importable by $PY: the kernels and the write tag run below, the engine runs do not"
fi
if [[ -n ${CPU_ONLY:-} ]]; then exit 0; fi
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible'; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
if [[ -z ${BACKENDS:-} ]]; then
    BACKENDS=nixl
    "$PY" -c "import importlib.metadata as m; m.version('mooncake-transfer-engine')" 2>/dev/null \
        && BACKENDS="nixl mooncake" || echo "mooncake: no CUDA wheel (mooncake-transfer-engine): NIXL only"
fi
"$PY" -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py
# gather / scatter bandwidth as a share of a device-to-device copy (goal: >= 0.8)
"$PY" benchmarks/gpu_kernels.py --layers 16 --tokens 8192
# the write tag (transfer.verify_writes = "mac", the default; NH on the device) on GPU blocks, beside a
# NIXL write of the same block and the line rate (bar: x_line >= 20, /model <= 5%)
NOWRITE=()
[[ -n $HAVE_NIXL ]] || NOWRITE=(--no-write)
"$PY" benchmarks/checksum_cost.py --device cuda --reps 10 --parts "${NOWRITE[@]}"
echo "== the write cipher on the GPU (transfer.encrypt_writes: ChaCha20, a Triton kernel)"
"$PY" benchmarks/cipher_cost.py --device cuda --reps 10
# without an engine, the rest cannot run
if [[ -z $HAVE_NIXL ]]; then
    echo "nixl: not importable: the descriptor probe, the raw writes and the hw runs are skipped"
    exit 0
fi
# the serving engine's per-descriptor costs (build, prepare, post) and the GIL, NIXL on host
# memory then on GPU memory, each fit with its R^2 (hw/probes/descriptors.py): the numbers the
# [engine] presets take from the VM (shared/scenario/engines.py), here on a GPU host
for dev in cpu cuda; do
    "$PY" -m kvstage.cli calibrate --descriptors --quick --device "$dev" \
        --out "$OUT/descriptors-$dev.json" || echo "descriptor probe on $dev failed (see above)"
done
for backend in $BACKENDS; do
    # the ceiling: one 256 MiB write GPU -> GPU through the engine, no protocol (its last write checked byte for byte)
    "$PY" benchmarks/transport_raw.py --backends "$backend" --device cuda --size-mib 256 --reps 5 \
        --json "$OUT/raw-$backend.json"
    for path in staging slice; do
        # the staging run ends with the bandwidth verdict (exit 1 on FAIL: judged below, not fatal)
        verdict=()
        [[ $path == staging ]] && verdict=(--target "$TARGET")
        "$PY" -m kvstage.cli hw scenarios/llama3-8b-p4-d2.toml --device cuda --backend "$backend" \
            --set prefill.tp=2 --set decode.tp=1 --set workload.requests=4 --set transfer.path=$path \
            --out "$OUT/$backend-$path" "${verdict[@]}" | tee "$OUT/$backend-$path.out" || true
    done
done
# One table, GB/s (10^9 bytes/s): the raw write; per run its lowest pair's bytes over the time
# its writes were busy, against the ceiling it measured in the same run (summary.json bandwidth),
# and the raw write's median; then each rank's transports and the verdict lines.
"$PY" - "$OUT" $BACKENDS <<'PYEOF'
import json, sys
out, backends = sys.argv[1], sys.argv[2:]
print(f"{'VRAM -> VRAM':26} {'GB/s':>8} {'ceiling':>8} {'of ceil':>8} {'of raw':>7} {'requests':>9} {'wrong':>10} / verified bytes")
ok = True
for backend in backends:
    raw = json.load(open(f"{out}/raw-{backend}.json"))[backend]
    ok &= bool(raw["ok"])  # transport_raw.py checks its last write byte for byte
    print(f"{'raw ' + backend + ', 1 write':26} {raw['large']:8.2f} {'-':>8} {'-':>8} {1.0:7.2f} {1:9d} "
          f"{'0' if raw['ok'] else 'not ok':>10} / {raw['bytes']:<12}")
    for path in ("staging", "slice"):
        s = json.load(open(f"{out}/{backend}-{path}/summary.json"))
        ok &= s["bytes_wrong"] == 0 and not s["errors"]
        pairs = s["bandwidth"]["pairs"]
        low = min(pairs, key=lambda p: p["achieved_gbs"]) if pairs else None
        gbs = low["achieved_gbs"] if low else 0.0
        ceil = f"{low['ceiling_gbs']:8.2f} {low['ratio']:8.2f}" if low and low["ceiling_gbs"] else f"{'-':>8} {'-':>8}"
        print(f"{backend + ' ' + path + ', P2->D1':26} {gbs:8.2f} {ceil} {gbs / raw['large']:7.2f} "
              f"{s['transfer_requests']['total']:9d} {s['bytes_wrong']:>10} / {s['bytes_verified']:<12}")
        for rank, u in sorted(s["transport_used"].items()):
            print(f"  {rank}: over {u.get('over')}: {u.get('writes')}")
    text = open(f"{out}/{backend}-staging.out").read()
    for line in text.splitlines():
        if line.startswith(("bandwidth: ", "limit on ")):
            print(f"  {backend}: {line}")
sys.exit(0 if ok else 1)
PYEOF
