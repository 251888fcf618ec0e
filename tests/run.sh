#!/usr/bin/env bash
# The whole test suite: C++ unit tests (ctest) then Python and multi-process
# tests (pytest). Builds what it tests from this tree first.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}

if [ ! -f build/CMakeCache.txt ]; then
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE="$(command -v "$python")"
fi
cmake --build build -j "$(nproc)"
cp build/_C*.so python/smp/  # the tree's package runs the tree's C++

ctest --test-dir build --output-on-failure --timeout 120
"$python" -m pytest tests/python "$@"
