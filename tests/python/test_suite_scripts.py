"""tests/run.sh and tests/gpu.sh say "passed" (exit 0) only when everything they stand for ran:
run.sh fails on a build without C++ tests, gpu.sh does not exit 0 with a check skipped."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(script: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", f"tests/{script}"],
        cwd=ROOT,
        env=os.environ | env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_run_sh_fails_on_a_build_configured_without_cpp_tests(tmp_path):
    """A build configured with -DSMP_BUILD_TESTS=OFF has no C++ tests (ctest would find none and
    pass): run.sh stops before building, naming the build and the fix."""
    build = tmp_path / "build"
    build.mkdir()
    (build / "CMakeCache.txt").write_text("SMP_BUILD_TESTS:BOOL=OFF\n")
    done = _run("run.sh", {"BUILD_DIR": str(build)}, timeout=60)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert f"{build}/ was configured with -DSMP_BUILD_TESTS=OFF" in done.stderr, done.stderr
    assert "-DSMP_BUILD_TESTS=ON" in done.stderr and "libgtest-dev" in done.stderr, done.stderr


def _python_seeing(gpus: int, folder) -> str:
    """An interpreter that tells gpu.sh this machine has `gpus` CUDA GPUs (and is itself otherwise)."""
    path = folder / f"python{gpus}"
    path.write_text(
        "#!/usr/bin/env bash\n"
        'case "$*" in\n'
        '  *"sys.executable"*) echo "$0"; exit 0 ;;\n'
        f'  *"torch.cuda.device_count"*) echo {gpus}; exit 0 ;;\n'
        "esac\n"
        f'exec {sys.executable} "$@"\n'
    )
    path.chmod(0o755)
    return str(path)


def test_gpu_sh_exit_status_is_zero_only_when_every_check_ran(tmp_path):
    """On a (pretended) GPU machine, checks skipped by SMP_GPU_SKIP or by the deadline end in
    status 3, not 0; with no GPU, 77."""
    gpu = {"PYTHON": _python_seeing(1, tmp_path)}
    for name, env, status in (
        ("skip", gpu | {"SMP_GPU_SKIP": "."}, 3),
        ("deadline", gpu | {"SMP_GPU_DEADLINE": "1"}, 3),
        ("no gpu", {"PYTHON": _python_seeing(0, tmp_path), "SMP_GPU_SKIP": "."}, 77),
    ):
        done = _run("gpu.sh", env | {"OUT": str(tmp_path / name)}, timeout=180)
        assert done.returncode == status, (name, done.stdout, done.stderr)
        table = (tmp_path / name / "gpu-checks" / "table.md").read_text()
        # every check a row, each skipped (none ran: nothing here needs the GPU or a build)
        assert re.search(r"\| total \((\d+) checks, 0 failed, \1 skipped\) \| skip \|", table), (name, table)
