#!/usr/bin/env bash
# The GPU path in one command, on a machine with a CUDA GPU (one is enough):
#
#     bash tests/gpu.sh
#
# 1. builds smp against this machine's torch without GoogleTest (cmake, only the extension) and
#    copies it into python/smp/ as tests/run.sh does; `pip install --no-deps --no-build-isolation
#    -e .` only when smp does not import from this tree;
# 2. runs every CUDA test (CUDA_TESTS below: ops against the CPU, activation offload, the NCCL
#    throttle with two ranks, pipelines over NCCL at pp=2 and pp=2 x tp=2);
# 3. runs the main job (examples/train_gpt2.py, bf16, a few steps) on one GPU at pp=tp=1, then
#    with several ranks at pp=2, tp=2 and pp=2 x tp=2, sharing the GPU if there is only one;
# 4. runs the Hugging Face parity cases (tests/python/test_hf_models.py) at tp=2 and pp=2 x tp=2,
#    and sharded data parallelism's (tests/python/test_sdp.py: sdp=2, sdp=2 x tp=2, sdp=2 x pp=2),
#    on CUDA (the harness puts every rank on its GPU when there is one);
# 5. runs the GPU benchmark (benchmarks/gpu.py: smp against plain PyTorch, MFU, checkpointing and
#    offloading, all_reduce against NCCL; within its --budget of 180 s, figures in its log);
# 6. prints one table: check | result (pass, FAIL, skip) | seconds.
#
# Every check runs under `timeout` (and an overall deadline, SMP_GPU_DEADLINE seconds, default
# 570: the checks after it are shortened, then skipped), and a failed check does not stop the
# others; whatever a check leaves running is killed before the next starts. Logs go to
# $OUT/gpu-checks/ when OUT is set, else to a new temporary directory; the table is also written
# there (table.md). Ranks sharing a GPU (fewer GPUs than ranks) each get an NCCL_HOSTID of their
# own, with NCCL_P2P_DISABLE=1 and NCCL_SHM_DISABLE=1: NCCL refuses two ranks of one host on one
# GPU, and uses its network transport over loopback between "hosts".
#
# Exit status (0 only when every check ran and passed):
#   0   every check ran, and passed (no check skipped, no test in a check skipped itself);
#   1   a check failed (or timed out);
#   3   none failed, but some did not run or did not run whole: a check named by SMP_GPU_SKIP,
#       one skipped for the overall deadline, or a pytest check in which a test skipped itself
#       (its reason is in the check's log);
#   77  no CUDA GPU here: nothing failed, the CUDA checks were skipped (the build, the install and
#       the pytest plumbing still ran; SMP_GPU_ON_CPU=1 also runs the main job and the parity
#       cases on the CPU, to check the script itself).
#
# Settings: PYTHON (default python3), SMP_GPU_STEPS (main job steps, default 20),
# SMP_GPU_DEADLINE (seconds, 0 for none), SMP_GPU_ON_CPU, SMP_GPU_SKIP (an extended regular
# expression: the checks whose names match are reported as skip, not run; for a short lease),
# SMP_GPU_BENCH_ARGS (more arguments for benchmarks/gpu.py, e.g. "--modes eager"; its --budget is
# what is left before the deadline, at most 180 s, unless these name one).
# shellcheck disable=SC2317  # the steps below are called through `timeout bash -c`
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# The interpreter itself (not a shim such as pyenv's): cmake, pip and every check use it.
python=$("${PYTHON:-python3}" -c 'import sys; print(sys.executable)') || {
  echo "gpu.sh: cannot run ${PYTHON:-python3}" >&2
  exit 1
}
STEPS=${SMP_GPU_STEPS:-20}
DEADLINE=${SMP_GPU_DEADLINE:-570}
SKIP=${SMP_GPU_SKIP:-}
if [ -n "${OUT:-}" ]; then
  LOGS=$OUT/gpu-checks
  mkdir -p "$LOGS"
else
  LOGS=$(mktemp -d "${TMPDIR:-/tmp}/smp-gpu-checks.XXXXXX")
fi
export ROOT python STEPS LOGS

