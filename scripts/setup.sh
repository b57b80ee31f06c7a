#!/usr/bin/env bash
# One-shot set-up for a fresh machine: Debian libraries the engines need, a venv,
# and the project with every extra, torch pinned to the CPU build in the same step.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVSTAGE_VENV:-.venv}

# --test: also what the test suite needs (headless Chromium for the report test).
want=(libibverbs1 libnuma1)
[ "${1:-}" = "--test" ] && want+=(chromium)
missing=()
for pkg in "${want[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "[setup] installing Debian packages: ${missing[*]}"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV"
    python3 -m venv "$VENV"
fi
stamp="$VENV/.kvstage-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "[setup] installing kvstage with extras sim, hw-cpu, dev, export, bench-client (torch==2.13.0 CPU build)"
    "$VENV/bin/pip" install -q --disable-pip-version-check \
        "torch==2.13.0" -e ".[sim,hw-cpu,dev,export,bench-client]"
    touch "$stamp"
fi
