#!/usr/bin/env bash
# The wheels a GPU machine with only a CUDA torch (and Python 3.12) needs to run the
# engine-free part of benchmarks/gpu_check.sh (the GPU tests, the kernels, the write
# tag): downloaded here into .whl/ (git-ignored through .git/info/exclude), at the
# versions of this checkout's venv. On the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   PY=python3 PYTHONPATH=/tmp/site:$PWD bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
mkdir -p .git/info .whl
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
names=(cryptography cffi pycparser pydantic pydantic_core annotated-types typing-inspection
    typing_extensions pyzmq msgpack)
pins=()
for n in "${names[@]}"; do
    pins+=("$n==$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$n")")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${pins[@]}"
ls -la .whl