# Every CUDA test: pytest node ids (a file alone: all of it). The "CUDA test list" check fails if
# a test file that asks for CUDA is not named here.
CUDA_TESTS=(
  "cuda ops match the CPU, outputs not views; TP value inference with CUDA fakes|tests/python/test_ops.py::test_cuda_matches_cpu tests/python/test_ops.py::test_cuda_outputs_change_in_place tests/python/test_ops.py::test_pass_value_inference_on_a_worker_thread_with_cuda_fakes|120"
  "activation offload (CUDA)|tests/python/test_activation_checkpointing.py::test_offload_parity_and_device_memory|120"
  "NCCL throttle, 2 ranks; backend registration|tests/python/test_throttle.py::test_cuda_nccl_throttle_two_ranks tests/python/test_throttle.py::test_smp_backend_is_registered_for_cpu_and_cuda|180"
  "cuda pipeline pp2 (every schedule)|tests/python/test_cuda_pipeline.py::test_cuda_pipeline_over_nccl_trains_like_one_process[pp2]|240"
  "cuda pipeline pp2 x tp2|tests/python/test_cuda_pipeline.py::test_cuda_pipeline_over_nccl_trains_like_one_process[pp2_tp2]|240"
)
HF_PARITY=(
  "HF parity tp2 (GPT-2, Llama, BERT)|tests/python/test_hf_models.py::test_parity[tp2]|240"
  "HF parity pp2 x tp2 (GPT-2, Llama, BERT)|tests/python/test_hf_models.py::test_parity[pp2_tp2]|300"
  "sdp2 on FSDP2 over NCCL (GPT, HF GPT-2, Llama; fp32, bf16)|tests/python/test_sdp.py::test_sdp2_trains_like_one_process|300"
  "sdp2 x tp2, sdp2 x pp2 over NCCL|tests/python/test_sdp.py::test_sdp_composes_with_tensor_and_pipeline_parallelism|420"
)
MAIN_JOBS=(# ranks pp tp seconds
  "1 1 1 150"
  "2 2 1 150"
  "2 1 2 150"
  "4 2 2 180"
)

now() { printf '%s' "${EPOCHREALTIME:-$(date +%s.%N)}"; }
START=$(now)
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# --- the environment -------------------------------------------------------------------------

GPUS=$(timeout 120 "$python" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null) || GPUS=0
export GPUS
{
  echo "python: $python"
  timeout 120 "$python" - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0])
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
    if torch.cuda.is_available():
        print("nccl", ".".join(map(str, torch.cuda.nccl.version())))
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"gpu {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB")
except Exception as e:  # reported, and the build fails with it
    print("torch: cannot import:", e)
for name in ("transformers", "numpy", "tqdm", "matplotlib", "pytest", "pytest_timeout"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", "installed"))
    except Exception as e:  # pytest-timeout is pytest.ini's second guard; each check has a timeout
        print(name, "absent (optional)" if name == "pytest_timeout" else f"MISSING: {e}")
EOF
  command -v nvidia-smi >/dev/null && timeout 30 nvidia-smi -L
  echo "cmake: $(cmake --version 2>/dev/null | head -n 1)"
  echo "cores: $(nproc)"
} >"$LOGS/environment.log" 2>&1
if [ "$GPUS" -gt 0 ]; then
  echo "gpu.sh: $GPUS CUDA GPU(s): $(grep -m1 '^gpu 0' "$LOGS/environment.log")"
else
  echo "gpu.sh: NO CUDA GPU on this machine (torch.cuda.is_available() is False): the CUDA checks are"
  echo "        reported as skip and the exit status is 77. Run this on a machine with a GPU."
fi
echo "gpu.sh: logs in $LOGS"

# --- running a check -------------------------------------------------------------------------

ROWS=()
FAILED=0
SKIPPED=0 # checks reported as skip, for whatever reason (each row says which)
N=0

