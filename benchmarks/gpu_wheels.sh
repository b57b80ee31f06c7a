#!/usr/bin/env bash
# The wheels a GPU machine with only a CUDA torch (and Python 3.12) needs to run the
# engine-free part of benchmarks/gpu_check.sh (the GPU tests, the kernels, the write
# tag): downloaded here into .whl/ (git-ignored through .git/info/exclude), at the
# versions of this checkout's venv. And NIXL's CUDA 13 build (nixl-cu13, 59 MB as a
# wheel: over what a lent machine's run may carry beside the tree) cut to what a rank
# uses (the Python binding, its libraries, UCX and its UCX plugin; not nixl_ep, the
# storage plugins, the cloud SDKs) and packed with xz into .nx/nixl-min.tar.xz (about
# 13 MB). On the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   tar xJf .nx/nixl-min.tar.xz -C /tmp/site
#   PY=python3 PYTHONPATH=/tmp/site:$PWD bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
mkdir -p .git/info .whl
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
names=(cryptography cffi pycparser pydantic pydantic_core annotated-types typing-inspection
    typing_extensions pyzmq msgpack simpy nixl)
pins=()
for n in "${names[@]}"; do
    pins+=("$n==$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$n")")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${pins[@]}"
ls -la .whl
# NIXL's CUDA build, cut and packed (the `nixl` wheel above picks nixl_cu13 beside a
# CUDA 13 torch, the lent machine's)
mkdir -p .nx
grep -qx "/.nx/" .git/info/exclude || echo "/.nx/" >> .git/info/exclude
root=$PWD tmp=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$tmp" "nixl-cu13==$("$PY" -c "import importlib.metadata as m; print(m.version('nixl'))")"
(cd "$tmp" && mkdir x && cd x && unzip -q ../nixl_cu13-*.whl \
    && rm -rf nixl_ep_cu13 nixl_cu13-*.data nixl_cu13.scripts nixl_cu13.libs/libaws* \
        nixl_cu13.libs/libazure* nixl_cu13.libs/ucx/libucx_perftest* \
    && find nixl_cu13.libs/nixl -type f ! -name libplugin_UCX.so ! -name libplugin_POSIX.so -delete \
    && tar cf - . | xz -9 -T4 > "$root/.nx/nixl-min.tar.xz")
rm -rf "$tmp"
ls -la .nx
