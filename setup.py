"""Builds smp's C++ extension with CMake against the installed torch.

Install without build isolation so the extension is compiled against the torch
that will run it (the c10d API is not in torch's stable ABI):

    pip install --no-build-isolation -e .
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str, target: str):
        super().__init__(name, sources=[])
        self.target = target


class CMakeBuild(build_ext):
    def build_extension(self, ext: CMakeExtension) -> None:
        # The same build tree as tests/run.sh, so neither rebuilds the other's work.
        build_dir = ROOT / "build"
        build_dir.mkdir(parents=True, exist_ok=True)
        configure = [
            "cmake",
            "-S",
            str(ROOT),
            "-B",
            str(build_dir),
            f"-DPython3_EXECUTABLE={sys.executable}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        if not (build_dir / "CMakeCache.txt").exists():
            subprocess.check_call(configure)
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call(["cmake", "--build", str(build_dir), "--target", ext.target, "-j", jobs])
        built = next(build_dir.glob("_C*.so"))
        dest = Path(self.get_ext_fullpath(ext.name))
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, dest)


setup(
    name="smp",
    version="0.1.0",
    description="Pipeline, tensor and sharded-optimizer parallelism for unmodified PyTorch models",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    # The graph passes have their own top-level folder, as the C++ parts do (backend/, ops/), and are
    # mapped into the package here: smp.passes and its subpackages come from passes/.
    package_dir={"": "python", "smp.passes": "passes"},
    packages=find_packages("python") + ["smp.passes"] + [f"smp.passes.{p}" for p in find_packages("passes")],
    ext_modules=[CMakeExtension("smp._C", target="smp_C")],
    cmdclass={"build_ext": CMakeBuild},
    install_requires=["torch>=2.11,<2.16"],
    zip_safe=False,
)