# Kills what a check left running: every process whose environment holds the check's tag
# (torchrun's workers and the test harness's ranks are in sessions of their own, out of reach
# of timeout's process-group kill).
reap() {
  local tag=$1 env pid
  for env in /proc/[0-9]*/environ; do
    pid=${env#/proc/}
    pid=${pid%/environ}
    if [ "$pid" != "$$" ] && grep -qzx "SMP_GPU_SH_TAG=$tag" "$env" 2>/dev/null; then
      kill -9 "$pid" 2>/dev/null && echo "gpu.sh: check $N left process $pid running: killed it" >>"$LOGS/leftovers.log"
    fi
  done
}

# check NAME SECONDS CLASSIFY COMMAND...: runs COMMAND (a function exported below, or a program)
# under timeout with its output in a log, then CLASSIFY LOG RC prints pass, FAIL or skip.
check() {
  local name=$1 limit=$2 classify=$3
  shift 3
  N=$((N + 1))
  local slug log tag t0 rc result left
  slug=$(printf '%02d-%s' "$N" "$name" | tr -c 'A-Za-z0-9._-' '_')
  log=$LOGS/$slug.log
  tag="$$-$N"
  t0=$(now)
  if [ -n "$SKIP" ] && printf '%s' "$name" | grep -qE "$SKIP"; then
    echo "not run: its name matches SMP_GPU_SKIP=$SKIP" >"$log"
    row "$name" skip "$t0" "not run (SMP_GPU_SKIP)"
    return
  fi
  if [ "$DEADLINE" -gt 0 ]; then
    left=$(awk -v a="$START" -v b="$t0" -v d="$DEADLINE" 'BEGIN { printf "%d", d - (b - a) - 5 }')
    if [ "$left" -lt 15 ]; then
      echo "not run: the overall deadline (SMP_GPU_DEADLINE=$DEADLINE s) passed" >"$log"
      row "$name" skip "$t0" "not run (deadline)"
      return
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  echo "\$ $* (timeout ${limit}s)" >"$log"
  SMP_GPU_SH_TAG=$tag timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1 </dev/null
  rc=$?
  reap "$tag"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "gpu.sh: TIMED OUT after ${limit}s (rc $rc)" >>"$log"
    result=FAIL
  else
    result=$("$classify" "$log" "$rc")
  fi
  [ "$result" = FAIL ] && FAILED=$((FAILED + 1))
  row "$name" "$result" "$t0" "rc $rc, log $log"
}

row() {
  local seconds
  seconds=$(elapsed "$3")
  [ "$2" = skip ] && SKIPPED=$((SKIPPED + 1))
  ROWS+=("| $1 | $2 | $seconds |")
  printf 'gpu.sh: [%s] %s: %s (%s s; %s)\n' "$N" "$1" "$2" "$seconds" "$4"
}

# For checks that do not apply here (no GPU): a row without running anything.
skip_check() {
  N=$((N + 1))
  echo "skipped: $2" >"$LOGS/$(printf '%02d-%s' "$N" "$1" | tr -c 'A-Za-z0-9._-' '_').log"
  row "$1" skip "$(now)" "$2"
}

by_rc() { if [ "$2" -eq 0 ]; then echo pass; else echo FAIL; fi; }

# pytest's verdict from its JUnit XML (the path is the log's, .xml): a failure or error is FAIL,
# else any skip is skip (something did not run: the skip reason is in the log), else pass; no
# test at all is FAIL (the selection matched nothing).
by_junit() {
  "$python" - "${1%.log}.xml" "$2" <<'EOF'
import sys
import xml.etree.ElementTree as ET

path, rc = sys.argv[1], int(sys.argv[2])
try:
    root = ET.parse(path).getroot()
except Exception:
    print("FAIL")
    sys.exit()
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
if rc != 0 or count["failures"] or count["errors"] or count["tests"] == 0:
    print("FAIL")
elif count["skipped"]:
    print("skip")
else:
    print("pass")
EOF
}

# --- the steps (run under timeout, so exported) ----------------------------------------------

build_smp() {
  set -e
  cd "$ROOT"
  if [ -f build/CMakeCache.txt ] && ! grep -qx "CMAKE_HOME_DIRECTORY:INTERNAL=$ROOT" build/CMakeCache.txt; then
    echo "build/ was configured for another source tree: configuring afresh"
    rm -rf build/CMakeCache.txt build/CMakeFiles
  fi
  if [ -f build/CMakeCache.txt ]; then
    # An existing build/ (tests/run.sh's, setup.py's) keeps its settings; only the extension is
    # built. Configuring again reads the torch installed now.
    cmake -S . -B build
  else
    cmake -S . -B build -DSMP_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE="$python"
  fi
  cmake --build build --target smp_C -j "$(nproc)"
  # The tree's package runs the tree's C++ (as tests/run.sh). Replaced by a rename, not rewritten
  # in place: a process that has the old one loaded keeps it intact.
  local so dest
  for so in build/_C*.so; do
    dest=python/smp/${so#build/}
    if cmp -s "$so" "$dest"; then
      echo "$dest is up to date"
    else
      cp "$so" "$dest.new.$$" && mv -f "$dest.new.$$" "$dest" && echo "copied $so to $dest"
    fi
  done
}

smp_imports_from_tree() {
  (cd / && "$python" -c 'import os, sys, smp, smp.passes, smp._C
sys.exit(os.path.dirname(os.path.realpath(smp.__file__)) != os.path.realpath(sys.argv[1]))' "$ROOT/python/smp")
}

install_smp() {
  cd "$ROOT"
  if smp_imports_from_tree; then
    echo "smp imports from this tree: no install needed"
  else
    echo "smp does not import from this tree: pip install --no-deps --no-build-isolation -e ."
    "$python" -m pip install --no-deps --no-build-isolation -e . || return 1
    smp_imports_from_tree
  fi
}

# Every test that asks for CUDA (a test under `skipif(not torch.cuda.is_available())`, or a whole
# file under such a pytestmark) must be in CUDA_TESTS, by its node id or its file.
cuda_test_list() {
  cd "$ROOT"
  local f t missing=0 listed tests
  listed=$(printf '%s\n' "$@" | tr ' ' '\n')
  while read -r f; do
    # Under a pytestmark, every test of the file; else the test after each such decorator.
    mapfile -t tests < <(awk -v all="$(grep -c '^pytestmark.*not torch.cuda.is_available()' "$f")" '
      /skipif\(not torch.cuda.is_available\(\)/ { want = 1 }
      (want || all > 0) && /^def test_/ { sub(/^def /, ""); sub(/\(.*/, ""); print; want = 0 }' "$f")
    for t in "${tests[@]/#/$f::}"; do
      # listed by its node id, by one of its parametrizations (all of them are asked for), or by file
      if grep -qxF "$t" <<<"$listed" || grep -qF "${t}[" <<<"$listed" || grep -qxF "$f" <<<"$listed"; then
        echo "covered: $t"
      else
        echo "NOT in tests/gpu.sh's CUDA_TESTS, though it asks for CUDA: $t"
        missing=1
      fi
    done
  done < <(grep -l 'not torch.cuda.is_available()' tests/python/test_*.py)
  return "$missing"
}

run_pytest() { # LOG_XML "NODE_ID [NODE_ID...]"
  cd "$ROOT"
  local xml=$1 ids
  read -ra ids <<<"$2" # split on spaces, without globbing the node ids' [params]
  "$python" -m pytest -p no:cacheprovider -q -rs --junitxml="$xml" "${ids[@]}"
}

# The main job on RANKS processes at PP x TP (bf16 on a GPU); ranks sharing a GPU each report
# a host of their own to NCCL.
main_job() { # RANKS PP TP OUT_DIR
  cd "$ROOT"
  local ranks=$1 pp=$2 tp=$3 out=$4 bf16=() launch=()
  [ "$GPUS" -gt 0 ] && bf16=(--bf16)
  if [ "$GPUS" -lt "$ranks" ]; then # (on the CPU too, with SMP_GPU_ON_CPU: it checks the wrapper)
    export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
    # torchrun sets LOCAL_RANK for each worker; bash gives each its NCCL_HOSTID, then becomes python.
    # shellcheck disable=SC2016  # expanded by the worker's bash, not here
    launch=(--no-python bash -c 'NCCL_HOSTID=smp-gpu-sh-rank$LOCAL_RANK exec "$0" "$@"' "$python")
  fi
  rm -rf "$out"
  "$python" -m torch.distributed.run --standalone --nproc_per_node="$ranks" "${launch[@]}" \
    examples/train_gpt2.py --pp "$pp" --tp "$tp" "${bf16[@]}" --steps "$STEPS" --log-every 10 \
    --out-dir "$out" || return 1
  # Trained: every logged loss finite, and the last below the first.
  "$python" - "$out/log.csv" <<'EOF'
import csv, math, sys

rows = list(csv.DictReader(open(sys.argv[1])))
losses = [float(r["loss"]) for r in rows]
print("logged losses:", losses)
ok = len(losses) >= 2 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
sys.exit(0 if ok else "the loss did not fall, or is not finite")
EOF
}

export -f build_smp smp_imports_from_tree install_smp cuda_test_list run_pytest main_job

# --- the checks ------------------------------------------------------------------------------

# shellcheck disable=SC2016  # these $ expand in the check's bash
check "environment (torch, NCCL, packages)" 60 by_rc \
  bash -c 'cat "$LOGS/environment.log" && ! grep -q "MISSING\|cannot import" "$LOGS/environment.log"'
check "build (cmake, no GoogleTest)" 300 by_rc bash -c build_smp
check "install (smp imports from this tree)" 300 by_rc bash -c install_smp
nodes=()
for entry in "${CUDA_TESTS[@]}"; do
  IFS='|' read -r _ ids _ <<<"$entry"
  nodes+=("$ids")
done
check "CUDA test list covers every CUDA test file" 30 by_rc bash -c 'cuda_test_list "$@"' _ "${nodes[@]}"

pytest_checks() {
  local entry name ids limit
  for entry in "$@"; do
    IFS='|' read -r name ids limit <<<"$entry"
    # shellcheck disable=SC2016
    check "$name" "$limit" by_junit bash -c 'run_pytest "$1" "$2"' _ \
      "$LOGS/$(printf '%02d-%s' "$((N + 1))" "$name" | tr -c 'A-Za-z0-9._-' '_').xml" "$ids"
  done
}
pytest_checks "${CUDA_TESTS[@]}"

for job in "${MAIN_JOBS[@]}"; do
  read -r ranks pp tp limit <<<"$job"
  name="main job pp=$pp tp=$tp, $ranks rank(s)"
  if [ "$GPUS" -gt 0 ] || [ -n "${SMP_GPU_ON_CPU:-}" ]; then
    check "$name" "$limit" by_rc bash -c 'main_job "$@"' _ "$ranks" "$pp" "$tp" "$LOGS/main_pp${pp}_tp${tp}"
  else
    skip_check "$name" "no CUDA GPU"
  fi
done

if [ "$GPUS" -gt 0 ] || [ -n "${SMP_GPU_ON_CPU:-}" ]; then
  pytest_checks "${HF_PARITY[@]}"
else
  for entry in "${HF_PARITY[@]}"; do
    skip_check "${entry%%|*}" "no CUDA GPU"
  done
fi

bench=(benchmarks/gpu.py --json "$LOGS/gpu-benchmark.json" --logs "$LOGS/gpu-benchmark")
read -ra bench_args <<<"${SMP_GPU_BENCH_ARGS:-}"
bench+=("${bench_args[@]}")
if [ "$DEADLINE" -gt 0 ] && ! printf ' %s' "${bench_args[@]}" | grep -q -- ' --budget'; then
  # The benchmark plans its jobs within its budget: give it what is left (check() ends it there).
  left=$(awk -v a="$START" -v b="$(now)" -v d="$DEADLINE" 'BEGIN { printf "%d", d - (b - a) - 30 }')
  [ "$left" -lt 180 ] && bench+=(--budget "$((left > 30 ? left : 30))")
fi
if [ "$GPUS" -gt 0 ]; then
  check "GPU benchmark (benchmarks/gpu.py)" 240 by_rc "$python" "${bench[@]}"
elif [ -n "${SMP_GPU_ON_CPU:-}" ]; then
  check "GPU benchmark (benchmarks/gpu.py)" 240 by_rc "$python" "${bench[@]}" --cpu-smoke --quick --part all
else
  skip_check "GPU benchmark (benchmarks/gpu.py)" "no CUDA GPU"
fi

# --- the table -------------------------------------------------------------------------------

{
  echo
  echo "| check | result | seconds |"
  echo "|---|---|---|"
  printf '%s\n' "${ROWS[@]}"
  total=pass
  [ "$SKIPPED" -gt 0 ] && total=skip
  [ "$FAILED" -gt 0 ] && total=FAIL
  echo "| total ($N checks, $FAILED failed, $SKIPPED skipped) | $total | $(elapsed "$START") |"
} | tee "$LOGS/table.md"
echo
echo "logs: $LOGS"
if [ "$FAILED" -gt 0 ]; then
  echo "gpu.sh: $FAILED check(s) FAILED (exit status 1)"
  exit 1
fi
if [ "$GPUS" -eq 0 ]; then
  echo "gpu.sh: no CUDA GPU: the CUDA checks were skipped (exit status 77)"
  exit 77
fi
if [ "$SKIPPED" -gt 0 ]; then
  echo "gpu.sh: none failed, but $SKIPPED check(s) were skipped or did not run whole (see the table): not"
  echo "        a pass (exit status 3). Run them (no SMP_GPU_SKIP, a longer SMP_GPU_DEADLINE) for 0."
  exit 3
fi
echo "gpu.sh: every check ran and passed (exit status 0)"
exit 0
