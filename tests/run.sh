#!/usr/bin/env bash
# The whole test suite: C++ unit tests (ctest) then Python and multi-process
# tests (pytest). Builds what it tests from this tree first.
#
# Settings: PYTHON (default python3); BUILD_DIR (default build/, configured here with the C++
# tests on if it has no CMakeCache.txt yet). A build without C++ tests (configured with
# -DSMP_BUILD_TESTS=OFF, or without GoogleTest) fails here before anything runs: the suite is
# not green with zero C++ tests.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
build=${BUILD_DIR:-build}

if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE="$(command -v "$python")"
fi
no_cpp_tests() {
  echo "tests/run.sh: $1; the C++ unit tests would not run." >&2
  echo "  Install GoogleTest (apt-get install libgtest-dev) and configure with the tests on:" >&2
  echo "  cmake -S . -B $build -DSMP_BUILD_TESTS=ON (or remove $build/ and run this again)." >&2
  exit 1
}
if ! grep -qx 'SMP_BUILD_TESTS:BOOL=ON' "$build/CMakeCache.txt"; then
  no_cpp_tests "$build/ was configured with -DSMP_BUILD_TESTS=OFF"
fi
cmake --build "$build" -j "$(nproc)"
# GoogleTest missing: CMake warned and built no test (ctest would find none and pass).
if ! ctest --test-dir "$build" -N | grep -q '^Total Tests: [1-9]'; then
  no_cpp_tests "$build/ has no C++ tests (GoogleTest was not found when it was configured)"
fi
cp "$build"/_C*.so python/smp/ # the tree's package runs the tree's C++

ctest --test-dir "$build" --output-on-failure --timeout 120 --no-tests=error
"$python" -m pytest tests/python "$@"
